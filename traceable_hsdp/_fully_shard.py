"""``fully_shard`` and the ``FSDPModule`` mixin."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from ._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._common import MeshInfo, PostForwardInfo
from ._param import FSDPParam, ParamModuleInfo, check_tp_placements, spmd_mesh
from ._param_group import FSDPParamGroup
from ._state import FSDPState
from .passes import install as _install_passes

__all__ = ["fully_shard", "FSDPModule", "register_fsdp_forward_method", "share_comm_ctx"]

_STATE_ATTR = "_traceable_hsdp_state"


def _get_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get(_STATE_ATTR)


class FSDPModule:
    """Mixin added to the class of every module passed to :func:`fully_shard`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Index 0 is the FSDP class itself, index 1 the mixin, index 2 the original.
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

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
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
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
        """Divide gradients by ``factor`` after summing them over the data-parallel
        ranks, instead of averaging (the default divides by the number of ranks).

        Raises:
            ValueError: ``factor`` is not a positive number.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}.")
        for state in _states(self, recurse=True):
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
        rounding). An explicit gradient divide factor takes precedence."""
        _set_on_groups(self, True, "force_sum", "enable", enable)

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
        state = _require_state(self)
        if not state.is_root:
            raise RuntimeError(
                f"reset_iter_state must be called on the root fully_shard module; this "
                f"{type(self).__name__} is nested in another fully_shard unit. Call it on "
                "the outermost module fully_shard was applied to."
            )
        state.reset_iter()

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
    # The six methods below tune torch's eager runtime: its communication objects,
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


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}.")


def _set_on_groups(module: Any, recurse: bool, attr: str, name: str, value: object) -> None:
    """The boolean setters' one body: checks that ``value`` (the argument ``name``)
    is a bool, then sets ``attr`` of this unit's parameter group to it, and with
    ``recurse`` of every unit's inside too."""
    _check_bool(name, value)
    for state in _states(module, recurse):
        if state.param_group is not None:
            setattr(state.param_group, attr, value)


def _states(module: Any, recurse: bool) -> list[FSDPState]:
    root = _require_state(module)
    if not recurse:
        return [root]
    out: list[FSDPState] = []
    for m in module.modules():
        s = _get_state(m)
        if s is not None and s not in out:
            out.append(s)
    return out


def _prefetch_states(modules: Any, which: str) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"set_modules_to_{which}_prefetch expects a list of modules.")
    out = []
    for m in modules:
        s = _get_state(m) if isinstance(m, nn.Module) else None
        if s is None:
            raise TypeError(
                f"set_modules_to_{which}_prefetch got a {type(m).__name__} that is not a "
                "fully_shard module; pass modules returned by fully_shard."
            )
        out.append(s)
    return out


def _require_state(module: Any) -> FSDPState:
    state = _get_state(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} has no fully_shard state")
    return state


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard(mesh=None) builds a mesh over the default process group, and "
            "none is initialized. Call torch.distributed.init_process_group() first "
            "(torchrun sets the environment for it) or pass mesh=."
        )
    backend = dist.get_backend()
    use_cuda = torch.cuda.is_available() and "nccl" in str(backend)
    device_type = "cuda" if use_cuda else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_info(mesh: DeviceMesh) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "fully_shard(mesh=...) expects a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}. Build one with init_device_mesh(device_type, (world,)) "
            "for FSDP or (replicate, shard) for HSDP."
        )
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=None)
    if mesh.ndim == 2:
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(
        f"fully_shard expects a 1-D mesh (FSDP) or a 2-D mesh (replicate, shard) for HSDP, "
        f"got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Slice it, e.g. "
        "mesh['dp_replicate', 'dp_shard']."
    )


