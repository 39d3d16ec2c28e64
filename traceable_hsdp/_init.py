"""What ``fully_shard`` does before it builds a unit: checks its arguments into one
:class:`UnitOptions`, builds the default mesh, and collects the parameters the unit
will manage (discovery and the sharing rules). Nothing here changes a module; the
unit is built from what these return (``_fully_shard.py``).

[Note: Unit options]
Everything a unit is built from travels as one frozen :class:`UnitOptions`, checked
once by :func:`unit_options`; ``fully_shard`` and ``hsdp()`` both build one and meet in
``_fully_shard.shard_unit``. Options a setter may change later are copied into the
unit's state.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as _TorchMixedPrecisionPolicy
from torch.distributed.tensor import Shard

from ._api import REDUCE_IN_GRAD_DTYPE, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._common import MeshInfo, PostForwardInfo, SpmdLayout
from ._exit import track_meshes
from ._param import ParamModuleInfo, check_spmd_param, check_tp_placements, spmd_mesh
from ._torch_internals import _concatenate, _flatten
from ._state import state_of
from .passes._graph import UnitPassOptions


@dataclass(frozen=True)
class UnitOptions:
    """The checked options of one fully_shard unit. See [Note: Unit options]."""

    mesh_info: MeshInfo
    """The mesh and which of its dims shard and replicate."""
    reshard_after_forward: bool | int | None
    """As checked by ``_check_reshard_after_forward``: a bool, ``None``, or a divisor
    k of the shard group's size with 1 < k < size."""
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: frozenset[nn.Parameter]
    replicate: Callable[[nn.Parameter], bool] | None = None
    """``hsdp()``: whether a parameter stays whole on every rank (see [Note:
    Replicated parameters] in ``_param.py``); ``None`` shards all."""
    keep_storage: bool = False
    """``hsdp(optimizer_level="level1")``: gathered storage is kept across steps."""
    pass_options: UnitPassOptions | None = None
    """``hsdp()``: the unit's own pass options (see [Note: Per-unit pass options] in
    ``passes/bucket_collectives.py``); ``None`` leaves the ``PassConfig`` to decide."""
    spmd: SpmdLayout | None = None
    """``dp_mesh_dims``: the full mesh and its data-parallel dims; ``mesh_info`` is then
    the data-parallel part. See [Note: The SPMD-mesh form] in ``_param.py``."""

    @property
    def mesh(self) -> DeviceMesh:
        return self.mesh_info.mesh

    @property
    def offload(self) -> CPUOffloadPolicy | None:
        """The CPU offload policy, or ``None`` for no offload."""
        p = self.offload_policy
        return p if isinstance(p, CPUOffloadPolicy) else None


def unit_options(
    *,
    mesh: DeviceMesh | None,
    reshard_after_forward: Any,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: Any,
    replicate: Callable[[nn.Parameter], bool] | None = None,
    keep_storage: bool = False,
    pass_options: UnitPassOptions | None = None,
    dp_mesh_dims: Any = None,
) -> UnitOptions:
    """Checks ``fully_shard``'s arguments (and ``hsdp()``'s additions) into one
    :class:`UnitOptions`; ``mesh=None`` builds the default mesh.

    Raises:
        TypeError, ValueError, NotImplementedError: as documented on ``fully_shard``.
        RuntimeError: ``mesh=None`` and no process group is initialized.
    """
    mesh = default_mesh("fully_shard(mesh=None)") if mesh is None else mesh
    spmd = None
    if dp_mesh_dims is None:
        info = _mesh_info(mesh)
    else:
        info, spmd = _spmd_mesh_info(mesh, dp_mesh_dims, reshard_after_forward)
        if not spmd.shard_dims:  # DDP: every parameter stays whole
            replicate = _replicate_all
    return UnitOptions(
        mesh_info=info,
        reshard_after_forward=_check_reshard_after_forward(reshard_after_forward, info),
        offload_policy=_check_offload_policy(offload_policy),
        mp_policy=_check_mp_policy(mp_policy),
        ignored_params=frozenset(_check_ignored(ignored_params)),
        shard_placement_fn=shard_placement_fn,
        replicate=replicate,
        keep_storage=keep_storage,
        pass_options=pass_options,
        spmd=spmd,
    )


