"""Per-rank bodies of the hsdp() tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _workers import CFG, LR, GraphRecorder, _data, _loss, _placeholder_bytes
from traceable_hsdp.models import Llama, shard_llama

STEPS = 3


def hsdp_worker(rank: int, world: int, shard_size: int, levels: list[str], mode: str) -> dict[str, Any]:
    """Trains one model per optimizer level with hsdp(threshold=1 KiB: the RMSNorm
    weights stay replicated; replicate_params: the output head) and reports losses,
    final parameters, placements, storage and graph counts."""
    out: dict[str, Any] = {}
    for level in levels:
        torch.manual_seed(0)
        model = Llama(CFG)
        keep = [model.output.weight]
        shard_llama(model, th.hsdp, shard_size=shard_size, threshold=1, optimizer_level=level,
                    replicate_params=keep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        rec = GraphRecorder()
        fwd = model
        if mode == "compiled":
            torch._dynamo.reset()
            th.enable_compiled_autograd(backend=rec)
            fwd = torch.compile(model, backend=rec, fullgraph=True)
        losses, bytes_after_bwd = [], []
        for x, y in _data(world, STEPS):
            loss = _loss(fwd(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            bytes_after_bwd.append(_placeholder_bytes(model))
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
        if mode == "compiled":
            th.disable_compiled_autograd()
        out[level] = dict(
            losses=losses,
            params={k: v.full_tensor() for k, v in model.state_dict().items()},
            placements={k: str(v.placements) for k, v in model.state_dict().items()},
            bytes_after_bwd=bytes_after_bwd,
            fwd_counts=rec.forward,
            bwd_counts=rec.backward,
        )
    return out


def reduce_op_worker(rank: int, world: int) -> dict[str, float]:
    """One backward with reduce_op="mean", "sum" and gradient_divide_factor=4: the
    sharded gradients must be in ratio 1 : world : world/4."""
    grads = {}
    for name, kwargs in (("mean", {}), ("sum", {"reduce_op": "sum"}),
                         ("div4", {"gradient_divide_factor": 4.0})):
        torch.manual_seed(0)
        model = Llama(CFG)
        shard_llama(model, th.hsdp, threshold=0, **kwargs)
        x, y = _data(world, 1)[0]
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        grads[name] = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    ratios = {}
    for k, g in grads["mean"].items():
        ratios[k] = (
            (grads["sum"][k] - world * g).abs().max().item(),
            (grads["div4"][k] - world / 4 * g).abs().max().item(),
        )
    return ratios
