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

import logging
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._refit import LayoutBuilder, LayoutError, RefitError, TensorBuilder

BACKEND = "refit"
"""The name ``weight_transfer_config={"backend": ...}`` selects refit by."""

_FLOATS = ("f64", "f32", "bf16", "f16")

Box = Tuple[List[int], List[int]]


_log = logging.getLogger("refit.vllm")
_register_warned = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers refit's engine in
    this vLLM process (the front end, the engine core and every worker
    each call it; the engine class is imported only where vLLM makes one).

    Never raises: vLLM calls plugins outside any ``try``, so an exception
    here would stop every vLLM process from starting. A vLLM without the
    weight-transfer API (``vllm.distributed.weight_transfer``), or any
    other failure to register, is one warning per process (logger
    ``refit.vllm``) and the engine goes on without refit's backend."""
    global _register_warned
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        if BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(BACKEND, "refit._vllm_worker", "RefitWeightTransferEngine")
    except Exception as e:  # noqa: BLE001 - a plugin must never take its host down
        if not _register_warned:
            _register_warned = True
            if isinstance(e, ImportError):
                why = f"this vLLM has no weight-transfer API (vllm.distributed.weight_transfer): {e}"
            else:
                why = f"{type(e).__name__}: {e}"
            _log.warning("refit: the %r weight-transfer backend is not available in this vLLM process (%s); vLLM runs without it", BACKEND, why)


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


def buffer_name(tensor: str, index: int, count: int) -> str:
    """The destination buffer of a rank's ``index``-th of ``count`` boxes of
    ``tensor``: the tensor's name for one box."""
    return tensor if count == 1 else f"{tensor}#{index}"


def dst_dtype(src_dtype: str, dtype: str) -> str:
    """Floating-point tensors arrive as ``dtype``; the others as they are."""
    return dtype if src_dtype in _FLOATS else src_dtype


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


def _connect_error(replica: int, error: BaseException, secret: str) -> RefitError:
    """Engine ``replica``'s failure to connect as a ``RefitError``: chained
    to ``error``, unless the secret appears anywhere in its chain (text or
    arguments): then only its text, the secret replaced, and no chain."""
    chain, seen = [], set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = f"{type(error).__name__}: {error}"
    leaks = bool(secret) and any(secret in str(x) or secret in repr(x) or secret in repr(x.args) for x in chain)
    if not leaks:
        out = RefitError(f"engine {replica}: connecting its workers failed: {text}")
        out.__cause__ = error
        return out
    out = RefitError(f"engine {replica}: connecting its workers failed: {text.replace(secret, '<secret>')}")
    out.__suppress_context__ = True
    return out


class VLLMRollouts:
    """vLLM engines (``vllm.LLM``, each started with
    ``weight_transfer_config={"backend": "refit"}``; one per replica, all
    with the same parallelism) taking refits from ``orchestrator``'s
    training ranks, whose layout is ``source``.

    ``dtype``: what floating-point weights arrive as (default: each
    engine's model dtype); the engine's loaders convert to what its
    parameters hold."""

    def __init__(self, orchestrator: Any, engines: Sequence[Any], source: Any, *, dtype: Optional[str] = None):
        if not engines:
            raise RefitError("VLLMRollouts: no engine given")
        if orchestrator.address is None:
            raise RefitError("VLLMRollouts: the orchestrator has no rendezvous (a local system); make one with refit.Orchestrator()")
        self.orchestrator = orchestrator
        self.engines = list(engines)
        self.source = source
        self.dtype = dtype
        self.version: Optional[int] = None
        sizes = {self._world(e) for e in self.engines}
        if len(sizes) != 1:
            raise RefitError(f"VLLMRollouts: engines of different sizes {sorted(sizes)} (every replica must be parallel alike)")
        self.world = sizes.pop()

    @staticmethod
    def _world(engine: Any) -> int:
        return int(engine.llm_engine.vllm_config.parallel_config.world_size)

    @property
    def ranks(self) -> int:
        """Destination ranks: every worker of every engine."""
        return self.world * len(self.engines)

    def connect(self, src_ranks: int, timeout: float = 120.0) -> Any:
        """Once: every worker derives its part of the layout (a dry run of
        its model's loading) and joins; then the orchestrator plans over
        ``src_ranks`` training ranks (joined, or joining within
        ``timeout`` s) and every worker. Returns the ``PlanReport``."""
        tensors = checkpoint_tensors(self.source)
        for replica, engine in enumerate(self.engines):
            info = {
                "rendezvous": self.orchestrator.address,
                "secret": self.orchestrator.secret,
                "tensors": tensors,
                "replica": replica,
                "replicas": len(self.engines),
                "dtype": self.dtype,
            }
            failed = None
            try:
                engine.init_weight_transfer_engine({"init_info": info})
            except Exception as e:
                failed = e
            if failed is not None:
                # Raised outside the except block, so that an error
                # carrying the secret (an engine echoing its arguments)
                # is not kept as this one's context.
                raise _connect_error(replica, failed, self.orchestrator.secret)
        return self.orchestrator.connect(src_ranks, self.ranks, timeout)

    def refit(self, version: int) -> Any:
        """Refits ``version`` (which every training rank holds) into every
        engine: the orchestrator's refit commits it on every worker of
        every engine or on none (``MemberError``/``RefitError``: every
        engine serves what it served), then each engine loads it into its
        model (its weight version becomes ``str(version)``). Returns the
        ``RefitReport``."""
        report = self.orchestrator.refit(version)
        self.load(version)
        return report

    def load(self, version: int) -> None:
        """Has every engine load committed ``version`` into its model (the
        current or the previous one refitted)."""
        for replica, engine in enumerate(self.engines):
            try:
                engine.start_weight_update()
                engine.update_weights({"update_info": {"version": int(version)}})
                engine.finish_weight_update(weight_version=str(version))
            except Exception as e:
                raise RefitError(f"engine {replica}: loading version {version} into the model failed: {e}") from e
        self.version = int(version)
