"""``fully_shard`` and the ``FSDPModule`` mixin.

``fully_shard`` is a short sequence of named steps, as torch's: check the modules and
the options into a ``UnitOptions`` (``_init.py``), collect the parameters
(``collect_params``), build the unit (``_build_unit``: one ``FSDPParam`` per
parameter, their ``FSDPParamGroup``, the ``FSDPState``), wire the tree
(``FSDPState.adopt_nested``), swap the classes (``_add_fsdp_class``), install the
global switches. ``hsdp()`` enters after the first step, through ``shard_unit``.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any, Literal, NoReturn, get_args, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import Shard

from . import _torch_internals
from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._common import compiling
from ._exit import track_meshes
from ._init import (
    CollectedParams,
    UnitOptions,
    check_grad_dtype,
    check_modules,
    collect_params,
    mark_managed,
    post_forward_info,
    unit_options,
)
from ._param import FSDPParam
from ._param_group import FSDPParamGroup
from ._state import FSDPState, marks_compile_region, state_of
from ._torch_internals import compiled_autograd, internal_error, resolve
from .passes import track_unit_options

__all__ = [
    "fully_shard",
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


# [Note: A subclass of torch's FSDPModule]
# Our mixin subclasses ``torch.distributed.fsdp.FSDPModule``, so code written against
# torch's FSDP2 recognises our units: ``isinstance(m, FSDPModule)`` in user loops,
# torchtitan and accelerate, and torch's public helpers that check it, such as
# ``torch.distributed.fsdp.register_fsdp_forward_method`` (a silent no-op on a module
# that is not one, which left a method reading sharded parameters). Every public method
# of torch's class is overridden here (tests/test_module_methods.py checks it), so none of
# torch's runtime runs on our units. torch's helpers that go further reach the unit's
# state through the private ``_get_fsdp_state()``; it returns a ``TorchStateView``
# that offers the two entries torch's ``register_fsdp_forward_method`` calls
# (``_pre_forward`` and ``_post_forward``, with torch's signatures) and raises an
# ``AttributeError`` naming the attribute and the way out for any other (torch's
# ``share_comm_ctx``, ``FSDPMemTracker``).
#
# torch.distributed.pipelining treats a stage whose module is an ``FSDPModule`` as
# FSDP: it runs every micro-batch's backward with gradient sync and resharding off,
# then, in its gradient-reduction step, fetches the state with torch's own
# ``fully_shard.state(module)`` and calls ``post_backward()`` on each parameter group
# and ``_root_post_backward_final_callback()`` on the root. So the view is also
# registered where torch's ``fully_shard.state`` looks (``_expose_to_torch``), and
# offers those three entries: a group's ``post_backward`` is the group's own
# ``end_of_backward`` (it reduces the gradients the micro-batches kept), the root's
# callback is our root's end-of-backward (which then frees the units, the last
# backward being flagged).
# tests/test_pipelining.py checks a 2-stage x 2-way FSDP schedule against one process.


class TorchStateView:
    """What ``FSDPModule._get_fsdp_state()`` and torch's ``fully_shard.state``
    return for our units: a unit's state seen through the entries of torch's FSDP
    state that torch's public helpers and pipelining call. See [Note: A subclass of
    torch's FSDPModule]."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self._state._pre_forward(args, kwargs)

    def _post_forward(self, module: nn.Module, input: Any, output: Any) -> Any:
        return self._state._post_forward(output, (input, {}))

    @property
    def _state_ctx(self) -> _TorchStateCtxView:
        return _TorchStateCtxView([TorchStateView(s) for s in self._state.root.states])

    @property
    def _fsdp_param_groups(self) -> list[_TorchGroupView]:
        pg = self._state.param_group
        return [] if pg is None else [_TorchGroupView(pg)]

    def _root_post_backward_final_callback(self) -> None:
        self._state.root._root_post_backward_final()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"traceable_hsdp: {name!r} is an attribute of torch's private FSDP state, "
            "which a traceable_hsdp unit does not have: its state is its own. Code that "
            "reads torch's FSDP internals (torch.distributed.fsdp.share_comm_ctx, "
            "FSDPMemTracker) does not work on traceable_hsdp units; the view offers "
            "only what torch's register_fsdp_forward_method and pipelining call. Use "
            "traceable_hsdp's public API instead "
            "(traceable_hsdp.share_comm_ctx, traceable_hsdp.fully_shard.state(module)); "
            "see docs/api.md."
        )


class _TorchStateCtxView:
    """torch's ``FSDPStateContext`` as pipelining reads it: ``all_states``."""

    def __init__(self, all_states: list[TorchStateView]) -> None:
        self.all_states = all_states


class _TorchGroupView:
    """A parameter group as pipelining's gradient-reduction step calls it."""

    def __init__(self, group: FSDPParamGroup) -> None:
        self._group = group

    def post_backward(self) -> None:
        """Reduces the gradients the micro-batches kept (gradient sync is on again)."""
        self._group.end_of_backward()


