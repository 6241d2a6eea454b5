"""On one GPU: in-place CUDA ranks and torch's streams (docs/python.md,
"In-place sources", "In-place destinations").

Every member of a 2 -> 2 refit (three f32 tensors of 32 MiB in row shards ->
bf16 column shards) runs in this process on cuda:0 over fabric="ipc";
sources and destinations are torch tensors registered in place. Each step
queues a long kernel (torch.cuda._sleep, --sleep-ms) and then the new
values, and leaves `stepping()` without synchronizing: the refit must still
carry the new values, read back inside `dst.serving()`. Values are small
integers, exact in bf16, different in every element from one version to
the next.

    python3 python/tests/gpu_stream_check.py [--out FILE] [--sleep-ms 300]

One JSON object per line per check (and a summary); exit 0 if every check
passes, 1 if one fails, 2 when torch has no CUDA or refit has no GPU
fabrics. Not a pytest module: python/tests/test_gpu_stream_check.py checks
its CPU path.
"""

import argparse
import json
import sys
import threading
import time
from contextlib import ExitStack

TENSORS = {"w0": [2048, 4096], "w1": [4096, 2048], "w2": [1024, 8192]}
DEVICE, FABRIC = "cuda:0", "ipc"  # a CPU rehearsal (the pytest) swaps these


class Unavailable(Exception):
    """This machine cannot run the check (exit 2)."""


def values(torch, name, shape, k):
    """Tensor `name` at version `k`: integers in [-125, 125]."""
    i = torch.arange(shape[0], device=DEVICE).unsqueeze(1)
    j = torch.arange(shape[1], device=DEVICE).unsqueeze(0)
    return ((i * 7 + j * 3 + 11 * k + 5 * sorted(TENSORS).index(name)) % 251 - 125).float()


def blocks(layout, rank):
    return {n: tuple(slice(o, o + e) for o, e in zip(off, ext)) for n, _, off, ext in layout.blocks(rank)}


