"""``fully_shard``, the public entry, with ``register_fsdp_forward_method`` and
``share_comm_ctx``.

``fully_shard`` is a short sequence of named steps, as torch's: check the modules and
the options into a ``UnitOptions`` (``_init.py``), collect the parameters
(``collect_params``), build the unit (``_build_unit``: one ``FSDPParam`` per
parameter, their ``FSDPParamGroup``, the ``FSDPState``), wire the tree
(``FSDPState.adopt_nested``), swap the classes (``add_fsdp_class`` in
``_fsdp_class.py``; the mixin is ``_module.py``'s ``FSDPModule``), install the global
switches. ``hsdp()`` enters after the first step, through ``shard_unit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.tensor import Shard

from . import _torch_internals
from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._compiled_call import dispatch_compiled_call
from ._exit import track_meshes
from ._fsdp_class import add_fsdp_class
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
from ._module import FSDPModule, GradientReductionHandle, UnshardHandle
from ._param import FSDPParam
from ._param_group import FSDPParamGroup
from ._state import FSDPState, require_state, state_of
from ._torch_view import expose_to_torch
from .passes import track_unit_options

__all__ = [
    "fully_shard",
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]


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
    dp_mesh_dims: DataParallelMeshDims | None = None,
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
            in ``_param.py``). With ``dp_mesh_dims``: the full mesh the parameters
            are ``DTensor``s on.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward;
            ``False`` keeps them until backward; ``None`` (default): ``False`` for the
            root (see [Note: The default keeps the root gathered for backward]),
            ``True`` for the others; an int k keeps 1/k per rank ([Note: Reshard to
            a smaller world]).
        shard_placement_fn: called with each managed parameter; returns a
            ``Shard(dim)``, ``None`` for ``Shard(0)``, or torch's
            ``ShardPlacementResult`` for another mesh (default ``None``).
        mp_policy: dtypes for the gathered parameters, the gradient reduction and
            the outputs (default full precision); torch's policy is accepted too.
        offload_policy: ``OffloadPolicy()`` (default) or ``CPUOffloadPolicy()``.
        ignored_params: parameters left alone (neither sharded nor reduced).
        dp_mesh_dims: torch's ``DataParallelMeshDims(shard=..., replicate=...)``:
            ``mesh`` is the full mesh, every parameter already a ``DTensor`` on it
            with ``Replicate()`` on the named dims, which FSDP shards over
            (``shard``) and replicates over (``replicate``: HSDP, or DDP alone);
            several names are flattened into one dim. The sharded parameters stay on
            ``mesh``. Default ``None``. See [Note: The SPMD-mesh form] in
            ``_param.py``.

    Returns:
        The same module (or list), its class now a subclass of ``FSDPModule``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (or list of them), ``mesh``
            is not a ``DeviceMesh``, or ``dp_mesh_dims`` not a
            ``DataParallelMeshDims``.
        ValueError: a mesh of 3 or more dims without ``dp_mesh_dims``; a parameter
            on another device than the mesh's (meta parameters are accepted: shard
            first, then ``module.to_empty(device=...)`` and initialize); a 0-dim
            parameter; unsupported option values; a ``DTensor`` parameter whose mesh
            does not combine with ``mesh`` or whose placements are not
            Shard/Replicate. With ``dp_mesh_dims``, as torch's: a mesh without dim
            names or names not in it; a parameter that is not a ``DTensor``, is on
            another mesh object, or is not ``Replicate()`` on a data-parallel dim.
        NotImplementedError: a ``DTensor`` parameter with an int
            ``reshard_after_forward`` (with ``dp_mesh_dims``, any parameter, as
            torch's); ``hsdp()`` replicating a ``DTensor`` parameter.
    """
    modules = check_modules(module)
    options = unit_options(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
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
    """Internal: :func:`fully_shard` with options already checked, for ``hsdp()``.
    See [Note: Unit options] in ``_init.py``.

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
    spmd = () if options.spmd is None else (options.spmd.mesh, options.spmd.sharded_mesh)
    track_meshes(
        options.mesh, *spmd, *(info.mesh for _, info in collected.placements.values())
    )
    state.adopt_nested()
    expose_to_torch(modules, state)
    for m in modules:
        add_fsdp_class(m)
        dispatch_compiled_call(m)  # See [Note: A unit compiled in place] (_compiled_call.py).
    # Every process-wide change to torch, each entry checked first. See [Note: Torch
    # internals].
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
            spmd=options.spmd,
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
        return require_state(self).forward(orig_method, args, kwargs)

    setattr(module, method_name, wrapped_method.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch's: makes several roots share their CUDA streams. Ours run on the current
    stream already ([Note: torch's communication tuning methods]), so it checks its
    argument as torch's does and changes nothing.

    Raises:
        ValueError: an entry is not a fully_shard module.
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
