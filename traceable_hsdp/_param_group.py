"""The parameters of one fully_shard unit, gathered and reduced together."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._common import MeshInfo, ShardedState, TrainingState
from ._param import FSDPParam


class FSDPParamGroup:
    """All managed parameters of one fully_shard call.

    The group is the unit of the lifecycle verbs: ``unshard`` (all-gather every
    parameter and fill its placeholder), ``reshard`` (free every placeholder) and the
    post-backward reduction. Each parameter keeps its own collective here; the
    fusion pass (``traceable_hsdp.passes``) merges a group's collectives in the
    compiled graph, and the eager path keeps the same per-parameter collectives so
    both modes compute the same numbers.
    """

    def __init__(self, fsdp_params: list[FSDPParam], mesh_info: MeshInfo, label: str):
        self.fsdp_params = fsdp_params
        self.mesh_info = mesh_info
        self.label = label  # the unit's module FQN ("" for the root), for messages
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._grads_pending = 0  # placeholder grads not yet reduced this backward

    # --------------------------------------------------------------- lifecycle
    def unshard(self) -> None:
        """All-gathers every parameter into its placeholder. Idempotent."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        with torch.no_grad():
            gathered = [p.all_gather() for p in self.fsdp_params]
            for p, g in zip(self.fsdp_params, gathered):
                p.fill_unsharded(g)
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Frees every placeholder and puts the sharded parameters back. Idempotent."""
        if self.sharded_state is ShardedState.SHARDED:
            return
        for p in self.fsdp_params:
            p.reshard()
        self.sharded_state = ShardedState.SHARDED

    @contextmanager
    def use_training_state(self, state: TrainingState) -> Iterator[None]:
        old = self.training_state
        self.training_state = state
        try:
            yield
        finally:
            self.training_state = old

    # ---------------------------------------------------------------- backward
    def pre_backward(self) -> None:
        """Re-gathers before this unit's backward (no-op if still unsharded)."""
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self._grads_pending = sum(
            1 for p in self.fsdp_params if p.unsharded_param.requires_grad
        )

    def post_accumulate_grad(self, fsdp_param: FSDPParam) -> None:
        """Runs when ``fsdp_param``'s placeholder gradient is complete: reduces it,
        frees the placeholder gradient, and frees the parameter."""
        p = fsdp_param.unsharded_param
        grad = p.grad
        p.grad = None
        fsdp_param.reduce_grad(grad)
        fsdp_param.reshard()
        self._grads_pending -= 1
        if self._grads_pending == 0:
            self.finish_backward()

    def finish_backward(self) -> None:
        """Leaves the group sharded (frees parameters that got no gradient)."""
        self.reshard()
        self.training_state = TrainingState.IDLE
        self._grads_pending = 0
