"""What the runtime refuses to compile, and the checkpointing it must detect to refuse
it: each refusal's message (the cause and the fix), the checks the root's
pre-forward and the units run, the detection of a checkpoint around a unit's call
(``checkpoint_wrapper``, Hugging Face's gradient checkpointing), and the hooks that
give a checkpoint inside a unit, recomputed eagerly in a compiled backward, the
gathered parameters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._common import ShardedState, compiling, refusal
from ._param import FSDPParam
from ._torch_internals import CheckpointWrapper, compiled_autograd

if TYPE_CHECKING:
    from ._state import FSDPState

UNIT_FULLGRAPH_FIX = (
    "traceable_hsdp: a fully_shard unit's forward is being compiled with "
    "fullgraph=True while compiled autograd is off. Without compiled autograd the "
    "unit's gathers and the hooks that re-gather it for backward and reduce its "
    "gradients run eagerly around the compiled compute, as torch's fully_shard hooks "
    "do, which needs the graph breaks that fullgraph=True forbids. Fix: call "
    "`traceable_hsdp.enable_compiled_autograd()` once before the training loop (the "
    "whole step, collectives included, is then traced), or drop fullgraph=True, or "
    "compile each block instead (block.compile(), before or after fully_shard). See "
    "docs/compile.md, 'Compiled without compiled autograd'."
)

_log = logging.getLogger("traceable_hsdp")
_EAGER_HOOKS_SAID = False


# [Note: A unit compiled without compiled autograd]
# With compiled autograd off (torchtitan's plain compile line, accelerate's FSDP2 flow,
# ``torch.compile(unit)`` below an eager root) a unit's backward hooks cannot be
# traced. Such a unit runs its pre- and post-forward as dynamo-disabled functions:
# dynamo breaks the graph around each and compiles the module's forward between them,
# as around torch's fully_shard hooks, so the step trains with the eager numbers; the
# process logs once how to get the traced step. Under ``fullgraph=True`` the disabled
# function's reason, ``UNIT_FULLGRAPH_FIX``, is the error the user reads. Tested by
# ``test_compiled_without_compiled_autograd`` (test_runtime.py),
# ``test_units_compiled_without_compiled_autograd_train_correctly``
# (test_reliability.py) and ``test_compiled_without_compiled_autograd_vs_torch``
# (test_conformance.py). A unit compiled in place (``block.compile()``) does not get
# here: see [Note: A unit compiled in place] (_compiled_call.py) and [Note: One FSDP
# class per module class] (_fsdp_class.py). With compiled autograd on, a unit traced
# on its own keeps its pre-forward in the graph, one graph for every unit of its
# class: [Note: One graph for every unit of a class] in _common.py.
@torch._dynamo.disable(reason=UNIT_FULLGRAPH_FIX)
def pre_forward_untraced(
    state: FSDPState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The unit's pre-forward, eagerly: see [Note: A unit compiled without compiled
    autograd]."""
    global _EAGER_HOOKS_SAID
    if not _EAGER_HOOKS_SAID:
        _EAGER_HOOKS_SAID = True
        _log.warning(
            "traceable_hsdp: fully_shard units are compiled while compiled autograd is "
            "off, so their all-gathers and reduce-scatters run eagerly at each unit's "
            "boundaries (as torch's fully_shard's do) and the compiled graphs hold only "
            "the compute. To trace the whole step, collectives included, call "
            "traceable_hsdp.enable_compiled_autograd() before the training loop "
            "(docs/compile.md)."
        )
    return state._pre_forward(args, kwargs)


@torch._dynamo.disable(reason=UNIT_FULLGRAPH_FIX)
def post_forward_untraced(state: FSDPState, output: Any, inputs: Any) -> Any:
    """The unit's post-forward, eagerly: see [Note: A unit compiled without compiled
    autograd]."""
    return state._post_forward(output, inputs)


UNUSED_PARAMS_COMPILE_FIX = (
    "traceable_hsdp: set_reduce_scatter_unused_params(True) reduces a unit's gradients "
    "at the end of the backward, which a compiled backward cannot do (it has no "
    "end-of-backward callback; the unit would be reduced only at the next forward, "
    "after the optimizer step), so this compiled backward is refused. Fix: run this "
    "model's backward eagerly (no compiled autograd), or make every rank use every "
    "parameter and call set_reduce_scatter_unused_params(False). See [Note: Unused "
    "parameters] in traceable_hsdp/_param_group.py."
)


refuse_unused_params_compiled = refusal(UNUSED_PARAMS_COMPILE_FIX)


HELD_AFTER_SYNC_FIX = (
    "traceable_hsdp: the last backward synced gradients but a parameter got no "
    "gradient in it, so the gradient kept for it by earlier "
    "set_requires_gradient_sync(False) backwards was "
    "never reduced (a compiled backward has no end-of-backward callback to do it), "
    "and the optimizer step ran without it. Fix: make the syncing micro-batch use "
    "these parameters, or run this model's backward eagerly (without compiled "
    "autograd), where they are reduced at the end of the backward. Call "
    "reset_iter_state() on the root to drop them and go on. See [Note: Held gradients "
    "of unused parameters] in traceable_hsdp/_param_group.py."
)