def _replicate_all(param: nn.Parameter) -> bool:
    return True


def _spmd_mesh_info(mesh: DeviceMesh, dims: Any, raf: Any) -> tuple[MeshInfo, SpmdLayout]:
    """The data-parallel mesh of ``mesh`` that ``dims`` names, checked as torch's
    ``fully_shard`` checks it, and the layout the parameters keep. See [Note: The
    SPMD-mesh form] in ``_param.py``.

    Raises:
        TypeError: ``dims`` is not a ``DataParallelMeshDims``, or ``mesh`` not a
            ``DeviceMesh``.
        ValueError: neither shard nor replicate set; a mesh without dim names; a name
            not in the mesh, or named twice.
        NotImplementedError: an int ``reshard_after_forward`` (torch refuses it too).
    """
    from torch.distributed.fsdp import DataParallelMeshDims

    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(
            "fully_shard(dp_mesh_dims=...) expects a "
            "torch.distributed.fsdp.DataParallelMeshDims(shard=..., replicate=...), got "
            f"{type(dims).__name__}."
        )
    if not isinstance(mesh, DeviceMesh):
        _mesh_info(mesh)  # raises the TypeError naming the mesh
    # torch's checks, exceptions and first words (_validate_mesh).
    if dims.shard is None and dims.replicate is None:
        raise ValueError(
            "At least one of shard or replicate must be set in dp_mesh_dims: name the "
            "mesh dim(s) FSDP shards over (shard=) and/or replicates over (replicate=)."
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided: build it with "
            "init_device_mesh(device_type, shape, mesh_dim_names=(...)) and name the "
            "data-parallel dims in dp_mesh_dims."
        )
    shard_names, replicate_names = dims.shard_names, dims.replicate_names
    for name in (*shard_names, *replicate_names):
        if name not in names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names} "
                f"(dp_mesh_dims={dims}). Name dims of the mesh passed to fully_shard."
            )
    every = (*shard_names, *replicate_names)
    if len(set(every)) != len(every):
        raise ValueError(
            f"dp_mesh_dims={dims} names a mesh dim more than once; each data-parallel "
            "dim either shards or replicates."
        )
    if shard_names and isinstance(raf, int) and not isinstance(raf, bool):
        raise NotImplementedError(  # torch's exception and first words
            "reshard_after_forward as int is not yet supported with SPMD mesh "
            f"(dp_mesh_dims), got reshard_after_forward={raf}. Use True or False."
        )

    def submesh(group: tuple[str, ...]) -> DeviceMesh:
        # Several dims are flattened into one, as torch's fully_shard does.
        if len(group) == 1:
            return mesh[group[0]]
        return _flatten(mesh[group], "_".join(group))

    shard_dims = tuple(names.index(n) for n in shard_names)
    replicate_dims = tuple(names.index(n) for n in replicate_names)
    sharded_mesh = mesh
    if not shard_names:  # DDP
        info = MeshInfo(submesh(replicate_names), shard_mesh_dim=0, replicate_mesh_dim=None)
    elif not replicate_names:  # FSDP
        info = MeshInfo(submesh(shard_names), shard_mesh_dim=0, replicate_mesh_dim=None)
    else:  # HSDP
        dp = _concatenate([submesh(replicate_names), submesh(shard_names)])
        info = MeshInfo(dp, shard_mesh_dim=1, replicate_mesh_dim=0)
    if len(shard_dims) > 1:
        sharded_mesh = _multi_shard_mesh(mesh, info, shard_dims, replicate_dims, dims)
    return info, SpmdLayout(mesh, dims, shard_dims, replicate_dims, sharded_mesh)


