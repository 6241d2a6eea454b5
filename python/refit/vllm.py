"""refit inside vLLM: a weight-transfer engine for vLLM's own weight-update API.

vLLM's weight-transfer API (``vllm/distributed/weight_transfer/``) lets an
engine of one's own take the weight updates of a running ``LLM``. refit's
is registered by the ``vllm.general_plugins`` entry point
``refit = "refit.vllm:register"`` (installing the ``refit`` package is
enough: every vLLM process loads it), and selected with::

    llm = vllm.LLM(model=..., weight_transfer_config={"backend": "refit"})

The trainer side (this module, ``VLLMRollouts``)::

    orch = refit.Orchestrator()                 # the rendezvous
    src = refit.Source(train_layout, rank)      # each training rank (any process)
    src.register(...); src.join(orch.address, orch.secret)
    rollouts = refit.vllm.VLLMRollouts(orch, [llm], train_layout)
    rollouts.connect(src_ranks=...)             # once
    for step in ...:
        version = src.step()                    # on every training rank
        rollouts.refit(version)                 # every engine serves `version`, or none changed

What each worker does (``refit._vllm_worker``):

- **At ``connect``** (vLLM's ``init_weight_transfer_engine``): a dry run of
  the model's own ``load_weights`` over float64 *shadows* of its
  parameters as created, one checkpoint tensor at a time, each tensor
  loaded as ``1 + element index``: the shadows then say which elements of
  every checkpoint tensor this worker loads, whatever the model's name
  mapping, fusing (q/k/v, gate/up, experts), vocabulary padding or
  tensor/expert parallelism. The engine's workers exchange what they
  found, and each builds the same destination layout (``derived_layout``:
  checkpoint tensors, each rank holding the boxes it loads), opens a
  ``refit.Destination`` for its rank and joins the rendezvous.
- **A refit** (``VLLMRollouts.refit``): the orchestrator's refit moves
  exactly those boxes from the training ranks into every worker's store,
  in refit's own threads while the engine keeps generating, and commits
  on every rank of every engine or on none. Then each engine is told
  (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``)
  to load the committed version: the worker hands the checkpoint tensors
  it holds a part of to ``model.load_weights`` under vLLM's layer-wise
  reload, so the backend's own processing runs again (the CPU backend
  repacks every linear weight; GPU kernels that quantize or repack do the
  same). Nothing of a model changes before its worker holds the whole
  version; a refit that fails leaves every engine serving what it served.

The checkpoint tensors are the training layout's tensors: Hugging Face
names and shapes, as ``megatron_layout`` and ``layout_from_dtensors``
write them. See docs/python.md, "vLLM".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._refit import LayoutBuilder, LayoutError, RefitError, TensorBuilder
from .lora import Adapter

BACKEND = "refit"
"""The name ``weight_transfer_config={"backend": ...}`` selects refit by."""

FLOATS = ("f64", "f32", "bf16", "f16")
"""refit's floating-point dtypes."""

Box = Tuple[List[int], List[int]]


