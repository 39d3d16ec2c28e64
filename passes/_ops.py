"""The op the bucketing passes add to graphs: ``torch.ops.traceable_hsdp.split_columns``.
(The exchanges' pooled all-to-all is in ``gloo/_pool.py``.)

[Note: One copy-out per all-gather bucket]
A bucketed all-gather returns the ranks' flat inputs one after another; each
parameter's gathered value is its column block of that grid (``view(out, [W, N])``,
columns ``offset:offset + n``), made contiguous by a copy. Written as one
``clone(slice(...))`` per parameter, each copy becomes a kernel of its own whose
source holds the parameter's offset in the bucket, so no two copies share a kernel:
a 16-block demo Llama compiled 227 C++ kernels, the same model unsharded 22, and on
the CPU each kernel is a run of the C++ compiler (about a second) on a cold cache.

``split_columns(grid, sizes)`` copies every block of a bucket out in one call
(``torch.split_with_sizes_copy`` along dim 1: one contiguous ``[W, n]`` tensor per
parameter, the same bytes as the clones). It is a custom op, not ATen's
``split_with_sizes_copy``: Inductor decomposes that one back into a copy per block,
and it cannot fall back to it from a post-grad graph (an op with a decomposition).
Inductor calls a custom op as it is (an extern call): no kernel is generated for
the copy-out. Dynamo and AOTAutograd never see the op (the passes insert it after
them), so it needs no autograd formula.
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
