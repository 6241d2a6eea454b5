#!/usr/bin/env python3
"""Writes the two layout pairs of docs/benchmarks.md, "Short rows on the
wire": 3000 [64, 32] tensors, TP2 by rows on 2 source nodes of one rank,
going to 8 destination ranks on one node,

  DIR/col:  bf16 -> bf16, TP8 by columns (rows of 4 elements on the wire)
  DIR/conv: bf16 -> f32,  TP8 by rows (every piece widened on receipt)

Usage: python3 benchmarks/short_rows.py [DIR]   (default /tmp)
then:  refit bench --src DIR/col/src.json --dst DIR/col/dst.json --transport tcp --reps 15
"""
import json
import os
import sys

N = 3000


def tensors(dtype, ranks, placement):
    return [
        {"name": f"t{i}", "dtype": dtype, "shape": [64, 32], "mesh": {"shape": [ranks]}, "placements": [placement]}
        for i in range(N)
    ]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    src = {"ranks": 2, "ranks_per_node": 1, "tensors": tensors("bf16", 2, "shard(0)")}
    pairs = {
        "col": {"ranks": 8, "ranks_per_node": 8, "tensors": tensors("bf16", 8, "shard(1)")},
        "conv": {"ranks": 8, "ranks_per_node": 8, "tensors": tensors("f32", 8, "shard(0)")},
    }
    for name, dst in pairs.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        for side, layout in (("src", src), ("dst", dst)):
            with open(os.path.join(d, f"{side}.json"), "w") as f:
                json.dump(layout, f)
        print(f"wrote {d}/src.json and {d}/dst.json")


if __name__ == "__main__":
    main()