def _multi_shard_mesh(
    mesh: DeviceMesh,
    info: MeshInfo,
    shard_dims: tuple[int, ...],
    replicate_dims: tuple[int, ...],
    dims: Any,
) -> DeviceMesh:
    """With several shard dims, the sharded parameters' mesh as torch's builds it:
    ``mesh``'s dims in order, the shard dims replaced by the unit's data-parallel mesh
    (for HSDP its replicate dims too, which that mesh holds).

    Raises:
        ValueError: the shard dims are not adjacent in ``mesh``.
    """
    if list(shard_dims) != list(range(shard_dims[0], shard_dims[0] + len(shard_dims))):
        raise ValueError(
            f"dp_mesh_dims={dims} names shard dims {dims.shard_names} that are not "
            f"adjacent in the mesh's dims {mesh.mesh_dim_names}: they are flattened into "
            "one dim of the sharded parameters' mesh. Order the mesh's dims so they are."
        )
    names = mesh.mesh_dim_names
    assert names is not None
    parts: list[DeviceMesh] = []
    for i, name in enumerate(names):
        if i == shard_dims[0]:
            parts.append(info.mesh)
        elif i in shard_dims or (info.replicate_mesh_dim is not None and i in replicate_dims):
            continue
        else:
            parts.append(mesh[name])
    return _concatenate(parts)