def _managed_params(
    module: nn.Module, ignored: set[nn.Parameter], conflicts: list[str]
) -> tuple[list[nn.Parameter], dict[nn.Parameter, list[tuple[str, ParamModuleInfo]]]]:
    """Parameters of ``module``'s subtree not owned by a nested unit nor ignored, in
    registration order, with every place each is registered. A parameter an earlier
    unit already sharded is left out, and why is appended to ``conflicts``.

    Raises:
        ValueError: a module of a nested unit is reachable outside it. See
            [Note: One unit per parameter].
    """
    owned_elsewhere: set[int] = set()  # every parameter in a nested unit's subtree
    nested_managed: dict[int, str] = {}  # a nested unit's managed tensors -> its FQN
    for sub in module.modules():
        state = _get_state(sub)
        if sub is module or state is None:
            continue
        for p in sub.parameters():
            owned_elsewhere.add(id(p))
        if state.param_group is not None:
            for fp in state.param_group.fsdp_params:
                desc = f"{fp.fqn!r} of the fully_shard unit {state.param_group.label}"
                nested_managed[id(fp.sharded_param)] = desc
                nested_managed[id(fp.unsharded_param)] = desc
    order: list[nn.Parameter] = []
    where: dict[nn.Parameter, list[tuple[str, ParamModuleInfo]]] = {}
    for mod_name, sub in _own_modules(module):
        for pname, p in list(sub._parameters.items()):
            if p is None or p in ignored:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in nested_managed:
                raise ValueError(
                    f"Parameter {fqn!r} of {type(module).__name__} is "
                    f"{nested_managed[id(p)]}, nested inside it: its module is also "
                    "reachable outside that unit, whose forward alone gathers it. A "
                    f"parameter can belong to one fully_shard unit only. {_SHARED_FIX}"
                )
            if id(p) in owned_elsewhere:
                continue
            prior = getattr(p, _SHARDED_AS_ATTR, None)
            if prior is not None:
                # Raised at the first forward, as torch's; see [Note: One unit per
                # parameter]. The parameter stays out of this unit.
                conflicts.append(
                    f"Parameter {fqn!r} of {type(module).__name__} is already managed by "
                    f"another fully_shard unit: it is shared with {prior}, which an "
                    "earlier fully_shard call sharded; sharding it again would make an "
                    "independent copy (silently untied). A parameter can belong to one "
                    f"fully_shard unit only. {_SHARED_FIX}"
                )
                continue
            if p not in where:
                order.append(p)
                where[p] = []
            if all(info.module is not sub or info.param_name != pname for _, info in where[p]):
                where[p].append((fqn, ParamModuleInfo(sub, pname)))
    return order, where


_SHARED_FIX = (
    "Fix: shard every module that uses it in one unit: do not call fully_shard on those "
    "modules separately and let their common parent's fully_shard manage the parameter "
    "(for a tied embedding and output head: fully_shard each block, then the root), or "
    "pass them together as one unit, fully_shard([module_a, module_b]). See "
    "docs/state_dict.md."
)

# Set on an original parameter once fully_shard replaced it with its sharded DTensor:
# "'<fqn>' of the fully_shard unit <Class>". See [Note: One unit per parameter].
_SHARDED_AS_ATTR = "_traceable_hsdp_sharded_as"


# [Note: One unit per parameter]
# A parameter registered on several modules (a tied embedding and output head) is
# managed once, by the unit whose own modules hold all its registrations: it is
# gathered once per forward into one placeholder that every one of them holds, and
# autograd sums the gradients of all uses into that placeholder's gradient before its
# post-accumulate-grad hook reduces it. A unit gathers only for its own forward, so a
# parameter cannot be split between units. The two ways to split it are refused
# (neither fails clearly by itself):
# - the original parameter is still registered outside an earlier unit: fully_shard
#   swapped it for a DTensor only on that unit's modules, so a later unit would shard
#   the original again into an independent copy: silently untied. Refused at the
#   first forward, as torch's (its message says "already managed by another"): the
#   later unit leaves the parameter out and records why;
# - a module inside a nested unit is also reachable from the parent outside it: the
#   parent's forward would read the nested unit's sharded DTensor ("got mixed
#   torch.Tensor and DTensor" deep in the forward). Refused when the parent is built.


