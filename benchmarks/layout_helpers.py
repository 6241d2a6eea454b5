"""How long the Python layout helpers take on a Qwen3-235B-shaped model
(94 layers of GQA attention with 4 KV heads and 128 routed experts each;
37,603 tensors): `megatron_layout` at TP 4 x PP 2 x DP 16 with EP 8 (128
training ranks) and `tp_inference_layout` at TP 8 x DP 8 with EP 64 (64
inference ranks).

    pip install ./python numpy && python benchmarks/layout_helpers.py [--write DIR]

With ``--write DIR`` both layouts are written (8 ranks per node) to
``DIR/src.json`` and ``DIR/dst.json``, for ``refit plan --src DIR/src.json
--dst DIR/dst.json``.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests"))
from test_layouts import model_shapes  # noqa: E402

import refit  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", help="write both layouts (8 ranks per node) as DIR/src.json and DIR/dst.json")
    args = parser.parse_args()
    shapes = model_shapes(94, 64, 4, head=128, hidden=4096, ffn=1536, vocab=151936, experts=128, moe_from=0)
    node = 8 if args.write else None
    layouts = []
    for name, make in (
        ("megatron_layout (TP 4 x PP 2 x DP 16, EP 8)", lambda: refit.megatron_layout(shapes, tp=4, pp=2, dp=16, num_attention_heads=64, num_kv_heads=4, ep=8, etp=1, ranks_per_node=node)),
        ("tp_inference_layout (TP 8 x DP 8, EP 64)", lambda: refit.tp_inference_layout(shapes, tp=8, dp=8, num_kv_heads=4, ep=64, ranks_per_node=node)),
    ):
        t = time.perf_counter()
        layout = make()
        print(f"{name}: {len(shapes)} tensors, {layout.ranks} ranks, {time.perf_counter() - t:.2f} s")
        layouts.append(layout)
    if args.write:
        os.makedirs(args.write, exist_ok=True)
        for file, layout in zip(("src.json", "dst.json"), layouts):
            with open(os.path.join(args.write, file), "w") as f:
                f.write(layout.to_json())
        print(f"wrote {args.write}/src.json and {args.write}/dst.json")


if __name__ == "__main__":
    main()