class Rig:
    def __init__(self, torch, refit, sleep_ms):
        self.torch, self.refit, self.version = torch, refit, 0
        train, infer = refit.LayoutBuilder(2), refit.LayoutBuilder(2)
        for name, shape in TENSORS.items():
            train = train.tensor(refit.TensorBuilder(name, "f32", shape).mesh([2], ["shard(0)"]))
            infer = infer.tensor(refit.TensorBuilder(name, "bf16", shape).mesh([2], ["shard(1)"]))
        self.train, self.infer = train.build(), infer.build()

        def tensors(layout, r, dtype):
            return {n: torch.zeros(ext, dtype=dtype, device=DEVICE) for n, _, _, ext in layout.blocks(r)}

        self.src_t = [tensors(self.train, r, torch.float32) for r in range(2)]
        self.dst_t = [tensors(self.infer, r, torch.bfloat16) for r in range(2)]
        self.orch = refit.Orchestrator(fabric=FABRIC, deadline=30.0)
        self.sources = [refit.Source.in_place(self.train, r, refit.param_buffers(self.train, r, self.src_t[r])) for r in range(2)]
        self.dests = [refit.Destination.in_place(self.infer, r, refit.param_buffers(self.infer, r, self.dst_t[r])) for r in range(2)]
        self.joined = refit.join(self.orch.address, self.orch.secret)
        for m in self.sources + self.dests:
            m.join(joined=self.joined, gpu=0)
        self.orch.connect(2, 2)
        self.side = torch.cuda.Stream(DEVICE)
        # _sleep counts GPU cycles: measure how many make a millisecond.
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        self.cycles = int(50_000_000 / start.elapsed_time(end) * sleep_ms)

    def step(self, how, sleep=True):
        """One version into every source, written as `how` says; returns
        how long leaving the `stepping()` blocks took (ms)."""
        torch, k = self.torch, self.version + 1
        new = [{n: values(torch, n, TENSORS[n], k)[b].contiguous() for n, b in blocks(self.train, r).items()} for r in range(2)]
        torch.cuda.synchronize()
        with ExitStack() as stack:
            if how == "current-side":  # the side stream is torch's current stream in the block
                stack.enter_context(torch.cuda.stream(self.side))
            for s in self.sources:
                stack.enter_context(s.stepping())
            writer = self.side if how == "side-waited" else torch.cuda.current_stream()
            writer.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(writer):
                if sleep:
                    torch.cuda._sleep(self.cycles)
                for r in range(2):
                    for n, t in self.src_t[r].items():
                        t.copy_(new[r][n])
            if how == "side-waited":  # the documented contract: the current stream waits for the side one
                torch.cuda.current_stream().wait_stream(self.side)
            left = time.perf_counter()
        self.version = k
        return (time.perf_counter() - left) * 1e3

    def served(self, k):
        """(versions served, elements compared, mismatches) inside serving()."""
        torch, n, bad = self.torch, 0, []
        with ExitStack() as stack:
            versions = [stack.enter_context(d.serving()) for d in self.dests]
            for r, tensors in enumerate(self.dst_t):
                for name, t in tensors.items():
                    b = blocks(self.infer, r)[name]
                    want = values(torch, name, TENSORS[name], k)[b].to(torch.bfloat16)
                    n += t.numel()
                    if not torch.equal(t, want):
                        prev = values(torch, name, TENSORS[name], k - 1)[b].to(torch.bfloat16)
                        bad.append({"rank": r, "tensor": name, "wrong": int((t != want).sum()), "holds_previous": bool(torch.equal(t, prev))})
            torch.cuda.synchronize()
        return versions, n, bad

    def refit_version(self):
        try:
            return self.orch.refit(self.version).seconds * 1e3
        except self.refit.MemberError as e:
            if "transport unavailable" in str(e):
                raise Unavailable(f"refit has no GPU fabrics here: {e}") from None
            raise

    def case(self, how, count, sleep_ms):
        d = {"versions": [], "exit_wait_ms": [], "refit_ms": [], "elements": 0, "mismatches": []}
        for _ in range(count):
            d["exit_wait_ms"].append(round(self.step(how), 1))
            d["refit_ms"].append(round(self.refit_version(), 1))
            versions, n, bad = self.served(self.version)
            d["versions"].append(self.version)
            d["elements"] += n
            d["mismatches"] += bad
            if versions != [self.version] * 2:
                d.setdefault("served", []).append(versions)
        # Leaving stepping() must have waited for the queued kernel.
        d["waited"] = min(d["exit_wait_ms"]) >= 0.5 * sleep_ms
        d["ok"] = d["waited"] and not d["mismatches"] and "served" not in d
        return d

    def serving_holds_commit(self, sleep_ms):
        """A refit started while every destination serves waits for the
        blocks, whose GPU work (a long kernel, then a copy of the weights,
        synchronized inside the block) sees the old version."""
        torch, old = self.torch, self.version
        self.step("current", sleep=False)
        done, errors = [], []

        def refit():
            try:
                done.append(self.refit_version())
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{type(e).__name__}: {e}")

        thread = threading.Thread(target=refit, daemon=True)
        with ExitStack() as stack:
            held = [stack.enter_context(d.serving()) for d in self.dests]
            thread.start()
            torch.cuda._sleep(self.cycles)
            snap = [{n: t.clone() for n, t in ts.items()} for ts in self.dst_t]
            torch.cuda.synchronize()
            time.sleep(sleep_ms / 1e3)
            early = bool(done)
        thread.join(60)
        snap_ok = all(torch.equal(t, values(torch, n, TENSORS[n], old)[blocks(self.infer, r)[n]].to(torch.bfloat16)) for r, ts in enumerate(snap) for n, t in ts.items())
        versions, n, bad = self.served(self.version)
        d = {"held": held, "committed_inside_block": early, "snapshot_is_old_version": snap_ok, "refit_ms": [round(x, 1) for x in done]}
        d.update(refit_errors=errors, versions=[self.version], elements=n, mismatches=bad, served=versions)
        d["ok"] = held == [old] * 2 and not early and snap_ok and len(done) == 1 and not bad and versions == [self.version] * 2
        return d

    def no_wait_control(self, sleep_ms):
        """stepping()'s wait removed: the refit should then read the old
        values (shows the check can fail; informational)."""
        saved = self.refit._ranks._wait_for_producers
        self.refit._ranks._wait_for_producers = lambda objects: None
        try:
            d = self.case("current", 1, sleep_ms)
        finally:
            self.refit._ranks._wait_for_producers = saved
            self.torch.cuda.synchronize()
        return {"stale_seen": bool(d["mismatches"]), "exit_wait_ms": d["exit_wait_ms"], "refit_ms": d["refit_ms"], "versions": d["versions"], "mismatches": d["mismatches"][:3], "ok": bool(d["mismatches"])}

    def close(self):
        self.joined.shutdown()
        self.orch.close()


