"""A unit compiled per block (``compile_block``): its all-gather traced into the
block's graph as a differentiable op whose backward is the reduce-scatter, so the
block's AOTAutograd forward and backward graphs hold its collectives without compiled
autograd, and every identical block shares them.

[Note: Compiled per block]
The whole-step mode (``torch.compile(model)`` + compiled autograd) traces every block
again, forward and backward: its compile time grows with depth. ``compile_block(block)``
compiles one block's call as torch's per-block recipe does (``block.compile()``,
compiled autograd off), and its unit gathers inside that graph instead of around it
(SimpleFSDP's formulation):

- forward: per (dtype, trainable) group of the unit's parameters, one
  :class:`_GatherFlat`: the local shards (``DTensor.to_local()``, so their gradients
  reach the sharded parameters as ``DTensor``s through autograd's own accumulation),
  cast to ``param_dtype`` and padded, one flat all-gather, copied out to the full
  parameters in one extern call (``split_columns``: [Note: One copy-out per
  all-gather bucket]), which the modules hold while the block's forward runs (graph
  intermediates, not the placeholders); over a group of one rank nothing is gathered
  or copied ([Note: Groups of one rank]);
- backward: ``_GatherFlat``'s backward, traced by AOTAutograd into the block's backward
  graph: the full gradients cast to ``reduce_dtype``, one flat reduce-scatter over
  the shard group (HSDP: then one all-reduce over the replicate group), each
  parameter's shard divided as ``FSDPParam.reduce_grad`` does and cast to the
  original dtype;
- the re-gather: with ``reshard_after_forward`` (the default below the root), the
  gather runs inside a selective checkpoint whose policy recomputes every op of it
  (``MUST_RECOMPUTE``), so AOTAutograd's partitioner re-gathers in the block's
  backward graph from the local shards (graph inputs) instead of saving the full
  parameters; with ``reshard_after_forward=False`` the full parameters are saved.

The dynamo frame is the block's ``_call_impl``; it reads no per-block constant (paths,
labels), so one graph serves every block of a kind. Across processes both of its
graphs are cached: the checkpoint's ``context_fn`` carries the ``cache_hash`` the
AOTAutograd cache keys it by, and the block's call runs with torch's
``autograd_cache_allow_custom_autograd_functions`` on (set back after the call), which
the cache needs for ``_GatherFlat``. A custom ``autograd.Function`` of the user's inside
such a block is cached the same way (its forward and backward are traced into the
graph the key hashes). The design card's mechanism (the 0-byte placeholder grown and
filled by ``fsdp.copy_``, freed by a resize) does not apply here: the gathered
parameters are ordinary graph values that the partitioner frees after their last
forward use and recomputes for the backward. It stays for the root (eager, as
torch's per-block recipe runs it) and for the whole-step mode. Collectives are one per
group and step direction, as torch's eager ``fully_shard`` issues; the passes'
bucketing and overlap have nothing to merge inside a block.

Refused, each naming the fix: compiled autograd on (the whole-step mode traces these
units already), the root, a unit holding another unit, gradient sync off
(``set_requires_gradient_sync(False)``; keep it on: the micro-batches' reduced
gradients sum into ``.grad``), an all-reduce hook, unused-parameter reduction,
``reshard_after_backward=False``, no re-gather in backward, an unshard issued
eagerly (prefetching) for the unit, a custom comm, all-gather extension hooks, and at
``compile_block`` an int ``reshard_after_forward``, CPU offload, TP (``DTensor``)
parameters, replicated parameters, a shard dim other than 0 and a parameter sharded
over another mesh.
Tested in ``tests/test_per_block.py``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ._collectives import all_gather_start, all_reduce, reduce_scatter
from ._common import ShardedState, refusal
from ._param import FSDPParam
from ._torch_internals import compiled_autograd
from .passes._ops import split_columns

if TYPE_CHECKING:
    from ._param_group import FSDPParamGroup
    from ._state import FSDPState

__all__ = ["compile_block", "forward_per_block"]

def compile_block(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compiles ``module``, a ``fully_shard`` block, per block: its forward and
    backward graphs hold its all-gather, re-gather and reduce-scatter, without compiled
    autograd, and every block of the same kind reuses them. See [Note: Compiled per
    block] in ``traceable_hsdp/_per_block.py``.

    Call it after ``fully_shard`` on the block (and its root), in place of
    ``block.compile(...)``; the root and what it holds outside the blocks (embeddings,
    head) run eagerly, as in torch's per-block recipe. Compiled autograd must stay off.

    Args:
        module: a module ``fully_shard`` was applied to, below a root.
        **compile_kwargs: passed to ``module.compile`` (``backend``, ``fullgraph``,
            ``mode``, ``options``, ...).

    Returns:
        ``module``, compiled in place.

    Raises:
        ValueError: ``module`` is not a ``fully_shard`` unit.
        NotImplementedError: the unit has an option this mode does not support (an int
            ``reshard_after_forward``, CPU offload, TP parameters, replicated
            parameters, a shard dim other than 0, a parameter on another mesh).
    """
    from ._state import state_of

    state = state_of(module)
    if state is None or module not in state.modules:
        raise ValueError(
            f"compile_block({type(module).__name__}): not a fully_shard unit. Call "
            "fully_shard(block) first (and fully_shard on the root), then "
            "compile_block(block)."
        )
    _check_options(state)
    state.per_block = True
    module.compile(**compile_kwargs)
    from ._compiled_call import dispatch_compiled_call

    dispatch_compiled_call(module)
    return module


