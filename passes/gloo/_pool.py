"""``torch.ops.traceable_hsdp.all_to_all_single``: torch's all-to-all with its output
from a pool of buffers kept across steps, which the exchanges (``exchange.py``) issue.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from ..._torch_internals import resolve

__all__ = [
    "POOLED_ALL_TO_ALL",
    "all_to_all_single",
    "exchange_pool_bytes",
    "pooled_all_to_all_lowering",
    "release_exchange_buffers",
]


# [Note: Exchange outputs from a pool]
# On the CPU a compiled step allocates its buffers afresh each step, and glibc returns
# large freed heap tops to the kernel, so the exchanges' outputs (a bucket each) are
# faulted in and zeroed again every step. So the exchanges issue
# ``traceable_hsdp::all_to_all_single``, torch's ``all_to_all_single`` with its output
# taken from a pool that outlives the graph (measured in docs/benchmarks.md):
#
# - A pooled buffer is handed out only when its storage's use count is 1 (the pool's
#   own reference): every reader, gloo's work in flight included, holds a reference,
#   so safety does not rest on the pass's view of lifetimes. A resized storage is
#   dropped.
# - Buffers are pooled by shape, dtype and device, at most :data:`POOL_DEPTH` a key
#   and :data:`POOL_MAX_BYTES` in all; beyond, outputs are allocated unpooled.
#   Unbounded, a large vocabulary's root bucket (embedding and head) and every
#   layer's stayed resident between steps, which put the compiled peak RSS above
#   torch's per-block compile (docs/benchmarks.md, "Memory");
#   ``test_pool_keeps_within_its_budget`` pins the bound.
# - :func:`release_exchange_buffers` drops every buffer not in use (as
#   ``torch.cuda.empty_cache()``); ``PassConfig(pool_exchange_outputs=False)`` uses
#   torch's op, and so do ``compile_block``'s graphs by default ([Note: Where the
#   exchanges pool] in ``passes/_install.py``).
#
# Inductor lowers the op as torch's (:func:`pooled_all_to_all_lowering`), so its input
# stays alive until the wait and the scheduler counts it as a collective. A torch
# without what the lowering needs raises ``TorchInternalError`` ([Note: Torch
# internals]).

POOL_DEPTH = 8
"""Most buffers kept for one (shape, dtype, device)."""

POOL_MAX_BYTES = 64 << 20
"""Most bytes the pool keeps in all, per process. See [Note: Exchange outputs from a
pool]."""

_pool: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[torch.UntypedStorage]] = {}
_pool_lock = threading.Lock()


# Resolved once: the pooled op runs for every exchange of every step.
_storage_use_count = resolve("torch._C._storage_Use_Count")
_resolve_process_group = resolve("torch._C._distributed_c10d._resolve_process_group")
_register_work = resolve("torch._C._distributed_c10d._register_work")


def _unused(storage: torch.UntypedStorage) -> bool:
    """Whether only the pool references ``storage`` (its use count is the pool's own
    reference). See [Note: Exchange outputs from a pool]."""
    return _storage_use_count(storage._cdata) == 1


def _take(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` over a pooled storage that nothing else references, or
    over a new one. See [Note: Exchange outputs from a pool]."""
    key = (tuple(shape), dtype, device)
    nbytes = dtype.itemsize * math.prod(shape)
    with _pool_lock:
        kept = _pool.setdefault(key, [])
        storage = None
        for i, s in enumerate(kept):
            if not _unused(s):
                continue  # read somewhere still
            if s.nbytes() != nbytes:
                kept.pop(i)  # resized under us: not ours to reuse
                break
            storage = s
            break
        if storage is None:
            storage = torch.empty(shape, dtype=dtype, device=device).untyped_storage()
            if len(kept) < POOL_DEPTH and _kept_bytes() + nbytes <= POOL_MAX_BYTES:
                kept.append(storage)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)


def _kept_bytes() -> int:
    """Bytes of every pooled buffer, by its key's size (a buffer resized under us
    counts at the size it was pooled at until it is dropped). Under ``_pool_lock``."""
    return sum(
        len(kept) * dtype.itemsize * math.prod(shape) for (shape, dtype, _), kept in _pool.items()
    )


def exchange_pool_bytes() -> int:
    """Bytes the pool holds, in use or not. See [Note: Exchange outputs from a pool]."""
    with _pool_lock:
        return sum(s.nbytes() for kept in _pool.values() for s in kept)


def release_exchange_buffers() -> int:
    """Drops every pooled exchange buffer that nothing reads; returns the bytes
    dropped. Buffers in use stay pooled. See [Note: Exchange outputs from a pool]."""
    dropped = 0
    with _pool_lock:
        for key, kept in list(_pool.items()):
            busy = [s for s in kept if not _unused(s)]
            dropped += sum(s.nbytes() for s in kept) - sum(s.nbytes() for s in busy)
            if busy:
                _pool[key] = busy
            else:
                del _pool[key]
    return dropped


@torch.library.custom_op("traceable_hsdp::all_to_all_single", mutates_args=())
def all_to_all_single(
    input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
    group_name: str,
) -> torch.Tensor:
    """``_c10d_functional.all_to_all_single`` with its output from the pool: issues
    the all-to-all and registers its work for ``wait_tensor``. See [Note: Exchange
    outputs from a pool]."""
    out = _take([sum(output_split_sizes), *input.shape[1:]], input.dtype, input.device)
    group = _resolve_process_group(group_name)
    work = group.alltoall_base(out, input, output_split_sizes, input_split_sizes)
    _register_work(out, work)
    return out


@all_to_all_single.register_fake
def _(
    input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
    group_name: str,
) -> torch.Tensor:
    return input.new_empty([sum(output_split_sizes), *input.shape[1:]])


POOLED_ALL_TO_ALL = torch.ops.traceable_hsdp.all_to_all_single.default

_lowering = False


def pooled_all_to_all_lowering() -> bool:
    """Registers Inductor's lowering of :data:`POOLED_ALL_TO_ALL` (once; the one
    torch gives its own all-to-all). See [Note: Exchange outputs from a pool].

    Returns:
        ``True``: it is registered.

    Raises:
        TorchInternalError: this torch's Inductor lacks what the lowering needs.
    """
    global _lowering
    if not _lowering:
        create = resolve("torch._inductor.ir._CollectiveKernel.create_out_of_place")
        box = resolve("torch._inductor.ir.TensorBox.create")
        lowering = "torch._inductor.lowering."

        def lower(inp: Any, out_splits: Any, in_splits: Any, group_name: str) -> Any:
            return box(create(POOLED_ALL_TO_ALL, inp, out_splits, in_splits, group_name))

        packet = torch.ops.traceable_hsdp.all_to_all_single
        resolve(lowering + "add_layout_constraint")(
            packet, resolve(lowering + "constrain_to_fx_strides"))
        resolve(lowering + "register_lowering")(packet)(lower)
        _lowering = True
    return _lowering
