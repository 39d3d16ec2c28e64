"""The parameters of one fully_shard unit, gathered and reduced together."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._annotate import call_annotated
from ._common import MeshInfo, ShardedState, TrainingState
from ._param import FSDPParam


# [Note: When a unit's backward is done]
# A unit may free its parameters once no backward op still needs them. A trainable
# parameter W is safe once its post-accumulate-grad hook ran: every op that read W
# also produces a gradient for W, and accumulation waits for all of them. A frozen
# parameter is not: an op that reads it only to produce its input's gradient (the
# ``dx = dy @ W`` of a frozen linear) is ordered before no accumulation at all, and
# freeing W under it is a use-after-free (seen: SIGSEGV). Every such op ends in a
# gradient of the unit's forward inputs, so the unit is done when all trainable
# gradients AND the gradients of all forward inputs that require grad are complete.
# The pre-forward registers a tensor hook on each such input (returning the gradient
# it gets, as compiled autograd requires) and the unit counts both kinds down.


class FSDPParamGroup:
    """All managed parameters of one fully_shard call.

    The group is the unit of the lifecycle verbs: ``unshard`` (= ``issue_unshard``,
    which starts the all-gathers, then ``wait_for_unshard``, which waits and fills the
    placeholders), ``reshard`` (free every placeholder) and the post-backward
    reduction. Each parameter keeps its own collective here; the fusion pass
    (``traceable_hsdp.passes``) merges a group's collectives in the compiled graph,
    and the eager path keeps the same per-parameter collectives so both modes
    compute the same numbers.
    """

    def __init__(self, fsdp_params: list[FSDPParam], mesh_info: MeshInfo, label: str):
        self.fsdp_params = fsdp_params
        self.mesh_info = mesh_info
        self.label = label  # the unit's module class name, for messages
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        # All-gather outputs issued but not yet waited for (one per parameter, 1D
        # list of ND tensors), or None.
        self._pending: list[torch.Tensor] | None = None
        self._grads_pending = 0  # placeholder grads not yet handled this backward
        # Settable per unit through FSDPModule's set_* methods.
        self.reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.all_reduce_grads = True  # HSDP: all-reduce over the replicas
        self.force_sum = False  # sum in the collectives, divide locally
        self.unshard_in_backward = True
        self.trainable = [p for p in fsdp_params if p.unsharded_param.requires_grad]
        self.input_grad_hooks = 0  # forward inputs with a post-backward hook, last forward


    # --------------------------------------------------------------- lifecycle
    def issue_unshard(self) -> None:
        """Starts the all-gathers (no wait). Idempotent; no-op when gathered."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending is not None:
            return
        with torch.no_grad():
            # See [Note: Collective annotations] (_annotate.py).
            self._pending = [
                call_annotated(self.label, p.fqn, p.all_gather_start) for p in self.fsdp_params
            ]

    def wait_for_unshard(self) -> None:
        """Waits for the all-gathers (issuing them first if needed) and fills the
        placeholders. Idempotent."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        self.issue_unshard()
        pending = self._pending
        if pending is None:
            raise AssertionError(f"{self.label}: no all-gather issued, state {self.sharded_state}")
        self._pending = None
        with torch.no_grad():
            gathered = [p.wait_gathered(t) for p, t in zip(self.fsdp_params, pending)]
            for p, g in zip(self.fsdp_params, gathered):
                p.fill_unsharded(g)
        self.sharded_state = ShardedState.UNSHARDED

    def unshard(self) -> None:
        """All-gathers every parameter into its placeholder. Idempotent."""
        self.issue_unshard()
        self.wait_for_unshard()

    def register_unsharded(self) -> None:
        """The modules hold the placeholders (the data must be gathered)."""
        for p in self.fsdp_params:
            p.register_unsharded()

    def register_sharded(self) -> None:
        """The modules hold the sharded parameters (the data may stay gathered)."""
        for p in self.fsdp_params:
            p.register_sharded()

    def reshard(self) -> None:
        """Frees every placeholder and puts the sharded parameters back. Idempotent.
        An all-gather still in flight is waited for and dropped."""
        self._drop_pending()
        for p in self.fsdp_params:
            p.reshard()
        self.sharded_state = ShardedState.SHARDED

    def _drop_pending(self) -> None:
        if self._pending is not None:
            for p, t in zip(self.fsdp_params, self._pending):
                p.wait_gathered(t)
            self._pending = None

    def post_forward_reshard(self) -> None:
        """Frees every placeholder, keeping each parameter's post-forward block (an int
        ``reshard_after_forward``; see [Note: Reshard to a smaller world] in
        ``_param.py``)."""
        self._drop_pending()
        for p in self.fsdp_params:
            p.post_forward_reshard()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    @contextmanager
    def use_training_state(self, state: TrainingState) -> Iterator[None]:
        old = self.training_state
        self.training_state = state
        try:
            yield
        finally:
            self.training_state = old

    # ---------------------------------------------------------------- backward
    # See [Note: When a unit's backward is done].
    def pre_backward(self) -> None:
        """Re-gathers before this unit's backward (no-op if still unsharded)."""
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
        self._grads_pending = len(self.trainable) + self.input_grad_hooks

    def post_accumulate_grad(self, fsdp_param: FSDPParam) -> None:
        """Runs when ``fsdp_param``'s placeholder gradient is complete for this
        backward: reduces it into the sharded gradient (unless gradient sync is off,
        when it stays on the placeholder and accumulates over micro-batches)."""
        p = fsdp_param.unsharded_param
        grad = p.grad.to(fsdp_param.reduce_dtype)
        p.grad = None
        # Gradients held back by set_requires_gradient_sync(False) accumulate here,
        # in reduce_dtype (fp32 under bf16 mixed precision, as torch's FSDP2 does).
        if fsdp_param.accumulated_grad is not None:
            grad = fsdp_param.accumulated_grad + grad
            fsdp_param.accumulated_grad = None
        if self.reduce_grads:
            call_annotated(
                self.label,
                fsdp_param.fqn,
                fsdp_param.reduce_grad,
                grad,
                self._divide_factor(),
                self.all_reduce_grads,
            )
        else:
            fsdp_param.accumulated_grad = grad
        self._count_down()

    def _divide_factor(self) -> float | None:
        if self.gradient_divide_factor is None and self.force_sum:
            return float(self.mesh_info.shard_size * self.mesh_info.replicate_size)
        return self.gradient_divide_factor

    def input_grad_ready(self) -> None:
        """Runs when the gradient of one of the unit's forward inputs is complete."""
        self._count_down()

    def _count_down(self) -> None:
        self._grads_pending -= 1
        if self._grads_pending == 0:
            self.finish_backward()

    def finish_backward(self) -> None:
        """Ends the unit's backward: frees the parameters when resharding after
        backward, and goes idle."""
        if self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self._grads_pending = 0