def default_mesh(caller: str, shard_size: int | None = None) -> DeviceMesh:
    """The mesh ``fully_shard(mesh=None)`` and ``hsdp(mesh=None)`` build over the
    default process group: on CUDA when its backend is NCCL, else on the CPU.

    Args:
        caller: the call that needs it, for the error message.
        shard_size: ``None`` (``fully_shard``, as torch's): a 1-D mesh over every
            rank with unnamed dims. An int (``hsdp()``'s ``shard_size``; ``-1`` for
            every rank): a 1-D ``("shard",)`` mesh over every rank, or a 2-D
            ``("replicate", "shard")`` mesh of ``world / shard_size`` groups of
            ``shard_size`` consecutive ranks.

    Raises:
        RuntimeError: no process group is initialized.
        ValueError: ``shard_size`` is not -1 nor a positive divisor of the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"{caller} builds its mesh over the default process group, and none is "
            "initialized. Call torch.distributed.init_process_group() first (torchrun "
            "sets the environment for it) or pass mesh=."
        )
    world = dist.get_world_size()
    backend = str(dist.get_backend())
    device_type = "cuda" if torch.cuda.is_available() and "nccl" in backend else "cpu"
    if shard_size is None:
        return init_device_mesh(device_type, (world,))
    if shard_size == -1:
        shard_size = world
    if shard_size <= 0 or world % shard_size:
        raise ValueError(
            f"hsdp(shard_size={shard_size}) must be -1 or a positive divisor of the world "
            f"size {world}: ranks are split into world/shard_size replica groups of "
            "shard_size ranks each."
        )
    if shard_size == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


@dataclass
class CollectedParams:
    """What a unit manages: its parameters with every place each is registered, and
    why parameters were left out ([Note: One unit per parameter])."""

    params: list[nn.Parameter]
    where: dict[nn.Parameter, list[tuple[str, ParamModuleInfo]]]
    conflicts: list[str]
    # Each parameter's shard dim and the mesh it is sharded over (the unit's, unless
    # shard_placement_fn returned a ShardPlacementResult).
    placements: dict[nn.Parameter, tuple[int, MeshInfo]]


def collect_params(modules: list[nn.Module], options: UnitOptions) -> CollectedParams:
    """The parameters of ``modules`` (one unit: a list is managed together) that no
    nested unit owns and that are not ignored, checked against the mesh.

    Raises:
        ValueError: a parameter on another device than the mesh's, a parameter that
            is a DTensor fully_shard cannot compose with (see :func:`check_tp_param`),
            or a module of a nested unit reachable outside it.
        NotImplementedError: a DTensor parameter with HSDP or an int
            ``reshard_after_forward``.
    """
    mesh, mesh_info, offload = options.mesh, options.mesh_info, options.offload
    ignored = set(options.ignored_params)
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
    spmd = options.spmd
    if spmd is not None:
        # See [Note: The SPMD-mesh form] in _param.py.
        for p in order:
            check_spmd_param(p, where[p][0][0], spmd)
    placements = {
        p: shard_placement(options.shard_placement_fn, p, where[p][0][0], mesh_info)
        for p in order
    }
    if spmd is not None:
        for p in order:
            if placements[p][1] != mesh_info:
                raise NotImplementedError(
                    f"shard_placement_fn returned a ShardPlacementResult for "
                    f"{where[p][0][0]!r} (another mesh than the unit's) with "
                    f"dp_mesh_dims={spmd.dims}: with the SPMD-mesh form every parameter is "
                    "sharded over the named dims of the full mesh. Return a Shard(dim) "
                    "(or None), or shard this parameter in a unit of its own."
                )
        return CollectedParams(order, where, conflicts, placements)
    replicate = options.replicate
    for p in order:
        if isinstance(p, torch.distributed.tensor.DTensor):
            # See [Note: FSDP x TP] in _param.py.
            check_tp_param(
                p, where[p][0][0], placements[p][1], options.reshard_after_forward,
                replicate is not None and replicate(p),
            )
    return CollectedParams(order, where, conflicts, placements)


def mark_managed(param: nn.Parameter, sharded: nn.Parameter, desc: str, unit: str) -> None:
    """Records on the original and the sharded parameter which unit sharded it, for
    [Note: One unit per parameter] and the message on a wrong order of calls."""
    setattr(param, _SHARDED_AS_ATTR, desc)
    setattr(sharded, _SHARD_OF_ATTR, unit)


# [Note: Post-forward meshes]
# An int ``reshard_after_forward=k`` needs a mesh of k-rank groups, built once per mesh
# object and k (it creates process groups). Keyed by identity, since a mesh rebuilt
# after re-initializing compares equal to one whose groups are gone; kept beside the
# mesh, not in its ``__dict__``, which the FX graph cache key pickles ([Note: FX graph
# cache keys across processes] in ``_cache.py``).
_post_forward_meshes: dict[int, tuple[weakref.ref[DeviceMesh], dict[int, DeviceMesh]]] = {}


def post_forward_info(mesh_info: MeshInfo, k: int) -> PostForwardInfo:
    """Groups of ``k`` consecutive ranks of each shard group. See [Note: Post-forward
    meshes]."""
    mesh = mesh_info.mesh
    key = id(mesh)
    entry = _post_forward_meshes.get(key)
    if entry is None or entry[0]() is not mesh:

        def drop(ref: weakref.ref[DeviceMesh], key: int = key) -> None:
            if _post_forward_meshes.get(key, (None,))[0] is ref:
                del _post_forward_meshes[key]

        entry = (weakref.ref(mesh, drop), {})
        _post_forward_meshes[key] = entry
    cache = entry[1]
    pf_mesh = cache.get(k)
    if pf_mesh is None:
        ranks = mesh.mesh
        shape = (*ranks.shape[:-1], ranks.shape[-1] // k, k)
        pf_mesh = DeviceMesh(mesh.device_type, ranks.reshape(shape))
        track_meshes(pf_mesh)  # See [Note: Exiting with gloo worker threads] (_exit.py).
        cache[k] = pf_mesh
    return PostForwardInfo(
        group_name=pf_mesh.get_group(pf_mesh.ndim - 1).group_name,
        size=k,
        index=pf_mesh.get_local_rank(pf_mesh.ndim - 1),
    )


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
        if mesh.mesh_dim_names is None:
            raise AssertionError(  # torch's exception and first words
                "Please init the 2D mesh for HSDP with mesh_dim_names specified: dim 0 "
                "replicates and dim 1 shards, e.g. init_device_mesh(device_type, (r, s), "
                "mesh_dim_names=('replicate', 'shard'))."
            )
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(  # torch's exception and first words
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: a 1-D mesh for FSDP "
        f"or a 2-D mesh (replicate, shard) for HSDP, not a {mesh.ndim}-D mesh of shape "
        f"{tuple(mesh.shape)}. Slice it, e.g. mesh['dp_replicate', 'dp_shard']."
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
        state = state_of(sub)
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
            unit = getattr(p, _SHARD_OF_ATTR, None)
            if unit is not None:
                raise ValueError(
                    f"Parameter {fqn!r} of {type(module).__name__} is already sharded by "
                    f"the fully_shard unit {unit}, which holds this module: fully_shard was "
                    "applied to an enclosing module first. Apply it to the blocks first, "
                    "then to the root: for block in model.layers: fully_shard(block); "
                    "then fully_shard(model)."
                )
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
_SHARD_OF_ATTR = "_traceable_hsdp_shard_of"


# [Note: One unit per parameter]
# A parameter registered on several modules (tied embedding and head) is managed once,
# by the unit whose modules hold all its registrations: one placeholder, gradients of
# all uses summed before the hook reduces them. Splitting it between units is refused:
# - still registered outside an earlier unit, a later unit would shard an untied copy:
#   the later unit leaves it out and the first forward refuses it, as torch's does;
# - a nested unit's module also reachable from the parent outside it would be read
#   sharded by the parent's forward: refused when the parent is built.


def _own_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``module`` and its submodules, pre-order, every path (duplicates included),
    without descending into nested fully_shard units."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or state_of(child) is not None:
            continue
        yield from _own_modules(child, f"{prefix}.{name}" if prefix else name)


def _check_no_torch_units(module: nn.Module) -> None:
    """Refuses ``module`` when it, or a module inside it, was sharded by torch's own
    ``fully_shard``: the two runtimes do not compose."""
    from torch.distributed.fsdp import FSDPModule

    for path, sub in _own_modules(module):
        if isinstance(sub, FSDPModule) and state_of(sub) is None:
            where = f"{type(module).__name__}.{path}" if path else type(module).__name__
            raise ValueError(
                f"{where} was already sharded by torch.distributed.fsdp.fully_shard; "
                "traceable_hsdp's fully_shard does not compose with torch's. Shard every "
                "unit of the model with one of them: import fully_shard from traceable_hsdp "
                "for each call (and apply it to the unsharded model)."
            )


def _check_no_forward_writes(module: nn.Module) -> None:
    """Refuses an ``nn.Embedding``/``EmbeddingBag`` with ``max_norm``: its in-place
    renormalization writes the gathered copy, which the reshard drops. See
    docs/real_jobs.md."""
    for path, sub in _own_modules(module):
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None:
            where = f"{type(module).__name__}.{path}" if path else type(module).__name__
            raise ValueError(
                f"{where} is an {type(sub).__name__} with max_norm={sub.max_norm}: it "
                "renormalizes its weight in place during forward, which in a fully_shard "
                "unit writes the gathered copy, and the reshard drops the change (torch's "
                "fully_shard drops it silently; a compiled step fails in AOTAutograd). Fix: "
                "set max_norm=None and apply the constraint to the weight's local shard after "
                "optimizer.step() (its rows stay whole under the default Shard(0)): with "
                "torch.no_grad(): local = w.to_local(); local.copy_(torch.renorm(local, 2, "
                "0, max_norm))."
            )


def check_modules(module: Any) -> list[nn.Module]:
    mods = list(module) if isinstance(module, (list, tuple)) else [module]
    for m in mods:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}."
            )
        if state_of(m) is not None:
            raise AssertionError(  # torch's exception and first words
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard was already applied to this {type(m).__name__}; apply "
                "it once per module."
            )
        _check_no_torch_units(m)
        _check_no_forward_writes(m)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            # Its parameters would be sharded, but no forward of its own would ever
            # gather them: its children would compute with the shards. torch's
            # fully_shard refuses it too.
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(m).__name__}. Apply it to each module in it (fully_shard(block) for "
                "block in container), or pass them as one unit: fully_shard(list(container))."
            )
    if not mods:
        raise ValueError("fully_shard got an empty list of modules.")
    return mods


def _check_reshard_after_forward(value: Any, mesh_info: MeshInfo) -> bool | int | None:
    """``True``/``False``/``None``, or an int k dividing the shard group's size ([Note:
    Reshard to a smaller world]); k equal to that size is ``True``, k = 1 ``False``."""
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
def check_grad_dtype(param: nn.Parameter, fqn: str, mp_policy: MixedPrecisionPolicy) -> None:
    """Refuses a ``grad_dtype`` set on ``param`` that torch 2.15 would reduce in
    (``reduce_dtype=None``) and ours would not. See [Note: reduce_dtype follows the
    installed torch] (_api.py)."""
    if not REDUCE_IN_GRAD_DTYPE or mp_policy.reduce_dtype is not None:
        return
    if param.dtype.is_floating_point and param.grad_dtype != param.dtype:
        raise NotImplementedError(
            f"Parameter {fqn!r} has grad_dtype={param.grad_dtype} (its dtype is "
            f"{param.dtype}); traceable_hsdp reduces gradients in the parameter's own "
            "dtype when MixedPrecisionPolicy.reduce_dtype is None. Set reduce_dtype "
            "explicitly, or leave grad_dtype at the parameter's dtype."
        )


def _check_mp_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    # torch.distributed.fsdp.MixedPrecisionPolicy has the same fields: accept it, so a
    # half-switched import still works. A field of torch's that ours lacks (a newer
    # torch) is refused, never dropped.
    if isinstance(mp_policy, _TorchMixedPrecisionPolicy):
        theirs = {f.name for f in dataclasses.fields(mp_policy)}
        ours = {f.name for f in dataclasses.fields(MixedPrecisionPolicy)}
        if theirs - ours:
            raise NotImplementedError(
                "torch's MixedPrecisionPolicy has fields traceable_hsdp does not "
                f"support on torch {torch.__version__}: {sorted(theirs - ours)}. Use a "
                "supported torch (2.13, 2.14 or 2.15) or leave them out."
            )
        return MixedPrecisionPolicy(**{n: getattr(mp_policy, n) for n in theirs})
    raise TypeError(
        "mp_policy must be a traceable_hsdp.MixedPrecisionPolicy, got "
        f"{type(mp_policy).__name__}."
    )


def shard_placement(
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    param: nn.Parameter,
    fqn: str,
    mesh_info: MeshInfo,
) -> tuple[int, MeshInfo]:
    """The dim ``shard_placement_fn`` picks for ``param`` (0 for None) and the mesh:
    the unit's, or a ``ShardPlacementResult``'s."""
    if shard_placement_fn is None:
        return 0, mesh_info
    if not callable(shard_placement_fn):
        raise TypeError(
            "shard_placement_fn must be a callable taking an nn.Parameter and returning "
            f"a Shard or None, got {type(shard_placement_fn).__name__}."
        )
    placement = shard_placement_fn(param)
    if type(placement).__name__ == "ShardPlacementResult" and hasattr(placement, "mesh_info"):
        mesh_info = mesh_info_from_result(placement.mesh_info, fqn)
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
        raise AssertionError(  # torch's exception and first words
            f"Shard dim {dim} is invalid for {ndim}D tensor: shard_placement_fn returned "
            f"Shard({dim}) for {fqn!r} of shape {tuple(data.shape)}; pick a dim in "
            f"[{-ndim}, {ndim})."
        )
    return dim % ndim, mesh_info


def mesh_info_from_result(info: Any, fqn: str) -> MeshInfo:
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


def check_tp_param(
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
        NotImplementedError: an int ``reshard_after_forward``; ``hsdp()`` keeping
            the parameter whole (replicated) with TP.
    """
    check_tp_placements(param, fqn)
    if replicate:
        raise NotImplementedError(
            f"Parameter {fqn!r} is a DTensor (placements {tuple(param.placements)}, from "
            "parallelize_module) and hsdp() keeps it whole over the data-parallel ranks "
            "(smaller than threshold, or in replicate_params): a TP parameter can be "
            "sharded over the data-parallel mesh, FSDP or HSDP, but not kept whole. Pass "
            "threshold=0 and leave it out of replicate_params, or use fully_shard. See "
            "docs/api.md."
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