def _own_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its submodules, pre-order, every path (duplicates included),
    without descending into nested fully_shard units."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or _get_state(child) is not None:
            continue
        yield from _own_modules(child, f"{prefix}.{name}" if prefix else name)


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
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
        reshard_after_forward: free the unsharded parameters after forward and
            re-gather them for backward (default ``True``). ``False`` keeps them from
            forward to backward. ``None``, as torch's: ``False`` for the root unit (its
            backward comes first), ``True`` for the others. An int k dividing the shard
            group's size keeps 1/k of each parameter per rank after forward and
            re-gathers over groups of k ranks for backward.
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
            with an int ``reshard_after_forward``.
    """
    return _fully_shard_impl(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
    )


def _state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``, as torch's: the unit's state object, or ``None``
    for a module fully_shard was not applied to. Its attributes are ours, not torch's
    (``param_group``, ``training_state``, ``is_root``)."""
    return _get_state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]


def _fully_shard_impl(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    replicate: Callable[[nn.Parameter], bool] | None = None,
    keep_storage: bool = False,
) -> Any:
    """:func:`fully_shard`, plus what ``hsdp()`` adds: ``replicate(param)`` says which
    parameters stay whole (see [Note: Replicated parameters] in ``_param.py``) and
    ``keep_storage`` keeps gathered storage across steps (``optimizer_level="level1"``)."""
    modules = _check_modules(module)
    mesh = _default_mesh() if mesh is None else mesh
    mesh_info = _mesh_info(mesh)
    raf = _check_reshard_after_forward(reshard_after_forward, mesh_info)
    offload_policy = _check_offload_policy(offload_policy)
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    mp_policy = _check_mp_policy(mp_policy)
    ignored = _check_ignored(ignored_params)

    # A list is one unit: its params are managed by the first module's state.
    owner = modules[0]
    order: list[nn.Parameter] = []
    where: dict[nn.Parameter, list[tuple[str, ParamModuleInfo]]] = {}
    conflicts: list[str] = []
    for m in modules:
        o, w = _managed_params(m, ignored, conflicts)
        for p in o:
            if p not in where:
                order.append(p)
                where[p] = []
            where[p].extend(w[p])
    for p in order:
        fqn = where[p][0][0]
        # A meta parameter is sharded on meta and materialized by module.to_empty();
        # see [Note: Changes after fully_shard] in _param.py.
        on_cpu_offloaded = offload is not None and p.device.type == "cpu"
        if not p.is_meta and not on_cpu_offloaded and (
            p.device.type != mesh.device_type
            or (p.device.type != "cpu" and p.device != mesh_info.device)
        ):
            where = mesh.device_type if p.device.type != mesh.device_type else mesh_info.device
            raise ValueError(
                f"Parameter {fqn!r} is on {p.device} but the mesh is on {where}. Move "
                f"the module first (module.to({str(where)!r})) or build the mesh on "
                f"{p.device.type!r}."
            )
    placements = {
        p: _shard_placement(shard_placement_fn, p, where[p][0][0], mesh_info) for p in order
    }
    for p in order:
        if isinstance(p, torch.distributed.tensor.DTensor):
            # See [Note: FSDP x TP] in _param.py.
            _check_tp_param(
                p, where[p][0][0], placements[p][1], raf, replicate is not None and replicate(p)
            )
    fsdp_params = [
        FSDPParam(
            p,
            where[p][0][0],
            [info for _, info in where[p]],
            placements[p][1],
            mp_policy,
            shard_dim=placements[p][0],
            offload=offload,
            replicate=replicate is not None and replicate(p),
        )
        for p in order
    ]
    post_forward = None
    if raf is not None and not isinstance(raf, bool):
        for fp in fsdp_params:
            if fp.mesh_info != mesh_info:
                raise NotImplementedError(
                    f"reshard_after_forward={raf} (an int) with parameter {fp.fqn!r} "
                    f"sharded over another mesh ({fp.mesh_info.mesh}, from "
                    "shard_placement_fn) than the unit's: the smaller re-gather groups are "
                    "built from the unit's mesh. Use reshard_after_forward=True or False "
                    "for this unit."
                )
        post_forward = _post_forward_info(mesh_info, raf)
    for fp in fsdp_params:
        fp.keep_storage = keep_storage
        fp.post_forward = post_forward
    label = type(owner).__name__
    for p, fp in zip(order, fsdp_params):
        # See [Note: One unit per parameter].
        setattr(p, _SHARDED_AS_ATTR, f"{fp.fqn!r} of the fully_shard unit {label}")
    group = FSDPParamGroup(fsdp_params, mesh_info, label) if fsdp_params else None
    state = FSDPState(modules, group, raf, mp_policy)
    state.init_errors = conflicts
    owner.__dict__[_STATE_ATTR] = state
    for m in modules[1:]:
        m.__dict__[_STATE_ATTR] = state

    # The new unit is root of its subtree: nested units stop being roots.
    nested: list[FSDPState] = []
    for m in modules:
        for sub in m.modules():
            s = _get_state(sub)
            if s is not None and s is not state and s not in nested:
                s.is_root = False
                s.root = state
                nested.append(s)
    state.states = [*nested, state]
    # Nested units are labelled by their path under this root ("layers.0"), for
    # messages and dumps; see [Note: Collective annotations] (_annotate.py).
    for m in modules:
        for name, sub in m.named_modules():
            s = _get_state(sub)
            if name and s is not None and s is not state and s.param_group is not None:
                s.param_group.label = name

    for m in modules:
        _add_fsdp_class(m)
    # See [Note: Saved views of the placeholder].
    torch._functorch.config.recompute_views = True
    _install_passes()  # Inductor post-grad passes; see passes/_install.py
    return module


