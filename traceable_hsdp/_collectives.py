"""Collectives as functional c10d ops, so the same code runs eagerly and traces.

Each function issues the collective and waits for it. The wait is a separate
``wait_tensor`` node in a traced graph, which the overlap pass may move later.
"""

from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def all_gather(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """All-gathers ``shard`` along dim 0: returns ``world_size * shard.size(0)`` rows."""
    out = _c10d.all_gather_into_tensor(shard.contiguous(), world_size, group_name)
    return _c10d.wait_tensor(out)


def reduce_scatter_avg(full: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Averages ``full`` over the group and returns this rank's 1/world_size of dim 0."""
    out = _c10d.reduce_scatter_tensor(full.contiguous(), "avg", world_size, group_name)
    return _c10d.wait_tensor(out)


def all_reduce_avg(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Averages ``tensor`` over the group (out of place)."""
    out = _c10d.all_reduce(tensor.contiguous(), "avg", group_name)
    return _c10d.wait_tensor(out)
