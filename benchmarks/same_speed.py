#!/usr/bin/env python3
"""Two builds of `refit`, alternated on the same machine: the same
commands, old then new (or new then old, every other pair), each run
printed as it ends, then the ranges and medians.

    python3 benchmarks/same_speed.py --old OLD/refit --new target/release/refit \
        [--pairs 5] [--launch-pairs 3] [--dsv3 DIR]

Rows: `refit bench --model llama3-8b --scale 8 --reps 15` in process and
over loopback TCP (the reshard's median rate, GiB/s), and `refit launch`
of the DeepSeek-V3 /128 files of `refit emit --model deepseek-v3 --scale
128 --out DIR` through worker processes per node (the median transfer of
5 refits, seconds). Used for the "same speed" tables of
docs/benchmarks.md; a run that fails stops the script (exit 1).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys


def run_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def bench_rate(binary, transport):
    d = run_json([binary, "bench", "--model", "llama3-8b", "--scale", "8", "--reps", "15", "--transport", transport, "--json"])
    r = d["reshard"]
    return r["bytes"] / r["median_s"] / 2**30


def launch_transfer(binary, files):
    d = run_json(
        [binary, "launch", "--src", os.path.join(files, "src.json"), "--dst", os.path.join(files, "dst.json"),
         "--per-process", "node", "--refits", "5", "--json", "--heartbeat-timeout-ms", "10000"]
    )
    times = [r["transfer_s"] for r in d["refits"]]
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--launch-pairs", type=int, default=3)
    ap.add_argument("--dsv3", default="/tmp/dsv3-same-speed")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.dsv3, "src.json")):
        subprocess.run([a.new, "emit", "--model", "deepseek-v3", "--scale", "128", "--out", a.dsv3], check=True,
                       capture_output=True)
    rows = [
        ("bench local, GiB/s", a.pairs, lambda b: bench_rate(b, "local")),
        ("bench tcp, GiB/s", a.pairs, lambda b: bench_rate(b, "tcp")),
        ("launch deepseek-v3 /128 per node, median transfer s", a.launch_pairs, lambda b: launch_transfer(b, a.dsv3)),
    ]
    for name, pairs, measure in rows:
        got = {"old": [], "new": []}
        for i in range(pairs):
            order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
            for which in order:
                v = measure(a.old if which == "old" else a.new)
                got[which].append(v)
                print(f"{name}: pair {i + 1} {which} {v:.3f}", flush=True)
        for which in ("old", "new"):
            v = got[which]
            print(f"== {name} {which}: {min(v):.3f}-{max(v):.3f} (median {statistics.median(v):.3f}, {len(v)} runs)",
                  flush=True)


if __name__ == "__main__":
    main()