refuse_held_after_sync = refusal(HELD_AFTER_SYNC_FIX)


CHECKPOINT_AROUND_UNIT_FIX = (
    "traceable_hsdp: a fully_shard unit is checkpointed around its whole call, so "
    "the unit's pre- and post-forward run inside the checkpointed region. Compiled, "
    "dynamo refuses a region with side effects (the hooks) and runs it eagerly, and "
    "the compiled backward then fails inside compiled autograd ('NoneType' object "
    "has no attribute 'op'). Fix, either: set "
    "`torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True` "
    "before the first compiled step (the hooks then run once, in the forward, and "
    "the backward recomputes only the region's ops, after the unit's re-gather); or "
    "checkpoint inside the unit: `fully_shard(checkpoint_wrapper(block))` "
    "(torchtitan's order) instead of Hugging Face's activation_checkpointing_enable() "
    "(or its older name, gradient_checkpointing_enable()) or checkpoint_wrapper "
    "applied after fully_shard. See docs/compile.md, "
    "'Activation checkpointing'."
)


refuse_checkpoint_around_unit = refusal(CHECKPOINT_AROUND_UNIT_FIX)


SPMD_TP_COMPILE_FIX = (
    "traceable_hsdp: a fully_shard unit with dp_mesh_dims whose parameters are "
    "DTensors over a mesh dim that is not data-parallel (tensor parallelism in the "
    "SPMD-mesh form) is compiled: its compiled backward computes wrong gradients, so "
    "it is refused. Fix: run this model eagerly, or use the submesh form of FSDP x "
    "TP, which compiles: parallelize_module(model, world_mesh['tp'], plan), then "
    "fully_shard(block, mesh=world_mesh['dp']) without dp_mesh_dims. See "
    "docs/api.md, 'dp_mesh_dims'."
)


refuse_spmd_tp_compiled = refusal(SPMD_TP_COMPILE_FIX)


# [Note: A checkpoint inside a unit, run eagerly by compiled autograd]
# ``checkpoint_wrapper(block)`` before ``fully_shard`` puts the checkpoint inside the
# unit; compiled, the backward recomputes the region inside the graphs. A graph break
# inside the region (transformers 5.25's attention sets a ``kernels`` context
# variable) makes dynamo run the checkpoint eagerly, and compiled autograd then runs
# its recompute eagerly too, between two of the backward's graphs, where the modules
# hold the sharded parameters ([Note: The module holds the placeholder only in
# forward] in _param.py): DTensor's "mixed torch.Tensor and DTensor" error. So each
# unit hooks the modules its checkpoint_wrappers wrap. Inside a compiled-autograd
# backward and not traced (the recompute runs under ``torch._dynamo.disable``), the
# forward pre-hook makes the modules hold the placeholders that the unit's traced
# pre-backward has filled by then, as the eager backward does; an ``always_call``
# forward hook puts the sharded parameters back when the recompute ends, also when
# it stops early (``_StopRecomputationError``). Swapping parameters is eager here,
# so dynamo never traces it. A parameter the unit did not re-gather
# (``set_unshard_in_backward(False)``) stays sharded, as eagerly. Eagerly, and while
# tracing, the hooks do nothing. Tested by tests/test_ac_graph_break.py (our Llama
# with a break in its block and HF Llama under aot_eager, bitwise; HF Llama under
# Inductor).

# [Note: A checkpoint around a unit's call]
# HF's ``activation_checkpointing_enable()`` (and ``gradient_checkpointing_enable()``)
# and ``checkpoint_wrapper`` applied after ``fully_shard`` put the checkpoint around a
# unit's whole call, hooks included ([Note: Forward wrapper, not module hooks]). Eagerly
# that trains ([Note: Forward during the unit's backward]); compiled, only with dynamo's
# ``skip_fwd_side_effects_in_bwd_under_checkpoint``, which is the user's to set (it lets
# compiled code differ from eager). Without it the step fails with an unhelpful
# ``AttributeError``, so the root's compiled pre-forward refuses it. Candidates are
# collected when the tree is wired (``checkpoint_suspects``: HF
# ``GradientCheckpointingLayer`` modules, and every nested unit with its holder
# ``slots``); a unit is checkpointed around if its holder is a ``checkpoint_wrapper`` or
# a wrapper replaced it there. Only the compiled pre-forward reads them; dynamo guards
# on each slot, so a wrapper added later recompiles and is seen.