_log = logging.getLogger("refit.vllm")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers refit's engine in
    this vLLM process (the front end, the engine core and every worker
    each call it; the engine class is imported only where vLLM makes one),
    refit's trainer-side engine where vLLM has that API
    (``WeightTransferTrainerFactory``), and makes the engine core drop what
    it derived from replaced weights after every refit load
    (``refit._vllm_core``).

    Never raises: vLLM calls plugins outside any ``try``, so an exception
    here would stop every vLLM process from starting. A vLLM without the
    weight-transfer API (``vllm.distributed.weight_transfer``), or any
    other failure to register, is one warning per process (logger
    ``refit.vllm``) and the engine goes on without refit's backend; a vLLM
    whose engine core refit does not know is one warning too (its prefix
    cache is then the caller's to reset after each load)."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, "refit._vllm_worker", "RefitWeightTransferEngine")
    except Exception as e:  # noqa: BLE001 - a plugin must never take its host down
        if isinstance(e, ImportError):
            why = f"this vLLM has no weight-transfer API (vllm.distributed.weight_transfer): {e}"
        else:
            why = f"{type(e).__name__}: {e}"
        _warn_once("backend", "refit: the %r weight-transfer backend is not available in this vLLM process (%s); vLLM runs without it", BACKEND, why)
        return
    try:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    except ImportError:
        pass  # an older vLLM: VLLMRollouts drives its engines without it
    else:
        try:
            if BACKEND not in WeightTransferTrainerFactory._registry:
                WeightTransferTrainerFactory.register_engine(BACKEND, "refit._vllm_trainer", "RefitTrainerEngine")
        except Exception as e:  # noqa: BLE001 - a plugin must never take its host down
            _warn_once("trainer", "refit: refit's trainer-side engine is not registered in this vLLM process (%s: %s)", type(e).__name__, e)
    _quiet_refusals()
    try:
        from . import _vllm_core

        _vllm_core.follow_weights()
    except Exception as e:  # noqa: BLE001 - a plugin must never take its host down
        _warn_once(
            "core",
            "refit: this vLLM's engine core is not one refit knows (%s: %s): after each refit load, reset its prefix cache "
            "yourself (LLM/AsyncLLM.reset_prefix_cache(reset_running_requests=True)), or prompts served before are continued from the old weights' KV",
            type(e).__name__,
            e,
        )


class _Refusals(logging.Filter):
    """Drops vLLM's tracebacks of a refit refusal that changed nothing (a
    training layout refused at connect, a version not held): the caller
    gets the error, whole; vLLM would log it at ERROR in the worker and
    again in the engine core, as if the engine had failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ._vllm_core import UNCHANGED

        error = record.exc_info[1] if record.exc_info else None
        return UNCHANGED not in str(error) and UNCHANGED not in str(record.msg)


def _quiet_refusals() -> None:
    quiet = _Refusals()
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, _Refusals) for f in handler.filters):
            handler.addFilter(quiet)


_warned: set = set()


def _warn_once(what: str, *args: Any) -> None:
    if what not in _warned:
        _warned.add(what)
        _log.warning(*args)


# --- layouts derived from a dry run ----------------------------------------


def boxes_of(flat: np.ndarray, shape: Sequence[int]) -> List[Box]:
    """The element indices ``flat`` (row-major, sorted, distinct) of a
    tensor of ``shape`` as few boxes ``(offset, extent)``: one box where
    they form one; else split along the first dimension, consecutive
    slices with the same boxes merged."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return [([], [])]
    coords = np.stack(np.unravel_index(np.asarray(flat, dtype=np.int64), shape), axis=1)
    return [(list(map(int, o)), list(map(int, e))) for o, e in _boxes(coords)]


def boxes_of_mask(mask: np.ndarray) -> List[Box]:
    """The ``True`` elements of ``mask`` (a boolean array of the tensor's
    shape) as boxes, as ``boxes_of``; one box is found from the mask's
    projections on each dimension, without listing its elements."""
    if mask.ndim == 0:
        return [([], [])] if bool(mask) else []
    count = int(np.count_nonzero(mask))
    if count == 0:
        return []
    lo, hi = [], []
    for d in range(mask.ndim):
        others = tuple(i for i in range(mask.ndim) if i != d)
        along = np.flatnonzero(mask.any(axis=others) if others else mask)
        lo.append(int(along[0]))
        hi.append(int(along[-1]) + 1)
    if int(np.prod([h - l for l, h in zip(lo, hi)], dtype=np.int64)) == count:
        return [(lo, [h - l for l, h in zip(lo, hi)])]
    return boxes_of(np.flatnonzero(mask), mask.shape)


def _boxes(c: np.ndarray) -> List[Tuple[np.ndarray, np.ndarray]]:
    lo, hi = c.min(axis=0), c.max(axis=0) + 1
    if int(np.prod(hi - lo)) == len(c):
        return [(lo, hi - lo)]
    if c.shape[1] == 1:
        cuts = np.nonzero(np.diff(c[:, 0]) != 1)[0] + 1
        return [(run[:1], np.array([len(run)])) for run in (r[:, 0] for r in np.split(c, cuts))]
    # Rows of the first dimension, each as the boxes of its remaining
    # dimensions; consecutive rows with the same boxes make one segment.
    starts = np.nonzero(np.r_[True, np.diff(c[:, 0]) != 0])[0]
    ends = np.r_[starts[1:], len(c)]
    segments: List[Tuple[int, int, List[Tuple[Tuple[int, ...], Tuple[int, ...]]]]] = []
    for s, e in zip(starts, ends):
        row = int(c[s, 0])
        sub = [(tuple(map(int, o)), tuple(map(int, x))) for o, x in _boxes(c[s:e, 1:])]
        if segments and segments[-1][0] + segments[-1][1] == row and segments[-1][2] == sub:
            first, count, _ = segments[-1]
            segments[-1] = (first, count + 1, sub)
        else:
            segments.append((row, 1, sub))
    return [(np.array([first, *o]), np.array([count, *x])) for first, count, sub in segments for o, x in sub]


def uncovered(shape: Sequence[int], boxes: Sequence[Box]) -> Tuple[int, List[Box]]:
    """The elements of a tensor of ``shape`` in none of ``boxes``: their
    count and the boxes they form (cells of the grid the boxes' edges cut
    the tensor into)."""
    shape = [int(s) for s in shape]
    if not shape:
        return (0, []) if boxes else (1, [([], [])])
    cuts = [sorted({0, n, *(o[d] for o, _ in boxes), *(o[d] + e[d] for o, e in boxes)}) for d, n in enumerate(shape)]
    cells = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for offset, extent in boxes:
        cells[tuple(slice(c.index(o), c.index(o + e)) for c, o, e in zip(cuts, offset, extent))] = True
    count, gaps = 0, []
    for cell in zip(*np.nonzero(~cells)):
        offset = [cuts[d][i] for d, i in enumerate(cell)]
        extent = [cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)]
        count += int(np.prod(extent, dtype=np.int64))
        gaps.append((offset, extent))
    return count, gaps


