"""The op the bucketing passes add to graphs: ``torch.ops.traceable_hsdp.split_columns``.
(The exchanges' pooled all-to-all is in ``gloo/_pool.py``.)

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

__all__ = ["SPLIT_COLUMNS", "split_columns"]


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
