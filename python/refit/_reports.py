"""What a refit, a plan and a replica change report (the dataclasses
the orchestrator returns), and ``plan``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from . import _refit
from ._refit import Layout

if TYPE_CHECKING:
    from ._ranks import Destination

@dataclass(frozen=True)
class RefitReport:
    """What one refit did."""

    version: int
    """The version every destination now serves."""
    bytes: int
    """Bytes moved (0 if every destination already served ``version``)."""
    seconds: float
    """Wall time of the refit."""
    transfer_seconds: float
    """Time the data movement took."""
    verify_seconds: float
    """The digest check before the commit (``digest_check``): the longest
    time a member took to read back what its run moved (part of
    ``transfer_seconds``) plus the orchestrator's comparison; 0 when off."""
    verified_ranks: int
    """Destination ranks the digest check compared whole with what their
    senders sent (0 when off)."""
    unverified_ranks: int
    """Destination ranks it could not (device memory on the NCCL and IPC
    fabrics; the baseline's bypassed scratch); 0 when off."""
    already_served: bool
    replanned: bool
    fingerprint: Optional[str]
    mode: str
    dropped_replicas: List[int] = field(default_factory=list)
    """Replicas of a destination group of replicas that failed this refit
    and left the group (each by its index in the group when it left): they
    serve what they served before; the others serve ``version``."""
    plan_seconds: float = 0.0
    """Asking members for their status and (re)planning if needed."""
    connect_seconds: float = 0.0
    """Opening the refit's data plane (or resuming the kept one)."""
    commit_seconds: float = 0.0
    """Committing on every destination."""


@dataclass(frozen=True)
class ReplicaReport:
    """What adding or removing a replica did."""

    replicas: int
    """Replicas in the destination group now."""
    seeded: Optional[Dict[str, Any]]
    """How the added replica was seeded from a serving one: ``version``,
    ``from_replica``, ``bytes`` (sent by that replica's ranks; no training
    rank sends anything), ``seconds``, ``fingerprint``. None when no replica
    served a whole version yet (the next refit fills it) or one was
    removed."""
    destinations: List["Destination"] = field(default_factory=list)
    """The added replica's ranks (a local system only)."""


@dataclass(frozen=True)
class PlanReport:
    """The plan installed on every member."""

    fingerprint: str
    bytes: int
    """Bytes every refit with this plan moves."""
    replanned: bool
    mode: str


@dataclass(frozen=True)
class PlanFigures:
    """What a refit of one plan moves, as ``refit plan`` prints it."""

    bytes: int
    """Every message's payload between two ranks, in its wire dtype."""
    src_egress_bytes: int
    """The part training ranks send."""
    relayed_bytes: int
    """The part inference ranks forward to other inference ranks."""
    cross_node_bytes: int
    dst_node_ingress_bytes: List[int]
    """Bytes into each inference node from outside it."""
    src_rank_egress_bytes: List[int]
    """Bytes each training rank sends to other nodes."""
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    messages: int
    rounds: int
    fingerprint: str


def plan(src: Layout, dst: Layout, mode: str = "reshard") -> PlanFigures:
    """Plans a refit from ``src`` to ``dst`` without members or memory
    (``mode``: ``"reshard"`` or ``"baseline"``, the gather-broadcast) and
    says what it moves; a pair that cannot be planned raises ``PlanError``
    naming the tensor."""
    return PlanFigures(**_refit.plan_figures(src, dst, mode))
