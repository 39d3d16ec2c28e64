"""The parameters of one fully_shard unit, gathered and reduced together."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._annotate import call_annotated
from ._common import MeshInfo, ShardedState, TrainingState, refusal
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
#
# A unit whose forward runs several times before one backward (weight reuse, a block
# applied twice) registers input hooks in every call; the count sums them, and the
# pre-backward takes it (and starts the next count from 0). The first use's backward
# to run re-gathers; the unit stays gathered until the last use's backward is done,
# because the parameters' gradients are complete only after every use (one
# AccumulateGrad per parameter). torch's FSDP2 instead reshards after each use's
# backward and re-gathers for the next: less memory between uses, one more
# all-gather per extra use. Inputs hooked in a forward whose output never reaches a
# backward keep the unit from finishing by the count; the end of the backward
# finishes it (see [Note: Hooks and compiled autograd] in ``_state.py``).


# [Note: The all-reduce hook]
# ``set_all_reduce_hook(hook)`` calls ``hook`` on each gradient once it is fully
# reduced: the reduce-scatter output for FSDP, the all-reduce output for HSDP (for a
# replicated parameter of ``hsdp()``, its all-reduce output), in ``reduce_dtype``,
# before the division by a gradient divide factor and before it is accumulated into
# the sharded parameter's ``.grad``; the hook may change it in place (its return
# value is ignored), as torch's does. torch reduces a unit in one flat buffer and
# calls the hook once on it; we reduce each parameter separately, so the hook runs
# once per trainable parameter, on that parameter's local shard (its sharded shape).
# It runs inside the post-accumulate-grad hook, so compiled autograd traces it into
# the backward graph like everything else there.
#
# ``stream=`` runs the hook on another stream (FSDP only, eager only): the stream
# waits for the current one, the hook runs under it, and the current stream waits
# for it before the gradient is used. Streams are eager-only here (see STYLE: one
# branch, ``_call_on_stream``); a traced backward refuses a hook stream instead of
# dropping it.


# [Note: Unused parameters]
# Each parameter's gradient is reduced when its post-accumulate-grad hook fires, in
# autograd's order. When ranks take different branches, a parameter one rank used
# and another did not would be reduced on the first rank only, and the collectives
# would no longer pair up across ranks (a hang, or wrong data). With
# ``set_reduce_scatter_unused_params(True)`` a unit instead keeps each gradient
# (summed in ``reduce_dtype``, where gradient accumulation keeps it) and reduces all
# of its trainable parameters together at the end of the backward, in registration
# order, a zero gradient for each that got none: every rank issues the same
# collectives in the same order, as torch's reduction of a whole unit does. The root
# runs it from its end-of-backward callback, for the units in module order, every
# unit with the option on (one whose forward did not run gets zero gradients, as in
# torch once the unit has been gathered). The branches must be inside units: a
# unit's forward still has to run on every rank, its all-gather being a collective.
# Cost: the unit's unsharded gradients live until the end of the backward (its
# parameters are still freed when their gradients are complete). Without the option
# the test's run (tests/test_module_methods.py) aborts a rank with SIGABRT (gloo,
# mismatched collectives). A compiled backward has no end-of-backward callback (see
# [Note: Hooks and compiled autograd] in ``_state.py``), so the option is refused
# when the backward is compiled.


# [Note: Held gradients of unused parameters]
# With gradient sync off (``set_requires_gradient_sync(False)``) each gradient is kept
# unreduced and the syncing backward adds it to the new one before reducing. A
# parameter used in the no-sync micro-batches but not in the syncing one (a mixture of
# experts' expert that got no token) has no post-accumulate-grad hook call in that
# backward; its kept gradient would stay unreduced and be added to a later step's,
# after the optimizer stepped without it. Eagerly the root's final callback reduces
# such gradients (``reduce_held_grads``), as torch's FSDP2 reduces a unit's
# accumulated gradients in its post-backward (also for a unit whose forward did not
# run in the syncing step). A compiled backward has no final callback; the root's
# next pre-forward finds the kept gradients of a unit whose backward ran
# (``held_after_sync``) and raises: too late to reduce. Known gap: a unit whose
# forward did not run at all in a compiled syncing step is not checked (checking
# every unit adds guards that change between micro-batches: recompiles).


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
        # See [Note: The all-reduce hook].
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        # See [Note: Unused parameters].
        self.reduce_scatter_unused_params = False
        # reduce_grads as the last backward began; see [Note: Held gradients of
        # unused parameters].
        self.backward_syncs = False
        self.trainable: list[FSDPParam] = []
        self.refresh_trainable()
        # Forward inputs given a gradient hook since the last pre-backward, summed over
        # every call of the unit's forward. See [Note: When a unit's backward is done].
        self.input_grad_hooks = 0

    def refresh_trainable(self) -> None:
        """The parameters that get gradients: those whose placeholder requires grad."""
        self.trainable = [p for p in self.fsdp_params if p.unsharded_param.requires_grad]

    def reset_sharded_params(self, check_device: bool = True) -> None:
        """Reads every sharded parameter again after the user changed one. See
        [Note: Changes after fully_shard] in ``_param.py``."""
        self.reshard()
        for fp in self.fsdp_params:
            fp.reset_sharded_param(check_device)
        self.refresh_trainable()

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

    # ---------------------------------------------------------------- backward
    # See [Note: When a unit's backward is done].
    def pre_backward(self) -> None:
        """Re-gathers before this unit's backward (no-op if still unsharded)."""
        self.training_state = TrainingState.PRE_BACKWARD
        self.backward_syncs = self.reduce_grads
        if self.unshard_in_backward:
            self.unshard()
            if not torch.compiler.is_compiling():
                # See [Note: The module holds the placeholder only in forward] (_param.py).
                self.register_unsharded()
        self._grads_pending = len(self.trainable) + self.input_grad_hooks
        self.input_grad_hooks = 0

    def post_accumulate_grad(self, fsdp_param: FSDPParam) -> None:
        """Runs when ``fsdp_param``'s placeholder gradient is complete for this
        backward: reduces it into the sharded gradient (unless gradient sync is off,
        when it stays on the placeholder and accumulates over micro-batches)."""
        p = fsdp_param.unsharded_param
        if not fsdp_param.sharded_param.requires_grad:
            # Frozen after fully_shard, seen while tracing: see [Note: Changes after
            # fully_shard] (_param.py).
            p.grad = None
            self._count_down()
            return
        grad = p.grad.to(fsdp_param.reduce_dtype)
        p.grad = None
        # Gradients held back by set_requires_gradient_sync(False) accumulate here,
        # in reduce_dtype (fp32 under bf16 mixed precision, as torch's FSDP2 does).
        if fsdp_param.accumulated_grad is not None:
            grad = fsdp_param.accumulated_grad + grad
            fsdp_param.accumulated_grad = None
        if self.reduce_grads and not self.reduce_scatter_unused_params:
            self._reduce(fsdp_param, grad)
        else:
            # Kept for a later backward, or for the end of this one: see
            # [Note: Unused parameters].
            fsdp_param.accumulated_grad = grad
        self._count_down()

    def reduce_held_grads(self) -> None:
        """At the end of a backward with gradient sync on (eager: the root's final
        callback), reduces the gradients still kept, in registration order: with
        ``reduce_scatter_unused_params`` every trainable parameter's, a zero gradient
        for one that got none (see [Note: Unused parameters]); without it, those
        kept by earlier no-sync backwards for a parameter that got no gradient in this
        one (see [Note: Held gradients of unused parameters])."""
        if not self.reduce_grads:
            return
        for fp in self.trainable:
            grad = fp.accumulated_grad
            if grad is None and not self.reduce_scatter_unused_params:
                continue
            fp.accumulated_grad = None
            if grad is None:
                grad = torch.zeros(fp.orig_size, dtype=fp.reduce_dtype, device=fp.device)
            self._reduce(fp, grad)

    def held_after_sync(self) -> list[str]:
        """FQNs of the gradients a finished syncing backward left unreduced: kept by
        earlier no-sync backwards, their parameter got no gradient in it, and no final
        callback reduced them (a compiled backward). See [Note: Held gradients of
        unused parameters]."""
        held = [fp.fqn for fp in self.trainable if fp.accumulated_grad is not None]
        # backward_syncs is read only when something is held: a compiled pre-forward
        # then guards on it only in that case (it changes every step; no recompiles).
        return held if held and self.backward_syncs else []

    def _reduce(self, fsdp_param: FSDPParam, grad: torch.Tensor) -> None:
        call_annotated(
            self.label,
            fsdp_param.fqn,
            fsdp_param.reduce_grad,
            grad,
            self._divide_factor(fsdp_param.mesh_info),
            self.all_reduce_grads,
            self._reduced_hook(),
        )

    def _reduced_hook(self) -> Callable[[torch.Tensor], None] | None:
        """The all-reduce hook as ``reduce_grad`` calls it. See
        [Note: The all-reduce hook]."""
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        if hook is None or stream is None:
            return hook
        return lambda reduced: _call_on_stream(hook, reduced, stream)

    def _divide_factor(self, mesh_info: MeshInfo) -> float | None:
        """For a parameter sharded over ``mesh_info`` (the unit's, or the one
        shard_placement_fn gave it)."""
        if self.gradient_divide_factor is None and self.force_sum:
            return float(mesh_info.shard_size * mesh_info.replicate_size)
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
        else:
            self.register_sharded()  # the data stays gathered for the next forward
        self.training_state = TrainingState.IDLE
        self._grads_pending = 0

    def reset(self) -> None:
        """Back to the state before any forward, after an exception stopped one (see
        ``FSDPModule.reset_iter_state``): waits for and drops in-flight all-gathers,
        frees every placeholder, and drops the gradients this iteration left
        unreduced (placeholder gradients, those kept by gradient accumulation, and
        HSDP shard-reduced gradients not yet all-reduced). Sharded gradients already
        reduced stay."""
        self.reshard()
        for fp in self.fsdp_params:
            fp.unsharded_param.grad = None
            fp.accumulated_grad = None
            if fp.replicas_pending:
                fp.sharded_param.grad = None
                fp.replicas_pending = False
        self.training_state = TrainingState.IDLE
        self._grads_pending = 0
        self.input_grad_hooks = 0
        self.backward_syncs = False


HOOK_STREAM_COMPILE_FIX = (
    "traceable_hsdp: set_all_reduce_hook(..., stream=...) runs the hook on another "
    "stream, which only the eager backward does; this backward is compiled, where the "
    "hook is traced into the graph on the current stream. Pass stream=None (the "
    "default) for a compiled backward. See [Note: The all-reduce hook]."
)


_refuse_hook_stream_compiled = refusal(HOOK_STREAM_COMPILE_FIX)


def _call_on_stream(
    hook: Callable[[torch.Tensor], None], reduced: torch.Tensor, stream: torch.Stream
) -> None:
    """Runs ``hook(reduced)`` on ``stream``, ordered after the current stream's work
    and before its later work. Eager only. See [Note: The all-reduce hook]."""
    if torch.compiler.is_compiling():
        _refuse_hook_stream_compiled()
    current = torch.accelerator.current_stream(reduced.device)
    stream.wait_stream(current)
    with stream:
        hook(reduced)
    current.wait_stream(stream)