def landing_gaps(tensors: Sequence[Tuple[str, str, Sequence[int]]], every: Sequence[Mapping[str, Sequence[Box]]]) -> List[str]:
    """Why some elements of the training tensors land in no worker of an
    engine (``every[r]``: what worker ``r``'s dry run found it loads), one
    line per tensor: a tensor the model does not load at all, or one larger
    than the parameters it loads into (extra rows or columns)."""
    out = []
    for name, dtype, shape in tensors:
        boxes = [b for found in every for b in found.get(name, ())]
        total = int(np.prod([int(s) for s in shape], dtype=np.int64)) if shape else 1
        if not boxes:
            out.append(f"tensor '{name}' {list(shape)} {dtype}: the model loads none of it (not a tensor of this model)")
            continue
        count, gaps = uncovered(shape, boxes)
        if count:
            where = ", ".join(_slices(o, e) for o, e in gaps[:3]) + (" ..." if len(gaps) > 3 else "")
            out.append(
                f"tensor '{name}' {list(shape)} {dtype}: {count} of its {total} elements land in no parameter of the model "
                f"({where}): larger than what the model loads"
            )
    return out


def _slices(offset: Sequence[int], extent: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + e}" for o, e in zip(offset, extent)) + "]"


def buffer_name(tensor: str, index: int, count: int) -> str:
    """The destination buffer of a rank's ``index``-th of ``count`` boxes of
    ``tensor``: the tensor's name for one box."""
    return tensor if count == 1 else f"{tensor}#{index}"


def dst_dtype(src_dtype: str, dtype: str) -> str:
    """Floating-point tensors arrive as ``dtype``; the others as they are."""
    return dtype if src_dtype in FLOATS else src_dtype


