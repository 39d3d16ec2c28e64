"""Per-module state and the hooks that drive the lifecycle.

[Note: Hooks and compiled autograd]
The same hooks run eagerly and under ``torch.compile``:

- pre-forward: all-gather the unit's parameters into the
  placeholders and register the placeholders on the module;
- post-forward: reshard when ``reshard_after_forward``, and
  register a tensor hook on every output that requires grad. The hook re-gathers the
  unit before its backward and returns the gradient it was given (a hook that
  returns ``None`` breaks compiled autograd, and an ``autograd.Function`` trigger
  fails under it);
- post-accumulate-grad hook on each placeholder: reduce-scatter the gradient into
  the sharded parameter's ``.grad``, drop the placeholder's gradient, free it;
- finishing: a group finishes (frees whatever is still gathered, goes idle) when its
  last gradient is reduced. Eagerly, the root also queues a callback on the autograd
  engine that finishes every unit, for units some of whose parameters got no
  gradient. Compiled autograd accepts ``queue_callback`` only when the backward is
  compiled with ``fullgraph=True``, which torch's recommended entry
  (``compiled_autograd = True`` around a default ``torch.compile``) is not, so in a
  compiled backward the root's next pre-forward finishes such units instead.

Compiled, the forward's hooks trace into the forward graph; the backward's hooks are
traced by compiled autograd into the backward graph. That needs compiled autograd to
be on when the forward is traced, so that dynamo defers the output hooks to the
backward (through a ``BackwardState``). Without it, AOTAutograd traces the hook into
its own joint graph and its partitioner may move the re-gather into the forward: the
numbers come out wrong with no error. So a forward compiled while compiled autograd
is off never traces a hook: each unit's pre- and post-forward run eagerly around the
compiled compute ([Note: A unit compiled without compiled autograd]).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor, distribute_tensor

from ._common import TrainingState, compiling, refusal, unit_forward
from ._param import FSDPParam, UserChange, refuse_all_gather_extension
from ._param_group import FSDPParamGroup
from ._torch_internals import (
    CheckpointWrapper,
    RegisterPostBackwardFunction,
    compiled_autograd,
    tree_flatten,
    tree_map,
)

if TYPE_CHECKING:
    from ._init import UnitOptions

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
# ``torch.compile(model)`` with compiled autograd off (torchtitan's plain compile
# line, HF accelerate's FSDP2 flow with a dynamo backend, ``torch.compile(unit)``
# below an eager root) cannot trace a unit's backward hooks. Such a unit, the root
# included, runs its pre-forward and its post-forward eagerly, as functions disabled
# for dynamo: dynamo breaks the graph around each and compiles the module's own
# forward between them, as around torch's fully_shard hooks. Its gathers and its
# reduce-scatters then run eagerly at the unit's boundaries and its backward hooks
# are registered eagerly, so the step trains with the eager numbers; the process
# logs once how to get the traced step instead. Under ``fullgraph=True`` there is no
# graph break to fall back on: the disabled function's reason,
# ``UNIT_FULLGRAPH_FIX``, is the error the user reads. Tested by
# ``test_compiled_without_compiled_autograd`` (test_runtime.py) and
# ``test_units_compiled_without_compiled_autograd_train_correctly``. A unit compiled in
# place (``block.compile()``) does not get here: see [Note: A unit compiled in place]
# in _fully_shard.py. With compiled autograd on, a unit traced on its own keeps its
# pre-forward in the graph, one graph for every unit of its class: [Note: One graph
# for every unit of a class] in _common.py.
@torch._dynamo.disable(reason=UNIT_FULLGRAPH_FIX)
def _pre_forward_untraced(
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
def _post_forward_untraced(state: FSDPState, output: Any, inputs: Any) -> Any:
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


_refuse_unused_params_compiled = refusal(UNUSED_PARAMS_COMPILE_FIX)


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


_refuse_held_after_sync = refusal(HELD_AFTER_SYNC_FIX)


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


_refuse_checkpoint_around_unit = refusal(CHECKPOINT_AROUND_UNIT_FIX)


# [Note: A checkpoint inside a unit, run eagerly by compiled autograd]
# ``checkpoint_wrapper(block)`` before ``fully_shard`` (torchtitan's order) puts the
# checkpoint inside the unit. Compiled, dynamo traces the region as a higher-order
# op and the backward recomputes it inside the compiled graphs. A graph break
# inside the region makes dynamo run the checkpoint eagerly instead. transformers
# 5.25 has one in every decoder layer: its attention sets a global of the
# ``kernels`` package, a side effect the higher-order op refuses ("Mutating a
# variable from outside the scope of this HOP"). The recompute then runs eagerly,
# inside the compiled-autograd backward, and reads the modules' parameters. A
# compiled backward leaves the sharded ones there ([Note: The module holds the
# placeholder only in forward] in _param.py), and the region failed on them with
# DTensor's "got mixed torch.Tensor and DTensor", naming neither cause nor fix.
# So each unit hooks the forward of the module each of its checkpoint_wrappers
# wraps, when that module holds parameters of the unit. The hook does nothing
# while dynamo traces or outside a compiled-autograd backward. There, if those
# parameters are not gathered in the modules, it raises with the fixes: dynamo's
# ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (transformers' side effect is
# a global set and restored within one call, which the recompute need not repeat),
# or no graph break in the region. (A forward run eagerly under compiled autograd
# meets the same, and is told to compile the forward.) Eagerly the modules hold the
# gathered parameters for the recompute, and the hook passes.

# [Note: A checkpoint around a unit's call]
# Two common ways of checkpointing put the checkpoint around a unit's whole call,
# hooks included: Hugging Face's ``activation_checkpointing_enable()`` (its layers
# checkpoint ``type(self).forward``, which for a unit is our forward wrapper, see
# [Note: Forward wrapper, not module hooks]; the older name,
# ``gradient_checkpointing_enable()``, deprecated in transformers 5.24, does the
# same, and both set the ``gradient_checkpointing`` flag that the check reads) and
# ``checkpoint_wrapper`` applied after ``fully_shard``. Eagerly that trains (the
# recompute sees the unit in its backward; see [Note: Forward during the unit's
# backward]). Compiled, it trains only with dynamo's
# ``skip_fwd_side_effects_in_bwd_under_checkpoint``; without it the step ended in a
# compiled-autograd ``AttributeError`` that names neither the cause nor the fix, so
# the root's compiled pre-forward refuses it instead. The flag is the user's to set,
# not ours: torch documents it as letting compiled code differ from eager for side
# effects in checkpointed code (eager replays them in the recompute). The units that
# can be so are found when the tree is wired, into the root's
# ``checkpoint_suspects``: a module whose class has Hugging Face's
# ``GradientCheckpointingLayer`` attribute (its flag is read), and every nested
# unit, with the module that holds it and the name it holds it by (its ``slots``). A
# unit is checkpointed around if that holder is a ``checkpoint_wrapper``
# (``checkpoint_wrapper(fully_shard(block))`` before the root's fully_shard) or if a
# wrapper has since replaced the unit in its holder (torch's
# ``apply_activation_checkpointing`` called after the root's fully_shard). That
# order was not refused before, and plain ``torch.compile`` (no fullgraph) then
# compiled each of the backward's graph breaks in turn, for minutes (seen: over 5
# minutes for 2 steps of a 2-block model on 1 rank, unfinished). Only the compiled
# pre-forward reads them, with the flag off: eager reads nothing, and in a compiled
# step dynamo guards on each slot (21 more guards on a 2-block Llama, 3,533 in all),
# so a wrapper put there later recompiles and is seen.


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
# ``torch.compiler.nested_compile_region`` is torch's way to compile a repeated block
# once. Inside our units, torch 2.13's compiled autograd graph-breaks at the region's
# backward (``invoke_subgraph``) without resuming: the rest of its graph runs eagerly,
# and each gradient hook it calls is compiled as a frame of its own (one per
# parameter, until dynamo's recompile limit, then eager). Those hooks reduce each
# gradient on its own, as traced ones do (see [Note: Eager or traced] in
# ``_common.py``), and train correctly, but the second compile of a hook frame makes
# the tensor sizes dynamic, and on 2 or more ranks dynamo then fails to build its
# guards (an ``IndexError`` naming no cause). So the root's compiled pre-forward
# refuses the regions unless ``automatic_dynamic_shapes`` is off, which the message
# offers along with removing them; the message names the marked modules. The
# regions are found when the tree is wired (a module whose class, or the module
# itself, has a forward carrying torch's ``__marked_compile_region_fn__``), and the
# root keeps the refusal that names them; a region marked on a plain function
# inside a forward is not seen.


def marks_compile_region(module: nn.Module) -> bool:
    """Whether ``module``'s forward (its own, or its classes') is marked with
    ``torch.compiler.nested_compile_region``. See [Note: A compile region inside a
    unit]."""
    forwards = [module.__dict__.get("forward")]
    forwards += [klass.__dict__.get("forward") for klass in type(module).__mro__]
    return any(hasattr(f, "__marked_compile_region_fn__") for f in forwards if f is not None)


class _InputGradsDone:
    """What torch's ``RegisterPostBackwardFunction`` calls (``post_backward``) when
    the gradients of one forward's inputs are complete; it counts them down when
    that forward counted them. See [Note: When a unit's backward is done]
    (_param_group.py)."""

    def __init__(self, state: FSDPState, counted: bool) -> None:
        self.state = state
        self.counted = counted

    def post_backward(self) -> None:
        if self.counted:
            self.state._input_grads_done()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward now (eagerly). See
    [Note: Forward during the unit's backward]."""
    return not compiling() and torch._C._current_graph_task_id() != -1


def _queue_final_callback(callback: Callable[[], None]) -> None:
    """Queues ``callback`` to run after the current backward, eagerly only.
    See [Note: Hooks and compiled autograd]."""
    if not compiling():
        Variable._execution_engine.queue_callback(callback)


# [Note: Forward during the unit's backward]
# Activation checkpointing runs a module's forward again inside the backward (the
# recompute). When that module is a unit (``checkpoint_wrapper`` applied after
# fully_shard), its forward runs while the unit is in its backward: it was
# re-gathered by its pre-backward, and its modules hold the placeholders (see
# [Note: The module holds the placeholder only in forward] in ``_param.py``). The
# pre- and post-forward then only make sure of that (gathering again if something
# resharded the unit since) and cast inputs and outputs as the first forward did,
# so the recompute computes what the forward computed; no reshard (which would free
# what the recompute's own backward reads), no hooks on the recomputed tensors.
# torch's FSDP2 does the same, for the same reasons. "During the unit's backward" is
# its PRE_BACKWARD state while the autograd engine runs a backward: a unit left in
# PRE_BACKWARD after a backward ended (a compiled backward, or
# ``set_is_last_backward(False)``) is finished by the next forward as usual. While
# dynamo traces a forward no recompute runs (a checkpointed region compiled with the
# forward is recomputed inside the compiled graphs).


# [Note: A unit's state and its group's backward]
# The unit's ``TrainingState`` lives on the ``FSDPState`` alone. Its parameter group
# keeps one different fact, ``in_backward``: its gradient work is in flight, from
# ``pre_backward`` (which re-gathers) until ``finish_backward`` (every gradient it
# waits for was handled). The two part where it matters: a group with nothing to wait
# for (every parameter frozen, no input needing grad) finishes inside
# ``pre_backward``, while its unit stays ``PRE_BACKWARD`` until its backward is over,
# so that the unit's other outputs' hooks do not re-gather it again, and a recompute
# of its forward (activation checkpointing) is still seen as part of its backward (see
# [Note: Forward during the unit's backward]). The unit goes ``IDLE`` when its group
# stops being in backward (``_idle_if_group_done``), when its root finishes it, or at
# its next post-forward; a post-forward also ends the group's backward, as the unit's
# forward starts a new iteration for both.


# [Note: Forward wrapper, not module hooks]
# Pre- and post-forward run inside the ``forward`` of the generated ``FSDP<Class>``
# rather than as module hooks. ``torch.compile(module)`` calls the top module's hooks
# outside dynamo and only picks up frames inside them, so hooks on the root would
# compile as two extra graphs (root gathers, root reshard) around the forward graph;
# inside ``forward`` they trace into one graph with everything else.


# [Note: The post-optimizer event]
# torch's FSDP all-gathers on its own streams and, by default, makes them wait for the
# current stream at the root's pre-forward, so that they follow the optimizer step;
# ``set_post_optim_event(event)`` replaces that wait by a wait on ``event``. Our
# collectives run on the current stream, so they follow the optimizer step already;
# the event is still honoured: before the root's next forward the current stream
# waits on it (``event.wait()``), once, and it is dropped. The wait is eager-only
# (events do not belong in a traced graph, and a new event each step would recompile
# it), in ``_wait_post_optim_event`` (dynamo-disabled), reached two ways, whichever
# comes first:
# - a forward pre-hook on the root's module(s), registered when the event is set and
#   removed once it fired: eagerly and under ``torch.compile(model)``, which runs the
#   top module's hooks outside dynamo (see [Note: Forward wrapper, not module hooks]),
#   so the forward graph never sees the event;
# - the root's pre-forward, when ``post_optim_pending`` (a bool, the one thing dynamo
#   guards on) is still set: for a step compiled whole, where dynamo inlines the
#   model's call and ignores hooks added after it compiled
#   (``skip_nnmodule_hook_guards``). That step graph-breaks there, in the steps that
#   have an event only (one more graph variant, not a recompile per event).


# The attribute of a module's ``__dict__`` that holds its unit's state.
_STATE_ATTR = "_traceable_hsdp_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The state of the fully_shard unit ``module`` belongs to as one of its modules,
    or ``None``."""
    return module.__dict__.get(_STATE_ATTR)


def _path_label(names: list[str]) -> str:
    """A unit's label from its modules' paths: the path, or for a list unit
    ``[a, b]``, all of them, as it was built."""
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _below(names: list[str], outer: list[str]) -> bool:
    """Whether every path in ``names`` lies below one of the paths in ``outer``."""
    return all(any(n.startswith(f"{o}.") for o in outer) for n in names)


def _relative(names: list[str], outer: list[str]) -> list[str]:
    """``names`` (each below one of ``outer``) as paths below it."""
    return [next(n[len(o) + 1:] for o in outer if n.startswith(f"{o}.")) for n in names]


class FSDPState:
    """The fully_shard state of one unit (one module, or a list sharded together).

    Built by ``fully_shard`` from the unit's checked options (see [Note: Unit options]
    in ``_init.py``), it attaches itself to its modules; the units nested in them
    join its tree through :meth:`adopt_nested`.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        param_group: FSDPParamGroup | None,
        options: UnitOptions,
        init_errors: list[str],
    ) -> None:
        self.modules = modules
        # Its (first) module's class name, before fully_shard extends the class.
        self.kind = type(modules[0]).__name__
        self.param_group = param_group
        self.options = options
        # Changed by FSDPModule.set_reshard_after_forward; the options keep the
        # value the unit was built with.
        self.reshard_after_forward = options.reshard_after_forward
        self.mp_policy = options.mp_policy
        self.is_root = True
        # For the root: every state in its subtree, itself included, in module order.
        self.states: list[FSDPState] = [self]
        self.training_state = TrainingState.IDLE
        self.is_last_backward = True  # root only: finish every unit after backward
        # Root only; see [Note: Manual backward finalization].
        self.manual_finalization = False
        self.reduction_pending = False  # finalize_backward(async_op=True) not waited
        self.iteration = 0  # bumped by reset_iter: invalidates a pending handle
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self._final_callback_queued = False
        # The outermost unit whose subtree holds this one (set by that unit's
        # fully_shard); itself while it is a root.
        self.root: FSDPState = self
        # Root only; see [Note: The post-optimizer event].
        self.post_optim_event: Any = None
        self.post_optim_pending = False  # an event is set (what dynamo guards on)
        self._post_optim_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._hooked: set[int] = set()  # ids of the FSDPParams with a post-acc hook
        # Why fully_shard left parameters out of this unit, raised at its first
        # forward. See [Note: One unit per parameter] (_init.py).
        self.init_errors = init_errors
        # See [Note: A checkpoint around a unit's call].
        self.hf_checkpointing_modules = [
            m for m in modules
            if isinstance(getattr(type(m), "gradient_checkpointing", None), bool)
        ]
        # Where the root found this unit's modules (set by adopt_nested): the module
        # holding each, its path under the root, and the name it holds it by.
        self.slots: list[tuple[nn.Module, str, str]] = []
        # Root only: the units of its tree that either can mark (set by adopt_nested).
        self.checkpoint_suspects: list[FSDPState] = []
        # Root only: the refusal naming the modules marked as compile regions, None
        # when there are none (adopt_nested). See [Note: A compile region inside a
        # unit].
        self._refuse_compile_regions: Callable[..., Any] | None = None
        if param_group is not None:
            self._register_post_acc_hooks()
            for m in modules:
                m.register_load_state_dict_post_hook(self._after_load_state_dict)
            # See [Note: state_dict and load_state_dict].
            by_module: dict[nn.Module, list[tuple[str, FSDPParam]]] = {}
            for fp in param_group.fsdp_params:
                for info in fp.module_infos:
                    by_module.setdefault(info.module, []).append((info.param_name, fp))
            for m, params in by_module.items():
                m.register_state_dict_pre_hook(self._before_state_dict)
                m.register_load_state_dict_pre_hook(
                    functools.partial(self._before_load_own_params, params)
                )
            self._hook_eager_recomputes(modules, by_module)
        for m in modules:
            m.register_load_state_dict_pre_hook(self._before_load_subtree)
        for m in modules:
            m.__dict__[_STATE_ATTR] = self

    def _hook_eager_recomputes(
        self, modules: list[nn.Module],
        by_module: dict[nn.Module, list[tuple[str, FSDPParam]]],
    ) -> None:
        """See [Note: A checkpoint inside a unit, run eagerly by compiled autograd].
        ``by_module``: the unit's parameters by the module that holds them."""
        for m in modules:
            for path, sub in m.named_modules():
                if not isinstance(sub, CheckpointWrapper):
                    continue
                inner = sub._checkpoint_wrapped_module
                # dict: a parameter held by two modules (tied) is checked once
                held = {
                    id(fp): fp for mod in inner.modules() for _, fp in by_module.get(mod, ())
                }
                params = list(held.values())
                if params:
                    inner.register_forward_pre_hook(
                        functools.partial(self._check_eager_recompute, path, params)
                    )

    def _check_eager_recompute(
        self, path: str, params: list[FSDPParam], module: nn.Module, args: Any
    ) -> None:
        """See [Note: A checkpoint inside a unit, run eagerly by compiled autograd]."""
        if compiling() or not compiled_autograd.in_compiled_autograd_region:
            return
        if all(fp.module_holds_unsharded for fp in params):
            return
        raise RuntimeError(
            f"Unit {self._where()!r}: the checkpoint_wrapper around "
            f"{type(module).__name__}{f' at {path!r}' if path else ''} in it runs "
            "eagerly inside a compiled-autograd backward, where its recompute "
            "would read the sharded parameters. A checkpoint runs eagerly when the forward "
            "is not compiled, or when its region breaks the graph (TORCH_LOGS=graph_breaks "
            "names the break; transformers 5.25 has one in every decoder layer's "
            "attention). Fix, either: set torch._dynamo.config."
            "skip_fwd_side_effects_in_bwd_under_checkpoint = True before the first "
            "compiled step, if the region's side effects need not run again in the "
            "recompute; or remove the graph break from the region; or compile the "
            "forward (torch.compile(model)) when the backward is compiled."
        )

    # -------------------------------------------------------------------- tree
    def adopt_nested(self) -> None:
        """Makes this unit the root of the units nested in its modules (built by
        earlier fully_shard calls), which stop being roots, and labels each nested
        unit by its path under it ("layers.0", for messages and dumps; see [Note:
        Collective annotations] in ``passes/_graph.py``). Called once, when this
        unit is built."""
        nested: list[FSDPState] = []
        for m in self.modules:
            for sub in m.modules():
                s = state_of(sub)
                if s is not None and s is not self and s not in nested:
                    s._nest_under(self)
                    s.slots = []  # found again below, under this root
                    nested.append(s)
        self.states = [*nested, self]
        regions: list[str] = []
        paths: dict[FSDPState, list[str]] = {}
        for m in self.modules:
            for name, sub in m.named_modules():
                s = state_of(sub)
                if name and s is not None and s is not self:
                    paths.setdefault(s, []).append(name)
                if marks_compile_region(sub):
                    regions.append(name or type(sub).__name__)
                for child_name, child in sub._modules.items():
                    held = state_of(child) if child is not None else None
                    if held is not None and held is not self:
                        # See [Note: A checkpoint around a unit's call].
                        held.slots.append((sub, name, child_name))
        for s, names in paths.items():
            # A list unit is labelled by all its modules' paths, as it was built.
            # See [Note: One graph for every unit of a class] (_common.py).
            enclosing = sorted(
                (a for a in paths if a is not s and _below(names, paths[a])),
                key=lambda a: -len(paths[a][0]),
            )
            s._label_as(_path_label(names), (
                s.kind,
                *(f"{a.kind}.{_path_label(_relative(names, paths[a]))}" for a in enclosing),
            ))
        self.checkpoint_suspects = [s for s in self.states if s.slots or s.hf_checkpointing_modules]
        # See [Note: A compile region inside a unit]. Built here: a refusal's message
        # is all dynamo shows (no details).
        self._refuse_compile_regions = (
            refusal(f"{COMPILE_REGION_FIX} Modules: {', '.join(regions)}.") if regions else None
        )

    def _nest_under(self, root: FSDPState) -> None:
        self.is_root = False
        self.root = root

    def _label_as(self, path: str, frame_labels: tuple[str, ...]) -> None:
        """Names the unit by its path under the root, and by what a frame traced
        below the root calls it (``FSDPParamGroup.frame_labels``)."""
        if self.param_group is not None:
            self.param_group.label = path
            self.param_group.frame_labels = frame_labels

    def _register_post_acc_hooks(self) -> None:
        """A post-accumulate-grad hook on every trainable placeholder that has none
        (a parameter unfrozen after fully_shard gets its hook here)."""
        pg = self.param_group
        assert pg is not None
        for fp in pg.trainable:
            if id(fp) not in self._hooked:
                self._hooked.add(id(fp))
                fp.unsharded_param.register_post_accumulate_grad_hook(
                    self._make_post_acc_hook(pg, fp)
                )

    # ------------------------------------------------- changes after fully_shard
    # See [Note: Changes after fully_shard] (_param.py).
    def _sync_user_changes(self) -> None:
        pg = self.param_group
        if pg is None:
            return
        if not compiling():
            # See [Note: All-gather extensions are refused] (_param.py).
            for fp in pg.fsdp_params:
                refuse_all_gather_extension(fp.fqn, fp.sharded_param._local_tensor)
        changes = [fp.user_change() for fp in pg.fsdp_params]
        # A compiled step follows a freeze without applying it (see the Note).
        if UserChange.OTHER in changes or (not compiling() and UserChange.FROZEN in changes):
            self._apply_user_changes()

    @torch._dynamo.disable(reason="traceable_hsdp: a parameter changed after fully_shard")
    def _apply_user_changes(self, check_device: bool = True) -> None:
        pg = self.param_group
        if pg is not None:
            if check_device:
                self._refuse_meta_params()
            pg.reset_sharded_params(check_device)
            self._register_post_acc_hooks()

    def _refuse_meta_params(self) -> None:
        """torch's check, with torch's exception and first words: the unit's parameters
        still on the meta device, by their paths under the root."""
        assert self.param_group is not None
        on_meta = [
            info for fp in self.param_group.fsdp_params
            for info in fp.module_infos[:1]
            if info.module._parameters[info.param_name].is_meta
        ]
        if not on_meta:
            return
        paths = {m: p for rm in self.root.modules for p, m in rm.named_modules()}
        names = [
            f"{paths[i.module]}.{i.param_name}" if paths.get(i.module) else i.param_name
            for i in on_meta
        ]
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, "
            f"but the following were still on meta device: {names}. Materialize them "
            "first: module.to_empty(device=...) and then initialize them "
            "(reset_parameters() or load a state dict)."
        )

    # ------------------------------------------------------------------ forward
    @unit_forward
    def forward(self, orig_forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs the unit's forward between its pre- and post-forward.
        See [Note: Forward wrapper, not module hooks]."""
        if (
            compiling()
            and not compiled_autograd.compiled_autograd_enabled
            and self.root._needs_backward()
        ):
            # See [Note: A unit compiled without compiled autograd].
            args, kwargs = _pre_forward_untraced(self, args, kwargs)
            output = orig_forward(*args, **kwargs)
            return _post_forward_untraced(self, output, (args, kwargs))
        args, kwargs = self._pre_forward(args, kwargs)
        output = orig_forward(*args, **kwargs)
        return self._post_forward(output, (args, kwargs))

    def _pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pg = self.param_group
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            # See [Note: Forward during the unit's backward].
            if pg is not None and pg.unshard_in_backward:
                pg.unshard()  # no-op unless something resharded it since
                if not compiling():
                    # See [Note: The module holds the placeholder only in forward].
                    pg.register_unsharded()
            return self._cast_inputs(args, kwargs)
        # A root checks its whole subtree before anything runs; a unit whose own
        # forward is called outside its root's, itself.
        for state in self.states if self.is_root else (self,):
            if state.init_errors:
                raise ValueError(state.init_errors[0])
        if self.is_root:
            self._root_pre_forward()
        self._sync_user_changes()
        self.training_state = TrainingState.FORWARD
        if pg is not None:
            pg.issue_unshard()
            for other in self.forward_prefetch:
                if other.param_group is not None:
                    other.param_group.issue_unshard()
            pg.wait_for_unshard()
            pg.register_unsharded()
        args, kwargs = self._cast_inputs(args, kwargs)
        if pg is not None and torch.is_grad_enabled():
            args, kwargs = self._mark_input_grads(pg, args, kwargs)
        return args, kwargs

    def _mark_input_grads(
        self, pg: FSDPParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Gives the forward new tensors for its inputs that require grad, through
        which the unit learns that their gradients are complete. See [Note: When a
        unit's backward is done] (_param_group.py)."""
        counted = pg.counts_input_grads
        if compiling():
            if counted:
                return _map_tensors((args, kwargs), self._hooked_alias)
            return args, kwargs
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs
        outputs = iter(RegisterPostBackwardFunction.apply(_InputGradsDone(self, counted), *inputs))
        if counted:
            pg.input_grad_hooks += 1
        args, kwargs = _map_tensors((args, kwargs), lambda t: next(outputs) if t.requires_grad else t)
        assert next(outputs, None) is None, "_tensors and _map_tensors disagree on order"
        return args, kwargs

    def _hooked_alias(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh alias of a forward input that requires grad, with the hook that
        counts its gradient; other tensors unchanged. See [Note: When a unit's
        backward is done] (_param_group.py)."""
        if not t.requires_grad:
            return t
        alias = t.view_as(t)
        alias.register_hook(self._input_grad_hook)
        assert self.param_group is not None
        self.param_group.input_grad_hooks += 1
        return alias

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floating((args, kwargs), dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _needs_backward(self) -> bool:
        """A root's: whether this forward will need a backward (grad on, and some unit
        of its tree trainable)."""
        return torch.is_grad_enabled() and any(
            s.param_group is not None and s.param_group.trainable for s in self.states
        )

    def _root_pre_forward(self) -> None:
        needs_backward = self._needs_backward()
        if (
            needs_backward
            and compiling()
            and not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
        ):
            for state in self.checkpoint_suspects:
                how = state._checkpointed_around()
                if how is not None:
                    _refuse_checkpoint_around_unit(how)
        if (
            needs_backward
            and compiling()
            and self._refuse_compile_regions is not None
            and torch._dynamo.config.automatic_dynamic_shapes
        ):
            # See [Note: A compile region inside a unit].
            self._refuse_compile_regions()
        if self.post_optim_pending:
            # Only for a step compiled whole; see [Note: The post-optimizer event].
            self._wait_post_optim_event()
        if (
            needs_backward
            and compiled_autograd.compiled_autograd_enabled
            and any(
                s.param_group is not None and s.param_group.reduce_scatter_unused_params
                for s in self.states
            )
        ):
            # See [Note: Unused parameters] (_param_group.py).
            _refuse_unused_params_compiled()
        # A compiled backward queues no final callback: finish what it left here.
        # See [Note: Hooks and compiled autograd].
        for state in self.states:
            if state.training_state is TrainingState.PRE_BACKWARD:
                # Only here: reading held gradients of every unit would add guards
                # that change between micro-batches (recompiles).
                held = [] if state.param_group is None else state.param_group.held_after_sync()
                if held:
                    _refuse_held_after_sync(f"Parameters: {', '.join(held)}.")
                state._finish_backward()
        self._final_callback_queued = False

    def _checkpointed_around(self) -> str | None:
        """How a checkpoint is put around this unit's whole call, if one is. See
        [Note: A checkpoint around a unit's call]."""
        for holder, path, name in self.slots:
            if isinstance(holder, CheckpointWrapper):
                return f"Unit {self._where()!r}: checkpoint_wrapper {path!r} wraps it."
            now = holder._modules.get(name)
            if isinstance(now, CheckpointWrapper) and now._checkpoint_wrapped_module in self.modules:
                where = f"{path}.{name}" if path else name
                return (f"Unit {self._where()!r}: checkpoint_wrapper {where!r} wraps it "
                        "(put there after fully_shard on the root).")
        for m in self.hf_checkpointing_modules:
            if m.gradient_checkpointing and m.training:
                return (f"Unit {self._where()!r}: Hugging Face gradient checkpointing "
                        "is on (activation_checkpointing_enable(), formerly "
                        "gradient_checkpointing_enable()).")
        return None

    def _where(self) -> str:
        """The unit's path under its root, for messages."""
        pg = self.param_group
        return pg.label if pg is not None else " ".join(type(m).__name__ for m in self.modules)

    # [Note: The default keeps the root gathered for backward]
    # ``reshard_after_forward=None`` (the default, as torch 2.13's) keeps the root's
    # parameters gathered after forward, because its backward comes first and would
    # re-gather them at once. We keep them only when a backward can follow: after a
    # forward with grad disabled (``torch.no_grad``, ``inference_mode``: evaluation)
    # the root reshards like every other unit. torch's keeps them, and then its
    # modules hold the gathered plain parameters until the next backward or
    # reshard(), so an optimizer built from ``model.parameters()`` after an
    # evaluation forward steps those copies and never the sharded parameters; the
    # loss of the second step differs, with no error (torch's, and ours with ``None``
    # before this: the same wrong losses, demo Llama, 2 ranks). Compiled, a root left
    # gathered by an evaluation forward also made the next training step compile its
    # forward and backward again (its state differs from the one the graphs were
    # traced with).
    # What it costs: an evaluation loop re-gathers the root's parameters at each
    # forward. An explicit ``False`` keeps them, as torch's.
    def _post_forward(self, output: Any, inputs: Any = ()) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            # See [Note: Forward during the unit's backward].
            return self._cast_output(output)
        pg = self.param_group
        if pg is not None:
            raf = self.reshard_after_forward
            if raf is None:  # See [Note: The default keeps the root gathered for backward].
                raf = not (self.is_root and torch.is_grad_enabled())
            if raf is True:
                pg.reshard()
            elif raf is False:
                # The data stays gathered for backward. Eagerly the modules keep
                # holding it, as torch's; see [Note: The module holds the placeholder
                # only in forward] (_param.py).
                if compiling():
                    pg.register_sharded()
            else:  # an int: keep 1/raf for a smaller re-gather in backward
                pg.post_forward_reshard()
            pg.in_backward = False  # See [Note: A unit's state and its group's backward].
            pg.open_calls.clear()  # See [Note: Output hooks after the unit's backward].
        self.training_state = TrainingState.IDLE
        output = self._cast_output(output)
        if torch.is_grad_enabled():
            self._register_pre_backward_hooks(output, inputs)
        return output

    # [Note: An output that is a view]
    # A unit is re-gathered for its backward by a hook on each of its outputs that
    # requires grad. An in-place op on an output that is a view (``out += y`` after a
    # unit that returned ``h.view(...)``, as HF's OPT decoder layer and timm's
    # PatchEmbed do) re-bases the view's autograd history: the node the hook sits on
    # leaves the graph, the hook never runs, and the unit's backward reads its freed
    # placeholders ("setStorage: ... out of bounds for storage of size 0"). torch's
    # fully_shard fails the same way (and since torch 2.13 warns at every forward
    # that returns a view, in-place op or not).
    # The view's base keeps its history: the in-place op's node leads on to the
    # base's own producer. So for an output that is a view of a tensor the unit's
    # forward made (not a forward input, nor the base of one; not a leaf), the unit
    # also hooks the base. The base's hook acts only if the view's did not run (the
    # two share a flag of their own): without an in-place op the view's hook runs
    # first and the base's does nothing. The numbers are those of the same op out of
    # place (tests/test_conformance.py: bitwise against torch's fully_shard on that
    # form). Compiled, dynamo traces both hooks (``is_leaf``, not ``grad_fn``, which
    # dynamo cannot read) and compiled autograd calls them as eagerly.
    #
    # [Note: Output hooks after the unit's backward]
    # A unit's backward is over once its trainable gradients are reduced (and, for a
    # unit with frozen parameters, its inputs' gradients are complete: [Note: When a
    # unit's backward is done] in _param_group.py). An output on no path to its
    # parameters can still get its gradient later: one the unit passes through
    # unchanged, as each T5 block returns the position bias it was given, completes
    # only after every later block's backward. Its hook then found the unit idle and
    # gathered it again, for nothing: compiled, HF T5 (2 ranks) re-gathered 65
    # parameters a backward instead of 44, recompiled its forward at step 2, and
    # kept 82,560 bytes of placeholders gathered after each backward; eagerly it
    # issued 6 all-gathers a backward instead of 4 (the root's final callback freed
    # them). So the hooks of one forward call share a flag: the first that runs
    # while the flag is down records it on the group, and the group's finish raises
    # every flag it recorded; a hook whose flag is up does nothing. A call none of
    # whose hooks ran before the finish (its outputs all on no path to the
    # parameters) still re-gathers, as before. Pipelining's forwards of several
    # micro-batches before their backwards each have their own flag, so a later
    # micro-batch's finish leaves an earlier one's hooks alone.
    def _register_pre_backward_hooks(self, output: Any, inputs: Any) -> None:
        """See [Note: An output that is a view] and [Note: Output hooks after the
        unit's backward]."""
        call = [False]
        input_bases: list[torch.Tensor] | None = None
        for t in _tensors(output):
            if not t.requires_grad:
                continue
            base = t._base
            if base is not None and not base.is_leaf:
                if input_bases is None:
                    input_bases = [x if x._base is None else x._base for x in _tensors(inputs)]
                if not any(base is b for b in input_bases):  # a tensor the unit made
                    ran = [False]
                    t.register_hook(functools.partial(self._output_pre_backward, call, ran))
                    base.register_hook(functools.partial(self._base_pre_backward, call, ran))
                    continue
            t.register_hook(functools.partial(self._output_pre_backward, call, None))

    def _output_pre_backward(
        self, call: list[bool], ran: list[bool] | None, grad: torch.Tensor
    ) -> torch.Tensor:
        if ran is not None:
            ran[0] = True
        return self._call_pre_backward(call, grad)

    def _base_pre_backward(self, call: list[bool], ran: list[bool], grad: torch.Tensor) -> torch.Tensor:
        if not ran[0]:  # the view's hook was lost to an in-place op
            self._call_pre_backward(call, grad)
        return grad

    def _call_pre_backward(self, call: list[bool], grad: torch.Tensor) -> torch.Tensor:
        pg = self.param_group
        if call[0]:  # this call's backward is over for the unit
            # Unless a later backward runs its graph again (retain_graph=True): see
            # [Note: A second backward through a retained graph] (_param_group.py).
            if compiling() or pg is None or not pg.rearm_if_retained(call):
                return grad
        if pg is not None and not any(c is call for c in pg.open_calls):
            pg.open_calls.append(call)
        return self._pre_backward(grad)

    # ----------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # Runs once per output tensor; every step below is idempotent. Any unit's
        # backward queues its root's final callback: a nested unit may run a backward
        # of its own (a module of it called outside the root's forward).
        root = self.root
        if not root._final_callback_queued:
            root._final_callback_queued = True
            _queue_final_callback(root._root_post_backward_final)
        pg = self.param_group
        if (
            pg is not None
            and not pg.in_backward
            and self.training_state is not TrainingState.PRE_BACKWARD
        ):
            self.training_state = TrainingState.PRE_BACKWARD
            pg.pre_backward()
            for other in self.backward_prefetch:
                if other.param_group is not None:
                    other.param_group.issue_unshard()
        return grad

    # [Note: Parameter hooks hold their unit weakly]
    # autograd keeps a placeholder's post-accumulate-grad hooks in C++, where the
    # garbage collector cannot see them. A hook that held its unit (state, group,
    # FSDPParam) strongly closed a cycle placeholder -> hook -> FSDPParam ->
    # placeholder that the collector could never free: every model ever sharded
    # stayed alive, with its parameters, meshes and process groups, for the life of
    # the process (torch's fully_shard, whose per-parameter work hangs off the
    # module's forward, frees its models). A process group that outlives
    # ``destroy_process_group`` keeps gloo's worker threads running to interpreter
    # exit, where one that still holds a finished collective's tensors must take the
    # GIL and aborts the process ("terminate called without an active exception",
    # torch issue 190489). ``examples/dcp_resume.py --eager`` under CPU load aborted
    # so in 9 of 34 runs, and in 1 of 32 with this fix: torch's DTensor sharding
    # cache still holds the mesh, hence the group, to exit (see [Note: Exiting with
    # gloo worker threads] in ``_exit.py`` for what releases it now).
    # So the hook holds its unit through weak references, and does nothing once the
    # unit is gone. ``tests/test_runtime.py`` checks that a dropped model is freed,
    # eager and compiled. Compiled autograd traces the dereferences like any other
    # Python in the hook.
    def _make_post_acc_hook(
        self, pg: FSDPParamGroup, fp: Any
    ) -> Callable[[torch.Tensor], None]:
        """See [Note: Parameter hooks hold their unit weakly]."""
        state_ref, pg_ref, fp_ref = weakref.ref(self), weakref.ref(pg), weakref.ref(fp)

        def hook(_param: torch.Tensor) -> None:
            state, pg, fp = state_ref(), pg_ref(), fp_ref()
            if state is None or pg is None or fp is None:
                return  # the unit was freed; its placeholder outlived it
            if pg.reduce_scatter_unused_params and compiling():
                # A backward compiled without a compiled forward (the root's
                # pre-forward refuses the other cases). See [Note: Unused parameters].
                _refuse_unused_params_compiled()
            pg.post_accumulate_grad(fp)
            state._idle_if_group_done()

        return hook

    def _input_grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        self._input_grads_done()
        return grad

    def _input_grads_done(self) -> None:
        if self.param_group is not None:
            self.param_group.input_grad_ready()
            self._idle_if_group_done()

    def _idle_if_group_done(self) -> None:
        if self.param_group is not None and not self.param_group.in_backward:
            # The group finished: the unit is idle again, so the next forward sees
            # the same state as the first (no recompile).
            self.training_state = TrainingState.IDLE

    def _finish_backward(self) -> None:
        if self.param_group is not None:
            self.param_group.finish_backward()
        self.training_state = TrainingState.IDLE

    def _root_post_backward_final(self) -> None:
        self._final_callback_queued = False
        if self.manual_finalization:
            return  # finalize_backward() ends the iteration
        self._end_backward_iteration()

    def _end_backward_iteration(self) -> None:
        # See [Note: Unused parameters] (_param_group.py).
        for state in self.states:
            if state.param_group is not None:
                state.param_group.end_of_backward()
        if self.is_last_backward or self.manual_finalization:
            for state in self.states:
                state._finish_backward()

    # [Note: Manual backward finalization]
    # torch 2.15's ``set_manual_backward_finalization(True)`` moves the end of the
    # backward iteration from the autograd engine's final callback to an explicit
    # ``finalize_backward()`` call, so that a schedule can run several backwards (the
    # micro-batches of a pipeline stage, with gradient sync off) and reduce once.
    # Here the root's final callback then does nothing, and ``finalize_backward``
    # does what the callback does on the last backward: every group reduces the
    # gradients it kept (gradient sync is on again by then) and every unit finishes
    # its backward (reshards as ``reshard_after_backward`` says). Our collectives run
    # on the current stream, so ``async_op=True`` finishes the reduction before it
    # returns its handle; the handle's ``wait()`` checks that no
    # ``reset_iter_state`` came between (``iteration``), as torch's does.
    # tests/test_backward_finalization.py checks it against torch's fully_shard, and
    # tests/test_pipelining.py through torch.distributed.pipelining (2.15).
    def finalize_backward(self) -> None:
        """Root only. See [Note: Manual backward finalization]."""
        if not self.manual_finalization:
            raise RuntimeError(
                "FSDP finalize_backward requires manual backward finalization. Call "
                "set_manual_backward_finalization(True) on the root before forward."
            )
        if self.reduction_pending:
            raise RuntimeError(
                "The previous gradient reduction must be waited on before finalizing "
                "backward again: call wait() on the handle finalize_backward(async_op="
                "True) returned."
            )
        if _in_backward():
            raise RuntimeError(
                "FSDP finalize_backward must be called after backward completes, not "
                "inside it (a hook or a callback of the backward)."
            )
        self._end_backward_iteration()

    # ------------------------------------------------------------ iteration
    def reset_iter(self) -> None:
        """Every unit of this root back to idle and sharded, after an exception
        stopped a forward or backward. See ``FSDPModule.reset_iter_state``."""
        for state in self.states:
            if state.param_group is not None:
                state.param_group.reset()
            state.training_state = TrainingState.IDLE
        self._final_callback_queued = False
        self.reduction_pending = False
        self.iteration += 1  # a pending GradientReductionHandle is invalid now

    def set_post_optim_event(self, event: Any) -> None:
        """Root only. See [Note: The post-optimizer event]."""
        self.post_optim_event = event
        self.post_optim_pending = True
        if not self._post_optim_hooks:
            self._post_optim_hooks = [
                m.register_forward_pre_hook(self._wait_post_optim_event, prepend=True)
                for m in self.modules
            ]

    def clear_post_optim_event(self) -> None:
        """Root only: drops an event set and not yet waited for (eagerly)."""
        if self.post_optim_pending:
            self.post_optim_event = None
            self._wait_post_optim_event()

    # Disabled as a whole: dynamo must not compile the hook's own frame either (under
    # torch.compile(model, fullgraph=True) that is a hard error).
    @torch._dynamo.disable
    def _wait_post_optim_event(self, *hook_args: Any) -> None:
        """The current stream waits on the event, once. Eager only. Also the forward
        pre-hook (``hook_args``: the module and its inputs, unused)."""
        event, self.post_optim_event = self.post_optim_event, None
        self.post_optim_pending = False
        for handle in self._post_optim_hooks:
            handle.remove()
        self._post_optim_hooks = []
        if event is not None:
            event.wait()

    # -------------------------------------------------------------- state dict
    # See [Note: state_dict and load_state_dict].
    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.param_group is not None:
            self.param_group.register_sharded()

    def _before_load_subtree(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        *args: Any,
    ) -> None:
        # On the unit's module, before any module under it loads: prepares every
        # value for this unit and the units nested in it, so a refused value raises
        # before anything is loaded.
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        paths: dict[int, list[str]] = {}
        for path, sub in module.named_modules(remove_duplicate=False):
            paths.setdefault(id(sub), []).append(f"{path}." if path else "")
        for state in self.states:
            pg = state.param_group
            if pg is None:
                continue
            reached = False
            for fp in pg.fsdp_params:
                for info in fp.module_infos:
                    for path in paths.get(id(info.module), ()):
                        key = prefix + path + info.param_name
                        _prepare_loaded_value(state_dict, key, fp, assign)
                        reached = True
            if reached:
                pg.reshard()  # See [Note: state_dict and load_state_dict].

    def _before_load_own_params(
        self,
        params: list[tuple[str, FSDPParam]],
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        *args: Any,
    ) -> None:
        # On a module holding managed parameters: the same for its own parameters,
        # for a load_state_dict() called on this module (or a parent that is no unit).
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        for name, fp in params:
            _prepare_loaded_value(state_dict, prefix + name, fp, assign)
        if self.param_group is not None:
            self.param_group.reshard()  # See [Note: state_dict and load_state_dict].

    def _after_load_state_dict(self, module: nn.Module, incompatible_keys: Any) -> None:
        if self.param_group is not None:
            # assign=True gives each registration of a shared parameter its own
            # tensor; the unit keeps the first one and every registration gets it
            # back, so the parameter stays shared (reset_sharded_param). The device
            # is not checked here: this hook runs after each of a list unit's modules
            # loads, when the next ones may still hold their meta shards (HF
            # accelerate loads its [final norm, head] unit so). A shard still on meta
            # at the next forward is refused there, naming the fix.
            self._apply_user_changes(check_device=False)


# [Note: state_dict and load_state_dict]
# Outside a unit's forward its modules hold the sharded DTensors under the original
# names, so ``state_dict()`` returns DTensors keyed by the original FQNs and
# ``load_state_dict()`` copies into the sharded parameters (DTensor.copy_). Pre-hooks
# make three cases work that would otherwise be wrong or fail:
#
# - state_dict() between unshard() and reshard(): the modules hold the unsharded
#   placeholders (plain full tensors). A pre-hook registers the sharded parameters
#   again (the gathered data stays, so a later forward or reshard() is unaffected),
#   and the state dict holds DTensors as always.
# - load_state_dict() while the unit holds gathered data (between unshard() and
#   reshard(), after a forward with reshard_after_forward=False, after a backward
#   with reshard_after_backward=False, or with an async unshard in flight): the new
#   values go to the sharded parameters, and the gathered copy would be stale, so
#   the pre-hooks reshard first (frees it; an all-gather in flight is waited for
#   and dropped). The next forward, or unshard(), gathers the loaded values.
#   torch's FSDP2 does the same (its pre-hooks move the group to sharded).
# - a plain tensor of the parameter's full shape (a full, consolidated state dict):
#   DTensor.copy_ refuses to mix tensor types, so the pre-hooks turn it into a
#   DTensor with distribute_tensor(..., src_data_rank=None): each rank keeps its
#   own shard of its own full tensor, without communication (as torch's
#   set_model_state_dict does for a full state dict). Every rank must pass the same
#   full values. A plain tensor of another shape is left for torch's size-mismatch
#   error.
#
# With assign=True the loaded DTensor becomes the sharded parameter (the post-hook,
# FSDPParam.reset_sharded_param, swaps it in); the pre-hook checks that it has the mesh,
# placements and dtype of the parameter it replaces.
#
# Two pre-hooks do this. One on each unit's module prepares every value of the unit
# and of the units nested in it, before any module under it loads, so a refused value
# raises before anything is copied or assigned (load_state_dict visits a module
# before its children). One on each module that holds managed parameters prepares
# its own: it covers load_state_dict() called on a module inside a unit, and is a
# no-op check when the unit's hook already ran.


def _prepare_loaded_value(
    state_dict: dict[str, Any], key: str, fp: FSDPParam, assign: bool
) -> None:
    """Turns a plain full tensor at ``key`` into a DTensor laid out like ``fp``'s
    sharded parameter, and with ``assign`` checks that it can replace it. See
    [Note: state_dict and load_state_dict]."""
    value = state_dict.get(key)
    if not isinstance(value, torch.Tensor):
        return  # missing (torch reports it) or not a tensor (torch raises)
    sharded = fp.sharded_param
    if not isinstance(value, DTensor):
        if value.shape != sharded.shape:
            return  # torch reports the size mismatch with the key
        # Each rank keeps its own shard of its own full tensor: no communication, so
        # every rank must load the same full values. distribute_tensor copies the
        # shard out, so an assigned parameter does not keep the full tensor alive.
        value = distribute_tensor(
            value.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None
        )
        local_device = fp.shard_device
        if value.to_local().device != local_device:
            # CPUOffloadPolicy keeps the shards on the CPU (distribute_tensor puts
            # them on the mesh's device).
            value = DTensor.from_local(
                value.to_local().to(local_device),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        state_dict[key] = value
    if assign:
        _check_assignable(key, value, fp)


def _check_assignable(key: str, value: DTensor, fp: FSDPParam) -> None:
    """Raises ValueError unless ``value`` can replace ``fp``'s sharded parameter under
    assign=True. A parameter still on meta (a model built there) is replaced by
    shards on the device it gathers from: torch's rank-0 broadcast flow (build on
    meta, fully_shard, load_state_dict(sharded_sd, assign=True))."""
    sharded = fp.sharded_param
    if value.device_mesh != sharded.device_mesh or tuple(value.placements) != tuple(
        sharded.placements
    ):
        raise ValueError(
            f"load_state_dict(assign=True): {key!r} is a DTensor with placements "
            f"{tuple(value.placements)} on {value.device_mesh}; the fully_shard parameter "
            f"it would replace has placements {tuple(sharded.placements)} on "
            f"{sharded.device_mesh}. Redistribute it first "
            "(value.redistribute(param.device_mesh, param.placements)), or load with "
            "assign=False, which copies."
        )
    if value.to_local().device != fp.shard_device:
        why = " (CPUOffloadPolicy keeps shards on the CPU)" if fp.offload is not None else ""
        raise ValueError(
            f"load_state_dict(assign=True): {key!r} holds its shard on "
            f"{value.to_local().device}; the fully_shard unit keeps this parameter's shard "
            f"on {fp.shard_device}{why}. Move the shards there first, or load with "
            "assign=False, which copies."
        )
    if value.dtype != sharded.dtype:
        raise ValueError(
            f"load_state_dict(assign=True): {key!r} has dtype {value.dtype}; the "
            f"fully_shard parameter it would replace has {sharded.dtype}, and the "
            "unit's gradients and mixed precision are set up for that dtype. Cast it "
            "first (value.to(param.dtype)), or load with assign=False, which casts."
        )


# [Note: Activations in dataclasses]
# A unit's inputs and outputs may hold tensors in dataclasses, which pytree does not
# flatten (named tuples, lists, tuples and dicts it does). A tensor the hooks missed
# is a unit whose output gets no pre-backward hook: its backward would read the
# freed placeholder. ``_tensors`` and ``_map_tensors`` therefore look inside
# dataclass instances too, as torch's FSDP2 does (its ``_apply_to_tensors``).


def _tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, dataclass fields included. See
    [Note: Activations in dataclasses]."""
    flat, _ = tree_flatten(tree)
    out: list[torch.Tensor] = []
    for leaf in flat:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                out.extend(_tensors(getattr(leaf, field.name)))
    return out


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to every tensor, dataclass fields included (as
    shallow copies: the caller's objects are untouched; a frozen dataclass's fields
    are set as its own ``__init__`` sets them). See [Note: Activations in
    dataclasses]."""

    def apply(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            new = copy.copy(x)
            frozen = type(x).__dataclass_params__.frozen  # type: ignore[attr-defined]
            set_field = object.__setattr__ if frozen else setattr
            for field in dataclasses.fields(x):
                set_field(new, field.name, _map_tensors(getattr(x, field.name), fn))
            return new
        return x

    return tree_map(apply, tree)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return _map_tensors(tree, cast)
