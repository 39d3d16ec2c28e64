"""What torch's own code sees of a unit's state: ``TorchStateView``, returned by
``FSDPModule._get_fsdp_state()`` and registered where torch's ``fully_shard.state``
looks (``expose_to_torch``). See [Note: A subclass of torch's FSDPModule] in
``_module.py``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._param_group import FSDPParamGroup
from ._state import FSDPState
from ._torch_internals import resolve

__all__ = ["TorchStateView", "expose_to_torch"]


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
        param_group = self._state.param_group
        return [] if param_group is None else [_TorchGroupView(param_group)]

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


def expose_to_torch(modules: list[nn.Module], state: FSDPState) -> None:
    """Makes torch's ``fully_shard.state(module)`` return the unit's view, and marks
    the modules as fully_shard's in torch's composable-API registry, so torch's
    ``replicate()`` leaves their parameters alone. See [Note: A subclass of torch's
    FSDPModule]."""
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
