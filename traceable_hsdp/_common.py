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
    """After forward with an int ``reshard_after_forward=k``: the placeholder's storage
    is 0 bytes and each rank keeps 1/k of the (padded) gathered parameter, to be
    re-gathered over a group of k ranks for backward; the module holds the sharded
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
class PostForwardInfo:
    """Where an int ``reshard_after_forward=k`` keeps parameters after forward: the
    shard group's ranks split into consecutive groups of ``size`` (= k) ranks; this
    rank is ``index`` in ``group_name``."""

    group_name: str
    size: int
    index: int


# [Note: Eager or traced]
# The runtime runs the same code eagerly and under dynamo, and a few steps differ
# between the two: eagerly a unit issues one flat collective per kind and waits for it
# explicitly, keeps its unsharded parameters registered on the modules after forward,
# queues end-of-backward callbacks and uses streams and events; traced, each parameter
# keeps its own collective (the graph passes bucket them), waits are folded into the
# graph, and nothing eager-only may run. Every such branch asks :func:`compiling`, the
# one place that decides: "traced" means dynamo is tracing the frame now (the forward
# graph, or the backward graph compiled autograd captures). It reads
# ``torch.compiler.is_compiling()`` on every call (a constant ``True`` to dynamo, so
# the traced graphs hold no trace of the branch); tests that stand in for tracing
# patch that function.
#
# One backward decision asks :func:`compiled_backward` instead: whether a
# parameter's gradient is reduced on its own (traced) or held for the unit's flat
# reduction (eager). Compiled autograd runs the hooks of a backward it cannot trace
# whole eagerly, from inside its own graph: after a graph break in that graph (seen
# with ``torch.compiler.nested_compile_region`` on a block: torch 2.13's compiled
# autograd does not trace ``invoke_subgraph``), and once a hook frame it compiles on
# its own reaches dynamo's recompile limit. So one unit's hooks can run some traced
# and some eagerly, and eager ones holding their gradients for a flat reduction that
# the traced ones never join would lose those gradients without a word. Inside a
# compiled-autograd graph every hook therefore reduces its own parameter, traced or not,
# and each runs whole whichever way it runs. ``tests/test_reliability.py`` trains a
# model with ``nested_compile_region`` blocks, compiled, against its eager run without
# them, bitwise.


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls it (``False`` when it runs
    eagerly). See [Note: Eager or traced]."""
    return torch.compiler.is_compiling()


def compiled_backward() -> bool:
    """Whether the code runs as part of a compiled-autograd graph: traced into it, or
    run eagerly by it (what it could not trace). See [Note: Eager or traced]."""
    return compiling() or compiled_autograd.in_compiled_autograd_region


# [Note: One graph for every unit of a class]
# Dynamo compiles a unit's forward as a frame of its own, without its root, in two
# common cases: a block compiled in place (``block.compile()``, torchtitan's
# per-block compile and HF accelerate's regional compilation) while compiled
# autograd is on, and a graph break inside a block under ``torch.compile(model)``
# (the model's forward then graph-breaks in its loop over the blocks and runs
# eagerly, each block's call starting a frame). One compiled frame should then serve
# every unit of the block's class, as torch's per-block compile does: the frame's
# guards pass for each of them (the class is shared: [Note: One FSDP class per module
# class] in _fsdp_class.py; parameters are graph inputs). One value differed: the
# unit's label ("layers.3"), traced into its collectives' annotations, which dynamo
# guards as a constant. Every block recompiled, and from the ninth on dynamo's
# ``recompile_limit`` (8) ran them eagerly, or under ``fullgraph=True`` failed the
# step (``FailOnRecompileLimitHit``): a 10-block Llama compiled in place with
# compiled autograd did not train. So the label traced
# (``FSDPParamGroup.traced_label``) depends on how many unit forwards the frame holds,
# which :func:`unit_forwards_in_frame` counts, at trace time, from the stack of frames
# dynamo is tracing (``torch._guards.TracingContext.extract_stack``, the frames it
# inlined down to here). With k of them the frame starts k - 1 units above this one:
# the label is this unit's path below that outermost unit, named by the outermost
# unit's class ("Block" for the block itself, "Block.ffn" for a unit nested in it, as
# torchtitan shards a block's MoE experts: ``FSDPParamGroup.frame_labels``, set by
# ``FSDPState.adopt_nested``). Where the frame reaches the root, the label is the
# unit's path. (A unit whose forward another unit calls from outside its own tree is
# named from its own enclosing units all the same: a name only, since no pass reads
# it.) ``torch._dynamo.assume_constant_result`` makes the count a constant of the
# graph, computed while tracing and not guarded: which frames a compiled frame inlines
# is fixed by its code, so no later call can need another count. In the whole-model
# graph the root's forward is in the frame too, and every unit keeps its path; the
# compiled-autograd backward graph holds no forward frame and keeps the paths as well
# (torch 2.13 drops its annotations anyway). A nested unit keeping its path in a
# block's frame would fail a 10-block Llama whose blocks each hold one at the ninth
# block, as above. Graph dumps of a shared frame name the class:
# the graph serves each unit of it.
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
    """A function that raises ``RuntimeError(message)`` (the details it is given
    appended), disabled for dynamo: reached while tracing it is a graph break whose
    reason is ``message`` (under ``fullgraph=True``, the error the user sees), run
    eagerly it raises. For what a compiled step cannot do right: refused loudly,
    never silently wrong."""

    @torch._dynamo.disable(reason=message)
    def refuse(*details: str) -> NoReturn:
        raise RuntimeError(" ".join((message, *details)))

    return refuse
