"""Rank functions for tests/test_dump.py: a fully_shard model compiled with Inductor
inside ``dump_graphs``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import nn

import traceable_hsdp
from traceable_hsdp import dump_graphs, fully_shard, passes


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU()),
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def inductor_schedule_worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Two blocks and a root inside ``dump_graphs(out_dir/rank<r>)``: one training
    step compiled with Inductor and the default passes, then (graph ``02_fwd``) the
    forward of a fresh copy of the model alone, under ``no_grad``, with every pass
    off. Returns the final-schedule records (collectives with their overlap
    distances, the order, the check note) and the training step's loss beside an
    eager one of the same sharded model (the dump must not change what runs)."""
    model = _model()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        eager_loss = model(x).square().mean().item()
    torch._dynamo.reset()
    with dump_graphs(f"{out_dir}/rank{rank}", print_summary=False) as dump:
        backend = dump.backend("inductor")
        traceable_hsdp.enable_compiled_autograd(backend=backend)
        loss = torch.compile(model, backend=backend)(x).square().mean()
        loss.backward()
        saved = passes.get_config()
        passes.set_config(passes.PassConfig(False, False, False, False))
        try:
            with torch.no_grad():
                torch.compile(_model(), backend=backend)(x)
        finally:
            passes.set_config(saved)
    traceable_hsdp.disable_compiled_autograd()
    return {
        "loss": (loss.item(), eager_loss),
        "scheduled": [
            {**asdict(r), "collectives": [asdict(c) for c in r.collectives]}
            for r in dump.records if r.stage == "scheduled"
        ],
        "summary": dump.summary(),
    }
