#!/usr/bin/env python3
"""The planner's busiest source rank against a linear-programming optimum.

On the 200 seeded random small layout pairs of `reshard/tests/balance.rs`
(2-8 source ranks, 1-6 destination ranks, 1-3 tensors of 1-3 dimensions;
sources replicated, grid-sharded unevenly, cut by overlapping partitions
or with extra boxes), every element the plan sends from sources must leave
from a source rank that holds it, as many copies as the plan sends, split
among its holders in any way (divisible). The least possible busiest
source rank of that problem is a linear program:

    minimise T  subject to  sum_r x[m, r] = demand[m]   for every set m
                            sum_m x[m, r] <= T           for every rank r
                            x >= 0, x[m, r] = 0 unless r is in m

solved here with scipy's HiGHS; the planner's figure is its
`max_src_rank_egress_bytes`. The LP's optimum must equal the Rust test's
exact max-flow formula (checked); the ratio planner / LP is printed as
median, p90 and worst.

Usage: python3 benchmarks/balance_lp.py [--check]
  (runs `cargo test --release -p reshard --test balance` to dump the cases;
  --check exits non-zero unless median <= 1.05 and worst <= 1.5)
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from scipy.optimize import linprog


def lp_optimum(ranks, demand):
    """The least busiest-rank load of one case, by HiGHS."""
    pairs = [(i, r) for i, (mask, _) in enumerate(demand) for r in range(ranks) if mask >> r & 1]
    n = len(pairs) + 1  # the x's, then T
    c = np.zeros(n)
    c[-1] = 1.0
    a_eq = np.zeros((len(demand), n))
    b_eq = np.array([float(b) for _, b in demand])
    a_ub = np.zeros((ranks, n))
    for k, (i, r) in enumerate(pairs):
        a_eq[i, k] = 1.0
        a_ub[r, k] = 1.0
    a_ub[:, -1] = -1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(ranks), A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * n, method="highs")
    if res.status != 0:
        raise SystemExit(f"HiGHS failed: {res.message}")
    return res.fun


def main():
    check = "--check" in sys.argv[1:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "cases.jsonl")
        env = dict(os.environ, BALANCE_DUMP=dump)
        subprocess.run(
            ["cargo", "test", "--release", "-q", "-p", "reshard", "--test", "balance", "dump_cases_for_the_lp_benchmark"],
            cwd=root, env=env, check=True, stdout=subprocess.DEVNULL,
        )
        with open(dump) as f:
            cases = [json.loads(line) for line in f]
    ratios = []
    for case in cases:
        opt = lp_optimum(case["ranks"], case["demand"])
        if abs(opt - case["exact"]) > 1e-6 * max(1.0, opt):
            raise SystemExit(f"case {case['seed']}: LP optimum {opt} differs from the exact formula {case['exact']}")
        if case["planner"] + 1e-6 < opt:
            raise SystemExit(f"case {case['seed']}: the planner ({case['planner']}) beats the LP optimum ({opt})")
        ratios.append(case["planner"] / opt if opt > 0 else 1.0)
    ratios.sort()
    at = lambda q: ratios[round((len(ratios) - 1) * q)]
    median, p90, worst = at(0.5), at(0.9), ratios[-1]
    print(f"{len(cases)} cases: busiest source rank / LP optimum (HiGHS): median {median:.3f}, p90 {p90:.3f}, worst {worst:.3f}")
    print("LP optimum equals the exact max-flow formula on every case")
    if check and not (median <= 1.05 and worst <= 1.5):
        raise SystemExit("above the bar: median <= 1.05 and worst <= 1.5")


if __name__ == "__main__":
    main()
