"""Per-rank bodies of tests/test_compile_cache.py (run in fresh spawned processes by
``_dist.run_ranks``; the Inductor cache directory comes from the environment)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

DIM = 16


def _tiny(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))


def compile_step(rank: int, world: int, mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Shards a 2-linear model (each linear and the root) over a mesh of
    ``mesh_shape`` (default ``(world,)``; two dims: HSDP), compiles it with Inductor
    and compiled autograd, runs one step; returns what the caches did (the
    ``CacheCounts`` fields)."""
    from torch.distributed.device_mesh import init_device_mesh

    import traceable_hsdp
    from traceable_hsdp._cache import CacheCounts

    mesh = init_device_mesh("cpu", mesh_shape or (world,))
    torch.manual_seed(0)
    model = _tiny(DIM)
    for m in (model[0], model[2], model):
        traceable_hsdp.fully_shard(m, mesh=mesh)
    before = CacheCounts.now()
    with traceable_hsdp.compiled_autograd():
        torch.compile(model, fullgraph=True)(torch.randn(4, DIM)).sum().backward()
    return dataclasses.asdict(CacheCounts.now() - before)


def mega_cache_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """:func:`compile_step`, then ``torch.compiler.save_cache_artifacts()`` to ``path``."""
    counts = compile_step(rank, world)
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None, "save_cache_artifacts() returned None: nothing was cached"
    with open(path, "wb") as f:
        f.write(saved[0])
    return counts


def mega_cache_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """``torch.compiler.load_cache_artifacts()`` from ``path``, then :func:`compile_step`."""
    with open(path, "rb") as f:
        info = torch.compiler.load_cache_artifacts(f.read())
    assert info is not None, "load_cache_artifacts() found no artifacts"
    return compile_step(rank, world)