def derived_layout(
    tensors: Sequence[Tuple[str, str, Sequence[int]]],
    every: Sequence[Mapping[str, Sequence[Box]]],
    *,
    replicas: int = 1,
    dtype: str = "bf16",
) -> Tuple[Any, List[str]]:
    """The destination layout of ``replicas`` engines of ``len(every)``
    workers each, from what each worker's dry run found (``every[r]``:
    tensor → boxes of it that worker ``r`` loads), and the checkpoint
    tensors no worker loads (left out of the layout). Engine ``i``'s worker ``r`` is rank
    ``i * len(every) + r``; an engine's workers are one node."""
    world = len(every)
    if world < 1 or replicas < 1:
        raise LayoutError(f"derived layout: {world} workers, {replicas} replicas")
    builder = LayoutBuilder(world * replicas, world)
    missing = []
    for name, src_dtype, shape in tensors:
        t = TensorBuilder(name, dst_dtype(src_dtype, dtype), [int(s) for s in shape])
        held = False
        for replica in range(replicas):
            for r, found in enumerate(every):
                boxes = list(found.get(name, ()))
                for i, (offset, extent) in enumerate(boxes):
                    held = True
                    t = t.shard(replica * world + r, offset=list(offset), extent=list(extent), buffer=buffer_name(name, i, len(boxes)), at=0)
        if held:
            builder = builder.tensor(t)
        else:
            missing.append(name)  # nothing to send for it: left out
    return builder.build(), missing


def checkpoint_tensors(layout: Any) -> List[List[Any]]:
    """``[name, dtype, shape]`` of every tensor of a (training) layout."""
    out = []
    for name in layout.tensor_names():
        dtype, shape = layout.tensor(name)
        out.append([name, dtype, [int(s) for s in shape]])
    return out


# --- the trainer side -------------------------------------------------------

# A refit worker's answer, as any front end carries its text: vLLM's
# executor wraps it ("Worker failed with error '...', please check ..."),
# the HTTP server puts that in its error body.
_ANSWER = re.compile(r"\[refit (\w+); model (unchanged|torn)\] (.*?)(?:', please check the stack trace|\Z)", re.S)


def _chain(error: BaseException) -> List[BaseException]:
    out, seen = [], set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def engine_error(replica: int, what: str, error: BaseException, secret: str = "") -> RefitError:
    """Engine ``replica``'s failure to do ``what`` as one refit error: the
    refit error a worker answered with (``LayoutError``, ``VersionError``,
    ...: the workers' answers name each worker and the cause), else a
    ``RefitError`` naming the engine. Chained to ``error``, unless
    ``secret`` appears anywhere in its chain (text or arguments): then
    only the text, the secret replaced, and no chain."""
    from . import _refit

    chain = _chain(error)
    found = next((m for m in (_ANSWER.search(str(x)) for x in chain) if m), None)
    if found is not None:
        kind, state, text = found.group(1), found.group(2), found.group(3).strip().replace("\\'", "'")
        cls = getattr(_refit, kind, RefitError)
        if not (isinstance(cls, type) and issubclass(cls, RefitError)):
            cls = RefitError
        if state == "torn":
            text += " (the engine's model is torn: it schedules nothing until a load succeeds)"
    else:
        cls, text = RefitError, f"engine {replica}: {what} failed: {type(error).__name__}: {error}"
    leaks = bool(secret) and any(secret in str(x) or secret in repr(x) or secret in repr(x.args) for x in chain)
    if not leaks:
        out = cls(text)
        out.__cause__ = error
        return out
    out = cls(text.replace(secret, "<secret>"))
    out.__suppress_context__ = True
    return out