def _check_options(state: FSDPState) -> None:
    """The options ``compile_block`` refuses at once. See [Note: Compiled per block]."""
    where = f"compile_block({state.kind})"
    raf = state.options.reshard_after_forward
    if raf is not None and not isinstance(raf, bool):
        raise NotImplementedError(
            f"{where}: reshard_after_forward={raf} (an int) is not supported per block. "
            "Use reshard_after_forward=True (re-gather in the backward graph) or False "
            "(keep the gathered parameters for the backward)."
        )
    if state.options.offload is not None or state.options.keep_storage:
        raise NotImplementedError(
            f"{where}: CPU offload and hsdp(optimizer_level='level1') are not supported "
            "per block. Compile the block with block.compile() instead, or drop the "
            "option."
        )
    group = state.param_group
    for fp in () if group is None else group.fsdp_params:
        reason = None
        if fp.tp_spec is not None:
            reason = "is a DTensor (TP) parameter"
        elif fp.replicate:
            reason = "is replicated (hsdp threshold/replicate_params)"
        elif fp.shard_dim != 0:
            reason = f"is sharded on dim {fp.shard_dim}"
        elif fp.mesh_info != group.mesh_info:
            reason = "is sharded over another mesh than the unit's"
        if reason is not None:
            raise NotImplementedError(
                f"{where}: parameter {fp.fqn!r} {reason}, which is not supported per "
                "block. Compile the block with block.compile() instead, or shard it "
                "on dim 0 over the unit's mesh."
            )


PER_BLOCK_FIX = (
    "traceable_hsdp: a unit compiled with compile_block() traces its gathers and "
    "gradient reduction into the block's graphs, which this use cannot have:"
)


def _refusal(reason: str) -> Any:
    """A refusal of this mode (built at import: dynamo cannot trace building one)."""
    return refusal(f"{PER_BLOCK_FIX} {reason} See [Note: Compiled per block] in "
                   "traceable_hsdp/_per_block.py.")


_REFUSE_COMPILED_AUTOGRAD = _refusal(
    "compiled autograd is on. Fix: turn it off "
    "(traceable_hsdp.disable_compiled_autograd()), or compile the whole step "
    "with block.compile() or torch.compile(model) instead of compile_block()."
)


_REFUSE_ROOT = _refusal(
    "the unit is a root. Fix: fully_shard the model too (its root runs eagerly), "
    "and compile_block() only the blocks below it."
)


_REFUSE_NESTED = _refusal(
    "the unit holds another fully_shard unit. Fix: compile_block() the inner "
    "unit's module instead, or compile the block with block.compile()."
)


_REFUSE_NO_SYNC = _refusal(
    "gradient sync is off (set_requires_gradient_sync(False) or "
    "set_requires_all_reduce(False)). Fix: keep it on for every micro-batch: "
    "each one's reduced gradients are summed into the sharded .grad (one "
    "reduce-scatter per micro-batch), or use the whole-step mode."
)


_REFUSE_HOOKS = _refusal(
    "set_all_reduce_hook() or set_reduce_scatter_unused_params(True) is set. "
    "Fix: unset it, or use block.compile() (the whole-step mode)."
)


_REFUSE_BACKWARD_SETTINGS = _refusal(
    "set_reshard_after_backward(False) or set_unshard_in_backward(False) is set: "
    "the gathered parameters are graph values, freed after the backward and "
    "re-gathered in it. Fix: leave both at their defaults."
)


