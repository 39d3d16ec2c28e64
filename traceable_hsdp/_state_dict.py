"""The state-dict hooks of a unit: ``state_dict()`` returns the sharded DTensors and
``load_state_dict()`` loads into them, whatever the unit holds at the time. See
[Note: state_dict and load_state_dict].
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._param import FSDPParam

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["register_load_subtree_hook", "register_state_dict_hooks"]


# [Note: state_dict and load_state_dict]
# Outside a unit's forward its modules hold the sharded DTensors under the original
# names, so ``state_dict()`` returns DTensors keyed by the original FQNs and
# ``load_state_dict()`` copies into the sharded parameters (DTensor.copy_). Pre-hooks
# make three cases work that would otherwise be wrong or fail:
#
# - state_dict() between unshard() and reshard(): a pre-hook registers the sharded
#   parameters again (the gathered data stays).
# - load_state_dict() while the unit holds gathered data: the pre-hooks reshard first,
#   since the gathered copy would be stale, as torch's FSDP2 does.
# - a plain tensor of the full shape (a consolidated state dict): turned into a DTensor
#   with distribute_tensor(..., src_data_rank=None), each rank keeping its shard
#   without communication. Every rank must pass the same values.
#
# With assign=True the loaded DTensor becomes the sharded parameter
# (FSDPParam.reset_sharded_param); the pre-hook checks its mesh, placements and dtype.
# The unit module's pre-hook prepares every value below it before any module loads, so
# a refused value raises before anything is copied; a pre-hook on each module holding
# managed parameters covers load_state_dict() called inside a unit.


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


def register_state_dict_hooks(
    state: FSDPState, by_module: dict[nn.Module, list[tuple[str, FSDPParam]]]
) -> None:
    """Registers the unit's state-dict hooks on its modules and on each module holding
    its parameters (``by_module``). See [Note: state_dict and load_state_dict]."""
    for m in state.modules:
        m.register_load_state_dict_post_hook(functools.partial(_after_load_state_dict, state))
    for m, params in by_module.items():
        m.register_state_dict_pre_hook(functools.partial(_before_state_dict, state))
        m.register_load_state_dict_pre_hook(
            functools.partial(_before_load_own_params, state, params)
        )


def register_load_subtree_hook(state: FSDPState) -> None:
    """Registers the pre-hook on the unit's modules that prepares the values of the
    unit and of the units nested in it. See [Note: state_dict and load_state_dict]."""
    for m in state.modules:
        m.register_load_state_dict_pre_hook(functools.partial(_before_load_subtree, state))


def _before_state_dict(state: FSDPState, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if state.param_group is not None:
        state.param_group.register_sharded()


def _before_load_subtree(
    unit: FSDPState,
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
    for state in unit.states:
        param_group = state.param_group
        if param_group is None:
            continue
        reached = False
        for fp in param_group.fsdp_params:
            for info in fp.module_infos:
                for path in paths.get(id(info.module), ()):
                    key = prefix + path + info.param_name
                    _prepare_loaded_value(state_dict, key, fp, assign)
                    reached = True
        if reached:
            param_group.reshard()  # See [Note: state_dict and load_state_dict].


def _before_load_own_params(
    state: FSDPState,
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
    if state.param_group is not None:
        state.param_group.reshard()  # See [Note: state_dict and load_state_dict].


def _after_load_state_dict(state: FSDPState, module: nn.Module, incompatible_keys: Any) -> None:
    if state.param_group is not None:
        # A shared parameter stays shared: the unit keeps the first assigned tensor.
        # The device is checked at the next forward (a list unit's other modules may
        # not be loaded yet).
        state._apply_user_changes(check_device=False)
