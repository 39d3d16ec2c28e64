"""Shared enums, mesh information, and the one eager-or-traced test (``compiling``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, NoReturn

import torch
from torch.distributed.device_mesh import DeviceMesh

from ._torch_internals import compiled_autograd


class TrainingState(Enum):
    """What a fully_shard unit is doing now."""

    IDLE = auto()
    """Outside forward and backward."""
    FORWARD = auto()
    """Between the unit's pre-forward and post-forward."""
    PRE_BACKWARD = auto()
    """The unit's parameters were re-gathered for its backward; back to ``IDLE`` once
    every gradient of the unit was reduced."""


class ShardedState(Enum):
    """Which tensors of a parameter hold its data."""

    SHARDED = auto()
    """Only the sharded DTensor has data; the unsharded placeholder's storage is 0 bytes
    and the module holds the sharded parameter."""
    SHARDED_POST_FORWARD = auto()
    """After forward with an int ``reshard_after_forward=k``: each rank keeps 1/k of
    the gathered parameter, the placeholder is 0 bytes, the module holds the sharded
    parameter."""
    UNSHARDED = auto()
    """The placeholder's storage is full and holds the gathered parameter; the module
    holds the placeholder."""


@dataclass(frozen=True)
class MeshInfo:
    """Where a unit shards and replicates.

    A 1-D mesh is FSDP: ``shard_mesh_dim == 0`` and no replicate dim. A 2-D mesh is HSDP:
    dim 0 replicates, dim 1 shards.
    """

    mesh: DeviceMesh
    shard_mesh_dim: int
    replicate_mesh_dim: int | None

    @property
    def shard_group_name(self) -> str:
        return self.mesh.get_group(self.shard_mesh_dim).group_name

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_mesh_dim)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_mesh_dim)

    @property
    def replicate_group_name(self) -> str | None:
        if self.replicate_mesh_dim is None:
            return None
        return self.mesh.get_group(self.replicate_mesh_dim).group_name

    @property
    def replicate_size(self) -> int:
        if self.replicate_mesh_dim is None:
            return 1
        return self.mesh.size(self.replicate_mesh_dim)

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.mesh.device_type, torch.accelerator.current_device_index())


@dataclass(frozen=True)
class SpmdLayout:
    """``fully_shard(mesh, dp_mesh_dims=...)``: the full mesh the parameters are
    ``DTensor``s on and which of its dims are data-parallel. See [Note: The SPMD-mesh
    form] in ``_param.py``."""

    mesh: DeviceMesh
    """The full mesh (every dim: data-parallel, tensor-parallel, ...), as passed."""
    dims: Any
    """The ``DataParallelMeshDims`` as passed, for messages."""
    shard_dims: tuple[int, ...]
    """Indices in ``mesh`` of the dims FSDP shards over (flattened when several)."""
    replicate_dims: tuple[int, ...]
    """Indices in ``mesh`` of the dims FSDP replicates over (HSDP; DDP without
    ``shard_dims``)."""
    sharded_mesh: DeviceMesh
    """The sharded parameters' mesh: ``mesh``, or with several shard dims (as torch's)
    ``mesh`` with those dims replaced by the unit's flattened data-parallel mesh."""


@dataclass(frozen=True)
class PostForwardInfo:
    """Where an int ``reshard_after_forward=k`` keeps parameters after forward: the
    shard group's ranks split into consecutive groups of ``size`` (= k) ranks; this
    rank is ``index`` in ``group_name``."""

    group_name: str
    size: int
    index: int


# [Note: Eager or traced]
# A few steps differ between eager and traced runs: eagerly a unit issues one flat
# collective per kind, keeps its parameters registered after forward, queues
# end-of-backward callbacks and uses streams; traced, each parameter keeps its own
# collective for the passes to bucket, and nothing eager-only runs. Every such branch
# asks :func:`compiling` (``torch.compiler.is_compiling()``, a constant to dynamo, so
# graphs hold no trace of the branch).
#
# One backward decision asks :func:`compiled_backward` instead: whether a gradient is
# reduced on its own or held for the flat reduction. Compiled autograd may run some
# hooks of one backward eagerly (after a graph break, or past the recompile limit); an
# eager hook holding its gradient for a flat reduction the traced ones never join
# would lose it. So inside a compiled-autograd graph every hook reduces its own
# parameter. ``tests/test_reliability.py`` checks it bitwise with
# ``nested_compile_region`` blocks.


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls it (``False`` when it runs
    eagerly). See [Note: Eager or traced]."""
    return torch.compiler.is_compiling()


def compiled_backward() -> bool:
    """Whether the code runs as part of a compiled-autograd graph: traced into it, or
    run eagerly by it (what it could not trace). See [Note: Eager or traced]."""
    return compiling() or compiled_autograd.in_compiled_autograd_region


# [Note: One graph for every unit of a class]
# Dynamo compiles a unit's forward as a frame of its own for a block compiled in place
# (``block.compile()``, per-block or regional compilation) and after a graph break in
# a block under ``torch.compile(model)``. One frame should serve every unit of the
# class ([Note: One FSDP class per module class] in _fsdp_class.py), but a traced unit
# label ("layers.3") is a guarded constant: every block would recompile until the
# recompile limit. So the traced label (``FSDPParamGroup.traced_label``) depends on how
# many unit forwards the frame holds (:func:`unit_forwards_in_frame`, from dynamo's
# ``TracingContext.extract_stack``): with k, it is the unit's path below the
# outermost one, named by that unit's class ("Block", "Block.ffn";
# ``frame_labels``, set by ``FSDPState.adopt_nested``). Where the frame reaches the
# root the label is the full path. ``assume_constant_result`` makes the count an
# unguarded constant: which frames a frame inlines is fixed by its code.
# (file, function name) of each unit forward, as dynamo's frame summaries name them.
_UNIT_FORWARDS: set[tuple[str, str]] = set()


def unit_forward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Marks ``fn`` (``FSDPState.forward``) as a unit's forward, for
    :func:`unit_forwards_in_frame`."""
    _UNIT_FORWARDS.add((fn.__code__.co_filename, fn.__code__.co_name))
    return fn


@torch._dynamo.assume_constant_result
def unit_forwards_in_frame() -> int:
    """While dynamo traces: how many unit forwards the frame being traced holds, from
    its outermost call down to here (0 eagerly, and in a compiled-autograd backward).
    See [Note: One graph for every unit of a class]."""
    from ._torch_internals import TracingContext

    if TracingContext.try_get() is None:
        return 0
    return sum((f.filename, f.name) in _UNIT_FORWARDS for f in TracingContext.extract_stack())


def refusal(message: str) -> Callable[..., NoReturn]:
    """A dynamo-disabled function raising ``RuntimeError(message)``: while tracing, a
    graph break with that reason (the error under ``fullgraph=True``). For what a
    compiled step cannot do right: refused loudly, never silently wrong."""

    @torch._dynamo.disable(reason=message)
    def refuse(*details: str) -> NoReturn:
        raise RuntimeError(" ".join((message, *details)))

    return refuse