_REFUSE_CUSTOM_COMM = _refusal(
    "a custom comm or the process group's allocator is set (set_custom_all_gather, "
    "set_custom_reduce_scatter, set_allocate_memory_from_process_group_for_comm). "
    "Fix: unset it, or run the unit eagerly."
)


_REFUSE_EXTENSION = _refusal(
    "a parameter's local shard has all-gather extension hooks "
    "(fsdp_pre_all_gather). Fix: compile the block with block.compile() and "
    "compiled autograd (the whole-step mode traces the hooks), or run it eagerly."
)


_REFUSE_UNSHARDED = _refusal(
    "the unit was unsharded eagerly (unshard(), or forward prefetching). Fix: "
    "do not prefetch or unshard units compiled per block."
)


def _check_runtime(state: FSDPState) -> None:
    """What the traced forward refuses (a graph break with the reason; the error under
    ``fullgraph=True``, and eagerly). See [Note: Compiled per block]."""
    if compiled_autograd.compiled_autograd_enabled:
        _REFUSE_COMPILED_AUTOGRAD()
    if state.is_root:
        _REFUSE_ROOT()
    group = state.param_group
    if group is None:
        return
    if len(state.states) > 1:
        _REFUSE_NESTED()
    if not group.reduce_grads or not group.all_reduce_grads:
        _REFUSE_NO_SYNC()
    if group.all_reduce_hook is not None or group.reduce_scatter_unused_params:
        _REFUSE_HOOKS()
    if not group.reshard_after_backward or not group.unshard_in_backward:
        _REFUSE_BACKWARD_SETTINGS()
    if group.all_gather_comm is not None or group.reduce_scatter_comm is not None:
        _REFUSE_CUSTOM_COMM()
    if any(
        fp.extension is not None or hasattr(fp.sharded_param._local_tensor, "fsdp_pre_all_gather")
        for fp in group.fsdp_params
    ):
        _REFUSE_EXTENSION()
    if group.sharded_state is not ShardedState.SHARDED or group._pending is not None:
        _REFUSE_UNSHARDED()


