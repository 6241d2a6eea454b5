"""The orchestrator (``Orchestrator``) over member processes or over
members in this process (``spawn_local``), and the local system."""

from __future__ import annotations

import secrets as _secrets
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _refit
from ._refit import Layout, RefitError
from ._reports import PlanReport, RefitReport, ReplicaReport
from ._ranks import Destination, Source

def _report(d: Dict[str, Any]) -> RefitReport:
    return RefitReport(**d)


class Orchestrator:
    """Runs refits: every source's weights into every destination.

    ``Orchestrator()`` opens a rendezvous (``address``, ``secret``) that
    member processes ``join``; ``connect(src_ranks, dst_ranks)`` waits for
    their members and plans. ``spawn_local`` makes one over members in this
    process.

    ``fabric``: how the bytes move. ``"node"`` (default): shared memory
    between ranks of a node, TCP between nodes. ``"nccl"``: one NCCL
    communicator over every member, each on the GPU it joined with
    (``join(gpu=...)``). ``"ipc"``: CUDA IPC between members of one node
    (colocated training and inference). Where a GPU fabric cannot run, the
    refit raises ``MemberError`` saying why (``... transport unavailable:
    ...``), before anything moves. ``"simulated-nccl"``,
    ``"simulated-ipc"``: the same fabrics over host memory, every member in
    this process, for testing a pipeline (and in-place sources) without a
    GPU.

    ``delta``: on every fabric, each refit after a clean one sends every
    message as what changed since the same message of the refit before
    (checksummed against it; any failure makes the next refit dense), and
    ``RefitReport.bytes`` counts the bytes on the wire. Each member keeps
    what it sent and received meanwhile. It pays on slow links when few
    weights change (docs/benchmarks.md, "Delta refits"); on the GPU fabrics
    each message goes through the host to be encoded (docs/gpu.md).

    ``digest_check`` (on by default): before any destination commits, every
    member reads back what its run moved — a sender what it sent, a
    receiver what it holds, from the memory the commit serves — as CRC-32C
    digests, and the orchestrator compares them; a difference raises
    ``MemberError`` naming the rank (``... the digest check failed ...;
    nothing was committed``), and every destination keeps its version.
    Off saves one read of every byte moved (docs/benchmarks.md, "The digest
    check"). Device memory (NCCL, IPC) is not read back
    (``RefitReport.unverified_ranks``).
    """

    def __init__(
        self,
        secret: Optional[str] = None,
        bind: str = "127.0.0.1:0",
        *,
        deadline: float = 60.0,
        control_timeout: float = 10.0,
        fabric: str = "node",
        delta: bool = False,
        replica: Optional[Layout] = None,
        digest_check: bool = True,
        _inner: Any = None,
    ):
        # The fabric, as named (what members in other processes are told,
        # e.g. refit.vllm's workers, which allocate where it moves bytes).
        self.fabric = fabric
        if _inner is not None:
            self._inner, self.secret, self.replica = _inner, None, replica
            return
        self.secret = secret or _secrets.token_hex(32)
        self.replica = replica
        settings = _refit.Settings(
            fabric=fabric, deadline=deadline, control_timeout=control_timeout, delta=delta, replica=replica, digest_check=digest_check
        )
        self._inner = _refit.Orchestrator(self.secret, bind, settings)

    @property
    def address(self) -> Optional[str]:
        """``host:port`` member processes join (None for a local system)."""
        return self._inner.address

    def connect(self, src_ranks: int, dst_ranks: int, timeout: float = 60.0) -> PlanReport:
        """Waits up to ``timeout`` s for every member to join, then plans
        and installs every member's program (a pair of layouts that cannot
        be planned fails here)."""
        return PlanReport(**self._inner.connect(src_ranks, dst_ranks, timeout))

    def refit(self, version: int, only: Optional[Sequence[str]] = None) -> RefitReport:
        """Refits exactly ``version``, which every source must hold.
        ``only``: a subset refit of these destination tensors (LoRA
        adapters): every destination keeps the other tensors from the
        version it serves (see docs/pipeline.md, "Subset refits")."""
        if only is not None:
            return _report(self._inner.refit_only(list(only), version))
        return _report(self._inner.refit(version))

    def refit_latest(self, only: Optional[Sequence[str]] = None) -> RefitReport:
        """Refits the newest version every source holds (``only``: as in
        ``refit``)."""
        if only is not None:
            return _report(self._inner.refit_only(list(only)))
        return _report(self._inner.refit_latest())

    def recover(self, timeout: float = 60.0) -> List[Tuple[str, int]]:
        """Puts a new member in the place of every member whose process
        died (or went silent for the heartbeat timeout, 2 s): the process
        that joins as the dead one's rank (``Source(...).join`` or
        ``Destination(...).join``, before or after this call) within
        ``timeout`` seconds in all. Returns the ranks replaced, as
        ``("src" | "dst", rank)``; empty when every member is alive. A
        refit that failed with ``MemberError`` because a member died can be
        retried once this returns: the new member gets its program then. A
        new destination serves nothing until that refit commits; a new
        source holds no version until it steps (``restore(version)`` puts
        it on its peers' version). A rank whose replacement does not join
        in time raises ``JoinError`` naming it; those replaced before it
        stay replaced, and calling again picks up the rest."""
        return [(g, r) for g, r in self._inner.recover(timeout)]

    def add_replica(self, name: Optional[str] = None, timeout: float = 60.0) -> ReplicaReport:
        """Adds a replica to a destination group of replicas (``replica``
        given at construction: the layout of one replica; the group is
        replicas of it, ``Layout.replicated(n)``). It is seeded with the
        newest version a whole replica serves, from that replica's memory
        (no training rank sends anything), and every later refit includes
        it. Over a rendezvous, ``name`` is the name its processes joined
        with (``Destination(replica_layout, j).join(..., replica=name)``),
        waited for up to ``timeout`` s; a local system makes the replica's
        ranks here (``ReplicaReport.destinations``). Waits for a refit in
        progress."""
        report, stores = self._inner.add_replica(name, timeout)
        return ReplicaReport(
            destinations=[Destination(self.replica, d.rank, _store=d) for d in stores] if self.replica is not None else [],
            **report,
        )

    def remove_replica(self, index: int) -> ReplicaReport:
        """Removes replica ``index`` (its place in the group) from a
        destination group of replicas: its ranks keep serving what they
        served and are refitted no more; the replicas after it move up one
        place. Waits for a refit in progress."""
        return ReplicaReport(**self._inner.remove_replica(index))

    def plan(self) -> PlanReport:
        return PlanReport(**self._inner.plan())

    def set_mode(self, mode: str) -> None:
        """``"reshard"`` (default) or ``"baseline"`` (gather, broadcast)."""
        self._inner.set_mode(mode)

    def close(self) -> None:
        """Stops the orchestrator; member processes see the rendezvous go."""
        self._inner.close()

    def __enter__(self) -> "Orchestrator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class LocalSystem:
    """Every rank in this process: for tests and single-process use."""

    orchestrator: Orchestrator
    sources: List[Source]
    destinations: List[Destination]

    def refit(self, version: int, only: Optional[Sequence[str]] = None) -> RefitReport:
        return self._refit(lambda: self.orchestrator.refit(version, only))

    def refit_latest(self, only: Optional[Sequence[str]] = None) -> RefitReport:
        return self._refit(lambda: self.orchestrator.refit_latest(only))

    def _refit(self, call) -> RefitReport:
        # Replicas that left the group leave ``destinations``, whether the
        # refit committed or failed after they left.
        try:
            report = call()
        except RefitError as e:
            self._drop(getattr(e, "dropped_replicas", []))
            raise
        self._drop(report.dropped_replicas)
        return report

    def add_replica(self) -> ReplicaReport:
        """Adds a replica (``spawn_local(replica=...)``): its ranks join
        ``destinations`` at the end, serving what the others serve."""
        report = self.orchestrator.add_replica()
        self.destinations.extend(report.destinations)
        return report

    def remove_replica(self, index: int) -> ReplicaReport:
        """Removes replica ``index``: its ranks leave ``destinations``."""
        report = self.orchestrator.remove_replica(index)
        k = self.orchestrator.replica.ranks if self.orchestrator.replica is not None else 0
        del self.destinations[index * k : (index + 1) * k]
        return report

    def _drop(self, dropped: Sequence[int]) -> None:
        k = self.orchestrator.replica.ranks if self.orchestrator.replica is not None else 0
        for index in dropped:
            del self.destinations[index * k : (index + 1) * k]


def spawn_local(src: Layout, dst: Layout, *, fabric: str = "in_process", **settings: Any) -> LocalSystem:
    """One store and member per rank of both layouts, in this process, and
    an orchestrator over them; plans (a pair that cannot be planned raises
    ``PlanError`` here). ``fabric``: ``"in_process"`` (default), or any of
    ``Orchestrator``'s; on ``"nccl"`` rank ``i`` of the communicator
    (sources first) runs on GPU ``i``. The other keyword arguments
    (``deadline``, ``control_timeout``, ``delta``, ``replica``,
    ``digest_check``) are ``Orchestrator``'s, with its defaults; another
    name raises ``TypeError``."""
    replica = settings.get("replica")
    orch, srcs, dsts = _refit.spawn_local(src, dst, _refit.Settings(fabric=fabric, **settings))
    return LocalSystem(
        Orchestrator(_inner=orch, replica=replica, fabric=fabric),
        [Source(src, s.rank, _store=s) for s in srcs],
        [Destination(dst, d.rank, _store=d) for d in dsts],
    )
