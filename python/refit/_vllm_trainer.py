"""refit's trainer-side engine in vLLM's weight-transfer API.

``WeightTransferTrainerFactory.trainer_init(RefitTrainerInitInfo(...),
client=...)`` (the ``"refit"`` backend, registered by the plugin entry
point ``refit.vllm:register``) gives a ``RefitTrainerEngine`` that drives
vLLM's engines through any ``VLLMWeightSyncClient`` (vLLM's
``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``, or refit's
``refit.vllm.client_of``): the engines connect at ``trainer_init``, and
each ``send_weights()`` refits the newest version every training rank
holds (``refit.vllm.VLLMRollouts`` does the work). The training ranks
themselves hold ``refit.Source`` objects as everywhere else; only the
sender (``rank == 0``) drives anything.

Imports vLLM: imported by vLLM's factory, or by ``refit.vllm``'s
``RefitTrainerEngine`` / ``RefitTrainerInitInfo`` names (which registers the engine
with vLLM's factory in a trainer process, where vLLM's plugins never ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from .vllm import BACKEND, VLLMRefitReport, VLLMRollouts


@dataclass(kw_only=True)
class RefitTrainerInitInfo(TrainerInitInfo):
    """The sender's orchestrator and training layout; ``src_ranks``
    training ranks join the orchestrator's rendezvous (within ``timeout``
    s). ``world_size``: each engine's workers (asked of the client where it
    can say: refit's clients can, vLLM's own cannot). ``dtype``, ``staged``:
    as ``refit.vllm.VLLMRollouts`` takes them."""

    backend: ClassVar[str] = BACKEND

    orchestrator: Any = None
    layout: Any = None
    src_ranks: int = 1
    world_size: Optional[int] = None
    dtype: Optional[str] = None
    staged: bool = False
    timeout: float = 120.0


class RefitTrainerEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """See the module doc. ``client``: one engine's client, or a list of
    them (one per replica)."""

    init_info_cls = RefitTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: RefitTrainerInitInfo, *, client: Any, source: Any = None) -> "RefitTrainerEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.rollouts = None
        engine.plan = None
        if engine.is_sender:
            if init_info.orchestrator is None or init_info.layout is None:
                from . import RefitError

                raise RefitError("RefitTrainerInitInfo: the sender (rank 0) needs orchestrator= and layout= (the training layout)")
            clients = list(client) if isinstance(client, (list, tuple)) else [client]
            engine.rollouts = VLLMRollouts(
                init_info.orchestrator, clients, init_info.layout, dtype=init_info.dtype, world_size=init_info.world_size, staged=init_info.staged
            )
            engine.plan = engine.rollouts.connect(init_info.src_ranks, timeout=init_info.timeout)
        return engine

    def send_weights(self, version: Optional[int] = None) -> Optional[VLLMRefitReport]:
        """Refits ``version`` (default: the newest every training rank
        holds) into every engine and has them load it; the report on the
        sender, None on the other ranks (their sources step on their own)."""
        if self.rollouts is None:
            return None
        return self.rollouts.refit(version)

    def shutdown(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()


def _register() -> None:
    # A trainer process imports this (through refit.vllm's names) without
    # starting any vLLM engine, so vLLM's plugins never ran in it.
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, RefitTrainerEngine)


_register()
