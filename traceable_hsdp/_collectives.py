"""Collectives as functional c10d ops, so the same code runs eagerly and traces.

A functional collective returns at once; ``wait_tensor`` blocks until its result is
ready. Issuing and waiting are separate calls so that an unshard can be issued early
(``unshard(async_op=True)``, prefetching) and waited for where the data is needed.
In a traced graph they are separate nodes, which the passes may move.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.debug import CommDebugMode

from ._common import compiling
from ._torch_internals import _get_current_dispatch_mode_stack
from .passes import get_config
from .passes._graph import group_backend
from .passes.gloo.exchange import is_gloo_group

_c10d = torch.ops._c10d_functional


# [Note: In-flight all-gathers on gloo]
# With gloo, the allocating ``all_gather_into_tensor`` corrupts the heap or hangs when
# another collective is in flight; the ``_out`` variant does not ([Note: CPU
# all-gathers into buffers] in ``passes/gloo/gather_into_buffers.py``). So eagerly
# all-gathers use ``all_gather_into_tensor_out`` and may stay in flight; while tracing
# each is waited for right after it is issued (safe for ``aot_eager``), and the last
# post-grad pass turns Inductor's CPU all-gathers into ``_out`` ones.


# [Note: Groups of one rank]
# Over a group of one rank each function below returns its input and issues nothing,
# as torch's FSDP2 does at world size 1.


# [Note: Gathering bytes]
# gloo has no float8 types, so a float8 shard is gathered as a uint8 view and viewed
# back, as torch's FSDP2 does. Reductions are unaffected: float8 parameters are frozen.
_GATHERED_AS_BYTES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def all_gather_start(shard: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Issues an all-gather of ``shard`` along dim 0 (``world_size * shard.size(0)``
    rows); pass the result to :func:`wait_all_gather` before reading it. While
    tracing, the result is already waited for. See [Note: In-flight all-gathers on
    gloo], [Note: Groups of one rank] and [Note: Gathering bytes]."""
    if world_size == 1:
        return shard
    shard = shard.contiguous()
    if shard.dtype in _GATHERED_AS_BYTES:
        return all_gather_start(shard.view(torch.uint8), world_size, group_name).view(shard.dtype)
    if compiling() or not _has_device_backend(group_name, shard.device) or _comm_debug_mode():
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard, world_size, group_name))
    out = shard.new_empty((world_size * shard.size(0), *shard.shape[1:]))
    return _c10d.all_gather_into_tensor_out(shard, world_size, group_name, out=out)


def _comm_debug_mode() -> bool:
    """Whether torch's ``CommDebugMode`` is counting: it does not know the ``_out``
    all-gather, so the allocating op is issued and waited for at once instead."""
    return any(isinstance(m, CommDebugMode) for m in _get_current_dispatch_mode_stack())


def _has_device_backend(group_name: str, device: torch.device) -> bool:
    """Whether the group has a backend for ``device``'s type, which the ``_out``
    collectives need (torch's threaded test group has none)."""
    return group_backend(group_name, device) is not None


def wait_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Waits for an all-gather issued by :func:`all_gather_start` and returns its
    result (while tracing it was waited for at issue: returned as it is)."""
    if compiling():
        return tensor
    return _c10d.wait_tensor(tensor)  # a no-op on a tensor no collective produced


def reduce_scatter(
    full: torch.Tensor, op: str, world_size: int, group_name: str, rank: int | None = None
) -> torch.Tensor:
    """Reduces ``full`` over the group with ``op`` ("sum" or "avg") and returns this
    rank's 1/world_size of dim 0; eagerly over two gloo ranks, given ``rank`` (this
    rank in the group), as an exchange ([Note: gloo reduce-scatters as an exchange] in
    ``passes/gloo/exchange.py``). Traced code passes no rank: the passes rewrite the
    graph's reduce-scatters."""
    if world_size == 1:
        return full
    full = full.contiguous()
    if (
        rank is not None
        and world_size == 2
        and op in ("sum", "avg")
        and full.device.type == "cpu"
        and not compiling()
        and get_config().reduce_scatter_by_exchange
        and is_gloo_group(group_name)
        and not _comm_debug_mode()
    ):
        # Eagerly each rank sends the peer its half and receives the peer's half of
        # its own, then adds its own half into the received one, which it owns: the
        # input and one half are alive at the peak, where a reduce-scatter holds its
        # input and its output. One addition of two terms, so bitwise gloo's sum.
        k = full.size(0) // 2
        splits = [0, k] if rank == 0 else [k, 0]
        got = _c10d.wait_tensor(
            _c10d.all_to_all_single(full.narrow(0, (1 - rank) * k, k), splits, splits, group_name)
        )
        got.add_(full.narrow(0, rank * k, k))
        return got.div_(2) if op == "avg" else got
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(full, op, world_size, group_name))


def all_reduce(tensor: torch.Tensor, op: str, group_name: str, group_size: int) -> torch.Tensor:
    """Reduces ``tensor`` over the group (of ``group_size`` ranks) with ``op`` (out of
    place, except over one rank: see [Note: Groups of one rank])."""
    if group_size == 1:
        return tensor
    return _c10d.wait_tensor(_c10d.all_reduce(tensor.contiguous(), op, group_name))


# [Note: Flat buffers]
# Eagerly a unit gathers and reduces all its parameters in one collective each (see
# [Note: One collective per unit, eagerly] in ``_param_group.py``). The two helpers
# below lay the parameters out in the flat buffers, as torch's FSDP2 does:
#
#   all-gather output (world, sum of n_i)   row r: rank r's padded shards, in order
#   reduce-scatter input (world, sum of n_i) row r: every gradient's r-th padded chunk
#
# where n_i is parameter i's padded rows per rank times its other dims (shard dim
# first). The reduce-scatter output thus has the all-gather input's layout.


def copy_out(
    gathered: torch.Tensor, world_size: int, numels: list[int], outs: list[torch.Tensor]
) -> None:
    """Copies a flat all-gather output (``world_size`` rows of ``sum(numels)``
    elements, 1D) into ``outs``, one ``(world_size, numels[i])`` tensor per
    parameter, in one op. See [Note: Flat buffers]."""
    torch.split_with_sizes_copy(gathered.view(world_size, -1), numels, dim=1, out=outs)


def chunk_cat(tensors: list[torch.Tensor], world_size: int, out: torch.Tensor) -> None:
    """Writes row ``r`` of ``out`` (2D) as the concatenation of every tensor's
    zero-padded ``r``-th dim-0 chunk, in one op. See [Note: Flat buffers]."""
    torch._chunk_cat(tensors, 0, world_size, out=out)
