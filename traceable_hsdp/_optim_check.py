"""No optimizer steps a parameter the model no longer trains: the process-wide
optimizer check.

[Note: An optimizer must hold the model's sharded parameters]
Between a forward and its backward, a unit that stays gathered (the root, by default)
has its modules hold its gathered parameters, as torch's ``fully_shard`` does ([Note:
The module holds the placeholder only in forward] in ``_param.py``), also after a
forward whose backward never runs. An optimizer built from ``model.parameters()`` then
steps copies the next reshard frees: the root's parameters silently never train (so
with torch's ``fully_shard`` too). Likewise an optimizer built before ``fully_shard``
holds the replaced parameters, which get no gradients.

:func:`install_optimizer_check` (``fully_shard`` calls it) registers
:func:`check_optimizer_params` with
``torch.optim.optimizer.register_optimizer_step_pre_hook``. Units register their
placeholders (:func:`register_placeholder`) and the parameters they replaced
(:func:`register_replaced`, weakly), and the hook raises ``RuntimeError`` at the first
step of an optimizer holding one, naming the parameter and the fix: a dict lookup per
parameter per step. Nothing is checked while dynamo traces (a guard per parameter), so
an optimizer whose step is only ever compiled is not checked.
:func:`uninstall_optimizer_check` removes the hook ([Note: Global switches]).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = [
    "check_optimizer_params",
    "install_optimizer_check",
    "register_placeholder",
    "register_replaced",
    "uninstall_optimizer_check",
]

# id(tensor) -> (a weak reference to it, its parameter's name, why no optimizer may
# hold it: _GATHERED or _REPLACED). An entry goes when its tensor is collected.
_registry: dict[int, tuple[weakref.ref[torch.Tensor], str, str]] = {}
_handle: RemovableHandle | None = None
_GATHERED = "gathered"
_REPLACED = "replaced"


def _register(tensor: torch.Tensor, fqn: str, why: str) -> None:
    key = id(tensor)
    _registry[key] = (weakref.ref(tensor, lambda _: _registry.pop(key, None)), fqn, why)


def register_placeholder(placeholder: torch.Tensor, fqn: str) -> None:
    """Marks ``placeholder`` (a unit's unsharded parameter, named ``fqn``) as one no
    optimizer may hold."""
    _register(placeholder, fqn, _GATHERED)


def register_replaced(param: torch.Tensor, fqn: str) -> None:
    """Marks ``param``, the parameter ``fully_shard`` replaced by the sharded one named
    ``fqn``, as one no optimizer may hold."""
    _register(param, fqn, _REPLACED)


def check_optimizer_params(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer step pre-hook. See [Note: An optimizer must hold the model's sharded
    parameters].

    Raises:
        RuntimeError: ``optimizer`` holds a fully_shard unit's gathered parameter, or
            a parameter fully_shard replaced.
    """
    if torch.compiler.is_compiling() or not _registry:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _registry.get(id(p))
            if entry is None or entry[0]() is not p:
                continue
            if entry[2] == _REPLACED:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds a parameter the model no longer has: "
                    f"{entry[1]!r} as it was before fully_shard replaced it by its sharded "
                    "DTensor (or before an assignment or load_state_dict(assign=True) "
                    "replaced that). The optimizer was built before the replacement, and "
                    "stepping it would never update the model. Build the optimizer after "
                    "fully_shard (and after any assign=True load), from model.parameters()."
                )
            raise RuntimeError(
                f"{type(optimizer).__name__} holds the gathered parameter {entry[1]!r} "
                "of a fully_shard unit, not its sharded DTensor: it was built from "
                "model.parameters() after a forward whose backward had not run (the "
                "root unit's modules hold its gathered parameters until then, as "
                "torch's fully_shard), and stepping it would never update the model. "
                "Build the optimizer before the first forward or after a backward, "
                "or run that forward under torch.no_grad()."
            )


def install_optimizer_check() -> None:
    """Registers :func:`check_optimizer_params` for every optimizer. Idempotent."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(check_optimizer_params)


def uninstall_optimizer_check() -> None:
    """Removes the hook :func:`install_optimizer_check` registered, if any."""
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
