#!/usr/bin/env python3
"""The colocated check: a trainer and an inference engine sharing one GPU,
refitted by refit over CUDA IPC (docs/gpu.md, "The colocated check").

    python3 scripts/colocated_check.py --out DIR            # on a GPU: 1B Qwen2, fabric "ipc"
    python3 scripts/colocated_check.py --out DIR --device cpu --size tiny --fabric node

Three processes: this one (the orchestrator, ``refit.Orchestrator`` and
the driver), a **trainer** (a transformers ``Qwen2ForCausalLM`` built from
a config, random weights, f32 master weights, AdamW: one real optimizer
step, next-token loss on random tokens, between refits; registered with
``refit.Source.in_place`` and stepped inside ``src.stepping()``) and an
**engine** (the same architecture's parameters as an inference engine
holds them: bf16, q/k/v fused into ``qkv_proj`` and gate/up into
``gate_up_proj`` as vLLM's Qwen2 does), which receives through
``refit._engine.RefitBuffers`` (the code vLLM's workers run) and loads
into its fused parameters with a ``load_weights`` that fuses like vLLM's.

Per refit: the trainer steps; the orchestrator refits the version; the
engine loads it and compares every element of its parameters, bit for
bit, with the trainer's masters cast to bf16 (read through torch's CUDA
IPC, on the GPU). Timed side by side on the same bytes: (a) refit's refit
(and refit + load), (b) torch's own IPC by hand, as colocated RL
frameworks do (every parameter shared with ``reduce_tensor``, rebuilt in
the engine and ``copy_``-ed with the bf16 cast into the fused
parameters), (c) one device-to-device copy of as many bytes as the refit
moved. Last, the trainer is killed (SIGKILL) in the middle of a refit:
the engine must keep its version (``serving()`` yields it, its parameters
unchanged, its refit buffers load it again) and its CUDA context must
still run a kernel.

Writes DIR/colocated.json. Exit status: 0 passed, 1 failed, 2 no GPU (or
torch/transformers missing). ``--device cpu`` runs the same processes on
the CPU (torch's IPC by hand is shared memory there): the logic is
tested in CI (python/tests/test_colocated_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen2 shapes: about 1.0e9 parameters (tied embeddings), and a tiny one.
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}

# How vLLM's Qwen2 stacks checkpoint tensors into its fused parameters
# (its load_weights' stacked_params_mapping): (fused, checkpoint part, shard).
STACKED = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def qwen2_config(size: str) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**SIZES[size], tie_word_embeddings=True, max_position_embeddings=4096)


# --- the engine's parameters ---------------------------------------------------


class FusedQwen2:
    """A Qwen2's parameters as vLLM's model holds them (``qkv_proj``,
    ``gate_up_proj``), in ``dtype`` on ``device``, and the loading that
    fuses checkpoint tensors into them (as vLLM's ``load_weights``)."""

    def __init__(self, config: Any, dtype: Any, device: Any):
        import torch

        h, inter = config.hidden_size, config.intermediate_size
        hd = h // config.num_attention_heads
        q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
        self.rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), 0: (0, inter), 1: (inter, 2 * inter)}
        shapes: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                    p + "self_attn.qkv_proj.bias": (q + 2 * kv,),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_up_proj.weight": (2 * inter, h),
                    p + "mlp.down_proj.weight": (h, inter),
                    p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
        self.params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes.items()}

    def target(self, name: str) -> Tuple[str, Optional[Tuple[int, int]]]:
        """The fused parameter a checkpoint tensor loads into, and its rows
        there (None: the whole parameter)."""
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), self.rows[shard]
        return name, None

    def part(self, name: str) -> Any:
        target, rows = self.target(name)
        param = self.params[target]
        return param if rows is None else param[rows[0] : rows[1]]

    def load_weights(self, weights: Any) -> None:
        """Copies each (checkpoint name, tensor) into its place, casting."""
        for name, tensor in weights:
            part = self.part(name)
            if tuple(part.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: {list(tensor.shape)} into {list(part.shape)}")
            part.copy_(tensor)

    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())


# --- child processes -------------------------------------------------------------


def _serve(conn: Any, handlers: Dict[str, Callable[..., Any]]) -> None:
    """Answers (command, args) from the driver until "exit" or EOF."""
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except Exception:  # noqa: BLE001 - the driver reports it
            conn.send(("err", traceback.format_exc()))