def _expose_to_torch(modules: list[nn.Module], state: FSDPState) -> None:
    """Makes torch's ``fully_shard.state(module)`` return the unit's view, for
    torch.distributed.pipelining, and marks the modules as fully_shard's in torch's
    registry of composable APIs, which torch's ``replicate()`` reads to leave
    fully_shard's parameters alone (without it, it turned our sharded parameters into
    plain ones and handed them to DDP). See [Note: A subclass of torch's FSDPModule]."""
    contract = "torch.distributed._composable.contract."
    state_key, registry_key = resolve(contract + "STATE_KEY"), resolve(contract + "REGISTRY_KEY")
    registry_item = resolve(contract + "RegistryItem")
    # torch's contract keys the state by the function it wraps. Read from the module
    # that defines it: users switch a library that calls torch's public name (HF
    # accelerate) by patching that name with ours, and ours wraps nothing.
    key = resolve("torch.distributed.fsdp._fully_shard._fully_shard.fully_shard.__wrapped__")
    view = TorchStateView(state)
    for m in modules:
        m.__dict__.setdefault(state_key, {})[key] = view
        m.__dict__.setdefault(registry_key, {})["fully_shard"] = registry_item()


class FSDPModule(_TorchFSDPModule):
    """Mixin added to the class of every module passed to :func:`fully_shard`. A
    subclass of torch's ``FSDPModule`` whose methods are all ours; see [Note: A
    subclass of torch's FSDPModule]."""

    # The generated class's MRO: FSDP<Orig>, this mixin, torch's FSDPModule, Orig.
    # torch's FSDPModule.__new__ reads it too: an entry of [Note: Torch internals],
    # checked by _torch_internals.install().
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing FSDP<Orig>(...) (e.g. indexing a container module) builds Orig.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` (compiles this module's call in place), for a unit:
        see [Note: A unit compiled in place]."""
        nn.Module.compile(self, *args, **kwargs)
        _dispatch_compiled_call(self)

    def _get_fsdp_state(self) -> TorchStateView:
        """torch's private accessor, for torch's helpers that call it (see [Note: A
        subclass of torch's FSDPModule]). Our own code uses ``fully_shard.state``."""
        return TorchStateView(_require_state(self))

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gathers this unit's parameters into their unsharded placeholders and
        registers those on the modules, as before its forward.

        Args:
            async_op: if ``True``, issue the all-gathers and return a handle whose
                ``wait()`` finishes the unshard (the next forward also waits for it);
                default ``False`` waits before returning.

        Returns:
            An :class:`UnshardHandle` when ``async_op``, else ``None``.
        """
        state = _require_state(self)
        pg = state.param_group
        if pg is None:
            return UnshardHandle(None) if async_op else None
        pg.issue_unshard()
        if async_op:
            return UnshardHandle(pg)
        pg.wait_for_unshard()
        pg.register_unsharded()
        return None

    def reshard(self) -> None:
        """Frees this unit's unsharded parameters and registers the sharded ones."""
        state = _require_state(self)
        if state.param_group is not None:
            state.param_group.reshard()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``model.to(dtype)``, ``to_empty(device=...)``, ``.double()``: nn.Module's
        # _apply converts the sharded DTensors; the unit then follows them. See
        # [Note: Changes after fully_shard] in _param.py.
        self.reshard()
        # The original class's _apply, past torch's FSDPModule (whose _apply would
        # read torch's private state).
        out = super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        # Devices are checked at the next forward: in a list unit, the other
        # modules may not be converted yet.
        _require_state(self)._apply_user_changes(check_device=False)
        return out

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether the next backwards reduce gradients. With ``False``, unsharded
        gradients accumulate on the placeholders across backwards (gradient
        accumulation without communication); the first backward with ``True``
        reduces the accumulated sum. For HSDP it covers the reduce-scatter and the
        all-reduce together.

        Args:
            requires_gradient_sync: reduce gradients (``True``) or accumulate them
                unsharded (``False``).
            recurse: also set it on every fully_shard unit inside this module
                (default ``True``).
        """
        _set_on_groups(self, recurse, "reduce_grads", "requires_gradient_sync", requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the next forwards free the unsharded parameters after use (and
        re-gather them for backward).

        Args:
            reshard_after_forward: the new setting.
            recurse: also set it on every fully_shard unit inside (default ``True``).
        """
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in _states(self, recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters when the unit's gradients
        are done. ``False`` keeps them gathered for the next micro-batch's forward;
        set it back to ``True`` before the last micro-batch (the optimizer step
        changes the sharded parameters, and a kept unsharded copy would be stale).

        Args:
            reshard_after_backward: the new setting.
            recurse: also set it on every fully_shard unit inside (default ``True``).
        """
        _set_on_groups(
            self, recurse, "reshard_after_backward", "reshard_after_backward", reshard_after_backward
        )

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. On the
        last backward the root finishes every unit (frees what backward left
        gathered); with ``False`` it leaves them as they are, for micro-batching.
        Eager only: a compiled backward finishes each unit when its last gradient is
        reduced (see docs/compile.md)."""
        _check_bool("is_last_backward", is_last_backward)
        _require_state(self).is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: "list[FSDPModule]") -> None:
        """All-gathers of these units are issued in this unit's pre-forward (after its
        own), so they overlap this unit's forward; each waits in its own pre-forward.

        Raises:
            TypeError: an entry is not a fully_shard module.
        """
        _require_state(self).forward_prefetch = _prefetch_states(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: "list[FSDPModule]") -> None:
        """All-gathers of these units are issued in this unit's pre-backward, so they
        overlap this unit's backward.

        Raises:
            TypeError: an entry is not a fully_shard module.
        """
        _require_state(self).backward_prefetch = _prefetch_states(modules, "backward")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's gradients by ``factor`` after summing them over the
        data-parallel ranks, instead of averaging (the default divides by the number
        of ranks). This unit only, as torch's (no ``recurse``): call it on each unit
        that should use the factor.

        Raises:
            ValueError: ``factor`` is not a positive number.
        """
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
        """Sum in the collectives and divide by the number of data-parallel ranks
        locally, instead of averaging in the collectives (same result up to
        rounding). An explicit gradient divide factor takes precedence. This unit
        only, as torch's (no ``recurse``)."""
        _set_on_groups(self, False, "force_sum", "enable", enable)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces gradients over the replicas. With
        ``False`` the reduce-scatter still runs and the shard-reduced gradients
        accumulate locally; the next backward with ``True`` all-reduces the sum.
        Nothing changes on a 1-D mesh."""
        _set_on_groups(self, recurse, "all_reduce_grads", "requires_all_reduce", requires_all_reduce)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit re-gathers its parameters for backward (default
        ``True``). ``False`` saves the re-gather for a unit whose backward does not
        read its parameters, e.g. an embedding: its weight gradient needs only the
        indices and the output gradient. A backward that does read a parameter that
        was not re-gathered fails loudly (its storage has size 0)."""
        _set_on_groups(self, False, "unshard_in_backward", "unshard_in_backward", unshard_in_backward)

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Calls ``hook`` on each of this unit's gradients once it is reduced (the
        reduce-scatter output for FSDP, the all-reduce output for HSDP), before it is
        divided by a gradient divide factor and accumulated into the sharded
        parameter's ``.grad``; the hook may change it in place. Unlike torch, which
        calls it once per unit on a flat buffer, it is called once per trainable
        parameter, on that parameter's local shard in ``reduce_dtype``. Eager and
        compiled (the hook is traced into the backward graph). Applies to this unit
        only, as torch's. See [Note: The all-reduce hook] in ``_param_group.py``.

        Args:
            hook: ``hook(reduced: torch.Tensor) -> None``; ``None`` removes it.
            stream: run the hook on this stream (default ``None``: the current
                one). FSDP on an accelerator mesh, eager backward only.

        Raises:
            TypeError: ``hook`` is not callable, or ``stream`` is not a stream.
            ValueError: ``stream`` with HSDP (a 2-D mesh), as in torch, or on a
                mesh whose device has no streams (CPU), or on another device type.
        """
        if hook is not None and not callable(hook):
            raise TypeError(
                f"set_all_reduce_hook expects a callable hook(reduced: Tensor) -> None, got "
                f"{type(hook).__name__}."
            )
        state = _require_state(self)
        pg = state.param_group
        if stream is not None:
            if not isinstance(stream, (torch.Stream, torch.cuda.Stream)):
                raise TypeError(
                    f"set_all_reduce_hook(stream=...) expects a torch.Stream (e.g. "
                    f"torch.cuda.Stream()), got {type(stream).__name__}."
                )
            if pg is not None and pg.mesh_info.replicate_mesh_dim is not None:
                raise ValueError(
                    "stream cannot be set when using native HSDP (a 2-D mesh): the hook "
                    "runs after the all-reduce, on the current stream. Pass stream=None."
                )
            if pg is not None:
                device = pg.mesh_info.device
                stream_type = torch.device(stream.device).type
                if device.type == "cpu" or stream_type != device.type:
                    raise ValueError(
                        f"set_all_reduce_hook(stream=...) got a {stream_type} stream for "
                        f"a unit on {device.type}; the stream must be on the mesh's "
                        "accelerator (a CPU mesh has no streams: pass stream=None)."
                    )
        if pg is not None:
            pg.all_reduce_hook = hook
            pg.all_reduce_hook_stream = stream if hook is not None else None

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Makes the root's next forward wait for ``event`` (recorded after the
        optimizer step): the current stream waits on it (``event.wait()``) before
        the root's pre-forward, once; then the event is dropped, so set a new one
        each iteration. Our all-gathers run on the current stream and so follow the
        optimizer step anyway; the wait is for an optimizer that ran on another
        stream. Works with a compiled model too (the wait runs outside the graph).
        Called on a nested unit, it sets the event of that unit's root. See
        [Note: The post-optimizer event] in ``_state.py``.

        Args:
            event: a ``torch.Event`` (or ``torch.cuda.Event``), or ``None``: what
                ``torch.cpu.current_stream().record_event()`` returns (the CPU has no
                events; CPU work is ordered already), which clears an event set
                before and waits for nothing.

        Raises:
            TypeError: ``event`` is neither an event nor ``None``.
        """
        if event is not None and not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(
                "set_post_optim_event expects a torch.Event (or torch.cuda.Event) "
                f"recorded after the optimizer step, got {type(event).__name__}."
            )
        root = _require_state(self).root
        if event is None:
            root.clear_post_optim_event()
        else:
            root.set_post_optim_event(event)

    def reset_iter_state(self) -> None:
        """Recovers from an exception that stopped a forward or backward midway:
        waits for and drops the all-gathers in flight, reshards every unit (the
        modules hold their sharded parameters again), drops the gradients the
        failed iteration left unreduced (unsharded gradients, those kept by
        ``set_requires_gradient_sync(False)`` or ``set_reduce_scatter_unused_params``,
        HSDP gradients not yet all-reduced) and sets every unit idle, so the next
        iteration runs normally. Gradients already reduced into the sharded
        parameters' ``.grad`` stay: call ``optimizer.zero_grad()`` to drop them. Every
        rank must raise at the same point and call it (as for any collective).

        Raises:
            RuntimeError: called on a unit that is not the root (the outermost
                ``fully_shard`` module).
        """
        _require_root(self, "reset_iter_state").reset_iter()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' storage (torch 2.15's
        method). ``True`` keeps each placeholder's full-size storage allocated across
        reshard and unshard, so its data pointer stays the same (what CUDA graph
        capture needs), at the cost of holding the unsharded parameters; the next
        unshard refills it. ``False`` (a unit's default) frees it at every reshard.
        Eager and compiled alike (a compiled graph that sees the change recompiles).

        Args:
            keep: keep the storage (``True``) or free it (``False``).
            recurse: also set it on every fully_shard unit inside (default ``True``).
        """
        _check_bool("keep", keep)
        for state in _states(self, recurse):
            if state.param_group is not None:
                for fp in state.param_group.fsdp_params:
                    fp.keep_storage = keep

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """Whether the caller ends each backward iteration with
        :meth:`finalize_backward` (torch 2.15's method). When enabled, the end of a
        backward neither reduces the gradients a unit kept nor reshards what backward
        left gathered, whatever ``set_is_last_backward`` says; ``finalize_backward``
        does both. torch.distributed.pipelining (2.15) uses it for its micro-batches.
        See [Note: Manual backward finalization] in ``_state.py``.

        Raises:
            RuntimeError: called on a unit that is not the root, or, to change the
                mode, during a backward or while a finalization is pending.
        """
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
        method): reduces the gradients the units kept and reshards them as
        ``set_reshard_after_backward`` says. Call it on the root after every
        backward of the iteration, with gradient sync on again. See [Note: Manual
        backward finalization] in ``_state.py``.

        Args:
            async_op: return a :class:`GradientReductionHandle` to ``wait()`` on
                (default ``False`` returns ``None``). The reduction is complete when
                it returns either way: our collectives run on the current stream.

        Raises:
            RuntimeError: not the root; manual finalization is off; called inside a
                backward; a previous ``async_op`` handle was not waited on.
        """
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
        """Whether parameters that got no gradient in a backward still join the
        gradient reduction, with zeros, so ranks that took different branches
        (mixture of experts, multi-modal models) issue the same collectives. A unit
        with it on reduces all its trainable parameters together at the end of the
        backward, in a fixed order; its unsharded gradients are kept until then.
        Eager backward only: a compiled backward with it on is refused with a
        ``RuntimeError``. See [Note: Unused parameters] in ``_param_group.py``.

        Args:
            reduce_scatter_unused_params: the new setting (default of a unit:
                ``False``).
            recurse: also set it on every fully_shard unit inside (default ``True``).
        """
        _set_on_groups(
            self, recurse, "reduce_scatter_unused_params", "reduce_scatter_unused_params",
            reduce_scatter_unused_params,
        )

    # [Note: torch's communication tuning methods]
    # The seven methods below tune torch's eager runtime: its communication objects,
    # staging buffers, streams and process groups. Here every collective is a
    # functional c10d op on the current stream, traced into the compiled graphs, and
    # its buffers are the graph's (Inductor plans them) or the eager op's: there is no
    # Comm object, staging buffer, copy-in buffer or side stream for them to act on.
    # They exist with torch's signatures and raise NotImplementedError naming what to
    # use instead; those whose argument asks for what already happens (turning an
    # option off) return quietly.

    def set_custom_all_gather(self, comm: Any) -> None:
        """Not supported: raises ``NotImplementedError``. See [Note: torch's
        communication tuning methods]."""
        _not_supported(
            "set_custom_all_gather",
            "the all-gathers are functional c10d ops traced into the compiled graphs, "
            "and their output buffers are allocated by the graph, so a custom AllGather "
            "(which allocates and issues the collective eagerly) has no place to run. "
            "To change how all-gathers are grouped, use traceable_hsdp.passes "
            "(PassConfig(bucket_all_gathers=..., bucket_cap_mb=...)).",
        )

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Not supported: raises ``NotImplementedError``. See [Note: torch's
        communication tuning methods]."""
        _not_supported(
            "set_custom_reduce_scatter",
            "the reduce-scatters are functional c10d ops traced into the compiled "
            "graphs, and their buffers are allocated by the graph, so a custom "
            "ReduceScatter has no place to run. To change how reduce-scatters are "
            "grouped, use traceable_hsdp.passes (PassConfig(bucket_reduce_scatters=..., "
            "bucket_cap_mb=...)); for a custom reduction after the collective, "
            "set_all_reduce_hook.",
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not supported with ``True``: raises ``NotImplementedError``; ``False`` (what
        happens anyway) does nothing. See [Note: torch's communication tuning
        methods]."""
        _check_bool("enable", enable)
        if enable:
            _not_supported(
                "set_allocate_memory_from_process_group_for_comm",
                "there are no FSDP staging buffers: collective inputs and outputs are "
                "ordinary tensors of the compiled graph, whose memory Inductor plans (or "
                "of the eager ops). Bucketing (traceable_hsdp.passes, bucket_cap_mb) "
                "controls how large the collective buffers are.",
            )

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Not supported: raises ``NotImplementedError`` (``TypeError``/``ValueError``
        first for a value torch would refuse). See [Note: torch's communication
        tuning methods]."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}."
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}.")
        _not_supported(
            "set_reduce_scatter_max_input_buffers",
            "there is no reduce-scatter copy-in buffer to recycle and no separate "
            "reduce-scatter stream: the reduce-scatters run on the current stream and "
            "Inductor plans their buffers. For overlap use traceable_hsdp.passes "
            "(PassConfig(overlap=True) waits for each reduce-scatter only before the next "
            "one), and bucket_cap_mb for the buffer size.",
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Not supported with ``True``: raises ``NotImplementedError``; ``False`` (what
        happens anyway) does nothing. See [Note: torch's communication tuning
        methods]."""
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
        """Not supported: raises ``NotImplementedError``. See [Note: torch's
        communication tuning methods]."""
        _not_supported(
            "set_symm_mem_for_comm",
            "the all-gather output buffers are allocated by the compiled graph "
            "(Inductor) or the eager op, not by FSDP, so they cannot be put in "
            "symmetric memory from here. Bucketing and overlap are configured with "
            "traceable_hsdp.passes.",
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's private switch that issues the pre-forward and pre-backward
        all-gathers with ``async_op=True`` so that their buffers are allocated on
        the current stream. Ours always are (every collective runs on the current
        stream), and prefetching stays as configured, so both values leave the
        behaviour as it is; the argument is checked. See [Note: torch's
        communication tuning methods]."""
        _check_bool("async_op", async_op)


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
    reduction. See [Note: Manual backward finalization] in ``_state.py``."""

    def __init__(self, state: FSDPState) -> None:
        self._state: FSDPState | None = state
        self._iteration = state.iteration

    def wait(self) -> None:
        """Releases the reduction (already complete). Idempotent.

        Raises:
            RuntimeError: ``reset_iter_state`` invalidated this handle.
        """
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


# The parameter group's flags the public setters write; a name outside this set is a
# typo that would otherwise create a new attribute and change nothing.
_GroupFlag = Literal[
    "reduce_grads", "reshard_after_backward", "force_sum", "all_reduce_grads",
    "unshard_in_backward", "reduce_scatter_unused_params",
]
_GROUP_FLAGS = frozenset(get_args(_GroupFlag))


def _set_on_groups(module: Any, recurse: bool, attr: _GroupFlag, name: str, value: object) -> None:
    """The boolean setters' one body: checks that ``value`` (the argument ``name``)
    is a bool, then sets ``attr`` of this unit's parameter group to it, and with
    ``recurse`` of every unit's inside too."""
    if attr not in _GROUP_FLAGS:
        raise AssertionError(f"_set_on_groups: {attr!r} is not a parameter-group flag")
    _check_bool(name, value)
    for state in _states(module, recurse):
        if state.param_group is not None:
            assert isinstance(getattr(state.param_group, attr), bool), attr
            setattr(state.param_group, attr, value)


def _states(module: Any, recurse: bool) -> list[FSDPState]:
    root = _require_state(module)
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


def _require_state(module: Any) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} has no fully_shard state")
    return state


def _require_root(module: Any, method: str) -> FSDPState:
    state = _require_state(module)
    if not state.is_root:
        raise RuntimeError(
            f"{method} must be called on the root FSDP module; this "
            f"{type(module).__name__} is nested in another fully_shard unit. Call it on "
            "the outermost module fully_shard was applied to."
        )
    return state


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shards ``module``'s parameters over ``mesh`` and makes its forward and backward
    gather and reduce them, eagerly or inside ``torch.compile`` graphs.

    A drop-in for ``torch.distributed.fsdp.fully_shard``: call it on each block, then
    on the root. The module's class is extended with :class:`FSDPModule`; its
    parameters become ``DTensor``s sharded on dim 0 (uneven sizes are padded in the
    collectives).

    Args:
        module: a module, or a list of modules sharded together as one unit.
        mesh: a 1-D ``DeviceMesh`` (FSDP) or a 2-D one (replicate, shard) for HSDP.
            Default ``None``: a 1-D mesh over the default process group. For a
            model already distributed by ``parallelize_module`` over
            ``world_mesh["tp"]``, pass ``world_mesh["dp"]`` (see [Note: FSDP x TP]
            in ``_param.py``).
        reshard_after_forward: ``True`` frees the unsharded parameters after forward
            and re-gathers them for backward; ``False`` keeps them from forward to
            backward. ``None`` (the default, as torch 2.13's): ``False`` for the root
            unit (its backward comes first; after a forward without grad it reshards
            too), ``True`` for the others. An int k dividing the shard group's size
            keeps 1/k of each parameter per rank after forward and re-gathers over
            groups of k ranks for backward.
        shard_placement_fn: called with each managed parameter; returns the
            ``Shard(dim)`` to shard it on, or ``None`` for ``Shard(0)`` (default
            ``None``: every parameter on dim 0), or torch's
            ``ShardPlacementResult(placement, mesh_info)`` to shard it over another
            mesh than ``mesh``.
        mp_policy: dtypes for the gathered parameters, the gradient reduction and
            the outputs (default full precision). torch's own policy object is
            accepted too.
        offload_policy: ``OffloadPolicy()`` (default, no offload) or
            ``CPUOffloadPolicy(pin_memory=True)``: sharded parameters and gradients
            live on the CPU and are copied to the mesh's device for the all-gather.
        ignored_params: parameters left alone (neither sharded nor reduced).
        dp_mesh_dims: torch 2.13's SPMD-mesh form (``DataParallelMeshDims``:
            parameters already ``DTensor``s on the full mesh, ``mesh`` that full mesh)
            is not supported: only ``None`` is accepted. The same layout is
            expressed with the TP submesh and the DP submesh; see Raises.

    Returns:
        The same module (or list), its class now a subclass of ``FSDPModule``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (or list of them), or ``mesh``
            is not a ``DeviceMesh``.
        ValueError: a mesh of 3 or more dims; a parameter on another device than the
            mesh's (meta parameters are accepted: shard first, then
            ``module.to_empty(device=...)`` and initialize); a 0-dim parameter;
            unsupported option values; a ``DTensor`` parameter whose mesh does not
            combine with ``mesh`` or whose placements are not Shard/Replicate.
        NotImplementedError: a ``DTensor`` parameter with HSDP (a 2-D ``mesh``), or
            with an int ``reshard_after_forward``; ``dp_mesh_dims`` other than ``None``.
    """
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims={dp_mesh_dims!r}): torch's SPMD-mesh form "
            "(parameters already DTensors on the full mesh) is not supported by "
            "traceable_hsdp. Express the same layout with submeshes: distribute the "
            "parameters over the non-data-parallel dims only (parallelize_module(model, "
            "world_mesh['tp'], plan)), then fully_shard(block, "
            "mesh=world_mesh['dp']) with the data-parallel submesh. See docs/api.md, "
            "FSDP x TP."
        )
    modules = check_modules(module)
    options = unit_options(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
    )
    _shard(modules, options)
    return module


def _state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``, as torch's: the unit's state object, or ``None``
    for a module fully_shard was not applied to. Its attributes are ours, not torch's
    (``param_group``, ``training_state``, ``is_root``)."""
    return state_of(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]


def shard_unit(module: nn.Module | list[nn.Module], options: UnitOptions) -> Any:
    """Internal: :func:`fully_shard` with options already checked, for ``hsdp()``
    (``_hsdp.py``), which builds :class:`~traceable_hsdp._init.UnitOptions` with what
    fully_shard's arguments cannot say (replicated parameters, kept storage, the
    unit's pass options). Not public API. See [Note: Unit options] in ``_init.py``.

    Returns:
        ``module``, as :func:`fully_shard` does.
    """
    _shard(check_modules(module), options)
    return module


def _shard(modules: list[nn.Module], options: UnitOptions) -> FSDPState:
    """fully_shard's steps after its arguments are checked: collect the parameters,
    build the unit, wire the tree, swap the classes (and route a call compiled in
    place), install the global switches."""
    collected = collect_params(modules, options)
    state = _build_unit(modules, collected, options)
    # See [Note: Exiting with gloo worker threads] (_exit.py).
    track_meshes(options.mesh, *(info.mesh for _, info in collected.placements.values()))
    state.adopt_nested()
    _expose_to_torch(modules, state)
    for m in modules:
        _add_fsdp_class(m)
        _dispatch_compiled_call(m)  # See [Note: A unit compiled in place].
    # Every process-wide change to torch (the passes and the switches of [Note: Global
    # switches], the FX graph cache keys, dynamo's side-effect messages, compiled
    # autograd's hook ordering, the exit hook, the optimizer check), each entry
    # checked first; undone by _torch_internals.undo(). See [Note: Torch internals].
    _torch_internals.install()
    from .debug._dump_env import start_from_env

    start_from_env()  # TRACEABLE_HSDP_DUMP; see [Note: The dump switch] (_dump_env.py)
    return state


def _build_unit(
    modules: list[nn.Module], collected: CollectedParams, options: UnitOptions
) -> FSDPState:
    """One FSDPParam per collected parameter (each replaces the original on its
    modules by the sharded DTensor), their group, and the unit's state, attached to
    ``modules``. A list is one unit, labelled by its first module's class."""
    raf = options.reshard_after_forward
    post_forward = None
    if raf is not None and not isinstance(raf, bool):
        for p in collected.params:
            if collected.placements[p][1] != options.mesh_info:
                raise NotImplementedError(
                    f"reshard_after_forward={raf} (an int) with parameter "
                    f"{collected.where[p][0][0]!r} sharded over another mesh "
                    f"({collected.placements[p][1].mesh}, from shard_placement_fn) than "
                    "the unit's: the smaller re-gather groups are built from the unit's "
                    "mesh. Use reshard_after_forward=True or False for this unit."
                )
        post_forward = post_forward_info(options.mesh_info, raf)
    where = collected.where
    for p in collected.params:
        check_grad_dtype(p, where[p][0][0], options.mp_policy)
    fsdp_params = [
        FSDPParam(
            p,
            where[p][0][0],
            [info for _, info in where[p]],
            collected.placements[p][1],
            options.mp_policy.resolve_for_param(p, where[p][0][0]),
            shard_dim=collected.placements[p][0],
            offload=options.offload,
            replicate=options.replicate is not None and options.replicate(p),
            keep_storage=options.keep_storage,
            post_forward=post_forward,
        )
        for p in collected.params
    ]
    label = type(modules[0]).__name__
    for p, fp in zip(collected.params, fsdp_params):
        mark_managed(p, fp.sharded_param, f"{fp.fqn!r} of the fully_shard unit {label}", label)
    group = None
    if fsdp_params:
        group = FSDPParamGroup(fsdp_params, options.mesh_info, label, options.pass_options)
        if options.pass_options is not None:
            # See [Note: Per-unit options and the FX graph cache] (passes).
            track_unit_options(group)
    return FSDPState(modules, group, options, collected.conflicts)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` gather and reshard like its ``forward``: the
    unit's pre-forward runs before it and its post-forward after it (for a model whose
    generation or encoding method reads the parameters without calling ``forward``).
    As torch's, a no-op when ``module`` is not a fully_shard module, so the call can
    stay when sharding is off.

    Args:
        module: a module ``fully_shard`` was applied to.
        method_name: the name of a method of it.

    Raises:
        ValueError: ``module`` has no such method.
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}.")
    orig_method = getattr(module, method_name)

    @functools.wraps(orig_method)
    def wrapped_method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _require_state(self).forward(orig_method, args, kwargs)

    setattr(module, method_name, wrapped_method.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch's: makes several roots (pipeline-parallel model chunks) share their CUDA
    streams. Ours has no streams to share: every collective runs on the current stream
    (see [Note: torch's communication tuning methods]), which the roots already
    share. It checks its argument as torch's does and changes nothing.

    Raises:
        ValueError: an entry is not a fully_shard module.
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


# [Note: One FSDP class per module class]
# As torch's fully_shard, every unit of one module class gets the same FSDP<Class>
# (cached in _FSDP_CLASSES). Dynamo guards the type of the module whose forward it
# traces, so with a class per unit (until 2026-12-05) each unit's forward frame
# recompiled: a model compiled per block in place (torchtitan's ``block.compile()``,
# HF accelerate's regional compilation) compiled its blocks one by one and, past
# dynamo's recompile_limit (8), ran the further blocks eagerly; a graph break inside
# every block of a 10-block Llama compiled 22 graphs, 15 with the class shared.
# The exception is a unit whose forward is marked torch.compiler.nested_compile_region
# (its own or its class's): it keeps a class of its own. With the class shared, the
# compiled forward of such blocks segfaulted inside invoke_subgraph
# (test_hooks_run_eagerly_by_compiled_autograd_reduce_every_gradient in
# tests/test_reliability.py, seen 2026-11-29 and again 2026-12-05), most likely
# because the region, traced once, was reused across units (not confirmed). See
# [Note: A unit compiled without its root] in _state.py for the other per-unit
# guards such a block met.
_FSDP_CLASSES: dict[type, type] = {}


def _add_fsdp_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    # See [Note: One FSDP class per module class].
    shared = not marks_compile_region(module)
    new_cls = _FSDP_CLASSES.get(cls) if shared else None
    if new_cls is None:
        orig_forward = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # See [Note: Forward wrapper, not module hooks].
            state = _require_state(self)
            fwd = orig_forward
            if not compiling():
                # See [Note: A unit compiled in place].
                fwd = self.__dict__.get(_COMPILED_FORWARD, orig_forward)
            return state.forward(functools.partial(fwd, self), args, kwargs)

        new_cls = type(
            f"FSDP{cls.__name__}",
            (FSDPModule, cls),
            {"forward": forward, "__deepcopy__": _unsupported_deepcopy},
        )
        new_cls._traceable_hsdp_orig_forward = orig_forward
        if shared:
            _FSDP_CLASSES[cls] = new_cls
    module.__class__ = new_cls
    inner = module.__dict__.get("forward")
    if inner is not None:
        # See [Note: A forward set on the instance].
        def instance_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _require_state(self).forward(inner, args, kwargs)

        module.__dict__["forward"] = types.MethodType(instance_forward, module)


# [Note: A unit compiled in place]
# torchtitan compiles each block in place before sharding it (``block.compile(
# fullgraph=True)``), without compiled autograd; HF accelerate's regional compilation
# does the same without fullgraph. ``nn.Module.compile`` stores
# ``torch.compile(module._call_impl)`` as ``module._compiled_call_impl``, and dynamo
# skips ``_call_impl`` (a torch file) as a top frame: with torch's fully_shard the
# hooks run eagerly there and only the block's forward is compiled. Ours puts the
# unit's pre- and post-forward in its forward wrapper, which dynamo then compiles as
# the top frame. So without compiled autograd, whose absence leaves the backward hooks
# untraceable, fullgraph=True was refused (naming the fix) and without it dynamo broke
# the graph around them. Now, below its root and with compiled autograd off, a unit
# compiled in place calls its ``_call_impl`` eagerly: its pre- and post-forward run
# eagerly and its module's own forward is compiled, with the same ``torch.compile``
# settings (the ``OptimizeContext`` that nn.Module.compile's function closes over,
# applied to the class's original forward, one code for every unit of the class).
# Where that context is not found (another torch), ``TorchInternalError`` says so. A
# module with a forward of its own on the instance keeps the compiled call and its
# refusal; one compiled with ``disable=True`` has nothing compiled to route. A root
# compiled in place, and any unit while compiled autograd is on, keep the compiled
# call: the whole step traced, as with torch.compile(model).
#
# A forward that dynamo skips as a frame (one of torch's own modules: a unit that is
# an ``nn.Embedding`` or an ``nn.Linear``, as HF accelerate makes of a model's
# embeddings and head) runs eagerly, as it does under torch's fully_shard: there the
# compiled ``_call_impl`` is a frame dynamo skips, and so is the module's forward, so
# nothing of such a unit is compiled. Compiled explicitly, dynamo would wrap each such
# forward in one shared frame (``external_utils.wrap_inline``) and recompile it for
# every other module class: accelerate's regional compile of HF Llama compiled 5
# graphs with ours against torch's 3 (2026-12-05), the two more being the embedding's
# and the head's, and each such class took one of the shared frame's entries under
# dynamo's recompile limit (8 by default).
_COMPILED_FORWARD = "_traceable_hsdp_compiled_forward"


def _skipped_by_dynamo(fn: Callable[..., Any]) -> bool:
    """Whether dynamo skips ``fn``'s frame (torch's own modules' forwards). See [Note:
    A unit compiled in place].

    Raises:
        TorchInternalError: this torch's dynamo has no ``trace_rules.check``.
    """
    return bool(resolve("torch._dynamo.trace_rules.check")(fn))


_OPTIMIZE_CONTEXT = "torch._dynamo.eval_frame.OptimizeContext"


def _optimize_context(compiled: Any) -> Any:
    """The dynamo ``OptimizeContext`` that ``torch.compile``'s result closes over.

    Raises:
        TorchInternalError: ``compiled`` closes over none (another torch).
    """
    context_type = resolve(_OPTIMIZE_CONTEXT)
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, context_type):
            return value
    raise internal_error(
        _OPTIMIZE_CONTEXT, f"is not in the closure of nn.Module.compile's function {compiled!r}")


def _dispatch_compiled_call(module: nn.Module) -> None:
    """Routes the in-place compiled call of ``module``, if any, through
    :func:`_compiled_call`. See [Note: A unit compiled in place]."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None or getattr(compiled, "_traceable_hsdp_dispatch", False):
        return
    if "forward" in module.__dict__ or getattr(compiled, "__self__", None) is module:
        return  # a forward on the instance, or compile(disable=True): nothing compiled
    ctx = _optimize_context(compiled)
    orig = type(module)._traceable_hsdp_orig_forward
    module.__dict__[_COMPILED_FORWARD] = orig if _skipped_by_dynamo(orig) else ctx(orig)
    dispatch = functools.partial(_compiled_call, module, compiled)
    dispatch._traceable_hsdp_dispatch = True  # type: ignore[attr-defined]
    module._compiled_call_impl = dispatch


def _compiled_call(
    module: nn.Module, compiled: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """What ``nn.Module.__call__`` calls for a unit compiled in place. See [Note: A
    unit compiled in place]."""
    state = state_of(module)
    if (
        state is not None
        and not state.is_root
        and not compiled_autograd.compiled_autograd_enabled
        and not compiling()
    ):
        return module._call_impl(*args, **kwargs)
    return compiled(*args, **kwargs)


# [Note: A forward set on the instance]
# The unit's forward wrapper is a method of its class, and an attribute ``forward``
# on the instance hides it from ``nn.Module.__call__``. Three common ways put one
# there before fully_shard: ``torch.compile(module)`` returns an ``OptimizedModule``
# whose ``forward`` is the compiled call of the module it wraps (torchtitan's
# per-block compile before fully_shard, in its older form; HF accelerate's FSDP2
# flow with a dynamo backend, which compiles the whole model and then calls
# fully_shard on the result); HF accelerate's mixed precision replaces
# ``model.forward`` with an autocast-wrapped bound method; and user code patches
# it. torch's fully_shard runs module hooks, which see none of this. Ours then
# never ran the unit's pre-forward: the modules computed with the sharded DTensors
# and failed in DTensor's dispatch ("got mixed torch.Tensor and DTensor"). So
# fully_shard moves such a forward inside the unit's wrapper: the instance gets a
# bound method that runs the unit's pre-forward, the forward that was there, and
# its post-forward. For an OptimizedModule that puts the gathers outside the
# compiled region, as torch's fully_shard has them. A forward assigned after
# fully_shard replaces the wrapper, unless it calls the one it replaces (HF
# accelerate's wrapping of ``model.forward.__func__`` does).


def _unsupported_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    # A copy would share the unit's state (its placeholders, whose storage is
    # resized to 0 outside forward: copying one read freed memory and killed the
    # process). torch's fully_shard refuses it with the same first sentence.
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization: "
        "build a second model, apply fully_shard to it in the same way, and "
        "load_state_dict(model.state_dict()) into it."
    )


