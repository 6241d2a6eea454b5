"""The refit weight-transfer engine inside vLLM's worker processes.

vLLM makes one ``RefitWeightTransferEngine`` per worker, right after the
worker loaded its model, when ``weight_transfer_config={"backend":
"refit"}`` (the ``vllm.general_plugins`` entry point ``refit.vllm:register``
registers the class in every vLLM process). The trainer side drives it
through vLLM's worker RPCs; ``refit.vllm`` has that side and the whole
story (docs/python.md, "vLLM").

``init_transfer_engine``: a dry run of the model's own ``load_weights``
finds which elements of every checkpoint tensor this worker loads
(``dry_run``), the engine's workers exchange those, and each builds the
same destination layout (``refit.vllm.derived_layout``), makes its
refit buffers where the model lives (``refit._engine.RefitBuffers``: host
memory, or the worker's GPU), registers them as a ``Destination`` for its
rank and joins the orchestrator's rendezvous.
Refits then stage and commit into that destination's store in refit's
own threads while the engine keeps generating.

``update_weights({"version": v})`` (after the orchestrator's refit of
``v`` committed on every rank): holds commits off and hands the checkpoint tensors to ``model.load_weights`` under vLLM's
layer-wise reload, which re-runs the backend's own weight processing
(repacking on the CPU backend, quantization where configured). Nothing
of the model is touched before every byte of the version is here (a
refit commits into this worker's refit buffers only once every rank of
every engine staged it).

With a LoRA adapter slot (``RefitInitInfo.adapter``, from
``refit.vllm.VLLMRollouts(..., adapter=...)``) there is no dry run: every
worker takes the adapter's tensors whole, checks at connect that the
engine can apply them (``refit._vllm_lora.AdapterSlot.check``), and a load
builds the version from copies and puts it in the engine's LoRA manager
in place of the previous one; the model's weights are not touched.

Imports vLLM: only vLLM's worker processes import this module.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import refit
from refit import vllm as _front
from refit._engine import REFIT_DTYPES, RefitBuffers

log = logging.getLogger("refit.vllm")

@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What ``refit.vllm.connect`` sends every worker once."""

    rendezvous: str = ""
    # Never in a repr (vLLM and users log these objects).
    secret: str = field(default="", repr=False)
    # The checkpoint tensors the sources hold: [name, refit dtype, shape].
    tensors: List[Any] = field(default_factory=list)
    replica: int = 0
    replicas: int = 1
    # The destination dtype of floating-point tensors (None: the model's).
    dtype: Optional[str] = None
    # Whether refits stage in the member's own store before the commit
    # copies into the refit buffers (see refit.vllm.VLLMRollouts).
    staged: bool = False
    # The orchestrator's fabric (refit.Orchestrator(fabric=...)): the
    # worker refuses at connect one that cannot reach its refit buffers
    # (device memory for a model on CUDA). None: not checked.
    fabric: Optional[str] = None
    # A LoRA adapter slot (refit.lora.Adapter.info()): the tensors are the
    # adapter's, every worker takes them whole, and a load puts them in
    # the engine's LoRA manager (refit._vllm_lora). None: the model's
    # weights.
    adapter: Optional[Dict[str, Any]] = None


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """Which committed version to load into the model."""

    version: int = -1


# --- the dry run -----------------------------------------------------------


