"""Refit time on a Ray cluster of emulated hosts, side by side in one run:

1. refit between Ray actors (examples/ray_cluster.py's: 2 FSDP2 trainer
   actors, f32, on two nodes; 2 TP2 rollout actors, bf16, on a third;
   an orchestrator actor), the time of `Orchestrator.refit`;
2. a gather-broadcast through Ray's object store on the same actors: the
   trainers gather every tensor whole (FSDP2's all-gather, `full_tensor`,
   over gloo), rank 0 returns them (bf16) as an object in its node's
   store, both rollout actors take that object as an argument (Ray pulls
   it to their node once) and copy their TP blocks out of it; timed from
   the gather to the last rollout's copy;
3. `refit launch --netns` with the same two layouts (written by the run
   above) and links shaped alike: one worker process per node.

Links: every worker node's link capped by the kernel in each direction at
its ranks times `--rate` MB/s (`scripts/ray-cluster.sh` RATES; `refit
launch --emulate-nic-mbps`): the trainer nodes at R, the rollout node at
2R. The trainers' step between refits is a `nudge` (every weight moves by
1e-3, no collective), so no training traffic shares the links. The first
refit of each kind (connections made) is reported apart; the rest give
the median and range. Every rollout element is checked against the
trainers' after the last refit and after the last gather-broadcast.

    python benchmarks/ray_cluster.py [--rate 10] [--reps 5] [--json FILE]

Root, ip, tc, Ray, torch and transformers needed; `cargo build --release`
first (target/release/refit).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "ray-cluster.sh")
REFIT = os.path.join(ROOT, "target", "release", "refit")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=10, help="MB/s per rank, each direction (default 10)")
    p.add_argument("--reps", type=int, default=5, help="timed refits of each kind after the first (default 5)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--driver", default=None, help=argparse.SUPPRESS)  # inside the head's namespace: the Ray part, results into this file
    return p.parse_args(argv)


def driver(args):
    """The Ray part (run inside the head's namespace): the results and the
    two layouts, as JSON into ``args.driver``."""
    import ray
    import ray.cloudpickle

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import ray_cluster

    ray.cloudpickle.register_pickle_by_value(ray_cluster)
    ray.init(address="10.78.0.1:6379", logging_level="ERROR")
    example = ray_cluster.parse(["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab), "--gloo-ifname", "eth0"])
    job = ray_cluster.Job(example)
    try:
        refits = []
        for _ in range(args.reps + 1):
            version = ray.get([t.nudge.remote() for t in job.trainers])[0]
            t = time.perf_counter()
            report = ray.get(job.refitter.refit.remote(version))
            wall = time.perf_counter() - t
            if "error" in report:
                raise RuntimeError(report["error"])
            refits.append(dict(refit_s=report["seconds"], transfer_s=report["transfer_seconds"], wall_s=wall, bytes=report["bytes"]))
        ray.get([r.load.remote(version) for r in job.rollouts])
        wrong = job.served(version, job.expected())
        if wrong:
            raise RuntimeError(f"after the refits: {wrong[:3]}")
        gathers = []
        for _ in range(args.reps + 1):
            version = ray.get([t.nudge.remote() for t in job.trainers])[0]
            t = time.perf_counter()
            whole = [t_.full.remote() for t_ in job.trainers]  # rank 0's object: every tensor, bf16
            moved = ray.get([r.take.remote(whole[0]) for r in job.rollouts])
            ray.get(whole[1])
            gathers.append(dict(wall_s=time.perf_counter() - t, bytes=sum(moved)))
        # The rollouts' arrays hold the last gather-broadcast's copy.
        wrong = job.differing(job.expected())
        if wrong:
            raise RuntimeError(f"after the gather-broadcasts: {wrong[:3]}")
        out = dict(
            plan_bytes=job.plan["bytes"],
            model_bytes=job.model_bytes,
            src_layout=json.loads(job.training_layout),
            dst_layout=json.loads(job.rollout_layout.to_json()),
            ray_refit=refits,
            ray_gather_broadcast=gathers,
        )
    finally:
        job.close()
        ray.shutdown()
    with open(args.driver, "w") as f:
        json.dump(out, f)


def summary(xs):
    return dict(median=statistics.median(xs), low=min(xs), high=max(xs))


def main(argv=None):
    args = parse(argv)
    if args.driver:
        driver(args)
        return 0
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    r = args.rate
    env = dict(os.environ, ROLES="train train rollout", RATES=f"{r} {r} {2 * r}")
    with tempfile.TemporaryDirectory(prefix="refit-ray-bench-") as tmp:
        results = os.path.join(tmp, "ray.json")
        try:
            subprocess.run([SCRIPT, "up", "3", ray], env=env, check=True, capture_output=True, timeout=300)
            forward = [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "vocab", "reps")]
            subprocess.run([SCRIPT, "exec", "0", sys.executable, os.path.abspath(__file__), *forward, "--driver", results], check=True, timeout=1800)
        finally:
            subprocess.run([SCRIPT, "down"], capture_output=True, timeout=120)
        with open(results) as f:
            got = json.load(f)
        for side in ("src", "dst"):
            with open(os.path.join(tmp, f"{side}.json"), "w") as f:
                json.dump(got[f"{side}_layout"], f)
        launch = subprocess.run(
            [REFIT, "launch", "--src", f"{tmp}/src.json", "--dst", f"{tmp}/dst.json", "--netns", "--emulate-nic-mbps", str(r)]
            + ["--per-process", "node", "--refits", str(args.reps + 1), "--verify", "--json"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if launch.returncode != 0:
            sys.exit(f"refit launch failed: {launch.stderr[-2000:]}")
        launched = json.loads(launch.stdout.strip().splitlines()[-1])
    rows = {
        "refit, Ray actors": [x["refit_s"] for x in got["ray_refit"]],
        "refit launch --netns": [x["refit_s"] for x in launched["refits"]],
        "gather-broadcast, Ray object store": [x["wall_s"] for x in got["ray_gather_broadcast"]],
    }
    report = dict(
        rate_mb_s_per_rank=r,
        model_bytes=got["model_bytes"],
        plan_bytes=got["plan_bytes"],
        launch_bytes=launched.get("bytes_moved"),
        launch_verified=launched.get("verified"),
        rows={k: dict(first=v[0], **summary(v[1:])) for k, v in rows.items()},
        raw=dict(ray_refit=got["ray_refit"], ray_gather_broadcast=got["ray_gather_broadcast"], launch=launched["refits"]),
    )
    print(f"policy: {got['model_bytes']} bytes of bf16 weights; refit's plan moves {got['plan_bytes']} (refit launch: {report['launch_bytes']})")
    print(f"links: {r} MB/s per rank each way (trainer nodes {r}, rollout node {2 * r}); {args.reps} timed after a first\n")
    print("| how | first (s) | median (s) | range (s) | vs refit on Ray |")
    print("|---|---|---|---|---|")
    base = report["rows"]["refit, Ray actors"]["median"]
    for name, row in report["rows"].items():
        print(f"| {name} | {row['first']:.2f} | {row['median']:.2f} | {row['low']:.2f}-{row['high']:.2f} | {row['median'] / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
