"""The parameters of one fully_shard unit, gathered and reduced together."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _custom_comm as custom_comm
from ._annotate import call_annotated, collective_annotation
from ._collectives import (
    all_gather_start,
    all_reduce,
    chunk_cat,
    copy_out,
    reduce_scatter,
    wait_all_gather,
)
from .passes._graph import UnitPassOptions
from ._common import (
    MeshInfo,
    ShardedState,
    compiled_backward,
    compiling,
    refusal,
    unit_forwards_in_frame,
)
from ._extension import as_plain
from ._param import FSDPParam


# [Note: When a unit's backward is done]
# A unit may free its parameters once no backward op still needs them. A trainable
# parameter W is safe once its post-accumulate-grad hook ran: every op that read W also
# produces a gradient for W. A frozen one is not: ``dx = dy @ W`` reads it and feeds no
# accumulation, and freeing W under it is a use-after-free. Such ops end in gradients of
# the unit's forward inputs, so a unit with a frozen parameter is done when all
# trainable gradients AND all input gradients are complete; it counts both down.
#
# Eagerly, every pre-forward passes the inputs that require grad through torch's
# ``RegisterPostBackwardFunction``, as torch's FSDP2 does, so a tensor several units
# read sums its gradient in torch's order (bitwise parity). Compiled, where that
# trigger fails, a unit with a frozen parameter hooks a fresh alias (``view_as``) of
# each input, made in this forward (a tensor living across steps would collect a hook
# per step). A unit whose parameters all train reads no count, so pipeline micro-batch
# forwards share one graph (tests/test_pipelining.py). A forward run several times
# before one backward sums its counts; the unit stays gathered until the last use's
# backward is done.


# [Note: The all-reduce hook]
# ``set_all_reduce_hook(hook)`` calls ``hook`` on each gradient once fully reduced (the
# reduce-scatter output for FSDP, the all-reduce output for HSDP), in ``reduce_dtype``,
# before division and accumulation; it may change it in place, as torch's does. torch
# calls it once on the unit's flat buffer; ours runs once per trainable parameter on its
# local shard, eager and traced alike, inside the post-accumulate-grad hook so compiled
# autograd traces it. ``stream=`` (FSDP, eager only) runs it on another stream joined
# both ways; a traced backward refuses a hook stream instead of dropping it.


# [Note: Unused parameters]
# When ranks take different branches, a parameter used on one rank and not another
# would be reduced on one rank only (traced) or in different flat reductions (eager):
# the collectives no longer pair up (a hang or wrong data). With
# ``set_reduce_scatter_unused_params(True)`` a unit keeps each gradient and reduces all
# its trainable parameters together at the end of the backward, in registration order,
# with zeros for those that got none, so every rank issues the same collectives, as
# torch's whole-unit reduction does. The root runs it from its end-of-backward callback
# for every unit with the option on. The branches must be inside units (a unit's forward
# still runs an all-gather). Cost: the unit's unsharded gradients live until the end of
# the backward. Tested in tests/test_module_methods.py. A compiled backward has no
# end-of-backward callback ([Note: Hooks and compiled autograd]), so the option is
# refused there.


# [Note: Held gradients of unused parameters]
# With gradient sync off each gradient is kept unreduced and added to the syncing
# backward's. A parameter unused in the syncing backward (an expert that got no token)
# would keep its gradient past the optimizer step. Eagerly the root's final callback
# reduces it (``reduce_held_grads``), as torch's post-backward does. A compiled backward
# has no final callback; the next pre-forward finds such gradients (``held_after_sync``)
# and raises. Known gap: a unit whose forward did not run in a compiled syncing step is
# not checked (checking every unit would add guards that recompile).


# [Note: One collective per unit, eagerly]
# Eagerly a unit issues one all-gather per process group and dtype and, once all its
# trainable gradients are complete, one reduce-scatter (and for HSDP one all-reduce), as
# torch's FSDP2 does: backends charge latency per call. Buffers are laid out as in
# [Note: Flat buffers] (``_collectives.py``): one flat input per group and dtype
# (``_foreach_copy_`` in, ``split_with_sizes_copy``
# out) for the all-gather; the gradients kept on ``accumulated_grad`` until the last
# one, then one ``_chunk_cat`` and reduce-scatter, then per parameter what
# ``FSDPParam.reduce_grad`` does. Replicated parameters and one-rank groups take the
# per-parameter path. The numbers are the per-parameter ones (bitwise on two ranks)
# and torch's; tests/test_eager_flat.py counts the collectives and checks parity.
#
# A traced unit keeps one collective per parameter ([Note: Eager or traced]) for the
# passes to bucket. An eager all-gather waited for by a traced forward
# (``unshard(async_op=True)``) is waited for by a dynamo-disabled function.


@dataclass
class _FlatGather:
    """One flat all-gather in flight: the parameters it serves, their copy-out
    targets and per-rank sizes, and its output (1D, ``world_size * sum(numels)``)."""

    params: list[FSDPParam]
    numels: list[int]
    world_size: int
    output: torch.Tensor
    work: dist.Work | None = None  # a custom comm's: [Note: Custom collectives]


@dataclass
class _EagerUnshard:
    """A unit's eager unshard in flight: the flat all-gathers, and the parameters that
    issue none (their gathered tensor, already final)."""

    flat: list[_FlatGather]
    single: list[tuple[FSDPParam, torch.Tensor]]


class FSDPParamGroup:
    """All managed parameters of one fully_shard call.

    The group is the unit of the lifecycle verbs: ``unshard`` (``issue_unshard`` then
    ``wait_for_unshard``), ``reshard`` and the post-backward reduction. Traced, each
    parameter keeps its own collective for the passes to bucket; eagerly the group
    issues one flat collective of each kind ([Note: One collective per unit, eagerly]).
    """

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        mesh_info: MeshInfo,
        label: str,
        pass_options: UnitPassOptions | None = None,
    ):
        self.fsdp_params = fsdp_params
        self.mesh_info = mesh_info
        # Class name, then the path under the root (FSDPState.adopt_nested).
        self.label = label
        # frame_labels[k - 1] is traced when the frame holds k unit forwards; see
        # traced_label.
        self.frame_labels: tuple[str, ...] = (label,)
        # From pre_backward to finish_backward; see [Note: A unit's state and its
        # group's backward] (_state.py).
        self.in_backward = False
        self.sharded_state = ShardedState.SHARDED
        # All-gathers in flight: traced, one output per parameter; eagerly, one
        # _EagerUnshard.
        self._pending: list[torch.Tensor] | _EagerUnshard | None = None
        self._grads_pending = 0  # placeholder grads not yet handled this backward
        # Eager: trainable gradients kept for the unit's flat reduction since the
        # last one. See [Note: One collective per unit, eagerly].
        self._grads_ready = 0
        # Settable per unit through FSDPModule's set_* methods.
        self.reduce_grads = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None
        self.all_reduce_grads = True  # HSDP: all-reduce over the replicas
        self.force_sum = False  # sum in the collectives, divide locally
        self.unshard_in_backward = True
        # See [Note: The all-reduce hook].
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        # See [Note: Per-unit pass options] (passes).
        self.pass_options = pass_options
        self.all_reduce_hook_stream: torch.Stream | None = None
        # See [Note: Unused parameters].
        self.reduce_scatter_unused_params = False
        # torch's reduce-scatter copy-in cap; recorded, see
        # FSDPModule.set_reduce_scatter_max_input_buffers.
        self.reduce_scatter_max_input_buffers = 1
        # See [Note: Custom collectives] (_custom_comm.py).
        self.all_gather_comm: Any = None
        self.reduce_scatter_comm: Any = None
        # reduce_grads as the last backward began; see [Note: Held gradients of
        # unused parameters].
        self.backward_syncs = False
        self.trainable: list[FSDPParam] = []
        self.refresh_trainable()
        # See [Note: When a unit's backward is done].
        self.input_grad_hooks = 0
        # See [Note: Output hooks after the unit's backward] (_state.py).
        self.open_calls: list[list[bool]] = []
        # Eager: what the last finished backward used, for running its graph again.
        # See [Note: A second backward through a retained graph].
        self._input_hooks_used = 0
        self._finished: tuple[int, list[list[bool]], int] | None = None

    @property
    def traced_label(self) -> str:
        """The label traced into the unit's collective annotations. See [Note: One
        graph for every unit of a class] (_common.py)."""
        k = unit_forwards_in_frame()
        return self.frame_labels[k - 1] if 0 < k <= len(self.frame_labels) else self.label

    def pass_options_key(self) -> str:
        """This unit and its own pass options, for the FX graph cache key; see
        [Note: Per-unit options and the FX graph cache] (passes/_install.py)."""
        return f"{self.label}={self.pass_options!r}"

    def refresh_trainable(self) -> None:
        """The parameters that get gradients: those whose placeholder requires grad."""
        self.trainable = [p for p in self.fsdp_params if p.unsharded_param.requires_grad]

    @property
    def counts_input_grads(self) -> bool:
        """Whether the unit holds a frozen parameter, so its backward also waits for
        its forward inputs' gradients. See [Note: When a unit's backward is done]."""
        return len(self.trainable) < len(self.fsdp_params)

    def reset_sharded_params(self, check_device: bool = True) -> None:
        """Reads every sharded parameter again after the user changed one. See
        [Note: Changes after fully_shard] in ``_param.py``."""
        self.reshard()
        for fp in self.fsdp_params:
            fp.reset_sharded_param(check_device, unit=self.label)
        self.refresh_trainable()

    # --------------------------------------------------------------- lifecycle
    def issue_unshard(self) -> None:
        """Starts the all-gathers (no wait). Idempotent; no-op when gathered."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending is not None:
            return
        with torch.no_grad():
            if compiling():
                if self.all_gather_comm is not None:
                    custom_comm.refuse_compiled()
                # See [Note: Collective annotations] (passes/_graph.py).
                label = self.traced_label
                self._pending = [
                    call_annotated(label, p.fqn, p.all_gather_start, options=self.pass_options)
                    for p in self.fsdp_params
                ]
            else:
                self._pending = self._issue_eager_unshard()

    def _issue_eager_unshard(self) -> _EagerUnshard:
        """One flat all-gather per (group, dtype). See [Note: One collective per
        unit, eagerly]."""
        buckets: dict[tuple[str, int, torch.dtype], list[FSDPParam]] = {}
        single: list[tuple[FSDPParam, torch.Tensor]] = []
        for fp in self.fsdp_params:
            group = fp.flat_gather_group()
            if group is None:
                single.append((fp, fp.all_gather_start()))
            else:
                buckets.setdefault((*group, fp.dtype), []).append(fp)
        flat = []
        for (group_name, world_size, dtype), params in buckets.items():
            sources = [fp.flat_gather_source() for fp in params]
            numels = [rows * math.prod(src.shape[1:]) for src, rows in sources]
            padded = any(src.size(0) != rows for src, rows in sources)
            alloc = torch.zeros if padded else torch.empty
            inp = alloc(sum(numels), dtype=dtype, device=params[0].device)
            dsts = [
                part.view(rows, *src.shape[1:]).narrow(0, 0, src.size(0))
                for (src, rows), part in zip(sources, inp.split(numels))
            ]
            torch._foreach_copy_(dsts, [src for src, _ in sources])
            work = None
            with collective_annotation(self.label, [fp.fqn for fp in params]):
                if self.all_gather_comm is None:
                    output = all_gather_start(inp, world_size, group_name)
                else:
                    output, work = custom_comm.all_gather(
                        self.all_gather_comm, inp, world_size, params[0].mesh_info
                    )
            flat.append(_FlatGather(params, numels, world_size, output, work))
        return _EagerUnshard(flat, single)

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
            if isinstance(pending, _EagerUnshard):
                _finish_eager_unshard(pending)
            else:
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
        pending, self._pending = self._pending, None
        if isinstance(pending, _EagerUnshard):
            for fg in pending.flat:
                wait_all_gather(fg.output)
            for p, t in pending.single:
                p.wait_gathered(t)
        elif pending is not None:
            for p, t in zip(self.fsdp_params, pending):
                p.wait_gathered(t)

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
        self.in_backward = True
        self.backward_syncs = self.reduce_grads
        if self.unshard_in_backward:
            self.unshard()
            if not compiling():
                # See [Note: The module holds the placeholder only in forward] (_param.py).
                self.register_unsharded()
        self._grads_pending = len(self.trainable) + self.input_grad_hooks
        if not compiling():
            self._input_hooks_used = self.input_grad_hooks
        self.input_grad_hooks = 0

    # [Note: A second backward through a retained graph]
    # A second backward through a graph kept with ``retain_graph=True`` runs the units'
    # backward again. torch re-gathers (its pre-backward fires once per backward); ours
    # is a flag per forward call, raised when the unit's backward finishes ([Note:
    # Output hooks after the unit's backward] in _state.py), so the second backward
    # would find it raised and the parameters freed. Eagerly, a finished backward
    # records its graph task id, the calls it closed and the input hooks it counted; an
    # output hook that finds its flag raised in another graph task re-arms them, and the
    # backward runs as the first did (bitwise torch's in tests/test_module_methods.py).
    # Only the last finished backward's graph can run again. A compiled backward records
    # nothing (the task id would be a new guard every step; docs/api.md).
    def rearm_if_retained(self, call: list[bool]) -> bool:
        """Eager, for an output hook whose forward call's flag is raised: ``True``
        after re-arming this unit's backward when the hook runs in a later backward
        through the graph its last backward ran (``retain_graph=True``), ``False``
        when it runs in that same backward. See [Note: A second backward through a
        retained graph].

        Raises:
            RuntimeError: the call's graph is older than the last backward's.
        """
        finished = self._finished
        task = torch._C._current_graph_task_id()
        if finished is None or finished[0] == task:
            return False
        _, calls, hooks = finished
        if not any(c is call for c in calls):
            raise RuntimeError(
                f"traceable_hsdp: a backward ran again through the graph of an earlier "
                f"forward of the fully_shard unit {self.label} after a backward through "
                "a later one. A graph kept with retain_graph=True can be run again only "
                "until the unit's next backward. Fix: run the backward calls of one "
                "forward before the next forward's, or sum the losses and call "
                "backward() once."
            )
        for c in calls:
            c[0] = False
        self.input_grad_hooks += hooks
        self._finished = None
        return True

    def post_accumulate_grad(self, fsdp_param: FSDPParam) -> None:
        """Runs when ``fsdp_param``'s placeholder gradient is complete: reduces it, or
        keeps it while gradient sync is off."""
        p = fsdp_param.unsharded_param
        if not fsdp_param.sharded_param.requires_grad or not p.requires_grad:
            # Frozen since: see [Note: Changes after fully_shard] and [Note: Changes
            # while the modules hold the gathered parameter].
            p.grad = None
            self._count_down()
            return
        grad = p.grad
        if fsdp_param.extension is not None:  # See [Note: All-gather extensions].
            grad = as_plain(grad)
        if grad.dtype != fsdp_param.reduce_dtype:  # static while tracing
            grad = grad.to(fsdp_param.reduce_dtype)
        p.grad = None
        # Gradients held back by set_requires_gradient_sync(False), in reduce_dtype.
        if fsdp_param.accumulated_grad is not None:
            grad = fsdp_param.accumulated_grad + grad
            fsdp_param.accumulated_grad = None
        if self.reduce_grads and not self.reduce_scatter_unused_params:
            if compiled_backward():  # see [Note: Eager or traced] (_common.py)
                self._reduce(fsdp_param, grad)
            else:
                # See [Note: One collective per unit, eagerly].
                fsdp_param.accumulated_grad = grad
                self._grads_ready += 1
                if self._grads_ready >= len(self.trainable):
                    if self._grads_pending == 1:
                        # The unit's backward ends here: free its parameters before
                        # the reduction allocates its buffers, as torch's FSDP2 does.
                        self._count_down()
                        self.reduce_held_grads()
                        return
                    self.reduce_held_grads()
        else:
            # See [Note: Unused parameters].
            fsdp_param.accumulated_grad = grad
        self._count_down()

    def reduce_held_grads(self) -> None:
        """Reduces the gradients still kept, in registration order, at the end of a
        syncing backward. See [Note: Unused parameters], [Note: Held gradients of
        unused parameters] and [Note: One collective per unit, eagerly]."""
        if not self.reduce_grads:
            return
        held = []
        for fp in self.trainable:
            grad = fp.accumulated_grad
            if grad is None and not self.reduce_scatter_unused_params:
                continue
            fp.accumulated_grad = None
            if grad is None:
                grad = torch.zeros(fp.orig_size, dtype=fp.reduce_dtype, device=fp.device)
            held.append((fp, grad))
        self._grads_ready = 0
        if not held:
            return
        grad = None  # the loop's last gradient: _reduce_flat frees them as it goes
        if compiled_backward():
            for fp, grad in held:
                self._reduce(fp, grad)
        else:
            self._reduce_flat(held)

    def held_after_sync(self) -> list[str]:
        """FQNs of the gradients a finished syncing backward left unreduced. See
        [Note: Held gradients of unused parameters]."""
        held = [fp.fqn for fp in self.trainable if fp.accumulated_grad is not None]
        # backward_syncs is read only when something is held: a compiled pre-forward
        # then guards on it only in that case (it changes every step; no recompiles).
        return held if held and self.backward_syncs else []

    def _reduce(self, fsdp_param: FSDPParam, grad: torch.Tensor) -> None:
        if self.reduce_scatter_comm is not None and compiling():
            custom_comm.refuse_compiled()
        call_annotated(
            self.traced_label,
            fsdp_param.fqn,
            fsdp_param.reduce_grad,
            grad,
            self._divide_factor(fsdp_param.mesh_info),
            self.all_reduce_grads,
            self._reduced_hook(),
            options=self.pass_options,
        )

    def _reduce_flat(self, held: list[tuple[FSDPParam, torch.Tensor]]) -> None:
        """Reduces ``held`` (parameter, unsharded gradient) in one flat collective per
        kind and ``reduce_dtype``, eagerly, and empties it. See [Note: One collective
        per unit, eagerly]."""
        hook = self._reduced_hook()
        # Parameters sharded over another mesh (torch's ShardPlacementResult) reduce
        # over their own groups, with their own divide factor.
        buckets: dict[tuple[Any, ...], list[tuple[FSDPParam, torch.Tensor]]] = {}
        for fp, grad in held:
            mi = fp.mesh_info
            key = (mi.shard_group_name, mi.replicate_group_name, fp.replicate, fp.reduce_dtype)
            buckets.setdefault(key, []).append((fp, grad.to(fp.reduce_dtype)))
        # From here only the buckets reference the unit's unsharded gradients, and each
        # bucket is emptied once packed into its flat buffer, so a gradient is freed
        # as soon as its collective's input holds it (the caller's list and the loop
        # variables would keep every gradient of the unit alive through the unit's
        # last collective).
        held.clear()
        grad = None
        for key in list(buckets):  # in order; each popped, so emptying it frees it
            replicate, bucket = key[2], buckets.pop(key)
            mi = bucket[0][0].mesh_info
            divide_factor = self._divide_factor(mi)
            op = "avg" if divide_factor is None else "sum"
            with collective_annotation(self.label, [fp.fqn for fp, _ in bucket]):
                if replicate:
                    self._all_reduce_flat(bucket, mi, op, divide_factor, hook)
                else:
                    self._reduce_scatter_flat(bucket, mi, op, divide_factor, hook)

    def _reduce_scatter_flat(
        self,
        bucket: list[tuple[FSDPParam, torch.Tensor]],
        mi: MeshInfo,
        op: str,
        divide_factor: float | None,
        hook: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """Sharded parameters: one reduce-scatter (and, for HSDP, one all-reduce), then
        each parameter's end as in ``FSDPParam.reduce_grad``."""
        ws = mi.shard_size
        params = [fp for fp, _ in bucket]
        numels = [fp.flat_numel for fp in params]
        rows = [fp.flat_reduce_rows(grad) for fp, grad in bucket]
        flat = torch.empty((ws, sum(numels)), dtype=rows[0].dtype, device=rows[0].device)
        chunk_cat(rows, ws, flat)
        del rows
        bucket.clear()  # the unsharded gradients can go (the caller's list is this one)
        if self.reduce_scatter_comm is None:
            out = reduce_scatter(flat.view(-1), op, ws, mi.shard_group_name, params[0]._shard_rank)
        else:
            out = custom_comm.reduce_scatter(self.reduce_scatter_comm, flat.view(-1), op, ws, mi)
        if mi.replicate_group_name is not None:
            parts = [fp.flat_reduced_local(part) for fp, part in zip(params, out.split(numels))]
            if not self.all_reduce_grads:
                for fp, local in zip(params, parts):
                    fp.hold_for_replicas(local)
                return
            for fp, local in zip(params, parts):
                fp.fold_replicas_pending(local)
            out = all_reduce(out, op, mi.replicate_group_name, mi.replicate_size)
        for fp, part in zip(params, out.split(numels)):
            fp.finish_flat_reduced(fp.flat_reduced_local(part), divide_factor, hook)

    def _all_reduce_flat(
        self,
        bucket: list[tuple[FSDPParam, torch.Tensor]],
        mi: MeshInfo,
        op: str,
        divide_factor: float | None,
        hook: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """Replicated parameters: one all-reduce per group, then each parameter's end
        as in ``FSDPParam.reduce_grad``."""
        params = [fp for fp, _ in bucket]
        flat = torch.cat([grad.reshape(-1) for _, grad in bucket])
        bucket.clear()  # the unsharded gradients can go (the caller's list is this one)
        out = all_reduce(flat, op, mi.shard_group_name, mi.shard_size)
        if mi.replicate_group_name is not None:
            out = all_reduce(out, op, mi.replicate_group_name, mi.replicate_size)
        for fp, part in zip(params, out.split([fp.orig_size.numel() for fp in params])):
            fp.finish_flat_reduced(part.view(fp.orig_size), divide_factor, hook)

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

    def end_of_backward(self) -> None:
        """When the whole backward is over (root's final callback, or after a pipeline's
        micro-batches): reduces the gradients still kept and waits for the offload
        copies ([Note: Offload copies and the CPU])."""
        self.reduce_held_grads()
        self.wait_grad_offload()

    def wait_grad_offload(self) -> None:
        """Waits on the CPU for the asynchronous gradient copies of CPU offload (eager
        only). See [Note: Offload copies and the CPU] in ``_param.py``."""
        for fp in self.fsdp_params:
            fp.wait_grad_offload()

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
        self.in_backward = False
        self._grads_pending = 0
        for call in self.open_calls:
            call[0] = True
        if not compiling():
            self._record_finish()
        self.open_calls.clear()

    def _record_finish(self) -> None:
        """Eager: records what this backward closed, for a later backward through
        the same graph. See [Note: A second backward through a retained graph]."""
        task = torch._C._current_graph_task_id()
        used, self._input_hooks_used = self._input_hooks_used, 0
        if task < 0:  # outside a backward (reset_iter_state): nothing to run again
            self._finished = None
            return
        closed = list(self.open_calls)
        if self._finished is not None and self._finished[0] == task:
            _, calls, hooks = self._finished
            self._finished = (task, calls + closed, hooks + used)
        else:
            self._finished = (task, closed, used)

    def reset(self) -> None:
        """Back to the state before any forward, after an exception stopped one (see
        ``FSDPModule.reset_iter_state``): drops in-flight all-gathers, frees every
        placeholder, and drops the gradients not yet reduced."""
        self.reshard()
        self.wait_grad_offload()
        for fp in self.fsdp_params:
            fp.unsharded_param.grad = None
            fp.accumulated_grad = None
            if fp.replicas_pending:
                fp.sharded_param.grad = None
                fp.replicas_pending = False
        self.in_backward = False
        self._grads_pending = 0
        self._grads_ready = 0
        self.input_grad_hooks = 0
        self.backward_syncs = False
        self.open_calls.clear()
        self._finished = None


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
    if compiling():
        _refuse_hook_stream_compiled()
    if isinstance(stream, torch.cpu.Stream):  # CPU work is synchronous
        with torch.cpu.stream(stream):
            hook(reduced)
        return
    current = torch.accelerator.current_stream(reduced.device)
    stream.wait_stream(current)
    with stream:
        hook(reduced)
    current.wait_stream(stream)


@torch._dynamo.disable(
    reason="traceable_hsdp: an all-gather issued eagerly, waited for in a traced forward"
)
def _finish_eager_unshard(pending: _EagerUnshard) -> None:
    """Waits for an eager unshard and fills the placeholders. See [Note: One
    collective per unit, eagerly]."""
    for fp, gathered in pending.single:
        fp.fill_unsharded(fp.wait_gathered(gathered))
    for fg in pending.flat:
        if fg.work is not None:
            fg.work.wait()
        output = wait_all_gather(fg.output)
        targets = [
            fp.flat_gather_target(fg.world_size, n) for fp, n in zip(fg.params, fg.numels)
        ]
        with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            copy_out(output, fg.world_size, fg.numels, targets)
        for fp, target in zip(fg.params, targets):
            fp.flat_gather_done(target)
