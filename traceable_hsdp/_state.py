"""Per-module state and the hooks that drive the lifecycle.

[Note: Hooks and compiled autograd]
The same hooks run eagerly and under ``torch.compile``:

- pre-forward: all-gather the unit's parameters and register the placeholders;
- post-forward: reshard when ``reshard_after_forward``, and hook every output that
  requires grad; the hook re-gathers before the unit's backward and returns its
  gradient (compiled autograd breaks on ``None``, and on an ``autograd.Function``
  trigger);
- post-accumulate-grad hook on each placeholder: reduce the gradient into the sharded
  ``.grad`` and free the placeholder's;
- finishing: a group finishes when its last gradient is reduced. Eagerly the root also
  queues an engine callback that finishes units some of whose parameters got no
  gradient. Compiled autograd accepts ``queue_callback`` only under ``fullgraph=True``,
  which torch's recommended entry is not, so compiled, the next pre-forward finishes
  such units.

Compiled autograd must be on when the forward is traced, so that dynamo defers the
output hooks to the backward (``BackwardState``). Otherwise AOTAutograd's partitioner
may move the re-gather into the forward: wrong numbers, no error. So a forward compiled
without compiled autograd runs each unit's pre- and post-forward eagerly around the
compiled compute ([Note: A unit compiled without compiled autograd] in
``_compile_checks.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from ._common import TrainingState, compiling, unit_forward
from ._compile_checks import (
    checkpointed_around,
    compile_region_refusal,
    hf_checkpointing_modules,
    hook_eager_recomputes,
    marks_compile_region,
    post_forward_untraced,
    pre_forward_untraced,
    refuse_checkpoint_around_unit,
    refuse_held_after_sync,
    refuse_spmd_tp_compiled,
    refuse_unused_params_compiled,
)
from ._param import FSDPParam, UserChange
from ._per_block import forward_per_block
from ._param_group import FSDPParamGroup
from ._post_optim import PostOptimEvent
from ._state_dict import register_load_subtree_hook, register_state_dict_hooks
from ._torch_internals import (
    RegisterPostBackwardFunction,
    compiled_autograd,
    tree_flatten,
    tree_map,
)

if TYPE_CHECKING:
    from ._init import UnitOptions


class _InputGradsDone:
    """Called by torch's ``RegisterPostBackwardFunction`` when one forward's input
    gradients are complete. See [Note: When a unit's backward is done]."""

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
# Activation checkpointing reruns a unit's forward inside its backward (the unit is in
# PRE_BACKWARD while the engine runs). The pre- and post-forward then only make sure the
# unit is gathered and cast inputs and outputs as the first forward did: no reshard
# (the recompute's backward reads the parameters) and no hooks, as torch's FSDP2. A unit
# left in PRE_BACKWARD after a backward ended is finished by the next forward as usual.


# [Note: A unit's state and its group's backward]
# The unit's ``TrainingState`` lives on the ``FSDPState``; its group keeps
# ``in_backward`` (gradient work in flight, ``pre_backward`` to ``finish_backward``).
# They differ for a group with nothing to wait for, which finishes inside
# ``pre_backward`` while its unit stays ``PRE_BACKWARD`` until the backward is over, so
# other output hooks do not re-gather it and a recompute is still seen as backward. The
# unit goes ``IDLE`` when its group finishes (``_idle_if_group_done``), when its root
# finishes it, or at its next post-forward.


# [Note: Forward wrapper, not module hooks]
# Pre- and post-forward run inside the generated ``FSDP<Class>.forward``, not as module
# hooks: ``torch.compile(module)`` runs the top module's hooks outside dynamo, which
# would make two extra graphs around the forward graph.


# The attribute of a module's ``__dict__`` that holds its unit's state.
_STATE_ATTR = "_traceable_hsdp_state"


def state_of(module: nn.Module) -> FSDPState | None:
    """The state of the fully_shard unit ``module`` belongs to as one of its modules,
    or ``None``."""
    return module.__dict__.get(_STATE_ATTR)


def require_state(module: Any) -> FSDPState:
    """The fully_shard state of ``module``; ``RuntimeError`` if it has none."""
    state = state_of(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} has no fully_shard state")
    return state


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
        # Changed by FSDPModule.set_reshard_after_forward.
        self.reshard_after_forward = options.reshard_after_forward
        self.mp_policy = options.mp_policy
        self.is_root = True
        # For the root: every state in its subtree, itself included, in module order.
        self.states: list[FSDPState] = [self]
        self.training_state = TrainingState.IDLE
        # Set by compile_block; see [Note: Compiled per block] (_per_block.py).
        self.per_block = False
        self.is_last_backward = True  # root only: finish every unit after backward
        # Root only; see [Note: Manual backward finalization].
        self.manual_finalization = False
        self.reduction_pending = False  # finalize_backward(async_op=True) not waited
        self.iteration = 0  # bumped by reset_iter: invalidates a pending handle
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self._final_callback_queued = False
        # The outermost unit holding this one; itself while it is a root.
        self.root: FSDPState = self
        # Root only; see [Note: The post-optimizer event] (_post_optim.py).
        self.post_optim = PostOptimEvent(modules)
        self._hooked: set[int] = set()  # ids of the FSDPParams with a post-acc hook
        # Why fully_shard left parameters out of this unit, raised at its first
        # forward. See [Note: One unit per parameter] (_init.py).
        self.init_errors = init_errors
        # See [Note: A checkpoint around a unit's call] (_compile_checks.py).
        self.hf_checkpointing_modules = hf_checkpointing_modules(modules)
        # Where the root found this unit's modules (set by adopt_nested): the module
        # holding each, its path under the root, and the name it holds it by.
        self.slots: list[tuple[nn.Module, str, str]] = []
        # dp_mesh_dims with a non-data-parallel mesh dim of more than one rank (TP):
        # refused compiled. See [Note: The SPMD-mesh form] (_param.py).
        spmd = options.spmd
        self.spmd_model_parallel = spmd is not None and any(
            spmd.mesh.size(i) > 1
            for i in range(spmd.mesh.ndim)
            if i not in spmd.shard_dims and i not in spmd.replicate_dims
        )
        # Root only: the units of its tree that either can mark (set by adopt_nested).
        self.checkpoint_suspects: list[FSDPState] = []
        # Root only; see [Note: A compile region inside a unit].
        self._refuse_compile_regions: Callable[..., Any] | None = None
        if param_group is not None:
            self._register_post_acc_hooks()
            by_module: dict[nn.Module, list[tuple[str, FSDPParam]]] = {}
            for fp in param_group.fsdp_params:
                for info in fp.module_infos:
                    by_module.setdefault(info.module, []).append((info.param_name, fp))
            register_state_dict_hooks(self, by_module)
            hook_eager_recomputes(modules, by_module)
        register_load_subtree_hook(self)
        for m in modules:
            m.__dict__[_STATE_ATTR] = self

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
                        # See [Note: A checkpoint around a unit's call] (_compile_checks.py).
                        held.slots.append((sub, name, child_name))
        for s, names in paths.items():
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
        # See [Note: A compile region inside a unit] (_compile_checks.py).
        self._refuse_compile_regions = compile_region_refusal(regions)

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
        param_group = self.param_group
        assert param_group is not None
        for fp in param_group.trainable:
            if id(fp) not in self._hooked:
                self._hooked.add(id(fp))
                fp.register_post_accumulate_grad_hook(self._make_post_acc_hook(param_group, fp))

    # ------------------------------------------------- changes after fully_shard
    # See [Note: Changes after fully_shard] (_param.py).
    def _sync_user_changes(self) -> None:
        param_group = self.param_group
        if param_group is None:
            return
        changes = [fp.user_change() for fp in param_group.fsdp_params]
        # A compiled step follows a freeze without applying it (see the Note).
        if UserChange.OTHER in changes or (not compiling() and UserChange.FROZEN in changes):
            self._apply_user_changes()

    @torch._dynamo.disable(reason="traceable_hsdp: a parameter changed after fully_shard")
    def _apply_user_changes(self, check_device: bool = True) -> None:
        param_group = self.param_group
        if param_group is not None:
            if check_device:
                self._refuse_meta_params()
            param_group.reset_sharded_params(check_device)
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
        if self.spmd_model_parallel and compiling():
            # See [Note: The SPMD-mesh form] (_param.py).
            refuse_spmd_tp_compiled(f"Unit: {self.kind}.")
        if self.per_block and compiling():
            # See [Note: Compiled per block] (_per_block.py).
            return forward_per_block(self, orig_forward, args, kwargs)
        if (
            compiling()
            and not compiled_autograd.compiled_autograd_enabled
            and self.root._needs_backward()
        ):
            # See [Note: A unit compiled without compiled autograd] (_compile_checks.py).
            args, kwargs = pre_forward_untraced(self, args, kwargs)
            output = orig_forward(*args, **kwargs)
            return post_forward_untraced(self, output, (args, kwargs))
        args, kwargs = self._pre_forward(args, kwargs)
        output = orig_forward(*args, **kwargs)
        return self._post_forward(output, (args, kwargs))

    def _pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        param_group = self.param_group
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            # See [Note: Forward during the unit's backward].
            if param_group is not None and param_group.unshard_in_backward:
                param_group.unshard()  # no-op unless something resharded it since
                if not compiling():
                    # See [Note: The module holds the placeholder only in forward].
                    param_group.register_unsharded()
            return self._cast_inputs(args, kwargs)
        # A root checks its subtree; a unit called outside its root's forward, itself.
        for state in self.states if self.is_root else (self,):
            if state.init_errors:
                raise ValueError(state.init_errors[0])
        if self.is_root:
            self._root_pre_forward()
        self._sync_user_changes()
        self.training_state = TrainingState.FORWARD
        if param_group is not None:
            param_group.issue_unshard()
            for other in self.forward_prefetch:
                if other.param_group is not None:
                    other.param_group.issue_unshard()
            param_group.wait_for_unshard()
            param_group.register_unsharded()
        args, kwargs = self._cast_inputs(args, kwargs)
        if param_group is not None and torch.is_grad_enabled():
            args, kwargs = self._mark_input_grads(param_group, args, kwargs)
        return args, kwargs

    def _mark_input_grads(
        self, param_group: FSDPParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Aliases the forward inputs that require grad, to count their gradients.
        See [Note: When a unit's backward is done]."""
        counted = param_group.counts_input_grads
        if compiling():
            if counted:
                return _map_tensors((args, kwargs), self._hooked_alias)
            return args, kwargs
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if not inputs:
            return args, kwargs
        outputs = iter(RegisterPostBackwardFunction.apply(_InputGradsDone(self, counted), *inputs))
        if counted:
            param_group.input_grad_hooks += 1
        args, kwargs = _map_tensors((args, kwargs), lambda t: next(outputs) if t.requires_grad else t)
        assert next(outputs, None) is None, "_tensors and _map_tensors disagree on order"
        return args, kwargs

    def _hooked_alias(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh alias of ``t`` with a counting hook, if it requires grad. See
        [Note: When a unit's backward is done]."""
        if not t.requires_grad:
            return t
        if _traced_dtensor(t):
            alias = _hooked_dtensor(t, self._input_grad_hook)
        else:
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
                how = checkpointed_around(state)
                if how is not None:
                    refuse_checkpoint_around_unit(how)
        if (
            needs_backward
            and compiling()
            and self._refuse_compile_regions is not None
            and torch._dynamo.config.automatic_dynamic_shapes
        ):
            # See [Note: A compile region inside a unit] (_compile_checks.py).
            self._refuse_compile_regions()
        if self.post_optim.pending:
            # Only for a step compiled whole; see [Note: The post-optimizer event].
            self.post_optim.wait()
        if (
            needs_backward
            and compiled_autograd.compiled_autograd_enabled
            and any(
                s.param_group is not None and s.param_group.reduce_scatter_unused_params
                for s in self.states
            )
        ):
            # See [Note: Unused parameters] (_param_group.py).
            refuse_unused_params_compiled()
        # A compiled backward queues no final callback: finish what it left here.
        # See [Note: Hooks and compiled autograd].
        for state in self.states:
            if state.training_state is TrainingState.PRE_BACKWARD:
                # Only here: reading held gradients of every unit would add guards
                # that change between micro-batches (recompiles).
                held = [] if state.param_group is None else state.param_group.held_after_sync()
                if held:
                    refuse_held_after_sync(f"Parameters: {', '.join(held)}.")
                state._finish_backward()
        self._final_callback_queued = False

    def _where(self) -> str:
        """The unit's path under its root, for messages."""
        param_group = self.param_group
        if param_group is not None:
            return param_group.label
        return " ".join(type(m).__name__ for m in self.modules)

    # [Note: The default keeps the root gathered for backward]
    # ``reshard_after_forward=None`` (the default) keeps the root gathered after forward,
    # since its backward would re-gather at once, but only when a backward can follow:
    # under ``torch.no_grad``/``inference_mode`` the root reshards. torch's keeps it, so an
    # optimizer built from ``model.parameters()`` after an evaluation forward silently
    # steps the gathered copies; compiled, the next step would also recompile. Cost: an
    # evaluation loop re-gathers the root each forward. An explicit ``False`` keeps them.
    def _post_forward(self, output: Any, inputs: Any = ()) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD and _in_backward():
            # See [Note: Forward during the unit's backward].
            return self._cast_output(output)
        param_group = self.param_group
        if param_group is not None:
            raf = self.reshard_after_forward
            if raf is None:  # See [Note: The default keeps the root gathered for backward].
                raf = not (self.is_root and torch.is_grad_enabled())
            if raf is True:
                param_group.reshard()
            elif raf is False:
                # See [Note: The module holds the placeholder only in forward].
                if compiling():
                    param_group.register_sharded()
            else:  # an int: keep 1/raf for a smaller re-gather in backward
                param_group.post_forward_reshard()
            param_group.in_backward = False  # See [Note: A unit's state and its group's backward].
            param_group.open_calls.clear()  # See [Note: Output hooks after the unit's backward].
        self.training_state = TrainingState.IDLE
        output = self._cast_output(output)
        if torch.is_grad_enabled():
            output = self._register_pre_backward_hooks(output, inputs)
        return output

    # [Note: An output that is a view]
    # An in-place op on an output that is a view (``out += y`` after ``h.view(...)``, as
    # HF's OPT and timm's PatchEmbed do) re-bases the view's history: its hook never
    # runs and the backward reads freed placeholders (torch's fully_shard fails the same
    # way). The base keeps its history, so for an output that is a view of a tensor the
    # forward made, the unit also hooks the base; the two share a flag, and the base's
    # hook acts only if the view's did not run. tests/test_conformance.py: bitwise
    # against torch's fully_shard on the out-of-place form. Dynamo reads ``is_leaf``,
    # not ``grad_fn``, which it cannot trace.
    #
    # [Note: Output hooks after the unit's backward]
    # An output on no path to the unit's parameters (a T5 block's pass-through position
    # bias) can get its gradient after the unit's backward is over ([Note: When a unit's
    # backward is done] in _param_group.py); its hook would re-gather the unit for
    # nothing (and, compiled, recompile). So the hooks of one forward call share a flag:
    # the first to run records it on the group, the group's finish raises every flag it
    # recorded, and a hook whose flag is up does nothing. Each pipeline micro-batch's
    # forward has its own flag.
    def _register_pre_backward_hooks(self, output: Any, inputs: Any) -> Any:
        """See [Note: An output that is a view] and [Note: Output hooks after the
        unit's backward]. Returns ``output``, its traced DTensors replaced: see [Note:
        Hooks on DTensor activations, traced]."""
        call = [False]
        if compiling() and any(_traced_dtensor(t) for t in _tensors(output)):
            hook = functools.partial(self._output_pre_backward, call, None)
            output = _map_tensors(
                output, lambda t: _hooked_dtensor(t, hook) if _traced_dtensor(t) else t
            )
        input_bases: list[torch.Tensor] | None = None
        for t in _tensors(output):
            if not t.requires_grad or _traced_dtensor(t):
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
        return output

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
        param_group = self.param_group
        if call[0]:  # this call's backward is over for the unit
            # Unless a later backward runs its graph again (retain_graph=True): see
            # [Note: A second backward through a retained graph] (_param_group.py).
            if compiling() or param_group is None or not param_group.rearm_if_retained(call):
                return grad
        if param_group is not None and not any(c is call for c in param_group.open_calls):
            param_group.open_calls.append(call)
        return self._pre_backward(grad)

    # ----------------------------------------------------------------- backward
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # Runs once per output tensor; every step below is idempotent. Any unit queues
        # its root's final callback: a nested unit may run a backward of its own.
        root = self.root
        if not root._final_callback_queued:
            root._final_callback_queued = True
            _queue_final_callback(root._root_post_backward_final)
        param_group = self.param_group
        if (
            param_group is not None
            and not param_group.in_backward
            and self.training_state is not TrainingState.PRE_BACKWARD
        ):
            self.training_state = TrainingState.PRE_BACKWARD
            param_group.pre_backward()
            for other in self.backward_prefetch:
                if other.param_group is not None:
                    other.param_group.issue_unshard()
        return grad

    # [Note: Parameter hooks hold their unit weakly]
    # autograd keeps post-accumulate-grad hooks in C++, invisible to the garbage
    # collector, so a hook holding its unit strongly would keep every sharded model (and
    # its process groups, whose gloo threads can abort the process at exit: [Note:
    # Exiting with gloo worker threads] in ``_exit.py``) alive forever. The hook holds
    # its unit weakly and does nothing once it is gone. ``tests/test_runtime.py`` checks
    # that a dropped model is freed, eager and compiled.
    def _make_post_acc_hook(
        self, param_group: FSDPParamGroup, fp: Any
    ) -> Callable[[torch.Tensor], None]:
        """See [Note: Parameter hooks hold their unit weakly]."""
        state_ref, pg_ref, fp_ref = weakref.ref(self), weakref.ref(param_group), weakref.ref(fp)

        def hook(_param: torch.Tensor) -> None:
            state, param_group, fp = state_ref(), pg_ref(), fp_ref()
            if state is None or param_group is None or fp is None:
                return  # the unit was freed; its placeholder outlived it
            if param_group.reduce_scatter_unused_params and compiling():
                # A backward compiled without a compiled forward (the root's
                # pre-forward refuses the other cases). See [Note: Unused parameters].
                refuse_unused_params_compiled()
            param_group.post_accumulate_grad(fp)
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
            # Idle again, so the next forward sees the first one's state (no recompile).
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
    # backward iteration from the engine's final callback to ``finalize_backward()``, so
    # a schedule can run several backwards and reduce once. The root's callback then
    # does nothing and ``finalize_backward`` does what it does on the last backward.
    # ``async_op=True`` is complete on return (current-stream collectives); the handle's
    # ``wait()`` checks no ``reset_iter_state`` came between. Tested in
    # tests/test_backward_finalization.py and tests/test_pipelining.py.
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

# [Note: Activations in dataclasses]
# pytree does not flatten dataclasses; a missed output tensor gets no pre-backward
# hook. ``_tensors`` and ``_map_tensors`` look inside them, as torch's
# ``_apply_to_tensors`` does.


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


# [Note: Hooks on DTensor activations, traced]
# A unit's outputs (and, with a frozen parameter, its inputs) get gradient hooks. Under
# the SPMD-mesh form ([Note: The SPMD-mesh form] in _param.py) they are DTensors, and
# AOTAutograd has no rule for a hook on a DTensor (the ``trace_wrapped`` higher-order
# op of compiled autograd's hooks). So, traced, such a DTensor is replaced by a
# ``from_local`` of its ``to_local()`` with the hook on the plain local tensor, the
# gradient placements pinned to the DTensor's own (``grad_placements``): a gradient
# laid out as the activation passes through unchanged, any other is redistributed to
# that layout, value-preserving. Eagerly the hook goes on the DTensor itself, as
# torch's. tests/test_dp_mesh_dims.py: compiled bitwise equal to eager (aot_eager).


def _traced_dtensor(t: torch.Tensor) -> bool:
    """A DTensor that requires grad, while tracing. See [Note: Hooks on DTensor
    activations, traced]."""
    return t.requires_grad and compiling() and isinstance(t, DTensor)


def _hooked_dtensor(t: DTensor, hook: Callable[[torch.Tensor], torch.Tensor]) -> DTensor:
    """``t`` again, with ``hook`` on its local gradient. See [Note: Hooks on DTensor
    activations, traced]."""
    local = t.to_local()
    local.register_hook(hook)
    return DTensor.from_local(
        local,
        t.device_mesh,
        t.placements,
        shape=t.shape,
        stride=t.stride(),
        grad_placements=t.placements,
    )


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to every tensor, dataclasses shallow-copied. See
    [Note: Activations in dataclasses]."""

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