def forward_per_block(
    state: FSDPState, orig_forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The unit's forward while dynamo traces a block compiled per block: gather in
    the graph, run the forward on the full parameters, give the modules back their
    sharded ones. See [Note: Compiled per block]."""
    _check_runtime(state)
    group = state.param_group
    if group is not None:
        state._sync_user_changes()
        raf = state.reshard_after_forward
        fulls = gather_in_graph(group, recompute=raf is None or raf is True)
        for fp, full in zip(group.fsdp_params, fulls):
            for info in fp.module_infos:
                info.module._parameters[info.param_name] = full
    args, kwargs = state._cast_inputs(args, kwargs)
    output = orig_forward(*args, **kwargs)
    if group is not None:
        for fp in group.fsdp_params:
            for info in fp.module_infos:
                info.module._parameters[info.param_name] = fp.sharded_param
    return state._cast_output(output)


def gather_in_graph(group: FSDPParamGroup, recompute: bool) -> list[torch.Tensor]:
    """Every parameter of ``group`` gathered (full shape, ``param_dtype``), one flat
    :class:`_GatherFlat` per (dtype, trainable) group, in the group's order. See
    [Note: Compiled per block]."""
    buckets: dict[tuple[torch.dtype, bool], list[int]] = {}
    params = group.fsdp_params
    for i, fp in enumerate(params):
        trainable = fp.sharded_param.requires_grad and torch.is_grad_enabled()
        buckets.setdefault((fp.dtype, trainable), []).append(i)
    fulls: list[torch.Tensor | None] = [None] * len(params)
    mi = group.mesh_info
    divide = group._divide_factor(mi)
    for (_, trainable), idx in buckets.items():
        spec = _spec([params[i] for i in idx], divide)
        if params[idx[0]]._shard_size == params[idx[0]]._replicate_size == 1 and divide is None:
            # See [Note: Groups of one rank] (_collectives.py): nothing to gather or
            # reduce, so no copy either; autograd casts the gradient back.
            for i in idx:
                local = params[i].sharded_param.to_local()
                fulls[i] = local if local.dtype == params[i].dtype else local.to(params[i].dtype)
            continue
        if trainable:
            locals_ = [params[i].sharded_param.to_local() for i in idx]
            if recompute:
                out = checkpoint(
                    _GatherFlat.apply, spec, *locals_, use_reentrant=False,
                    context_fn=_recompute_all, preserve_rng_state=False,
                )
            else:
                out = _GatherFlat.apply(spec, *locals_)
        else:
            with torch.no_grad():
                out = _gather(spec, [params[i].sharded_param._local_tensor for i in idx])
        for i, full in zip(idx, out):
            fulls[i] = full
    return fulls  # type: ignore[return-value]


def _spec(params: list[FSDPParam], divide: float | None) -> tuple[Any, ...]:
    """The constants of one flat gather: ``(ws, group, divide factor, dtype, reduce
    dtype, per-parameter (orig dtype, chunk rows, local rows, full shape), replicas,
    replicate group)`` (HSDP: the replicate group, else 1 and ``None``). All are the
    same for identical blocks."""
    fp0 = params[0]
    return (
        fp0._shard_size, fp0._shard_group_name, divide, fp0.dtype, fp0.reduce_dtype,
        tuple((fp.orig_dtype, fp.chunk_rows, fp.local_rows, tuple(fp.orig_size)) for fp in params),
        fp0._replicate_size, fp0._replicate_group_name,
    )


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_all() -> Any:
    """Selective checkpointing that recomputes every op of the gather. See [Note:
    Compiled per block]."""
    return create_selective_checkpoint_contexts(_policy)


# The AOTAutograd cache keys a selective checkpoint's ``context_fn`` by this attribute
# and bypasses the cache without it (a warm restart would trace the block's AOTAutograd
# graphs again). It names the one policy above: every op recomputed.
_recompute_all.cache_hash = "traceable_hsdp._per_block._recompute_all: MUST_RECOMPUTE"  # type: ignore[attr-defined]


def _gather(spec: tuple[Any, ...], locals_: list[torch.Tensor]) -> list[torch.Tensor]:
    ws, group, _, dtype, _, per_param, _, _ = spec
    inputs = []
    for local, (_, chunk, rows, _shape) in zip(locals_, per_param):
        if local.dtype != dtype:
            local = local.to(dtype)
        if rows != chunk:
            local = torch.cat([local, local.new_zeros((chunk - rows, *local.shape[1:]))])
        inputs.append(local.reshape(-1))
    numels = [t.numel() for t in inputs]
    flat = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
    out = all_gather_start(flat, ws, group).view(ws, -1)
    # One extern copy-out, not a kernel per parameter: see [Note: One copy-out per
    # all-gather bucket] (passes/_ops.py).
    parts = split_columns(out, numels) if len(numels) > 1 else [out]
    fulls = []
    for part, (_, chunk, _, shape) in zip(parts, per_param):
        full = part.view(ws * chunk, *shape[1:])
        if full.size(0) != shape[0]:
            full = full.narrow(0, 0, shape[0])
        fulls.append(full)
    return fulls


class _GatherFlat(torch.autograd.Function):
    """Forward: one flat all-gather of the local shards into the full parameters.
    Backward: one flat reduce-scatter of their gradients into the local shards'. See
    [Note: Compiled per block]."""

    @staticmethod
    def forward(ctx: Any, spec: tuple[Any, ...], *locals_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.spec = spec
        return tuple(_gather(spec, list(locals_)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ws, group, divide, _, reduce_dtype, per_param, replicas, replicate_group = ctx.spec
        op = "avg" if divide is None else "sum"
        rows_in = []
        numels = []
        for grad, (_, chunk, _, shape) in zip(grads, per_param):
            if grad.dtype != reduce_dtype:
                grad = grad.to(reduce_dtype)
            pad = ws * chunk - shape[0]
            if pad:
                grad = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
            numel = chunk * math.prod(shape[1:])
            numels.append(numel)
            rows_in.append(grad.reshape(ws, numel))
        flat = rows_in[0] if len(rows_in) == 1 else torch.cat(rows_in, dim=1)
        out = reduce_scatter(flat.reshape(-1), op, ws, group)
        if replicate_group is not None:  # HSDP: then across the replicas, as eagerly
            out = all_reduce(out, op, replicate_group, replicas)
        local_grads = []
        for part, (orig_dtype, chunk, rows, shape) in zip(out.split(numels), per_param):
            local = part.view(chunk, *shape[1:])
            if rows != chunk:
                local = local.narrow(0, 0, rows)
            if divide is not None:
                local = local / divide
            if local.dtype != orig_dtype:
                local = local.to(orig_dtype)
            local_grads.append(local)
        return (None, *local_grads)
