"""The ops the passes add to graphs: ``torch.ops.traceable_hsdp.split_columns`` (the
bucketing passes) and ``torch.ops.traceable_hsdp.pack_twice`` (gloo's all-gather
exchange). (The exchanges' pooled all-to-all is in ``gloo/_pool.py``.)

[Note: One copy-out per all-gather bucket]
Each parameter's gathered value is a column block of a bucketed all-gather's
``[W, N]`` output. One ``clone(slice(...))`` per parameter would become a kernel each
(a C++ compile each on the CPU). ``split_columns(grid, sizes)`` copies every block out
in one extern call (``torch.split_with_sizes_copy`` along dim 1). It is a custom op
because Inductor decomposes ATen's ``split_with_sizes_copy`` back into a copy per
block. The passes insert it after dynamo and AOTAutograd, so it needs no autograd
formula.
"""

from __future__ import annotations

import torch

__all__ = ["PACK_TWICE", "SPLIT_COLUMNS", "pack_twice", "split_columns"]


@torch.library.custom_op("traceable_hsdp::split_columns", mutates_args=())
def split_columns(grid: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``grid`` (2-D) split into column blocks of ``sizes``, each a new contiguous
    tensor of ``grid.size(0)`` rows. See [Note: One copy-out per all-gather bucket]."""
    return list(torch.split_with_sizes_copy(grid, sizes, dim=1))


@split_columns.register_fake
def _(grid: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    if sum(sizes) != grid.size(1):
        raise ValueError(
            f"split_columns: the sizes {sizes} add up to {sum(sizes)}, not to the "
            f"{grid.size(1)} columns of the grid"
        )
    return [grid.new_empty((grid.size(0), n)) for n in sizes]


SPLIT_COLUMNS = torch.ops.traceable_hsdp.split_columns.default


# [Note: The doubled all-gather input, packed by one extern call]
# Over two gloo ranks an all-gather is an exchange of this rank's shards sent to both
# ranks ([Note: gloo all-gathers as an exchange] in ``gloo/exchange.py``), so its input
# is the shards packed twice. Packed by an Inductor ``cat``, that input is a buffer
# Inductor plans: its C++ backend may put the packing in one kernel with independent
# loops before it (allocating the buffer early), and the wrapper may keep the freed
# buffer for a later one of its size (seen: a block's, kept from its exchange's wait
# through that block's backward, for the gather two blocks on). ``pack_twice(pieces)``
# packs it in one extern call, allocated when the call runs and freed after the
# exchange's wait. Bitwise the same as the ``cat`` (a copy); checked in
# ``tests/test_passes_unit.py`` (``test_all_gather_by_exchange_moves_the_same_bytes``).


@torch.library.custom_op("traceable_hsdp::pack_twice", mutates_args=())
def pack_twice(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The 1-D ``pieces`` concatenated, twice over. See [Note: The doubled all-gather
    input, packed by one extern call]."""
    return torch.cat([*pieces, *pieces])


@pack_twice.register_fake
def _(pieces: list[torch.Tensor]) -> torch.Tensor:
    if not pieces or any(p.dim() != 1 or p.dtype != pieces[0].dtype for p in pieces):
        raise ValueError(
            "pack_twice: the pieces must be 1-D tensors of one dtype, at least one; got "
            f"{[(tuple(p.shape), p.dtype) for p in pieces]}"
        )
    return pieces[0].new_empty(2 * sum(p.numel() for p in pieces))


PACK_TWICE = torch.ops.traceable_hsdp.pack_twice.default
