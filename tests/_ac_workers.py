"""Per-rank body of the activation-checkpointing parity run
(tests/test_activation_checkpointing.py): one process group, several variants."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import traceable_hsdp as th
from traceable_hsdp.demo.models import Llama, shard_llama
from traceable_hsdp.debug._recorder import current_compile
from traceable_hsdp.passes._graph import (
    is_all_gather,
    is_fsdp_copy,
    is_placeholder_op,
    is_reduce_scatter,
    is_view,
)
from _dist import full_tensor
from _workers import CFG, LR, STEPS, _data, _loss, _mean_over_ranks, compile_for

_WRAPPED = "_checkpoint_wrapped_module."


def _mm_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Llama, kind: str) -> None:
    """``wrapper``: checkpoint_wrapper (non-reentrant) around every block, before
    fully_shard (torchtitan's order); ``sac``: the same with a policy that saves
    matmuls; ``inner``: ``checkpoint(use_reentrant=False)`` around each block's MLP,
    called inside the block's forward; ``none``."""
    layers = model.layers
    if kind in ("wrapper", "sac"):
        ctx = (
            {"context_fn": functools.partial(create_selective_checkpoint_contexts, _mm_policy)}
            if kind == "sac"
            else {}
        )
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **ctx)
    elif kind == "inner":
        for layer in layers:
            mlp = layer.ffn
            mlp.forward = functools.partial(checkpoint, type(mlp).forward.__get__(mlp), use_reentrant=False)
    elif kind != "none":
        raise ValueError(kind)


def early_placeholder_reads(gm: fx.GraphModule) -> list[str]:
    """Nodes of a backward graph that read an unsharded placeholder (directly or
    through views) before the ``fsdp.copy_`` that refills it: a read of 0 bytes."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    bad = []
    for copy in gm.graph.nodes:
        if not is_fsdp_copy(copy) or not isinstance(copy.args[0], fx.Node):
            continue
        p = copy.args[0]
        if any(is_fsdp_copy(u) and order[u] < order[copy] for u in p.users):
            continue  # not the first refill of p
        stack = list(p.users)
        while stack:
            u = stack.pop()
            if u.op != "call_function" or is_placeholder_op(u):
                continue
            if is_view(u):
                stack.extend(u.users)
            elif order[u] < order[copy]:
                bad.append(f"{u.name} reads {p.name}")
    return bad


class ACRecorder:
    """aot_eager with a recording partitioner: per forward graph the bytes of the
    activations it saves for backward (placeholders, i.e. parameters and inputs, not
    counted) and its collectives; per compiled-autograd graph its collectives, its
    matmuls and its early placeholder reads."""

    def __init__(self) -> None:
        self.forward: list[dict[str, int]] = []
        self.backward: list[dict[str, Any]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Any:
        _, is_bwd = current_compile()
        saved: list[int] = []

        def partition(joint: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
            fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
            out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
            saved.append(int(sum(
                n.meta["val"].numel() * n.meta["val"].element_size()
                for n in out[kw["num_fwd_outputs"]:]
                if isinstance(n, fx.Node) and n.op != "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor)
            )))  # an int even where a size is symbolic (it has a hint)
            return fw, bw

        def compile_graph(g: fx.GraphModule, inputs: Any) -> Any:
            counts = {
                "all_gather": sum(map(is_all_gather, g.graph.nodes)),
                "reduce_scatter": sum(map(is_reduce_scatter, g.graph.nodes)),
                "mm": sum(1 for n in g.graph.nodes if n.target is torch.ops.aten.mm.default),
            }
            if is_bwd:
                self.backward.append({**counts, "early_reads": early_placeholder_reads(g)})
            else:
                self.forward.append({**counts, "saved_bytes": saved[0] if saved else 0})
            return boxed_nop(g, inputs)

        return aot_autograd(
            fw_compiler=compile_graph, bw_compiler=boxed_nop, partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _run(rank: int, world: int, kind: str, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(CFG)
    apply_ac(model, kind)
    shard_llama(model, th.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rec = ACRecorder()
    torch._dynamo.reset()
    fwd, compiled_step = compile_for(model, mode, rec)
    losses, graphs = [], []
    try:
        for x, y in _data(world, STEPS):
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            if mode == "step":
                loss = compiled_step(xs, ys)
            else:
                loss = _loss(fwd(xs), ys)
                loss.backward()
            graphs.append((len(rec.forward), len(rec.backward)))
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(loss, world))
    finally:
        if mode == "loop":
            th.disable_compiled_autograd()
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    params = {k.replace(_WRAPPED, ""): full_tensor(v) for k, v in model.state_dict().items()}
    return dict(losses=losses, params=params, graphs=graphs, forward=rec.forward, backward=rec.backward)


def ac_worker(rank: int, world: int, variants: list[tuple[str, str]]) -> dict[str, Any]:
    """Trains ``CFG``'s Llama for STEPS steps per (checkpointing kind, mode) variant,
    each from the same initial weights; mode "eager", "step" (whole step compiled
    under ``compiled_autograd = True``) or "loop" (``enable_compiled_autograd`` and a
    compiled model)."""
    return {f"{kind}/{mode}": _run(rank, world, kind, mode) for kind, mode in variants}