def _device(name: str) -> Any:
    import torch

    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer_main(conn: Any, opts: Dict[str, Any]) -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    from transformers import Qwen2ForCausalLM

    import refit
    from refit.vllm import derived_layout

    device = _device(opts["device"])
    torch.manual_seed(0)
    config = qwen2_config(opts["size"])
    with device:
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.train()
    masters = dict(model.named_parameters())
    if device.type == "cpu":
        # torch's IPC of host tensors moves them into shared memory: done
        # now, before refit registers them (it refuses moved memory).
        for p in masters.values():
            p.data.share_memory_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tensors = [(n, "f32", list(p.shape)) for n, p in masters.items()]
    layout, _ = derived_layout(tensors, [{n: [([0] * len(s), s)] for n, _, s in tensors}], dtype="f32")
    # The masters' memory, as tensors of their own (refit reads them in
    # place; AdamW writes them in place).
    src = refit.Source.in_place(layout, 0, {n: p.detach() for n, p in masters.items()})
    state: Dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(1)

    def join(rendezvous: str, secret: str) -> Dict[str, Any]:
        state["joined"] = src.join(rendezvous, secret, gpu=device.index if device.type == "cuda" else None)
        return {"tensors": tensors, "params": sum(p.numel() for p in masters.values())}

    def step() -> Dict[str, Any]:
        """One optimizer step: next-token loss on random tokens."""
        t = time.perf_counter()
        tokens = torch.randint(0, config.vocab_size, (opts["batch"], opts["seq"]), device=device, generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        with src.stepping():
            opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return {"version": src.version, "loss": float(loss.detach()), "seconds": time.perf_counter() - t}

    def share() -> Tuple[List[Tuple[str, Any]], float]:
        """Every master shared as torch's IPC does it (the by-hand way)."""
        t = time.perf_counter()
        out = [(n, reduce_tensor(p.detach())) for n, p in masters.items()]
        return out, time.perf_counter() - t

    def hold_step() -> str:
        """Enters an optimizer step and never leaves it: a refit's source
        waits here (the version fence) until this process is killed."""
        entered = threading.Event()

        def hold() -> None:
            with src.stepping():
                entered.set()
                threading.Event().wait()

        threading.Thread(target=hold, daemon=True).start()
        entered.wait()
        return "holding"

    def device_copy(nbytes: int, reps: int) -> List[float]:
        """One flat copy of ``nbytes`` on the device, ``reps`` times."""
        a = torch.ones(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        out = []
        for _ in range(reps + 1):
            _sync(device)
            t = time.perf_counter()
            b.copy_(a)
            _sync(device)
            out.append(time.perf_counter() - t)
        del a, b
        return out[1:]

    _serve(conn, {"join": join, "step": step, "share": share, "hold_step": hold_step, "device_copy": device_copy})


def engine_main(conn: Any, opts: Dict[str, Any]) -> None:
    import torch

    from refit._engine import RefitBuffers
    from refit.vllm import derived_layout

    device = _device(opts["device"])
    config = qwen2_config(opts["size"])
    model = FusedQwen2(config, torch.bfloat16, device)
    state: Dict[str, Any] = {}

    def connect(tensors: List[Any], rendezvous: str, secret: str, fabric: str) -> Dict[str, Any]:
        # The engine holds every tensor whole (one rank, no tensor
        # parallelism): what a vLLM worker's dry run finds at TP 1.
        held = {n: [([0] * len(s), list(s))] for n, _, s in tensors}
        layout, _ = derived_layout(tensors, [held], dtype="bf16")
        # As vLLM's worker does by default: refits write the buffers in
        # place (on one GPU, one copy per byte from the trainer's tensors);
        # --staged keeps a staging copy and commits into them.
        buffers = RefitBuffers(tensors, held, layout, 0, dtype="bf16", device=device, fabric=fabric, staged=opts["staged"])
        state["buffers"] = buffers
        buffers.join(rendezvous, secret)
        return {"buffer_bytes": buffers.bytes, "params": model.numel()}

    def load(version: int) -> Dict[str, float]:
        t = time.perf_counter()
        parts = state["buffers"].receive(version, model.load_weights)
        parts["whole"] = time.perf_counter() - t
        return parts

    def rebuild(handles: List[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
        return [(n, fn(*args)) for n, (fn, args) in handles]

    def verify(handles: List[Tuple[str, Any]]) -> Dict[str, int]:
        """Every element of the fused parameters against the trainer's
        masters cast to bf16, bit for bit (on the device)."""
        masters = rebuild(handles)
        mismatched, compared = 0, 0
        with torch.no_grad():
            for name, master in masters:
                want = master.to(torch.bfloat16).view(torch.int16)
                have = model.part(name).view(torch.int16)
                mismatched += int((want != have).sum())
                compared += have.numel()
        del masters
        _sync(device)
        return {"mismatched": mismatched, "compared": compared, "elements": model.numel()}

    def by_hand(handles: List[Tuple[str, Any]]) -> float:
        """torch's IPC by hand: rebuild every shared master and copy it,
        cast, into the fused parameters (what colocated RL frameworks do)."""
        t = time.perf_counter()
        with torch.no_grad():
            model.load_weights(rebuild(handles))
        _sync(device)
        return time.perf_counter() - t

    def snapshot() -> Optional[int]:
        state["snapshot"] = {n: p.clone() for n, p in model.params.items()}
        with state["buffers"].dst.serving() as served:
            return served

    def after_kill(version: int) -> Dict[str, Any]:
        """After the trainer died mid-refit: the version served, the
        parameters unchanged, the buffers loading it again, a kernel."""
        out: Dict[str, Any] = {}
        buffers = state["buffers"]
        with buffers.dst.serving() as served:
            out["served"] = served
        same = lambda: all(torch.equal(p.view(torch.int16), state["snapshot"][n].view(torch.int16)) for n, p in model.params.items())  # noqa: E731
        out["params_unchanged"] = same()
        try:
            buffers.receive(version, model.load_weights)
            out["reloaded"] = True
        except Exception as e:  # noqa: BLE001 - reported
            out["reloaded"] = f"{type(e).__name__}: {e}"
        out["params_after_reload_unchanged"] = same()
        x = torch.randn(512, 512, device=device)
        out["kernel"] = float((x @ x).sum())
        _sync(device)
        out["kernel_ran"] = True
        return out

    handlers = {"connect": connect, "load": load, "verify": verify, "by_hand": by_hand, "snapshot": snapshot, "after_kill": after_kill}
    try:
        _serve(conn, handlers)
    finally:
        if "buffers" in state:
            state["buffers"].shutdown()


# --- the driver ------------------------------------------------------------------


class Child:
    """A child process answering commands."""

    def __init__(self, ctx: Any, name: str, target: Callable[..., None], opts: Dict[str, Any]):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, opts), name=name, daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd: str, *args: Any, timeout: float = 300.0) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name}: no answer to {cmd} in {timeout:.0f} s")
        kind, value = self.conn.recv()
        if kind == "err":
            raise RuntimeError(f"{self.name}: {cmd} failed:\n{value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", ()))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def environment(device: str) -> Dict[str, Any]:
    import importlib.metadata

    import torch

    env: Dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        env["refit"] = importlib.metadata.version("refit")
    except importlib.metadata.PackageNotFoundError:
        env["refit"] = None
    import refit

    env["refit_path"] = os.path.dirname(refit.__file__)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    info = os.path.join(ROOT, "target", "gpu-carry", "BUILD_INFO.json")
    if os.path.exists(info):
        with open(info) as f:
            env["commit"] = json.load(f).get("commit")
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import torch.cuda.nccl as nccl

            version = nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as e:  # noqa: BLE001 - recorded, not needed by the check
            env["nccl"] = f"unknown ({type(e).__name__}: {e})"
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def run(opts: Dict[str, Any], result: Dict[str, Any]) -> List[str]:
    """The check; the failures found (empty: passed). Fills ``result``."""
    import torch.multiprocessing as mp

    import refit

    failures: List[str] = []
    ctx = mp.get_context("spawn")
    orch = refit.Orchestrator(fabric=opts["fabric"], deadline=opts["deadline"])
    trainer = Child(ctx, "trainer", trainer_main, opts)
    engine = Child(ctx, "engine", engine_main, opts)
    try:
        joined = trainer.call("join", orch.address, orch.secret)
        tensors = joined["tensors"]
        connected = engine.call("connect", tensors, orch.address, orch.secret, opts["fabric"])
        result["model"] = {"params": joined["params"], "tensors": len(tensors), "engine_elements": connected["params"], "refit_buffer_bytes": connected["buffer_bytes"]}
        plan = orch.connect(1, 1, timeout=120)
        result["model"]["plan_bytes"] = getattr(plan, "bytes", None)
        rounds: List[Dict[str, Any]] = []
        for i in range(opts["refits"]):
            stepped = trainer.call("step")
            v = stepped["version"]
            t = time.perf_counter()
            report = orch.refit(v)
            refit_s = time.perf_counter() - t
            loaded = engine.call("load", v)
            handles, share_s = trainer.call("share")
            checked = engine.call("verify", handles)
            # (b): the same version by hand, after the check of refit's.
            t = time.perf_counter()
            handles, _ = trainer.call("share")
            engine.call("by_hand", handles)
            by_hand_s = time.perf_counter() - t
            one = {
                "version": v,
                "loss": stepped["loss"],
                "step_s": stepped["seconds"],
                "bytes": report.bytes,
                "refit_s": refit_s,
                "refit_report": {"seconds": report.seconds, "transfer_s": report.transfer_seconds, "connect_s": report.connect_seconds, "commit_s": report.commit_seconds, "plan_s": report.plan_seconds},
                "load_s": loaded["whole"],
                "refit_plus_load_s": refit_s + loaded["whole"],
                "by_hand_s": by_hand_s,
                **checked,
            }
            rounds.append(one)
            if checked["mismatched"] or checked["compared"] != checked["elements"]:
                failures.append(f"refit {i + 1} (version {v}): {checked['mismatched']} of {checked['compared']} elements differ from the masters cast to bf16 ({checked['elements']} in the engine)")
            if report.version != v:
                failures.append(f"refit {i + 1}: reported version {report.version}, asked {v}")
        result["refits"] = rounds
        # (c): one device copy of the bytes the refit moved.
        nbytes = max(r["bytes"] for r in rounds)
        copies = trainer.call("device_copy", nbytes, 5)
        # The first refit opens the data plane (staging, buckets): the
        # steady state is the others.
        steady = rounds[1:] if len(rounds) > 1 else rounds
        timing = {
            "bytes": nbytes,
            "refit_s": median([r["refit_s"] for r in steady]),
            "refit_transfer_s": median([r["refit_report"]["transfer_s"] for r in steady]),
            "refit_plus_load_s": median([r["refit_plus_load_s"] for r in steady]),
            "by_hand_s": median([r["by_hand_s"] for r in steady]),
            "device_copy_s": median(copies),
            "first_refit_s": rounds[0]["refit_s"],
            "of": f"medians of refits 2..{len(rounds)}" if len(rounds) > 1 else "the one refit",
        }
        timing["device_copy_GBps"] = nbytes / timing["device_copy_s"] / 1e9
        timing["refit_GBps"] = nbytes / timing["refit_s"] / 1e9
        timing["refit_speed_vs_device_copy"] = timing["device_copy_s"] / timing["refit_s"]
        # The data movement alone (RefitReport.transfer_seconds: without the
        # control plane's round trips and the commit).
        timing["refit_transfer_speed_vs_device_copy"] = timing["device_copy_s"] / timing["refit_transfer_s"]
        timing["goal_speed_vs_device_copy"] = 0.7
        timing["goal_met"] = timing["refit_speed_vs_device_copy"] >= 0.7
        timing["refit_faster_than_by_hand"] = timing["refit_s"] < timing["by_hand_s"]
        timing["refit_plus_load_faster_than_by_hand"] = timing["refit_plus_load_s"] < timing["by_hand_s"]
        result["timing"] = timing
        failures += kill_mid_refit(orch, trainer, engine, rounds[-1]["version"], opts, result)
    finally:
        engine.stop()
        trainer.stop()
        orch.close()
    return failures