class LLMClient:
    """vLLM's weight-sync calls on a ``vllm.LLM`` in this process (the four
    methods of vLLM's ``VLLMWeightSyncClient``)."""

    def __init__(self, llm: Any):
        self.llm = llm

    @property
    def world_size(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


class AsyncLLMClient:
    """vLLM's weight-sync calls on an ``AsyncLLM`` (any vLLM
    ``EngineClient``) whose event loop runs in another thread: each call is
    scheduled on ``loop`` and waited for."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop

    @property
    def world_size(self) -> int:
        return int(self.engine.vllm_config.parallel_config.world_size)

    def _run(self, coro: Any) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RefitError("an AsyncLLM's weight update was waited for on its own event loop (it would never run): await VLLMRollouts.refit_async(...) there")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))


class HTTPClient:
    """vLLM's weight-sync calls on a vLLM server (``vllm serve ...
    --weight-transfer-config '{"backend": "refit"}'``) at ``base_url``:
    vLLM's own ``HTTPVLLMWeightSyncClient`` routes, with the server's error
    text kept in the error raised (so a worker's refusal arrives whole)."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        import json
        import urllib.error
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}/{path}", data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                body = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RefitError(f"{method} {self.base_url}/{path}: HTTP {e.code}: {str(body)[:4000]}") from None

    @property
    def world_size(self) -> int:
        return int(self._call("GET", "get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        self._call("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "start_weight_update")

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        self._call("POST", "update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._call("POST", "finish_weight_update", None if weight_version is None else {"weight_version": weight_version})


def client_of(engine: Any, loop: Optional[asyncio.AbstractEventLoop] = None) -> Any:
    """The weight-sync client of ``engine``: a ``vllm.LLM``, an ``AsyncLLM``
    (with the ``loop`` it runs on, when driven from another thread), a
    server's base URL (``"http://host:port"``), or any object with the four
    methods of vLLM's ``VLLMWeightSyncClient`` (vLLM's own
    ``HTTPVLLMWeightSyncClient`` or ``RayVLLMWeightSyncClient`` over one
    replica's actor), used as it is."""
    if isinstance(engine, str):
        return HTTPClient(engine)
    if hasattr(engine, "llm_engine"):
        return LLMClient(engine)
    if asyncio.iscoroutinefunction(getattr(engine, "start_weight_update", None)):
        return AsyncLLMClient(engine, loop or _loop_of(engine))
    if all(callable(getattr(engine, m, None)) for m in _CLIENT_METHODS):
        return engine
    raise RefitError(f"{type(engine).__name__} is no vLLM engine refit can drive (an LLM, an AsyncLLM, a server URL, or a weight-sync client with {', '.join(_CLIENT_METHODS)})")


_CLIENT_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def _loop_of(engine: Any) -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RefitError(
            f"{type(engine).__name__}: an async engine is driven on its event loop: make VLLMRollouts inside it (or give loop=)"
        ) from None


@dataclass(frozen=True)
class VLLMRefitReport:
    """What one refit into vLLM engines did: the refit (``refit``:
    ``RefitReport``, its stages ``plan_seconds``, ``transfer_seconds``,
    ``commit_seconds``, ...) while the engines generated, then the load
    into every engine at the same time."""

    refit: Any
    load_seconds: List[float]
    """Each engine's weight-update calls, one after another, in engine
    order (start, update, finish and the version). The engine stops only
    in the update (the load; then it recomputes running requests' KV), and
    generates between the calls, so this is longer than its pause
    (docs/benchmarks.md, "vLLM: the pause")."""
    seconds: float
    """The whole update: refit and loads."""

    @property
    def version(self) -> int:
        return int(self.refit.version)

    @property
    def bytes(self) -> int:
        """Bytes the refit moved."""
        return int(self.refit.bytes)

    @property
    def pause_seconds(self) -> float:
        """An upper bound of the longest an engine paused: the slowest
        engine's weight-update calls."""
        return max(self.load_seconds, default=0.0)


class VLLMRollouts:
    """vLLM engines taking refits from ``orchestrator``'s training ranks,
    whose layout is ``source``: one engine per replica, all parallel alike,
    each a ``vllm.LLM``, an ``AsyncLLM``, a server's URL or a weight-sync
    client (``client_of``), every one started with
    ``weight_transfer_config={"backend": "refit"}``.

    ``dtype``: what floating-point weights arrive as (default: each
    engine's model dtype); the engine's loaders convert to what its
    parameters hold. ``world_size``: each engine's workers (default: asked
    of the engines).

    Each worker keeps a refit buffer of its share of every checkpoint
    tensor (the engine's loading reprocesses what it loads: repacking on
    the CPU backend, quantizing where configured, so the model's own
    parameters cannot be written directly). Refits write those buffers in
    place while the engine generates (``staged=False``, the default): the
    model reads them only during a load, which holds refits off. A refit
    that fails leaves them torn (nothing loads them; the engines keep
    their weights) until the next refit. ``staged=True`` stages each refit
    in refit's own store first and copies it into the buffers at the
    commit: a second copy of each worker's share, for which the last
    committed version stays loadable after a failed refit
    (docs/benchmarks.md, "vLLM: the pause").

    ``adapter``: a LoRA adapter slot (``refit.lora.Adapter``): ``source``
    is then the layout of a PEFT adapter's tensors
    (``refit.lora.adapter_parameters``), every worker takes them whole,
    and each load puts the refitted version in place of the previous one
    under the adapter's LoRA id; the model's weights are not touched
    (engines started with ``enable_lora=True``; ``dtype`` defaults to their
    LoRA dtype). Requests name it with ``adapter.request()``."""

    def __init__(
        self,
        orchestrator: Any,
        engines: Sequence[Any],
        source: Any,
        *,
        dtype: Optional[str] = None,
        world_size: Optional[int] = None,
        staged: bool = False,
        loop: Optional[asyncio.AbstractEventLoop] = None,
        adapter: Optional[Adapter] = None,
    ):
        if not engines:
            raise RefitError("VLLMRollouts: no engine given")
        if orchestrator.address is None:
            raise RefitError("VLLMRollouts: the orchestrator has no rendezvous (a local system); make one with refit.Orchestrator()")
        if adapter is not None and not isinstance(adapter, Adapter):
            raise RefitError(f"VLLMRollouts: adapter is a {type(adapter).__name__}, expected a refit.lora.Adapter")
        self.orchestrator = orchestrator
        self.engines = list(engines)
        self.clients = [client_of(e, loop) for e in self.engines]
        self.source = source
        self.dtype = dtype
        self.staged = bool(staged)
        self.adapter = adapter
        self.version: Optional[int] = None
        if world_size is None:
            sizes = {int(size) for size in (getattr(c, "world_size", None) for c in self.clients) if size is not None}
            if len(sizes) > 1:
                raise RefitError(f"VLLMRollouts: engines of different sizes {sorted(sizes)} (every replica must be parallel alike)")
            if not sizes:
                raise RefitError("VLLMRollouts: give world_size= (the workers of each engine): these clients do not say")
            world_size = sizes.pop()
        self.world = int(world_size)
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="refit-vllm")

    @property
    def ranks(self) -> int:
        """Destination ranks: every worker of every engine."""
        return self.world * len(self.engines)

    def _each(self, what: str, call: Any) -> List[Any]:
        """``call(replica, client)`` on every engine at once; the engines'
        errors as one refit error (the first engine's, the others' named in
        it)."""
        futures = [self._pool.submit(call, r, c) for r, c in enumerate(self.clients)]
        results, errors = [], []
        for replica, f in enumerate(futures):
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - turned into refit's errors below
                errors.append(engine_error(replica, what, e, self.orchestrator.secret))
                results.append(None)
        if errors:
            first = errors[0]
            if len(errors) > 1:
                first.args = (f"{first}; and {len(errors) - 1} more engine(s): " + "; ".join(str(e) for e in errors[1:]),)
            raise first
        return results

    def connect(self, src_ranks: int, timeout: float = 120.0) -> Any:
        """Once (or again, after a refusal): every worker derives its part of
        the layout (a dry run of its model's loading) and joins; then the
        orchestrator plans over ``src_ranks`` training ranks (joined, or
        joining within ``timeout`` s) and every worker. Returns the
        ``PlanReport``. A training layout the engines cannot take raises
        ``LayoutError`` naming the tensor and the elements; the engines are
        then ready to connect again."""
        tensors = checkpoint_tensors(self.source)

        def init(replica: int, client: Any) -> None:
            info = {
                "rendezvous": self.orchestrator.address,
                "secret": self.orchestrator.secret,
                "tensors": tensors,
                "replica": replica,
                "replicas": len(self.engines),
                "dtype": self.dtype,
                "staged": self.staged,
                # Each worker refuses here a fabric that cannot reach its
                # refit buffers (device memory for a model on CUDA).
                "fabric": getattr(self.orchestrator, "fabric", None),
                "adapter": None if self.adapter is None else self.adapter.info(),
            }
            client.init_weight_transfer_engine(info)

        self._each("connecting its workers", init)
        return self.orchestrator.connect(src_ranks, self.ranks, timeout)

    def refit(self, version: Optional[int] = None) -> VLLMRefitReport:
        """Refits ``version`` (default: the newest every training rank
        holds) into every engine while they generate: the orchestrator's
        refit commits it on every worker of every engine or on none
        (``MemberError``/``RefitError``: every engine serves what it
        served); then every engine loads it at the same time (``load``).
        One log line (logger ``refit.vllm``) says each stage."""
        t0 = time.perf_counter()
        report = self.orchestrator.refit_latest() if version is None else self.orchestrator.refit(version)
        loads = self.load(report.version)
        out = VLLMRefitReport(refit=report, load_seconds=loads, seconds=time.perf_counter() - t0)
        _log.info(
            "refit: version %d into %d engine(s) x %d worker(s): plan %.1f ms, transfer %.1f ms (of which the digest check %.1f ms), commit %.1f ms, load %.1f ms (the slowest engine's update calls), whole %.1f ms, %d bytes",
            out.version,
            len(self.engines),
            self.world,
            report.plan_seconds * 1e3,
            report.transfer_seconds * 1e3,
            report.verify_seconds * 1e3,
            report.commit_seconds * 1e3,
            out.pause_seconds * 1e3,
            out.seconds * 1e3,
            report.bytes,
        )
        return out

    def load(self, version: int) -> List[float]:
        """Has every engine load committed ``version`` into its model (the
        current or the previous one refitted), all at the same time; each
        engine's seconds. An engine whose load fails on any worker (its
        model torn) schedules nothing until a load succeeds (the others
        serve ``version``); the error names it and the cause."""

        def one(_replica: int, client: Any) -> float:
            t = time.perf_counter()
            client.start_weight_update()
            try:
                client.update_weights({"version": int(version)})
            except BaseException:
                # vLLM ends the update session only on the worker whose
                # update raised (the last: see refit._vllm_worker._Workers);
                # end it on the others too, so the next load can start.
                try:
                    client.finish_weight_update()
                except Exception:  # noqa: BLE001 - the update's error is the one to raise
                    pass
                raise
            client.finish_weight_update(weight_version=str(version))
            return time.perf_counter() - t

        seconds = self._each(f"loading version {version} into the model", one)
        self.version = int(version)
        return seconds

    async def connect_async(self, src_ranks: int, timeout: float = 120.0) -> Any:
        """``connect`` from the engines' event loop (``AsyncLLM``)."""
        return await self._in_thread(self.connect, src_ranks, timeout)

    async def refit_async(self, version: Optional[int] = None) -> VLLMRefitReport:
        """``refit`` from the engines' event loop (``AsyncLLM``): the
        engines go on generating on it meanwhile."""
        return await self._in_thread(self.refit, version)

    async def _in_thread(self, call: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        for c in self.clients:
            if isinstance(c, AsyncLLMClient) and c.loop is not loop:
                raise RefitError("VLLMRollouts: an AsyncLLM runs on another event loop than this call's")
        return await loop.run_in_executor(None, call, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def __getattr__(name: str) -> Any:
    # vLLM's trainer-side engine and its init info import vLLM: only here.
    if name in ("RefitTrainerEngine", "RefitTrainerInitInfo"):
        from . import _vllm_trainer

        return getattr(_vllm_trainer, name)
    raise AttributeError(f"module 'refit.vllm' has no attribute {name!r}")
