"""Rank functions for tests/test_dump_env.py: a program that knows nothing of the
dump (no dump_graphs call), run with TRACEABLE_HSDP_DUMP in its environment."""

from __future__ import annotations

import torch
from torch import nn

import traceable_hsdp
from traceable_hsdp import fully_shard


def compiled_train_worker(rank: int, world: int, steps: int) -> list[float]:
    """Two blocks and a root, compiled with aot_eager, ``steps`` training steps; returns
    the losses. The dump is written when the rank's process exits."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 8), nn.ReLU()),
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    traceable_hsdp.enable_compiled_autograd(backend="aot_eager")
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    traceable_hsdp.disable_compiled_autograd()
    return losses