def host_work_result():
    """Work this process's GPU planes did on the host: any fallback (a
    conversion or an FP8 quantization the device has a path for) fails the
    check, naming each; dtype pairs no kernel converts are listed."""
    import refit

    def described(w):
        return f"{w['rank']} {w['what']} on the host x{w['times']} ({w['why']})"

    work = refit._refit.host_work()
    fallbacks = [described(w) for w in work if w["fallback"]]
    return {
        "check": "host-fallbacks",
        "ok": not fallbacks,
        "host_fallbacks": sum(w["times"] for w in work if w["fallback"]),
        "host_fallback_work": fallbacks,
        "host_work_without_kernel": [described(w) for w in work if not w["fallback"]],
    }


def main(argv=None):
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--out", help="also write the JSON lines to this file")
    args.add_argument("--sleep-ms", type=float, default=300.0, help="the kernel queued before each write (default 300)")
    args = args.parse_args(argv)
    lines = []

    def emit(d):
        lines.append(json.dumps(d))
        print(lines[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    try:
        import torch
    except ImportError as e:
        emit({"check": "setup", "ok": False, "unavailable": f"torch is not installed ({e})"})
        return 2
    if not torch.cuda.is_available():
        emit({"check": "setup", "ok": False, "unavailable": f"torch {torch.__version__} has no CUDA device"})
        return 2
    failed, rig = 0, None
    try:
        import refit

        rig = Rig(torch, refit, args.sleep_ms)
        rig.step("current", sleep=False)  # version 1: the IPC fabric's set-up; also the probe for it
        ms = rig.refit_version()
        versions, n, bad = rig.served(1)
        emit({"check": "warm-up", "ok": not bad and versions == [1, 1], "refit_ms": round(ms, 1), "elements": n, "mismatches": bad, "sleep_cycles": rig.cycles})
        failed += bool(bad) or versions != [1, 1]
        cases = [
            ("torch-stream", lambda: rig.case("current", 3, args.sleep_ms)),
            ("side-stream-waited", lambda: rig.case("side-waited", 2, args.sleep_ms)),
            ("current-side-stream", lambda: rig.case("current-side", 2, args.sleep_ms)),
            ("serving-holds-commit", lambda: rig.serving_holds_commit(args.sleep_ms)),
            ("no-wait-control", lambda: rig.no_wait_control(args.sleep_ms)),
        ]
        for name, run in cases:
            try:
                d = {"check": name, **run(), "sleep_ms": args.sleep_ms}
            except Unavailable:
                raise
            except Exception as e:  # noqa: BLE001 - reported, and the next case runs
                d = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
            if name == "no-wait-control":
                d["gating"] = False  # says whether the check can fail; never fails the run
            else:
                failed += not d["ok"]
            emit(d)
    except Unavailable as e:
        emit({"check": "setup", "ok": False, "unavailable": str(e)})
        return 2
    except Exception as e:  # noqa: BLE001
        emit({"check": "setup", "ok": False, "error": f"{type(e).__name__}: {e}"})
        failed += 1
    finally:
        if rig is not None:
            rig.close()
    d = host_work_result()
    failed += not d["ok"]
    emit(d)
    emit({"check": "summary", "ok": failed == 0, "failed": failed})
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
