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
# On the CPU every buffer of a compiled step is new memory each step: Inductor frees
# its buffers when the graph returns, and a collective allocates its output when it
# is issued. glibc gives the top of its heap back to the kernel when a free leaves
# more than its trim threshold there (about twice the largest block it has unmapped:
# 8 MiB with 4 MiB buckets), and every page of it is faulted in and zeroed again
# when it is next written. The exchanges' outputs (``exchange.py``) are the largest
# such buffers, a bucket each, written by gloo's threads as they receive. With the
# pool those pages stay mapped and gloo's threads take no page fault on them; the
# step is as fast or faster, and the heap's peak grows by the pooled buffers not alive
# at the peak before (a few MiB; docs/benchmarks.md has the measurements).
#
# So the exchanges issue ``traceable_hsdp::all_to_all_single``, torch's
# ``_c10d_functional.all_to_all_single`` (the same schema and the same call into the
# process group: ``alltoall_base`` into an output, the work registered for
# ``wait_tensor``) with its output taken from a pool that outlives the graph:
#
# - A pooled buffer is handed out only when nothing else references its storage
#   (``torch._C._storage_Use_Count`` is 1: the pool's own reference). Every reader of
#   an output (Inductor's wrapper variables and their views, gloo's work in flight,
#   a tensor a user kept) holds a reference to the storage, so a buffer still read
#   anywhere is never handed out again; the safety does not rest on the pass's view
#   of lifetimes. (gloo's worker can hold a finished work, and so its output, for a
#   moment after the wait returns: the op then takes another buffer.) A storage whose
#   size changed is dropped from the pool.
# - Buffers are pooled by shape and dtype and device; at most :data:`POOL_DEPTH` a
#   key, and at most :data:`POOL_MAX_BYTES` in all. When all of a key's buffers are
#   in use, the op allocates a new one and pools it while the key and the budget
#   have room, else returns it unpooled (freed after use), as torch's op does. So
#   the pool holds at most the most exchanges of a shape whose outputs were alive at
#   once, like the CUDA caching allocator's reserved memory, within the budget.
#   Without the budget a model with a large vocabulary kept its root's bucket (the
#   embedding and the head) and every layer's, resident between steps: about 700
#   MiB a rank for an 8-layer HF Llama of width 1024 on 2 ranks, which put our peak
#   RSS above torch's per-block compile; with it, 40 MiB and the same peak as
#   torch's (docs/benchmarks.md, "Memory"). ``test_pool_keeps_within_its_budget``
#   pins it.
# - It is kept between steps, which is the point; :func:`release_exchange_buffers`
#   drops every buffer not in use (as ``torch.cuda.empty_cache()`` does), and
#   ``PassConfig(pool_exchange_outputs=False)`` compiles graphs that allocate as
#   torch's op does.
#
# Inductor lowers the op as it lowers torch's (:func:`pooled_all_to_all_lowering`:
# ``ir._CollectiveKernel.create_out_of_place``), so its input stays alive until the
# wait and its buffer is not reused before then (``_WaitKernel.get_volatile_reads``),
# and its scheduler counts it as a collective. On a torch without what that lowering
# needs, registering it raises ``TorchInternalError`` ([Note: Torch internals]);
# ``PassConfig(pool_exchange_outputs=False)`` compiles torch's op instead.

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