# [Note: Saved views of the placeholder]
# AOTAutograd's partitioner may save a *view* of an unsharded placeholder for backward
# (e.g. the transpose a linear's input-gradient needs) and compute it at the end of
# the forward graph, after the placeholder was resized to 0 bytes. Eagerly executed
# (aot_eager) that view fails its storage-bounds check; compiled, it is only correct
# by accident of aliasing. ``torch._functorch.config.recompute_views = True`` makes
# the partitioner recompute views in the backward from the placeholder itself, after
# the re-gather. fully_shard turns it on (it is a global config, read when a graph is
# partitioned) and docs/compile.md says so.


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


def _add_fsdp_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    orig_forward = cls.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # See [Note: Forward wrapper, not module hooks].
        state = _require_state(self)
        return state.forward(functools.partial(orig_forward, self), args, kwargs)

    new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"forward": forward})
    module.__class__ = new_cls


def _check_modules(module: Any) -> list[nn.Module]:
    mods = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}."
            )
        if _get_state(m) is not None:
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once "
                "per module."
            )
    if not mods:
        raise ValueError("fully_shard got an empty list of modules.")
    return mods


def _check_reshard_after_forward(value: Any, mesh_info: MeshInfo) -> bool | int | None:
    """``True``/``False``/``None``, or an int k dividing the shard group's size (see
    [Note: Reshard to a smaller world] in ``_param.py``): k equal to that size is
    ``True``, k = 1 keeps the whole parameter (``False``). ``None`` stays: ``False``
    while the unit is a root, else ``True`` (decided at each forward), as torch's."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        size = mesh_info.shard_size
        if value < 1 or value > size or size % value:
            raise ValueError(
                f"reshard_after_forward={value} must divide the shard group's size {size} "
                f"(a divisor in 1..{size}): it is the number of ranks each parameter is "
                "resharded over after forward. Use True/False, or a divisor such as the "
                "number of GPUs per node."
            )
        if value == size:
            return True
        if value == 1:
            return False
        return value
    raise TypeError(
        f"reshard_after_forward must be a bool or int, got {type(value).__name__}."
    )


# Set on a DeviceMesh object: {k: the mesh of groups of k ranks built from it}.
_POST_FORWARD_MESHES_ATTR = "_traceable_hsdp_post_forward_meshes"


def _post_forward_info(mesh_info: MeshInfo, k: int) -> PostForwardInfo:
    """Groups of ``k`` consecutive ranks of each shard group (one DeviceMesh per mesh
    object and k, built once: building it creates process groups on every rank). The
    cache lives on the mesh object, not in a module-level table keyed by its value:
    a mesh built again after the process group was destroyed and re-created compares
    equal to the old one, whose cached groups no longer exist."""
    mesh = mesh_info.mesh
    cache: dict[int, DeviceMesh] = mesh.__dict__.setdefault(_POST_FORWARD_MESHES_ATTR, {})
    pf_mesh = cache.get(k)
    if pf_mesh is None:
        ranks = mesh.mesh
        shape = (*ranks.shape[:-1], ranks.shape[-1] // k, k)
        pf_mesh = DeviceMesh(mesh.device_type, ranks.reshape(shape))
        cache[k] = pf_mesh
    return PostForwardInfo(
        group_name=pf_mesh.get_group(pf_mesh.ndim - 1).group_name,
        size=k,
        index=pf_mesh.get_local_rank(pf_mesh.ndim - 1),
    )


def _check_mp_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    # torch.distributed.fsdp.MixedPrecisionPolicy has the same fields: accept it, so a
    # half-switched import still works.
    if type(mp_policy).__name__ == "MixedPrecisionPolicy" and hasattr(mp_policy, "param_dtype"):
        return MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            output_dtype=mp_policy.output_dtype,
            cast_forward_inputs=mp_policy.cast_forward_inputs,
        )
    raise TypeError(
        "mp_policy must be a traceable_hsdp.MixedPrecisionPolicy, got "
        f"{type(mp_policy).__name__}."
    )


def _shard_placement(
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    param: nn.Parameter,
    fqn: str,
    mesh_info: MeshInfo,
) -> tuple[int, MeshInfo]:
    """The dim ``shard_placement_fn`` picks for ``param`` (0 when it returns None) and
    the mesh to shard it over: the unit's, unless it returns torch's
    ``ShardPlacementResult(placement, mesh_info)`` (e.g. experts sharded over a smaller
    mesh than the rest of their block)."""
    if shard_placement_fn is None:
        return 0, mesh_info
    if not callable(shard_placement_fn):
        raise TypeError(
            "shard_placement_fn must be a callable taking an nn.Parameter and returning "
            f"a Shard or None, got {type(shard_placement_fn).__name__}."
        )
    placement = shard_placement_fn(param)
    if type(placement).__name__ == "ShardPlacementResult" and hasattr(placement, "mesh_info"):
        mesh_info = _mesh_info_from_result(placement.mesh_info, fqn)
        placement = placement.placement
    if placement is None:
        return 0, mesh_info
    if not isinstance(placement, Shard):
        raise TypeError(
            f"shard_placement_fn returned {placement!r} for {fqn!r}; it must return a "
            "torch.distributed.tensor.Shard(dim), None (for Shard(0)), or a "
            "ShardPlacementResult(placement, mesh_info)."
        )
    dim = placement.dim
    data = param._local_tensor if isinstance(param, torch.distributed.tensor.DTensor) else param
    ndim = data.dim()
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({dim}) for {fqn!r}, which has {ndim} "
            f"dim(s) (shape {tuple(data.shape)}); pick a dim in [{-ndim}, {ndim})."
        )
    return dim % ndim, mesh_info


def _mesh_info_from_result(info: Any, fqn: str) -> MeshInfo:
    """Our MeshInfo for the ``mesh_info`` of torch's ``ShardPlacementResult`` (its
    ``FSDPMeshInfo`` or ``HSDPMeshInfo``)."""
    if isinstance(info, MeshInfo):
        return info
    mesh = getattr(info, "mesh", None)
    shard_dim = getattr(info, "shard_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or not isinstance(shard_dim, int):
        raise TypeError(
            f"shard_placement_fn returned a ShardPlacementResult for {fqn!r} whose "
            f"mesh_info is a {type(info).__name__}; expected torch's FSDPMeshInfo(mesh, "
            "shard_mesh_dim) or HSDPMeshInfo(mesh, shard_mesh_dim, replicate_mesh_dim)."
        )
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    expected = (1, 0, None) if replicate_dim is None else (2, 1, 0)
    if (mesh.ndim, shard_dim, replicate_dim) != expected:
        raise ValueError(
            f"shard_placement_fn returned a ShardPlacementResult for {fqn!r} with a "
            f"{mesh.ndim}-D mesh {mesh}, shard_mesh_dim={shard_dim}, replicate_mesh_dim="
            f"{replicate_dim}; expected a 1-D mesh (FSDP, shard_mesh_dim=0) or a 2-D "
            "(replicate, shard) mesh (HSDP, shard_mesh_dim=1, replicate_mesh_dim=0)."
        )
    return _mesh_info(mesh)


def _check_tp_param(
    param: torch.distributed.tensor.DTensor,
    fqn: str,
    mesh_info: MeshInfo,
    raf: bool | int | None,
    replicate: bool,
) -> None:
    """Refuses what fully_shard cannot do with an already distributed parameter. See
    [Note: FSDP x TP] in _param.py.

    Raises:
        ValueError: its layout, or its mesh with fully_shard's (``spmd_mesh``).
        NotImplementedError: an int ``reshard_after_forward``; HSDP or ``hsdp()``
            replication with TP.
    """
    check_tp_placements(param, fqn)
    if mesh_info.replicate_mesh_dim is not None or replicate:
        raise NotImplementedError(
            f"Parameter {fqn!r} is a DTensor (placements {tuple(param.placements)}, from "
            "parallelize_module) and fully_shard's mesh is 2-D (HSDP) or hsdp() keeps it "
            "whole: traceable_hsdp composes tensor parallelism with FSDP over a 1-D dp "
            "mesh only (2-D FSDP x TP). Use fully_shard(..., mesh=world_mesh['dp']) with "
            "one data-parallel dim, or torch.distributed.fsdp.fully_shard for HSDP x TP. "
            "See docs/api.md."
        )
    if raf is not None and not isinstance(raf, bool):
        raise NotImplementedError(
            f"reshard_after_forward={raf} (an int) with the DTensor parameter {fqn!r} "
            f"(placements {tuple(param.placements)}): resharding to a smaller world is not "
            "supported with tensor parallelism (torch's fully_shard refuses it too). Use "
            "reshard_after_forward=True or False for this unit."
        )
    spmd_mesh(mesh_info.mesh, param.device_mesh, fqn)


def _check_offload_policy(offload_policy: Any) -> OffloadPolicy:
    # torch.distributed.fsdp's policies have the same names and fields: accept them,
    # so a half-switched import still works (as for mp_policy).
    torch_name = type(offload_policy).__name__
    if not isinstance(offload_policy, OffloadPolicy) and torch_name in (
        "OffloadPolicy",
        "CPUOffloadPolicy",
    ):
        if torch_name == "CPUOffloadPolicy":
            offload_policy = CPUOffloadPolicy(pin_memory=getattr(offload_policy, "pin_memory", True))
        else:
            offload_policy = OffloadPolicy()
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be a traceable_hsdp.OffloadPolicy (no offload) or "
            f"CPUOffloadPolicy(pin_memory=...), got {type(offload_policy).__name__}."
        )
    if isinstance(offload_policy, CPUOffloadPolicy) and not isinstance(
        offload_policy.pin_memory, bool
    ):
        raise TypeError(
            "CPUOffloadPolicy.pin_memory must be a bool, got "
            f"{type(offload_policy.pin_memory).__name__}."
        )
    return offload_policy


def _check_ignored(ignored_params: Any) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)):
        raise TypeError(
            f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}."
        )
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params holds a {type(p).__name__}, not an nn.Parameter.")
    return set(ignored_params)
