"""refit from Python: move weights from training ranks to inference ranks.

A thin layer over the Rust crates (compiled as ``refit._refit``): layouts
are ``reshard`` layouts, the stores are the Rust ``SrcStore``/``DstStore``
with their version fence and group-atomic commit, the orchestrator is the
Rust actor. See docs/python.md.

Weights cross into the stores by copy: ``Source.step()`` copies every
registered array or tensor into the rank's store (one optimizer step, one
version); ``Destination.load()`` copies one committed version out into the
registered arrays. ``Source.in_place`` and ``Destination.in_place`` keep
the weights in the framework's own tensors instead (CUDA tensors on the GPU
fabrics, host arrays on ``"node"``): sources are read where they are,
destinations receive each committed version by one copy from the refit's
staging.
"""

from __future__ import annotations

from . import _refit
from ._refit import (
    JoinError,
    Layout,
    LayoutBuilder,
    LayoutError,
    MemberError,
    PlanError,
    RefitError,
    RegistrationError,
    TensorBuilder,
    TensorError,
    VersionError,
)
from .dtensor import layout_from_dtensors
from .inference import tp_inference_layout
from .megatron import megatron_layout

__all__ = [
    "Destination",
    "JoinError",
    "Joined",
    "Layout",
    "LayoutBuilder",
    "LayoutError",
    "LocalSystem",
    "MemberError",
    "Orchestrator",
    "PlanError",
    "PlanFigures",
    "PlanReport",
    "RefitError",
    "RefitReport",
    "RegistrationError",
    "Source",
    "TensorBuilder",
    "TensorError",
    "VersionError",
    "join",
    "layout_from_dtensors",
    "megatron_layout",
    "param_buffers",
    "VOCABULARY",
    "plan",
    "spawn_local",
    "tp_inference_layout",
]

# The package's parts (one module each); the names above are its face.
# `_copy_into`, `_to_bytes`, `_host_array` and `_wait_for_producers` are
# re-exported for the benchmarks and tests that measure or bypass them.
from ._arrays import VOCABULARY, _copy_into, _host_array, _to_bytes, _wait_for_producers, param_buffers
from ._orchestrator import LocalSystem, Orchestrator, spawn_local
from ._ranks import Destination, Joined, Source, join
from ._reports import PlanFigures, PlanReport, RefitReport, ReplicaReport, plan
