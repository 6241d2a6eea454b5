"""refit inside vLLM's engine core: the engine's state follows its weights.

A load (the ``update_weights`` call the trainer side makes once a refit
committed) reaches vLLM's engine core as one collective call to its
workers, whatever the front end (``LLM``, ``AsyncLLM``, the HTTP server's
``/update_weights``, a Ray actor holding one): the core runs it between
two scheduler steps, so no step sees half a load. Around that call, for
engines whose weight-transfer backend is refit's (and only for them):

- **After a load, what the engine derived from the replaced weights is
  dropped in the same call**, before the next step: every cached KV block
  (the prefix cache: a prompt served before would otherwise be continued
  from KV computed with the old weights), the KV of running requests
  (preempted: they recompute their prompt and what they generated so far
  with the new weights) and, for multimodal models, the encoder cache.
- **A load that failed on any worker leaves the model torn** (some
  parameters of the new version, some of the old) unless every worker
  said its model is unchanged (``[refit ...; model unchanged]`` in the
  error, as ``refit._vllm_worker`` writes it). A torn engine schedules
  nothing (every request waits, none is served from a torn model), refuses
  to resume (``resume_scheduler`` raises), and resumes by itself, in the
  pause state it had, when a load succeeds.

``follow_weights`` wraps ``EngineCore.collective_rpc`` and every
``resume_scheduler`` of the engine-core classes once per process; the
plugin entry point (``refit.vllm.register``) calls it in every vLLM
process. Tested on vLLM 0.32 (``python/tests/test_vllm_frontends.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("refit.vllm")

_WRAPPED = "_refit_follows_weights"
UNCHANGED = "; model unchanged]"
"""What a refit worker's error says when its model was not touched."""


def follow_weights() -> None:
    """Wraps vLLM's engine core (once per process): see the module doc."""
    from vllm.v1.engine import core

    engine = core.EngineCore
    if getattr(engine.collective_rpc, _WRAPPED, False):
        return
    engine.collective_rpc = _wrap_rpc(engine.collective_rpc)
    for cls in vars(core).values():
        if isinstance(cls, type) and issubclass(cls, engine) and "resume_scheduler" in vars(cls):
            cls.resume_scheduler = _wrap_resume(vars(cls)["resume_scheduler"])


def _uses_refit(core: Any) -> bool:
    from .vllm import BACKEND

    config = getattr(core.vllm_config, "weight_transfer_config", None)
    return config is not None and getattr(config, "backend", None) == BACKEND


def _wrap_rpc(original: Any) -> Any:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> Any:
        if method != "update_weights" or not _uses_refit(self):
            return original(self, method, timeout, args, kwargs)
        try:
            out = original(self, method, timeout, args, kwargs)
        except BaseException as e:
            if UNCHANGED not in str(e):
                _hold(self, e)
            _drop_derived(self)
            raise
        _drop_derived(self)
        _release(self)
        return out

    setattr(collective_rpc, _WRAPPED, True)
    return collective_rpc


def _wrap_resume(original: Any) -> Any:
    @functools.wraps(original)
    def resume_scheduler(self: Any) -> Any:
        held = getattr(self, "_refit_held", None)
        if held is not None:
            # Resumed when a load succeeds, then as asked now.
            from vllm.v1.core.sched.interface import PauseState

            self._refit_resume_to = PauseState.UNPAUSED
            raise RuntimeError(f"refit: this engine's model is torn by a failed load ({held}); it schedules nothing until a load succeeds")
        return original(self)

    return resume_scheduler


def _hold(core: Any, error: BaseException) -> None:
    """Fail closed: nothing is scheduled until a load succeeds."""
    from vllm.v1.core.sched.interface import PauseState

    scheduler = core.scheduler
    if getattr(core, "_refit_held", None) is None:
        core._refit_resume_to = scheduler.pause_state
    core._refit_held = str(error).splitlines()[0][:500] if str(error) else type(error).__name__
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    log.error("refit: a load failed and may have left the model torn; the engine schedules nothing until a load succeeds: %s", core._refit_held)


def _release(core: Any) -> None:
    if getattr(core, "_refit_held", None) is None:
        return
    core._refit_held = None
    core.scheduler.set_pause_state(core._refit_resume_to)
    log.warning("refit: a load succeeded; the engine schedules again (pause state %s)", core._refit_resume_to.name)


def _drop_derived(core: Any) -> None:
    """Drops what the engine computed with the weights it no longer has."""
    scheduler = core.scheduler
    try:
        if not scheduler.reset_prefix_cache(reset_running_requests=True):
            log.error("refit: vLLM could not reset its prefix cache after a load: cached prompts may be served from the old weights' KV")
    except Exception as e:  # noqa: BLE001 - reported, the load itself stands
        log.error("refit: resetting vLLM's prefix cache after a load failed: %s: %s", type(e).__name__, e)
    if getattr(core.vllm_config.model_config, "is_multimodal_model", False):
        for owner in (scheduler, core.model_executor):
            reset = getattr(owner, "reset_encoder_cache", None)
            if reset is not None:
                reset()