def kill_mid_refit(orch: Any, trainer: Child, engine: Child, served: int, opts: Dict[str, Any], result: Dict[str, Any]) -> List[str]:
    """The trainer steps to a new version and enters the next step; the
    refit of the new version starts (every member prepared and connected,
    the engine's run waiting for the trainer's bytes, the trainer's source
    waiting for its step: the version fence), and the trainer is killed
    (SIGKILL). The refit must fail and the engine keep ``served``."""
    failures: List[str] = []
    before = engine.call("snapshot")
    new = trainer.call("step")["version"]
    trainer.call("hold_step")
    outcome: Dict[str, Any] = {}

    def refit_new() -> None:
        t = time.perf_counter()
        try:
            outcome["report"] = orch.refit(new).version
        except Exception as e:  # noqa: BLE001 - the expected failure
            outcome["error"] = f"{type(e).__name__}: {e}"
        outcome["seconds"] = time.perf_counter() - t

    thread = threading.Thread(target=refit_new, daemon=True)
    thread.start()
    time.sleep(opts["kill_after"])
    in_flight = thread.is_alive()
    trainer.proc.kill()
    trainer.proc.join(10)
    thread.join(opts["deadline"] + 30)
    after = engine.call("after_kill", served, timeout=120)
    kill = {
        "served_before": before,
        "new_version": new,
        "refit_in_flight_at_kill": in_flight,
        "trainer_exit": trainer.proc.exitcode,
        "refit_outcome": outcome,
        **after,
    }
    result["kill"] = kill
    if before != served:
        failures.append(f"kill: the engine served {before} before the kill, expected {served}")
    if not in_flight:
        failures.append(f"kill: the refit of version {new} was not in flight when the trainer was killed: {outcome}")
    if "error" not in outcome:
        failures.append(f"kill: the refit of version {new} did not fail when its trainer was killed: {outcome}")
    if not after["params_unchanged"] or not after["params_after_reload_unchanged"]:
        failures.append("kill: the engine's parameters changed")
    if opts["staged"]:
        # A staged refit never touched the buffers: they hold the version.
        if after["served"] != served:
            failures.append(f"kill: the engine's buffers hold {after['served']} after the kill, expected {served}")
        if after["reloaded"] is not True:
            failures.append(f"kill: the engine could not load its version again: {after['reloaded']}")
    elif after["served"] not in (served, None):
        failures.append(f"kill: the engine's buffers hold {after['served']} after the kill, expected {served} or none (torn)")
    elif after["served"] is None and after["reloaded"] is True:
        # Written in place: a failed refit leaves the buffers torn, and a
        # load from them must be refused (the model keeps its version).
        failures.append("kill: the engine loaded from refit buffers a failed refit tore")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for colocated.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default=None, help="default: 1b on cuda, tiny on cpu")
    parser.add_argument("--fabric", default=None, help='the orchestrator\'s fabric (default: "ipc" on cuda, "node" on cpu)')
    parser.add_argument("--refits", type=int, default=5, help="refits checked (at least 4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--deadline", type=float, default=30.0, help="the orchestrator's deadline per refit (s)")
    parser.add_argument("--kill-after", type=float, default=2.0, help="seconds into the last refit the trainer is killed")
    parser.add_argument("--staged", action="store_true", help="the engine stages each refit and commits it into its buffers (default: written in place, as vLLM's worker does)")
    args = parser.parse_args()
    opts = {
        "device": args.device,
        "size": args.size or ("1b" if args.device == "cuda" else "tiny"),
        "fabric": args.fabric or ("ipc" if args.device == "cuda" else "node"),
        "refits": max(4, args.refits),
        "batch": args.batch,
        "seq": args.seq,
        "deadline": args.deadline,
        "kill_after": args.kill_after,
        "staged": args.staged,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "colocated.json")
    result: Dict[str, Any] = {"check": "colocated", "config": opts}

    def write(status: str, failures: List[str]) -> None:
        result["status"], result["failures"] = status, failures
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps({"status": status, "failures": failures, "timing": result.get("timing"), "kill": result.get("kill")}, indent=2))

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        write("no-gpu", [f"cannot run: {e}"])
        return 2
    result["environment"] = environment(opts["device"])
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        write("no-gpu", ["no CUDA device visible to torch"])
        return 2
    try:
        failures = run(opts, result)
    except Exception:  # noqa: BLE001 - a failed check, reported whole
        failures = [traceback.format_exc()]
    write("pass" if not failures else "fail", failures)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