def _loader_of(tensor: torch.Tensor) -> Any:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    loader = getattr(tensor, "weight_loader", default_weight_loader)
    # vLLM's layer-wise reload wraps loaders; the dry run calls the original.
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _as_class_of(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` with ``like``'s class and attributes (as vLLM materializes
    parameters for its layer-wise reload)."""
    tensor.__class__ = like.__class__
    tensor.__dict__ = like.__dict__.copy()
    return tensor


class _Shadows:
    """Every parameter of the model replaced by a placeholder on ``meta``
    whose weight loader, on first use, puts a float64 *shadow* of the
    parameter's original shape in its place (zeros) and loads into it. A
    checkpoint tensor loaded as ``1 + element index`` then leaves, in the
    shadows, exactly which of its elements this worker keeps and where.

    Loads into a placeholder without a loader call (a model that copies into
    ``param.data`` itself) write nothing (``meta``): those elements are
    missed, and the parameter counts as never loaded (``never_loaded``).
    Buffers are snapshotted and put back. ``restore()`` puts every live
    parameter back as it was."""

    def __init__(self, model: torch.nn.Module):
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.live: List[Tuple[torch.nn.Module, str, torch.Tensor]] = []
        self.buffers: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.touched: Dict[Tuple[int, str], Tuple[torch.nn.Module, str, torch.Tensor]] = {}
        self.originals: Dict[Tuple[int, str], torch.Tensor] = {}
        self.names: Dict[Tuple[int, str], str] = {}
        self.loaded: set = set()
        # The parameter the model's loading last wrote into.
        self.loading: Optional[Tuple[int, str]] = None
        for prefix, layer in model.named_modules():
            original_params = get_layerwise_info(layer).restore_metadata[0]
            for name, buf in layer._buffers.items():
                if buf is not None and not buf.is_meta:
                    self.buffers.append((buf, buf.detach().clone()))
            for name, param in list(layer._parameters.items()):
                if param is None:
                    continue
                self.live.append((layer, name, param))
                # The parameter as created (before the backend repacked it),
                # or the live one where vLLM recorded none (biases).
                recorded = original_params.get(name)
                if recorded is not None:
                    original = restore_layer_refs(to_meta_tensor(recorded), layer)
                else:
                    original = to_meta_tensor(param)
                key = (id(layer), name)
                self.originals[key] = original
                self.names[key] = f"{prefix}.{name}" if prefix else name
                layer._parameters[name] = self._placeholder(layer, name, original)

    def _placeholder(self, layer: torch.nn.Module, name: str, original: torch.Tensor) -> torch.Tensor:
        loader = _loader_of(original)
        signature = inspect.signature(loader)
        key = (id(layer), name)
        touched = self.touched

        def shadow_loader(*args: Any, **kwargs: Any) -> Any:
            self.loading = key
            hit = touched.get(key)
            if hit is None:
                shadow = torch.zeros(tuple(original.shape), dtype=torch.float64)
                _as_class_of(shadow, original)
                shadow.weight_loader = loader
                layer._parameters[name] = shadow
                touched[key] = (layer, name, shadow)
            else:
                shadow = hit[2]
            bound = signature.bind(*args, **kwargs)
            if "param" in bound.arguments:
                bound.arguments["param"] = shadow
            return loader(*bound.args, **bound.kwargs)

        placeholder = torch.empty(tuple(original.shape), dtype=original.dtype, device="meta")
        _as_class_of(placeholder, original)
        placeholder.weight_loader = shadow_loader
        return placeholder

    def take(self) -> List[Tuple[Tuple[int, str], torch.Tensor]]:
        """The shadows loaded into since the last call (with their keys), as
        placeholders again (the next load starts from zeros)."""
        out = []
        for key, (layer, name, shadow) in self.touched.items():
            out.append((key, shadow))
            self.loaded.add(key)
            layer._parameters[name] = self._placeholder(layer, name, self.originals[key])
        self.touched.clear()
        return out

    def never_loaded(self) -> List[str]:
        """The parameters no load has written (a tied parameter counts as
        loaded through any of its names), each named once."""
        loaded = {id(param) for layer, name, param in self.live if (id(layer), name) in self.loaded}
        seen, out = set(), []
        for layer, name, param in self.live:
            if id(param) not in loaded and id(param) not in seen:
                seen.add(id(param))
                out.append(self.names[(id(layer), name)])
        return out

    def describe(self, key: Tuple[int, str]) -> str:
        """A parameter by name, shape and dtype as created."""
        original = self.originals[key]
        return f"'{self.names[key]}' {list(original.shape)} {str(original.dtype).replace('torch.', '')}"

    def restore(self) -> None:
        for layer, name, param in self.live:
            layer._parameters[name] = param
        for buf, saved in self.buffers:
            buf.data.copy_(saved)


def dry_run(model: torch.nn.Module, tensors: List[Tuple[str, str, Tuple[int, ...]]]) -> Dict[str, List[Tuple[List[int], List[int]]]]:
    """For every checkpoint tensor ``(name, dtype, shape)``, the boxes
    ``(offset, extent)`` of it that ``model.load_weights`` puts into this
    worker's parameters (the tensor is absent where it puts none). Runs
    the model's own loading, one tensor at a time, over float64 shadows of
    the parameters as created (see ``_Shadows``); the model's weights are
    as before when it returns, whatever happens.

    ``LayoutError`` naming the tensor where the model's loading refuses
    one (a wrong shape), and naming the parameters no tensor loads (a
    refit would leave them as they are: the training layout lacks them)."""
    shadows = _Shadows(model)
    held: Dict[str, List[Tuple[List[int], List[int]]]] = {}
    try:
        with torch.no_grad():
            for name, dtype, shape in tensors:
                numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
                if numel >= 2**53:
                    raise refit.LayoutError(f"tensor '{name}': {numel} elements cannot be traced in float64")
                probe = torch.arange(1, numel + 1, dtype=torch.float64).reshape(tuple(shape))
                shadows.loading = None
                try:
                    model.load_weights([(name, probe)])
                except Exception as e:
                    into = f" (loading it into parameter {shadows.describe(shadows.loading)})" if shadows.loading else ""
                    raise refit.LayoutError(
                        f"tensor '{name}' {list(shape)} {dtype}: the model's load_weights refused it{into}: {type(e).__name__}: {e}".rstrip(": ")
                    ) from e
                # Which elements landed anywhere: a mask over the tensor.
                mask = np.zeros(numel, dtype=bool)
                taken = shadows.take()
                _check_kind(name, dtype, [(shadows.describe(k), shadows.originals[k].dtype) for k, _ in taken])
                for _key, shadow in taken:
                    values = shadow.detach().reshape(-1)
                    values = values[values != 0]
                    if values.numel():
                        mask[values.to(torch.int64).numpy() - 1] = True
                boxes = _front.boxes_of_mask(mask.reshape(tuple(shape)))
                if boxes:
                    held[name] = boxes
        never = shadows.never_loaded()
        if never:
            raise refit.LayoutError(
                f"no tensor of the training layout loads {len(never)} parameter(s) of the model: {never[:8]}"
                f"{' ...' if len(never) > 8 else ''} (a refit would leave them as they are; the training layout must hold "
                "every checkpoint tensor the model loads)"
            )
    finally:
        shadows.restore()
    return held


@contextlib.contextmanager
def _muted(logger: str, unwanted: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Drops the records of vLLM's ``logger`` that ``unwanted`` picks."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            try:
                return not unwanted(record)
            except Exception:  # noqa: BLE001 - a record we cannot read is kept
                return True

    target = logging.getLogger(logger)
    drop = Drop()
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


def _quiet_float64() -> Any:
    """The dry run's float64 probes, which vLLM's loader warns about once
    per tensor and worker (the dtype is the dry run's own)."""
    return _muted(
        "vllm.model_executor.models.utils",
        lambda r: str(r.msg).startswith("Attempted to load weight") and len(r.args) > 1 and r.args[1] == torch.float64,
    )


def _bare_layers(model: torch.nn.Module) -> set:
    """The classes of the model's layers that never hold parameters of
    their own."""
    bare = {type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is None}
    return bare - {type(m).__name__ for m in model.modules() if next(m.parameters(recurse=False), None) is not None}


def _quiet_reload(bare: set) -> Any:
    """vLLM's layer-wise reload warns "Failed to load weights" for every
    layer whose checkpoint holds nothing, parameter-less layers included
    (their buffers count): kept for layers with parameters of their own
    (``bare``: ``_bare_layers``, found once at connect)."""
    return _muted(
        "vllm.model_executor.model_loader.reload.layerwise",
        lambda r: str(r.msg) == "%s: Failed to load weights" and r.args[0] in bare,
    )


def _check_kind(name: str, dtype: str, into: List[Tuple[str, torch.dtype]]) -> None:
    """A floating-point tensor loads into floating-point parameters only,
    and any other kind into parameters of its own kind."""
    floating = dtype in _front.FLOATS
    wrong = [what for what, dt in into if dt.is_floating_point != floating]
    if wrong:
        kind = "floating-point" if floating else "non-floating-point"
        raise refit.LayoutError(
            f"tensor '{name}' is {dtype} in the training layout ({kind}), but the model loads it into parameter(s) of another kind: "
            f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''} (a wrong dtype in the training layout)"
        )


# --- the engine -------------------------------------------------------------


def _repack_cpu_experts(model: torch.nn.Module) -> None:
    """Prepacks reloaded MoE experts on vLLM's CPU backend, which vLLM 0.32
    skips on a reload.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts kernel's
    own ``process_weights_after_loading`` only the first time (when it
    makes the kernel); on a weight update it copies the new weights in and
    stops. On the CPU backend that step is the prepack into the grouped
    GEMM's layout (``experts/cpu_moe.py``), so reloaded experts are left
    unpacked and the kernel computes with them as if packed: generation
    drifts (found by ``python/tests/test_vllm_refit.py``; vLLM's own
    reload of full checkpoint tensors does the same). Applied to the vLLM
    release it was found on only, where every MoE layer was just reloaded
    whole; a release that packs on reload itself must not be packed twice."""
    import vllm

    if not vllm.__version__.startswith("0.32."):
        return
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if (
            experts is not None
            and type(method).__name__ == "UnquantizedFusedMoEMethod"
            and type(experts).__module__.endswith("fused_moe.experts.cpu_moe")
        ):
            experts.process_weights_after_loading(layer)


class _Workers:
    """This engine's workers answering every call together: each says how
    its part went, all learn every answer (one gather on vLLM's CPU group),
    and one error naming each worker that failed is raised on the last
    worker only. vLLM's ``collective_rpc`` reads the workers' replies in
    rank order and raises at the first failed one, leaving the replies
    after it queued for the next call; with the last worker the only one
    failing, every reply is read and the next call starts in step."""

    def __init__(self, replica: int):
        from vllm.distributed.parallel_state import get_world_group

        self.group = get_world_group()
        self.replica = replica
        self.rank = self.group.rank_in_group
        self.size = self.group.world_size

    def gather(self, mine: Any) -> List[Any]:
        if self.size == 1:
            return [mine]
        every: List[Any] = [None] * self.size
        with warnings.catch_warnings():
            # torch's all_gather_object calls its own deprecated collective
            # (a FutureWarning per worker and process that says nothing to users).
            warnings.simplefilter("ignore", FutureWarning)
            torch.distributed.all_gather_object(every, mine, group=self.group.cpu_group)
        return every

    def outcome(self, failure: Optional[Tuple[str, str, bool]], what: str) -> Optional[BaseException]:
        """``failure``: this worker's ``(refit error class, message, model
        unchanged)``, or None. The same error (or None) on every worker."""
        return self.error_of(self.gather(failure), what)

    def error_of(self, answers: List[Optional[Tuple[str, str, bool]]], what: str) -> Optional[BaseException]:
        failed = [(r, f) for r, f in enumerate(answers) if f is not None]
        if not failed:
            return None
        kind = failed[0][1][0]
        unchanged = all(f[2] for _, f in failed)
        # One line per distinct message, naming the workers that gave it.
        lines: Dict[str, List[int]] = {}
        for r, (_, message, _) in failed:
            lines.setdefault(message, []).append(r)
        text = "; ".join(f"worker{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in lines.items())
        state = "model unchanged" if unchanged else "model torn"
        message = f"[refit {kind}; {state}] engine {self.replica}: {what} failed on {len(failed)} of {self.size} worker(s): {text}"
        return _ERRORS.get(kind, refit.RefitError)(message)

    def common(self, kind: str, message: str, what: str) -> BaseException:
        """An error every worker found alike (from the answers they share)."""
        return _ERRORS.get(kind, refit.RefitError)(f"[refit {kind}; model unchanged] engine {self.replica}: {what}: {message}")

    def report(self, error: Optional[BaseException]) -> None:
        """Raises ``error`` on the last worker (see the class doc)."""
        if error is not None and self.rank == self.size - 1:
            raise error


_ERRORS = {e.__name__: e for e in (refit.LayoutError, refit.VersionError, refit.RefitError, refit.JoinError, refit.MemberError, refit.TensorError)}


def _failure(error: BaseException, *, unchanged: bool) -> Tuple[str, str, bool]:
    """An exception as a worker's answer: refit's own class where it is
    one (else ``RefitError``, the original class in the text), the message
    on one line."""
    kind = type(error).__name__
    text = " ".join(str(error).split())
    if kind not in _ERRORS:
        text, kind = f"{kind}: {text}", "RefitError"
    return kind, text, unchanged


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """refit's weight-transfer engine (see the module doc)."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        # A second connect replaces the first: leave its rendezvous first.
        self.shutdown()
        workers = _Workers(init_info.replica)
        self.workers = workers
        tensors = [(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in init_info.tensors]
        failure = None
        held: Dict[str, List[Tuple[List[int], List[int]]]] = {}
        self.adapter = None
        try:
            if init_info.adapter:
                held = self._adapter_slot(init_info.adapter, tensors)
            else:
                with _quiet_float64():
                    held = dry_run(self.model, tensors)
        except Exception as e:  # noqa: BLE001 - every worker answers (see _Workers)
            failure = _failure(e, unchanged=True)
        answers = workers.gather((held, failure))
        checked = "the check of the adapter" if init_info.adapter else "the dry run of the model's loading"
        error = workers.error_of([f for _, f in answers], f"connecting ({checked})")
        if error is None:
            # Every worker computes the same from the same answers.
            every = [h for h, _ in answers]
            gaps = _front.landing_gaps(tensors, every)
            if gaps:
                message = f"{len(gaps)} training tensor(s) do not fit the model: " + "; ".join(gaps[:6]) + (" ..." if len(gaps) > 6 else "")
                error = workers.common("LayoutError", message, "connecting")
        if error is None:
            failure = None
            try:
                self._open(init_info, tensors, every, held)
            except Exception as e:  # noqa: BLE001 - every worker answers (see _Workers)
                failure = _failure(e, unchanged=True)
            error = workers.outcome(failure, "connecting (opening the destination and joining the rendezvous)")
        if error is not None:
            self.shutdown()
        workers.report(error)

    def _adapter_slot(self, adapter: Dict[str, Any], tensors: List[Tuple[str, str, Tuple[int, ...]]]) -> Dict[str, Any]:
        """The LoRA adapter slot this worker's loads go to, checked against
        the training layout's tensors (``refit._vllm_lora``): what this
        worker holds of each, every one whole."""
        from refit._vllm_lora import AdapterSlot

        slot = AdapterSlot(self.model, adapter)
        slot.check(tensors)
        self.adapter = slot
        return {name: [([0] * len(shape), list(shape))] for name, _, shape in tensors}

    def _open(self, init_info: RefitInitInfo, tensors: List[Tuple[str, str, Tuple[int, ...]]], every: List[Any], held: Dict[str, Any]) -> None:
        workers = self.workers
        own = self.adapter.manager.lora_config.lora_dtype if self.adapter is not None else self.model_config.dtype
        dtype = init_info.dtype or REFIT_DTYPES.get(own)
        if dtype is None:
            raise refit.LayoutError(f"the engine's dtype {own} has no refit dtype: give dtype= to refit.vllm.VLLMRollouts")
        layout, self.missing = _front.derived_layout(tensors, every, replicas=init_info.replicas, dtype=dtype)
        self.every = every
        self.bare_layers = _bare_layers(self.model)
        rank = init_info.replica * workers.size + workers.rank
        self.rank = rank
        self.layout = layout
        self.shapes = {n: shape for n, _, shape in tensors}
        # The refit buffers, where the model lives (host memory, or the
        # worker's GPU), registered and joined (refit._engine).
        self.buffers = RefitBuffers(
            tensors, held, layout, rank, dtype=dtype, device=self.device, fabric=init_info.fabric, staged=init_info.staged
        )
        self.dst = self.buffers.dst
        self.joined = self.buffers.join(init_info.rendezvous, init_info.secret)

    def start_weight_update(self) -> None:
        # Nothing of the model changes until update_weights (the refit
        # itself ran before, into this worker's refit buffers).
        pass

    def update_weights(self, update_info: Any) -> None:
        # Parsed inside the answer: every worker answers even a bad request.
        self._answer_load(lambda: self.parse_update_info(update_info))

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        self._answer_load(lambda: update_info)

    def _answer_load(self, parse: Callable[[], RefitUpdateInfo]) -> None:
        self.touched = False
        failure, what = None, "loading"
        try:
            version = int(parse().version)
            what = f"loading version {version}"
            if getattr(self, "dst", None) is None:
                raise refit.RefitError("not connected: no refit destination on this worker (connect first)")
            self._receive(version)
        except Exception as e:  # noqa: BLE001 - every worker answers (see _Workers)
            failure = _failure(e, unchanged=not self.touched)
        workers = getattr(self, "workers", None) or _Workers(0)
        workers.report(workers.outcome(failure, what))

    def _receive(self, version: int) -> None:
        def load(tensors: Iterator[Tuple[str, torch.Tensor]]) -> None:
            if self.adapter is None:
                self.touched = True
                self._load_model(tensors)
                return
            # The adapter is built (and checked) before the previous one goes.
            lora = self.adapter.build(tensors)
            self.touched = True
            self.adapter.put(lora)

        # Seconds of the last load, by part (benchmarks/vllm_update.py).
        self.last_load = self.buffers.receive(version, load)
        log.debug("refit: version %s loaded: %s", version, self.last_load)

    def _load_model(self, tensors: Iterator[Tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(tensors)
        finally:
            with _quiet_reload(self.bare_layers):
                finalize_layerwise_reload(self.model, self.model_config)
        _repack_cpu_experts(self.model)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        joined = getattr(self, "joined", None)
        if joined is not None:
            joined.shutdown()
            self.joined = None