COMPILE_REGION_FIX = (
    "traceable_hsdp: a module inside a fully_shard unit has its forward marked "
    "torch.compiler.nested_compile_region. torch 2.13's compiled autograd cannot "
    "trace the region's backward: it runs the rest of the backward eagerly and "
    "compiles each of the units' gradient hooks as a graph of its own, which with "
    "dynamo's automatic dynamic shapes fails on 2 or more ranks (an IndexError "
    "while dynamo builds guards). Fix, either: remove nested_compile_region from "
    "these modules (recommended: the backward then stays one compiled graph, with its "
    "collectives bucketed and overlapped); or set "
    "`torch._dynamo.config.automatic_dynamic_shapes = False` before the first "
    "compiled step (it trains correctly, its backward partly eager). See [Note: A "
    "compile region inside a unit] in traceable_hsdp/_state.py."
)


# [Note: A compile region inside a unit]
# Inside our units, compiled autograd graph-breaks at a ``nested_compile_region``'s
# backward without resuming: the rest runs eagerly and each gradient hook compiles as
# a frame of its own, whose second compile goes dynamic and, on 2 or more ranks, fails
# building guards (an ``IndexError`` naming no cause). So the root's compiled
# pre-forward refuses the regions, naming the marked modules (found when the tree is
# wired, by torch's ``__marked_compile_region_fn__`` on a forward), unless
# ``automatic_dynamic_shapes`` is off. A region marked on a plain function inside a
# forward is not seen.


def marks_compile_region(module: nn.Module) -> bool:
    """Whether ``module``'s forward (its own, or its classes') is marked with
    ``torch.compiler.nested_compile_region``. See [Note: A compile region inside a
    unit]."""
    forwards = [module.__dict__.get("forward")]
    forwards += [klass.__dict__.get("forward") for klass in type(module).__mro__]
    return any(hasattr(f, "__marked_compile_region_fn__") for f in forwards if f is not None)


def hf_checkpointing_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules whose class has Hugging Face's ``gradient_checkpointing`` flag. See
    [Note: A checkpoint around a unit's call]."""
    return [
        m for m in modules
        if isinstance(getattr(type(m), "gradient_checkpointing", None), bool)
    ]


def compile_region_refusal(regions: list[str]) -> Callable[..., Any] | None:
    """The refusal naming the modules marked as compile regions, ``None`` for none.
    Built when the tree is wired: a refusal's message is all dynamo shows. See
    [Note: A compile region inside a unit]."""
    return refusal(f"{COMPILE_REGION_FIX} Modules: {', '.join(regions)}.") if regions else None


def hook_eager_recomputes(
    modules: list[nn.Module],
    by_module: dict[nn.Module, list[tuple[str, FSDPParam]]],
) -> None:
    """See [Note: A checkpoint inside a unit, run eagerly by compiled autograd].
    ``by_module``: the unit's parameters by the module that holds them."""
    for m in modules:
        for sub in m.modules():
            if not isinstance(sub, CheckpointWrapper):
                continue
            inner = sub._checkpoint_wrapped_module
            # dict: a parameter held by two modules (tied) is handled once
            held = {
                id(fp): fp for mod in inner.modules() for _, fp in by_module.get(mod, ())
            }
            params = list(held.values())
            if params:
                swapped: list[FSDPParam] = []
                inner.register_forward_pre_hook(
                    functools.partial(_gathered_for_recompute, params, swapped)
                )
                inner.register_forward_hook(
                    functools.partial(_sharded_after_recompute, swapped), always_call=True
                )


def _gathered_for_recompute(
    params: list[FSDPParam], swapped: list[FSDPParam], module: nn.Module, args: Any
) -> None:
    """See [Note: A checkpoint inside a unit, run eagerly by compiled autograd]."""
    if compiling() or not compiled_autograd.in_compiled_autograd_region:
        return
    for fp in params:
        if not fp.module_holds_unsharded and fp.sharded_state is ShardedState.UNSHARDED:
            fp.register_unsharded()
            swapped.append(fp)


def _sharded_after_recompute(
    swapped: list[FSDPParam], module: nn.Module, args: Any, output: Any
) -> None:
    """See [Note: A checkpoint inside a unit, run eagerly by compiled autograd]."""
    if compiling() or not swapped:
        return
    for fp in swapped:
        fp.register_sharded()
    swapped.clear()


def checkpointed_around(state: FSDPState) -> str | None:
    """How a checkpoint is put around this unit's whole call, if one is. See
    [Note: A checkpoint around a unit's call]."""
    for holder, path, name in state.slots:
        if isinstance(holder, CheckpointWrapper):
            return f"Unit {state._where()!r}: checkpoint_wrapper {path!r} wraps it."
        now = holder._modules.get(name)
        if isinstance(now, CheckpointWrapper) and now._checkpoint_wrapped_module in state.modules:
            where = f"{path}.{name}" if path else name
            return (f"Unit {state._where()!r}: checkpoint_wrapper {where!r} wraps it "
                    "(put there after fully_shard on the root).")
    for m in state.hf_checkpointing_modules:
        if m.gradient_checkpointing and m.training:
            return (f"Unit {state._where()!r}: Hugging Face gradient checkpointing "
                    "is on (activation_checkpointing_enable(), formerly "
                    "gradient_checkpointing_enable()).")
    return None
