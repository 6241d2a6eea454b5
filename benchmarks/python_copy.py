#!/usr/bin/env python3
"""How long `Source.step()` and `Destination.load()` take for one large
array, in place (the default for C-contiguous numpy arrays) and through
Python `bytes` (the path anything else takes), side by side in one run.

One tensor of `--mib` MiB (f32) on one source and one destination rank,
in process; each repetition bumps every element, steps, refits and loads
(checked), once per path, alternating. Prints min-max and median per path.

Usage: python3 benchmarks/python_copy.py [--mib 256] [--reps 6]
(needs the package: pip install ./python, and numpy)
"""
import argparse
import statistics
import time

import numpy as np

import refit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    n = args.mib << 18  # f32 elements
    one = lambda: refit.LayoutBuilder(1).tensor(refit.TensorBuilder("w", "f32", [n]).mesh([1], ["replicate"])).build()
    system = refit.spawn_local(one(), one())
    src, dst = system.sources[0], system.destinations[0]
    a, b = np.ones(n, np.float32), np.zeros(n, np.float32)
    src.register("w", a)
    dst.register("w", b)
    times = {"in place": ([], []), "bytes": ([], [])}
    for _ in range(args.reps):
        for path, (steps, loads) in times.items():
            a += 1
            t = time.perf_counter()
            if path == "in place":
                version = src.step()
            else:
                version = src._store.update([("w", refit._to_bytes(a))])
            steps.append(time.perf_counter() - t)
            system.refit(version)
            t = time.perf_counter()
            if path == "in place":
                dst.load()
            else:
                _, datas = dst._store.read(["w"], None)
                refit._copy_into(b, datas[0], "w")
            loads.append(time.perf_counter() - t)
            assert b[0] == a[0] and b[-1] == a[-1], "the destination does not hold the step"
    ms = lambda xs: f"{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f} ms (median {statistics.median(xs) * 1e3:.0f})"
    print(f"{args.mib} MiB f32, {args.reps} repetitions per path")
    for path, (steps, loads) in times.items():
        print(f"{path:9s} step {ms(steps)}, load {ms(loads)}")


if __name__ == "__main__":
    main()
