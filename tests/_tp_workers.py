"""Per-rank bodies of the FSDP x TP tests (importable by spawned ranks).

The model is the project's Llama with a torchtitan-style tensor-parallel plan (no
sequence parallelism): attention q/k/v and the MLP's w1/w3 column-wise, wo and w2
row-wise, the token embedding row-wise and the output head column-wise with a
replicated output; the RMSNorm weights stay plain tensors. The world mesh is
``(dp, tp)``; ranks of one TP group see the same batch.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import traceable_hsdp as th
from _workers import CFG, LR, GraphRecorder, _data, _loss, _placeholder_bytes
from traceable_hsdp.models import Llama

TP_STEPS = 3


def tp_plan(model: Llama) -> dict[str, Any]:
    """torchtitan's Llama plan with sequence parallelism: every parameter becomes a
    DTensor on the TP mesh (the RMSNorm weights replicated), so all sharded
    parameters live on the (dp, tp) mesh, as torch's clip_grad_norm_ needs."""
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan[p + "attn_norm"] = SequenceParallel()
        plan[p + "attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan[p + "ffn_norm"] = SequenceParallel()
        plan[p + "ffn"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        for name in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3"):
            plan[p + name] = ColwiseParallel()
        for name in ("attn.wo", "ffn.w2"):
            plan[p + name] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def build_2d(world_mesh: DeviceMesh, fully_shard_fn: Any, **kwargs: Any) -> Llama:
    """The torchtitan order: parallelize_module over world_mesh["tp"], then
    fully_shard each block and the root over world_mesh["dp"]."""
    torch.manual_seed(0)
    model = Llama(CFG)
    tp_mesh = world_mesh["tp"]
    parallelize_module(model, tp_mesh, tp_plan(model))
    for layer in model.layers:
        layer.attn.n_heads //= tp_mesh.size()  # each TP rank computes its heads
    for layer in model.layers:
        fully_shard_fn(layer, mesh=world_mesh["dp"], **kwargs)
    fully_shard_fn(model, mesh=world_mesh["dp"], **kwargs)
    return model


def train(model: nn.Module, fwd: Any, world_mesh: DeviceMesh, steps: int, clip: float | None = None) -> dict[str, Any]:
    dp = world_mesh["dp"].size()
    dp_rank = world_mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, bytes_after = [], [], []
    for x, y in _data(dp, steps):
        loss = _loss(fwd(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank])
        loss.backward()
        bytes_after.append(_placeholder_bytes(model) if hasattr(model, "unshard") else 0)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(norm.full_tensor().item() if isinstance(norm, DTensor) else norm.item())
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / torch.distributed.get_world_size())
    return dict(
        losses=losses,
        norms=norms,
        bytes_after=bytes_after,
        params={k: v.full_tensor() for k, v in model.state_dict().items()},
        placements={k: str(v.placements) for k, v in model.state_dict().items()},
    )


def explore_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out = {}
    model = build_2d(world_mesh, torch_fully_shard)
    out["torch"] = train(model, model, world_mesh, TP_STEPS, clip=1.0)
    model = build_2d(world_mesh, th.fully_shard)
    out["ours"] = train(model, model, world_mesh, TP_STEPS, clip=1.0)
    return out


def explore_compiled(rank: int, world: int) -> dict[str, Any]:
    world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out = {}
    model = build_2d(world_mesh, th.fully_shard)
    out["eager"] = train(model, model, world_mesh, TP_STEPS)
    model = build_2d(world_mesh, th.fully_shard)
    rec = GraphRecorder()
    torch._dynamo.reset()
    th.enable_compiled_autograd(backend=rec)
    fwd = torch.compile(model, backend=rec, fullgraph=True)
    out["compiled"] = train(model, fwd, world_mesh, TP_STEPS)
    th.disable_compiled_autograd()
    out["fwd"], out["bwd"] = rec.forward, rec.backward
    return out
