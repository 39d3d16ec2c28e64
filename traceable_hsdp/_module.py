"""The ``FSDPModule`` mixin every unit's class gets, its methods, and the handles they
return (``UnshardHandle``, ``GradientReductionHandle``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from . import _custom_comm as custom_comm
from ._compiled_call import dispatch_compiled_call
from ._param_group import FSDPParamGroup
from ._state import FSDPState, require_state, state_of
from ._torch_view import TorchStateView

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle"]


# [Note: A subclass of torch's FSDPModule]
# The mixin subclasses torch's ``FSDPModule``, so code written against torch's FSDP2
# (``isinstance`` checks in torchtitan and accelerate, ``register_fsdp_forward_method``)
# recognises our units. Every public method is overridden (test_module_methods.py
# checks it), so none of torch's runtime runs on them. ``_get_fsdp_state()`` returns a
# ``TorchStateView`` with only the entries torch's helpers call. The view is also
# registered as ``fully_shard.state(module)`` (``expose_to_torch``), where
# torch.distributed.pipelining calls ``post_backward()`` and the root's final callback
# after the micro-batches (test_pipelining.py).


class FSDPModule(_TorchFSDPModule):
    """Mixin added to the class of every module passed to :func:`fully_shard`. A
    subclass of torch's ``FSDPModule`` whose methods are all ours; see [Note: A
    subclass of torch's FSDPModule]."""

    # FSDP<Orig>, this mixin, torch's FSDPModule, Orig; torch's __new__ reads it too
    # ([Note: Torch internals]).
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing FSDP<Orig>(...) (e.g. indexing a container module) builds Orig.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` for a unit: see [Note: A unit compiled in place]."""
        nn.Module.compile(self, *args, **kwargs)
        dispatch_compiled_call(self)

    def _get_fsdp_state(self) -> TorchStateView:
        """torch's private accessor, for its helpers ([Note: A subclass of torch's FSDPModule])."""
        return TorchStateView(require_state(self))

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gathers this unit's parameters into their placeholders and registers
        those, as before its forward. ``async_op`` (default ``False``: wait) returns an
        :class:`UnshardHandle` whose ``wait()`` (or the next forward) finishes it."""
        state = require_state(self)
        param_group = state.param_group
        if param_group is None:
            return UnshardHandle(None) if async_op else None
        param_group.issue_unshard()
        if async_op:
            return UnshardHandle(param_group)
        param_group.wait_for_unshard()
        param_group.register_unsharded()
        return None

    def reshard(self) -> None:
        """Frees this unit's unsharded parameters and registers the sharded ones."""
        state = require_state(self)
        if state.param_group is not None:
            state.param_group.reshard()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``model.to(...)``, ``to_empty(...)``: see [Note: Changes after fully_shard].
        self.reshard()
        # Past torch's FSDPModule, whose _apply reads torch's private state.
        out = super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        # Devices are checked at the next forward (a list unit's other modules may
        # not be converted yet).
        require_state(self)._apply_user_changes(check_device=False)
        return out

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether the next backwards reduce gradients; with ``False`` unsharded
        gradients accumulate until a backward with ``True`` reduces the sum.
        ``recurse`` (default ``True``) also sets every unit inside."""
        _set_on_groups(self, recurse, "reduce_grads", "requires_gradient_sync", requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the next forwards free the unsharded parameters after use (and
        re-gather them for backward). ``recurse`` (default ``True``) also sets every
        unit inside."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in _states(self, recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters when the unit's gradients
        are done. ``False`` keeps them for the next micro-batch; set ``True`` again
        before the last one (a kept copy goes stale at the optimizer step).
        ``recurse`` (default ``True``) also sets every unit inside."""
        _set_on_groups(
            self, recurse, "reshard_after_backward", "reshard_after_backward", reshard_after_backward
        )

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step (the root
        then finishes every unit); ``False`` keeps them gathered. Eager only."""
        _check_bool("is_last_backward", is_last_backward)
        require_state(self).is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: "list[FSDPModule]") -> None:
        """All-gathers of these units are issued in this unit's pre-forward (after its
        own), to overlap its forward. Raises ``TypeError`` for a non-fully_shard entry."""
        require_state(self).forward_prefetch = _prefetch_states(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: "list[FSDPModule]") -> None:
        """All-gathers of these units are issued in this unit's pre-backward, to
        overlap its backward. Raises ``TypeError`` for a non-fully_shard entry."""
        require_state(self).backward_prefetch = _prefetch_states(modules, "backward")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's gradients by ``factor`` after summing them over the
        data-parallel ranks, instead of averaging. This unit only, as torch's. Raises
        ``ValueError`` unless ``factor`` is a positive number."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}.")
        for state in _states(self, recurse=False):
            if state.param_group is not None:
                state.param_group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in torch)."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor.",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum in the collectives and divide locally (a gradient divide factor takes
        precedence). This unit only, as torch's."""
        _set_on_groups(self, False, "force_sum", "enable", enable)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces gradients over the replicas; with
        ``False`` they accumulate until the next backward with ``True``."""
        _set_on_groups(self, recurse, "all_reduce_grads", "requires_all_reduce", requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit re-gathers its parameters for backward (default
        ``True``). ``False`` suits a unit whose backward reads no parameter (an
        embedding); one that does fails loudly (the storage has size 0)."""
        _set_on_groups(self, False, "unshard_in_backward", "unshard_in_backward", unshard_in_backward)

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Calls ``hook`` on each of this unit's gradients once it is reduced, before
        division and accumulation; the hook may change it in place. Unlike torch's, it
        runs once per trainable parameter on its local shard. This unit only. See
        [Note: The all-reduce hook] in ``_param_group.py``.

        Args:
            hook: ``hook(reduced: torch.Tensor) -> None``; ``None`` removes it.
            stream: run the hook on this stream (default ``None``: the current
                one), a stream of the mesh's device; FSDP only, eager backward
                only. On a CPU mesh, a ``torch.cpu.Stream`` is the current stream
                while the hook runs, as in torch (CPU work is synchronous).

        Raises:
            TypeError: ``hook`` is not callable, or ``stream`` is not a stream.
            ValueError: ``stream`` with HSDP (a 2-D mesh), as in torch, or a
                stream of another device type than the mesh's.
        """
        if hook is not None and not callable(hook):
            raise TypeError(
                f"set_all_reduce_hook expects a callable hook(reduced: Tensor) -> None, got "
                f"{type(hook).__name__}."
            )
        state = require_state(self)
        param_group = state.param_group
        if stream is not None:
            if not isinstance(stream, (torch.Stream, torch.cuda.Stream, torch.cpu.Stream)):
                raise TypeError(
                    f"set_all_reduce_hook(stream=...) expects a torch.Stream (e.g. "
                    f"torch.cuda.Stream()), got {type(stream).__name__}."
                )
            if param_group is not None and param_group.mesh_info.replicate_mesh_dim is not None:
                raise ValueError("stream cannot be set when using native HSDP")  # torch's words
            if param_group is not None:
                device = param_group.mesh_info.device
                cpu = isinstance(stream, torch.cpu.Stream)
                stream_type = "cpu" if cpu else torch.device(stream.device).type
                if stream_type != device.type or (device.type == "cpu") != cpu:
                    raise ValueError(
                        f"set_all_reduce_hook(stream=...) got a {type(stream).__name__} on "
                        f"{stream_type} for a unit on {device.type}; pass "
                        f"torch.get_device_module({device.type!r}).Stream() or None."
                    )
        if param_group is not None:
            param_group.all_reduce_hook = hook
            param_group.all_reduce_hook_stream = stream if hook is not None else None

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Makes the root's next forward wait once for ``event`` (recorded after an
        optimizer step on another stream); ``None`` (a CPU stream's
        ``record_event()``) clears it. Eager and compiled; see [Note: The
        post-optimizer event]. Raises ``TypeError`` for anything else."""
        if event is not None and not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(
                "set_post_optim_event expects a torch.Event (or torch.cuda.Event) "
                f"recorded after the optimizer step, got {type(event).__name__}."
            )
        root = require_state(self).root
        if event is None:
            root.post_optim.clear()
        else:
            root.post_optim.set(event)

    def reset_iter_state(self) -> None:
        """Recovers from an exception that stopped a forward or backward midway: drops
        the all-gathers in flight and the unreduced gradients, reshards every unit and
        sets it idle (reduced ``.grad`` stays). Every rank must call it at the same
        point, on the root (else ``RuntimeError``)."""
        _require_root(self, "reset_iter_state").reset_iter()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' storage (torch 2.15's
        method): ``True`` keeps data pointers stable (for CUDA graphs) at the cost of
        the memory; ``False`` (default) frees it. ``recurse`` (default ``True``) also
        sets every unit inside."""
        _check_bool("keep", keep)
        for state in _states(self, recurse):
            if state.param_group is not None:
                for fp in state.param_group.fsdp_params:
                    fp.keep_storage = keep

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether the caller ends each backward iteration with
        :meth:`finalize_backward` (torch 2.15's method). See [Note: Manual backward
        finalization]. Raises ``RuntimeError`` off the root, or when the mode changes
        during a backward or with a reduction pending."""
        _check_bool("enabled", enabled)
        state = _require_root(self, "set_manual_backward_finalization")
        if enabled != state.manual_finalization:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    "set_manual_backward_finalization cannot change mode during backward"
                )
            if state.reduction_pending:
                raise RuntimeError(
                    "set_manual_backward_finalization cannot change mode while a gradient "
                    "reduction is pending: call wait() on its GradientReductionHandle first"
                )
        state.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """Ends the backward iteration under manual finalization (torch 2.15's
        method): reduces the kept gradients and reshards. ``async_op`` (default
        ``False``) returns a :class:`GradientReductionHandle`; the reduction is
        complete either way. Raises ``RuntimeError`` off the root, with manual
        finalization off, inside a backward, or with an earlier handle not waited on."""
        _check_bool("async_op", async_op)
        state = _require_root(self, "finalize_backward")
        state.finalize_backward()
        if not async_op:
            return None
        state.reduction_pending = True
        return GradientReductionHandle(state)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters that got no gradient join the reduction with zeros
        (default ``False``), so ranks that took different branches issue the same
        collectives. Eager backward only; see [Note: Unused parameters]. ``recurse``
        (default ``True``) also sets every unit inside."""
        _set_on_groups(
            self, recurse, "reduce_scatter_unused_params", "reduce_scatter_unused_params",
            reduce_scatter_unused_params,
        )

    # [Note: torch's communication tuning methods]
    # These tune torch's eager runtime. The comm objects (custom all-gather and
    # reduce-scatter, the process group's allocator) drive ours' eager collectives too
    # ([Note: Custom collectives] in _custom_comm.py). The side streams and symmetric
    # memory have no counterpart: every collective is a functional c10d op on the
    # current stream whose buffers Inductor or the eager op plan, so those raise
    # NotImplementedError naming what to use instead, or return quietly when asked for
    # what already happens.

    def set_custom_all_gather(self, comm: Any) -> None:
        """Issues this unit's eager all-gather through ``comm`` (torch's ``AllGather``).
        See :meth:`set_custom_reduce_scatter`."""
        _set_comm(self, "set_custom_all_gather", "all_gather_comm", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Issues this unit's eager reduce-scatter through ``comm`` (torch's
        ``ReduceScatter``: ``allocate`` and ``__call__``), with ``ReduceOp.SUM`` and an
        average divided after. A compiled step refuses a comm. See [Note: Custom
        collectives] in ``_custom_comm.py``.

        Raises:
            TypeError: ``comm`` has no ``allocate`` or is not callable.
            ValueError: the unit's parameters span meshes, as in torch.
        """
        _set_comm(self, "set_custom_reduce_scatter", "reduce_scatter_comm", comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Whether this unit's eager all-gather and reduce-scatter buffers come from
        the process group's allocator (when its backend has one, e.g. NCCL; else
        ``torch.empty``). A compiled step refuses ``True``. See [Note: Custom
        collectives] in ``_custom_comm.py``.

        Raises:
            TypeError: ``enable`` is not a bool.
            AssertionError: a custom comm is set, as in torch.
        """
        _check_bool("enable", enable)
        group = require_state(self).param_group
        if group is None:
            return
        for kind, comm in (("all gather", group.all_gather_comm),
                           ("reduce scatter", group.reduce_scatter_comm)):
            if custom_comm.is_custom(comm):
                raise AssertionError(  # torch's exception and words
                    "cannot call set_allocate_memory_from_process_group() when "
                    f"{kind} comm is custom: {type(comm).__name__}"
                )
        pg = group.mesh_info.mesh.get_group(group.mesh_info.shard_mesh_dim)
        group.all_gather_comm = custom_comm.ProcessGroupAllocAllGather(pg) if enable else None
        group.reduce_scatter_comm = (
            custom_comm.ProcessGroupAllocReduceScatter(pg) if enable else None
        )

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """torch's cap on reduce-scatter copy-in buffers in flight: checked (a
        positive int, else ``TypeError``/``ValueError``) and recorded, and changes
        nothing here (eagerly one buffer is in flight; traced, the overlap pass
        decides). ``recurse`` (default ``True``) also sets every unit inside."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}."
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}.")
        for state in _states(self, recurse):
            if state.param_group is not None:
                state.param_group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """``True`` raises ``NotImplementedError``; ``False`` does nothing."""
        _check_bool("enable", enable)
        if enable:
            _not_supported(
                "set_separate_reduce_scatter_group",
                "every collective runs on the current stream through the unit's mesh "
                "groups, whose names are baked into the compiled graphs; there is no "
                "reduce-scatter stream for a second process group to run on. For "
                "overlap use traceable_hsdp.passes (PassConfig(overlap=True)).",
            )

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Raises ``NotImplementedError`` ([Note: torch's communication tuning methods])."""
        _not_supported(
            "set_symm_mem_for_comm",
            "the all-gather output buffers are allocated by the compiled graph "
            "(Inductor) or the eager op, not by FSDP, so they cannot be put in "
            "symmetric memory from here. Bucketing and overlap are configured with "
            "traceable_hsdp.passes.",
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private switch to all-gather on the current stream, where ours
        always are: the argument is checked and nothing changes."""
        _check_bool("async_op", async_op)


def _set_comm(module: nn.Module, method: str, attr: str, comm: Any) -> None:
    """Sets the unit's comm ``attr`` after torch's checks of ``comm``."""
    group = require_state(module).param_group
    custom_comm.check_comm(
        method, comm, [] if group is None else [fp.mesh_info for fp in group.fsdp_params]
    )
    if group is not None:
        setattr(group, attr, comm)


def _not_supported(method: str, why: str) -> None:
    raise NotImplementedError(f"traceable_hsdp does not support FSDPModule.{method}: {why}")


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the unshard."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Waits for the all-gathers and fills the placeholders. Idempotent."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group.register_unsharded()
            self._group = None


# torch 2.15 adds the class; a handle of ours is an instance of torch's where it exists.
_TorchGradientReductionHandle: type = getattr(
    torch.distributed.fsdp, "GradientReductionHandle", object
)


class GradientReductionHandle(_TorchGradientReductionHandle):  # type: ignore[misc,valid-type]
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` ends the pending
    reduction ([Note: Manual backward finalization] in ``_state.py``)."""

    def __init__(self, state: FSDPState) -> None:
        self._state: FSDPState | None = state
        self._iteration = state.iteration

    def wait(self) -> None:
        """Releases the reduction (already complete). Idempotent; ``RuntimeError``
        once ``reset_iter_state`` invalidated the handle."""
        state = self._state
        if state is None:
            return
        if state.iteration != self._iteration:
            raise RuntimeError(
                "This gradient reduction handle was invalidated by reset_iter_state; "
                "the iteration's gradients were dropped."
            )
        state.reduction_pending = False
        self._state = None


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}.")


# The parameter-group flags the setters write (another name would be a typo).
_GroupFlag = Literal[
    "reduce_grads", "reshard_after_backward", "force_sum", "all_reduce_grads",
    "unshard_in_backward", "reduce_scatter_unused_params",
]
_GROUP_FLAGS = frozenset(get_args(_GroupFlag))


def _set_on_groups(module: Any, recurse: bool, attr: _GroupFlag, name: str, value: object) -> None:
    """Checks ``value`` is a bool and sets ``attr`` on this unit's group (and, with
    ``recurse``, on every unit's inside)."""
    if attr not in _GROUP_FLAGS:
        raise AssertionError(f"_set_on_groups: {attr!r} is not a parameter-group flag")
    _check_bool(name, value)
    for state in _states(module, recurse):
        if state.param_group is not None:
            assert isinstance(getattr(state.param_group, attr), bool), attr
            setattr(state.param_group, attr, value)


def _states(module: Any, recurse: bool) -> list[FSDPState]:
    root = require_state(module)
    if not recurse:
        return [root]
    out: list[FSDPState] = []
    for m in module.modules():
        s = state_of(m)
        if s is not None and s not in out:
            out.append(s)
    return out


def _prefetch_states(modules: Any, which: str) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"set_modules_to_{which}_prefetch expects a list of modules.")
    out = []
    for m in modules:
        s = state_of(m) if isinstance(m, nn.Module) else None
        if s is None:
            raise TypeError(
                f"set_modules_to_{which}_prefetch got a {type(m).__name__} that is not a "
                "fully_shard module; pass modules returned by fully_shard."
            )
        out.append(s)
    return out


def _require_root(module: Any, method: str) -> FSDPState:
    state = require_state(module)
    if not state.is_root:
        raise RuntimeError(
            f"{method} must be called on the root FSDP module; this "
            f"{type(module).__name__} is nested in another fully_shard unit. Call it on "
            "the outermost module fully_shard was applied to."
        )
    return state
