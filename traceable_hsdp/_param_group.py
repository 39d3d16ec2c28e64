"""The parameters of one fully_shard unit, gathered and reduced together."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
from ._param import FSDPParam


# [Note: When a unit's backward is done]
# A unit may free its parameters once no backward op still needs them. A trainable
# parameter W is safe once its post-accumulate-grad hook ran: every op that read W
# also produces a gradient for W, and accumulation waits for all of them. A frozen
# parameter is not: an op that reads it only to produce its input's gradient (the
# ``dx = dy @ W`` of a frozen linear) is ordered before no accumulation at all, and
# freeing W under it is a use-after-free (seen: SIGSEGV). Every such op ends in a
# gradient of the unit's forward inputs, so a unit that holds a frozen parameter is
# done when all trainable gradients AND the gradients of all forward inputs that
# require grad are complete; the unit counts both kinds down.
#
# Eagerly, every unit's pre-forward passes the inputs that require grad through
# torch's own ``RegisterPostBackwardFunction`` (one identity node per forward, as
# torch's FSDP2 does), whose backward runs once all their gradients are complete.
# A unit with a frozen parameter counts that; a unit whose parameters all train
# does not need it, but has the node anyway, for two reasons. (1) The autograd
# graph is then torch's: a tensor several units read (T5's encoder output, read by
# every decoder block) gets each unit's gradient through a node of its own, in
# torch's order, so its summed gradient is bitwise torch's (without the node, the
# same values summed in another order: T5's parameters were 3e-6 from torch's
# after 3 AdamW steps; with it, equal). (2) Tooling that counts that node's calls
# to check that units finish inside the backward (torch's own tests) sees ours.
# The class is private to torch 2.13's FSDP2 (``_fsdp_param_group``), which is the
# torch this project supports; if it moves, the import fails loudly.
#
# Compiled, an ``autograd.Function`` trigger fails under compiled autograd, so a
# unit with a frozen parameter gives the forward a fresh alias of each such input
# (``view_as``) and registers a tensor hook on the alias (returning the gradient it
# gets, as compiled autograd requires), one count per input; a unit whose
# parameters all train adds nothing. Either way the trigger is made in this
# forward, never on the caller's tensor: a tensor that lives across steps (a
# learnable prefix that is a leaf, a parameter of the parent unit, an input reused
# with ``requires_grad=True``) would collect one more hook each step, and in step k
# its k hooks would count the unit down k times and free the frozen weights before
# the ops that read them (seen: prefix tuning failed in its second backward,
# eagerly with ``setStorage ... storage of size 0``, compiled on a freed buffer).
# The count of a unit whose parameters all train is then the same in every
# backward, however many forwards ran before it.
#
# That matters compiled. The input count is a Python int that the traced
# pre-forward reads, so dynamo guards on its value; it sums every forward since the
# last pre-backward, and a pipeline schedule runs several micro-batch forwards
# before their backwards (GPipe: all of them), so each micro-batch's forward would
# be a new graph, until dynamo's recompile limit sends the rest to eager. With only
# trainable parameters there is nothing to read (tests/test_pipelining.py counts
# the graphs of a compiled GPipe stage: none new after the second step). A unit with
# frozen parameters under a compiled pipeline schedule still compiles one forward
# per micro-batch count (docs/api.md says so).
#
# A unit whose forward runs several times before one backward (weight reuse, a block
# applied twice) marks its inputs in every call; the count sums them, and the
# pre-backward takes it (and starts the next count from 0). The first use's backward
# to run re-gathers; the unit stays gathered until the last use's backward is done,
# because the parameters' gradients are complete only after every use (one
# AccumulateGrad per parameter). torch's FSDP2 instead reshards after each use's
# backward and re-gathers for the next: less memory between uses, one more
# all-gather per extra use. Inputs marked in a forward whose output never reaches a
# backward keep the unit from finishing by the count; the end of the backward
# finishes it (see [Note: Hooks and compiled autograd] in ``_state.py``).


# [Note: The all-reduce hook]
# ``set_all_reduce_hook(hook)`` calls ``hook`` on each gradient once it is fully
# reduced: the reduce-scatter output for FSDP, the all-reduce output for HSDP (for a
# replicated parameter of ``hsdp()``, its all-reduce output), in ``reduce_dtype``,
# before the division by a gradient divide factor and before it is accumulated into
# the sharded parameter's ``.grad``; the hook may change it in place (its return
# value is ignored), as torch's does. torch calls the hook once on the unit's flat
# buffer; ours runs once per trainable parameter, on that parameter's local shard
# (its sharded shape), eagerly (where the unit is reduced in one flat buffer too,
# see [Note: One collective per unit, eagerly]) as traced (one reduction per
# parameter). It runs inside the post-accumulate-grad hook, so compiled autograd
# traces it into the backward graph like everything else there.
#
# ``stream=`` runs the hook on another stream (FSDP only, eager only): the stream
# waits for the current one, the hook runs under it, and the current stream waits
# for it before the gradient is used. Streams are eager-only here (see STYLE: one
# branch, ``_call_on_stream``); a traced backward refuses a hook stream instead of
# dropping it.


# [Note: Unused parameters]
# A traced backward reduces each parameter's gradient when its post-accumulate-grad
# hook fires, in autograd's order; an eager one reduces a unit when its last
# trainable gradient is complete, or at the end of the backward when some got none
# (see [Note: One collective per unit, eagerly]). When ranks take different
# branches, a parameter one rank used and another did not would be reduced on the
# first rank only (traced), or in a flat reduction of different parameters or at
# another time (eager), and the collectives would no longer pair up across ranks (a
# hang, or wrong data). With
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


# [Note: One collective per unit, eagerly]
# Eagerly a unit issues one all-gather per process group and dtype (one in the
# common case) and, once all its trainable gradients are complete, one
# reduce-scatter (and, for HSDP, one all-reduce over the replicas), as torch's FSDP2
# does: gloo, NCCL and friends charge a latency per call, and a unit has many small
# parameters. The buffers are laid out as in [Note: Flat buffers] (``_collectives.py``):
#
# - all-gather: every parameter's local shard (shard dim first, cast to
#   ``param_dtype``, zero-padded to ``chunk_rows``) copied into one flat input with
#   one ``_foreach_copy_``; after the wait, one ``split_with_sizes_copy`` copies each
#   parameter's rows straight into its placeholder (a dim-0 shard without padding)
#   or into a buffer that ``fill_unsharded`` narrows, moves back and copies as the
#   per-parameter path does. Parameters gathered over another group (after an int
#   ``reshard_after_forward``, their post-forward blocks over the smaller group) or
#   in another dtype form their own flat all-gather. Replicated parameters of
#   ``hsdp()`` and groups of one rank issue no collective and take the
#   per-parameter path.
# - reduction: each post-accumulate-grad hook keeps its gradient (in
#   ``reduce_dtype``, held gradients added, as before) on ``accumulated_grad``; the
#   hook that completes the unit's trainable gradients reduces them all: one
#   ``_chunk_cat`` into the flat input, one reduce-scatter, (HSDP) the held
#   shard-reduced gradients folded in and one all-reduce, then per parameter the
#   all-reduce hook, the division and the accumulation into ``.grad`` exactly as
#   ``FSDPParam.reduce_grad`` does them. Replicated parameters go into one flat
#   all-reduce per group. A unit some of whose trainable parameters got no
#   gradient is reduced by the root's end-of-backward callback (with the held
#   gradients of [Note: Held gradients of unused parameters]), as torch reduces
#   such a unit in its final callback. Cost, as in torch: a unit's unsharded
#   gradients live until its last one is complete.
#
# Sums and averages are elementwise and each element meets the same elements of the
# other ranks as in a per-parameter collective, and every per-parameter step (hook,
# division, casts) is the same op on the same values, so the flat path gives the
# numbers of the per-parameter one, bitwise, on two ranks per group (an addition
# of two values is commutative). Over more ranks a backend may sum in an order
# that depends on the element's offset in the buffer; the flat layout is torch's,
# so the numbers are torch's fully_shard's there too. tests/test_eager_flat.py counts
# the collectives per unit and checks parity with torch's fully_shard (1-D, HSDP 2x2, 4
# ranks with an int ``reshard_after_forward``, ``hsdp()`` with replicated parameters).
#
# A traced unit keeps one collective per parameter ([Note: Eager or traced]):
# the graph passes bucket those, and the traced graphs are unchanged. What stays
# per parameter eagerly: the all-reduce hook is called once per parameter on its
# shard (see [Note: The all-reduce hook]), and an eager all-gather that a traced
# forward waits for (``unshard(async_op=True)`` before a compiled forward) is waited
# for by a dynamo-disabled function (a graph break there, not a wrong graph).


@dataclass
class _FlatGather:
    """One flat all-gather in flight: the parameters it serves, their copy-out
    targets and per-rank sizes, and its output (1D, ``world_size * sum(numels)``)."""

    params: list[FSDPParam]
    numels: list[int]
    world_size: int
    output: torch.Tensor


@dataclass
class _EagerUnshard:
    """A unit's eager unshard in flight: the flat all-gathers, and the parameters that
    issue none (their gathered tensor, already final)."""

    flat: list[_FlatGather]
    single: list[tuple[FSDPParam, torch.Tensor]]


class FSDPParamGroup:
    """All managed parameters of one fully_shard call.

    The group is the unit of the lifecycle verbs: ``unshard`` (= ``issue_unshard``,
    which starts the all-gathers, then ``wait_for_unshard``, which waits and fills the
    placeholders), ``reshard`` (free every placeholder) and the post-backward
    reduction. Traced, each parameter keeps its own collective and the fusion pass
    (``traceable_hsdp.passes``) merges a group's collectives in the compiled graph;
    eagerly the group issues one flat collective of each kind, with the same numbers
    (see [Note: One collective per unit, eagerly]).
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
        # The unit's module class name; its path under the root once it has one
        # (FSDPState.adopt_nested), for messages, dumps and annotations.
        self.label = label
        # The label traced when the frame holds k unit forwards is frame_labels[k - 1]
        # (the path beyond them): the class name, and for a nested unit the path below
        # each enclosing unit, set by adopt_nested. See traced_label.
        self.frame_labels: tuple[str, ...] = (label,)
        # The group's gradient work is in flight: from pre_backward to finish_backward.
        # Not a copy of the unit's TrainingState; see [Note: A unit's state and its
        # group's backward] (_state.py).
        self.in_backward = False
        self.sharded_state = ShardedState.SHARDED
        # All-gathers issued but not yet waited for, or None: traced, one output per
        # parameter (1D list of ND tensors); eagerly, an _EagerUnshard.
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
        # The unit's own pass options (hsdp()), carried in its collectives'
        # annotations; see [Note: Per-unit pass options] (passes).
        self.pass_options = pass_options
        self.all_reduce_hook_stream: torch.Stream | None = None
        # See [Note: Unused parameters].
        self.reduce_scatter_unused_params = False
        # torch's reduce-scatter copy-in cap; recorded, see
        # FSDPModule.set_reduce_scatter_max_input_buffers.
        self.reduce_scatter_max_input_buffers = 1
        # reduce_grads as the last backward began; see [Note: Held gradients of
        # unused parameters].
        self.backward_syncs = False
        self.trainable: list[FSDPParam] = []
        self.refresh_trainable()
        # Forward inputs given a gradient hook since the last pre-backward, summed over
        # every call of the unit's forward. See [Note: When a unit's backward is done].
        self.input_grad_hooks = 0
        # The flags of the forward calls whose output hooks opened this backward, set
        # when it finishes. See [Note: Output hooks after the unit's backward] (_state.py).
        self.open_calls: list[list[bool]] = []
        # Eager: what the last finished backward used, for running its graph again.
        # See [Note: A second backward through a retained graph].
        self._input_hooks_used = 0
        self._finished: tuple[int, list[list[bool]], int] | None = None

    @property
    def traced_label(self) -> str:
        """The label traced into the unit's collective annotations: its path, or, when
        the frame being traced starts below the root, its path below the frame's
        outermost unit, named by that unit's class ("Block.ffn"; "Block" for the block
        itself), so that one frame serves every unit of the class. See [Note: One graph
        for every unit of a class] (_common.py)."""
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
            with collective_annotation(self.label, [fp.fqn for fp in params]):
                output = all_gather_start(inp, world_size, group_name)
            flat.append(_FlatGather(params, numels, world_size, output))
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
    # ``loss.backward(retain_graph=True)`` and then another backward through the same
    # graph (two losses sharing a trunk, a GAN's discriminator pass) run the units'
    # backward twice. torch's fully_shard re-gathers for the second: its pre-backward
    # is a multi-grad hook that fires once per backward. Ours is a flag per forward
    # call, raised when the unit's backward finishes so that an output reached later
    # in the same backward (one the unit passes through unchanged; [Note: Output hooks
    # after the unit's backward] in _state.py) gathers nothing. A second backward
    # found the flags raised and its parameters freed: the eager backward failed in
    # autograd (``setStorage: ... out of bounds for storage of size 0``). So, eagerly,
    # a finished backward records its graph task (autograd's id of one backward()
    # call), the calls it closed and the input-gradient hooks it counted; an output
    # hook that finds its flag raised in another graph task lowers those flags and
    # counts those hooks again (the ``RegisterPostBackwardFunction`` nodes run again),
    # and the unit's backward runs as the first did: gradients accumulate into the
    # sharded ones, as torch's do (bitwise equal to torch's in
    # tests/test_module_methods.py). Only the last finished backward's graph can run
    # again; an older one is refused.
    # A compiled backward records nothing (compiled autograd traces these hooks, and
    # a graph task id read there would be a new guard every step); there the second
    # backward fails in torch's compiled-autograd runtime (docs/api.md).
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
        """Runs when ``fsdp_param``'s placeholder gradient is complete for this
        backward: reduces it into the sharded gradient (unless gradient sync is off,
        when it stays on the placeholder and accumulates over micro-batches)."""
        p = fsdp_param.unsharded_param
        if not fsdp_param.sharded_param.requires_grad or not p.requires_grad:
            # Frozen after fully_shard, seen while tracing: see [Note: Changes after
            # fully_shard] (_param.py). Or the gathered parameter was frozen after its
            # forward: autograd runs this hook but accumulates no gradient, and the
            # sharded one follows when the unit registers it again (see [Note: Changes
            # while the modules hold the gathered parameter]).
            p.grad = None
            self._count_down()
            return
        grad = p.grad
        if grad.dtype != fsdp_param.reduce_dtype:  # static while tracing
            grad = grad.to(fsdp_param.reduce_dtype)
        p.grad = None
        # Gradients held back by set_requires_gradient_sync(False) accumulate here,
        # in reduce_dtype (fp32 under bf16 mixed precision, as torch's FSDP2 does).
        if fsdp_param.accumulated_grad is not None:
            grad = fsdp_param.accumulated_grad + grad
            fsdp_param.accumulated_grad = None
        if self.reduce_grads and not self.reduce_scatter_unused_params:
            if compiled_backward():  # see [Note: Eager or traced] (_common.py)
                self._reduce(fsdp_param, grad)
            else:
                # Kept until the unit's last trainable gradient: see [Note: One
                # collective per unit, eagerly].
                fsdp_param.accumulated_grad = grad
                self._grads_ready += 1
                if self._grads_ready >= len(self.trainable):
                    self.reduce_held_grads()
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
        one (see [Note: Held gradients of unused parameters]) and, eagerly, those of
        this backward not yet reduced (see [Note: One collective per unit,
        eagerly]; the unit's last trainable gradient also calls this)."""
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
        out = reduce_scatter(flat.view(-1), op, ws, mi.shard_group_name)
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
        """Replicated parameters (see [Note: Replicated parameters] in ``_param.py``):
        one all-reduce over the shard group and one over the replicate group, then
        each parameter's end as in ``FSDPParam.reduce_grad``."""
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
        """What every group does when the whole backward is over (eagerly, the
        root's final callback; pipelining, after its micro-batches): reduces the
        gradients still kept (:meth:`reduce_held_grads`) and waits for the offload
        copies before ``backward()`` returns (see [Note: Offload copies and the CPU]
        in ``_param.py``)."""
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
        the same graph. A second finish in one backward (the root's final callback
        finishing every unit, or a call first reached after the unit's backward) adds
        to the first. See [Note: A second backward through a retained graph]."""
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
        ``FSDPModule.reset_iter_state``): waits for and drops in-flight all-gathers,
        frees every placeholder, and drops the gradients this iteration left
        unreduced (placeholder gradients, those kept by gradient accumulation, and
        HSDP shard-reduced gradients not yet all-reduced). Sharded gradients already
        reduced stay."""
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
    current = torch.accelerator.current_stream(reduced.device)
    stream.wait_stream(current)
    with stream:
        hook(reduced)
    current.wait_stream(stream)


@torch._dynamo.disable(
    reason="traceable_hsdp: an all-gather issued eagerly, waited for in a traced forward"
)
def _finish_eager_unshard(pending: _EagerUnshard) -> None:
    """Waits for an eager unshard and fills the placeholders: one copy-out per flat
    all-gather. Dynamo-disabled: see [Note: One collective per unit, eagerly]."""
    for fp, gathered in pending.single:
        fp.fill_unsharded(fp.wait_gathered(gathered))
    for fg in pending.flat:
        output = wait_all_gather(fg.output)
        targets = [
            fp.flat_gather_target(fg.world_size, n) for fp, n in zip(fg.params, fg.numels)
        ]
        with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
            copy_out(output, fg.world_size, fg.numels, targets)
        for fp, target in zip(fg.params, targets):
            fp.flat_gather_done(target)
