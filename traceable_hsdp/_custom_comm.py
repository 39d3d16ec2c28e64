"""torch FSDP2's custom collectives, on the eager path: ``set_custom_all_gather``,
``set_custom_reduce_scatter`` and ``set_allocate_memory_from_process_group_for_comm``.

[Note: Custom collectives]
torch's FSDP2 lets a unit issue its all-gather and its reduce-scatter through a comm
object: ``allocate(size, *, dtype, device)`` gives the output buffer, then
``comm(output_tensor, input_tensor, group, async_op)`` (the reduce-scatter's takes
``op`` before ``async_op``) issues the collective and may return a ``Work``; e.g. to
put the buffers in symmetric memory. ``set_allocate_memory_from_process_group_for_comm
(True)`` sets the comms that allocate from the process group's backend when it offers
an allocator (``Backend.allocate_tensor``: NCCL) and from ``torch.empty`` otherwise.

Eagerly a unit issues one flat collective of each kind ([Note: One collective per
unit, eagerly] in ``_param_group.py``); with a comm set, that collective's output
comes from ``comm.allocate`` and the comm issues it over the unit's shard group. The
reduce-scatter is issued with ``ReduceOp.SUM`` and an average divided after it (gloo
has no average). The per-parameter collectives (replicated parameters, groups of one
rank, all-gather extensions, parameters on another mesh) do not go through the comm;
a unit whose parameters span meshes refuses a custom comm (``ValueError``, as
torch's). A traced step refuses a comm with a ``RuntimeError`` naming the fix: its
collectives are graph nodes whose buffers Inductor plans, where a Python comm cannot
run. Tested by tests/test_custom_comm.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._common import MeshInfo, refusal
from ._torch_internals import resolve

COMM_COMPILE_FIX = (
    "traceable_hsdp: this unit has a custom collective (set_custom_all_gather, "
    "set_custom_reduce_scatter or set_allocate_memory_from_process_group_for_comm), "
    "which only its eager collectives use; this step is being compiled, where the "
    "collectives are graph nodes whose buffers Inductor plans. Fix: run the unit "
    "eagerly, or undo the setting (set_allocate_memory_from_process_group_for_comm"
    "(False); a custom comm cannot be unset, build the model again). See [Note: Custom "
    "collectives]."
)
refuse_compiled = refusal(COMM_COMPILE_FIX)


class _ProcessGroupAlloc:
    """Allocates from the group's backend when it has an allocator (torch's
    ``ProcessGroupAllocMixin``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        backend = resolve("torch.distributed.ProcessGroup._get_backend")(self._group, device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)


class ProcessGroupAllocAllGather(_ProcessGroupAlloc):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, async_op: bool = False,
    ) -> dist.Work | None:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ProcessGroupAllocReduceScatter(_ProcessGroupAlloc):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
        group: dist.ProcessGroup, op: Any, async_op: bool = False,
    ) -> dist.Work | None:
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def is_custom(comm: Any) -> bool:
    """Whether ``comm`` was set by the user (not ``None`` nor a process-group one)."""
    return comm is not None and not isinstance(comm, _ProcessGroupAlloc)


def check_comm(method: str, comm: Any, mesh_infos: Sequence[MeshInfo]) -> None:
    """Raises ``TypeError`` for a comm without ``allocate`` or not callable, and
    ``ValueError`` (torch's) for a unit whose parameters span meshes."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method}(comm) expects a comm object with allocate(size, *, dtype, device) "
            f"and __call__ (torch.distributed.fsdp's AllGather/ReduceScatter), got "
            f"{type(comm).__name__}."
        )
    if len({id(mi.mesh) for mi in mesh_infos}) > 1:
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param mesh "
            "via shard_placement_fn). The custom comm would be ambiguous across groups "
            "with different meshes."
        )


def all_gather(
    comm: Any, inp: torch.Tensor, world_size: int, mesh_info: MeshInfo
) -> tuple[torch.Tensor, dist.Work | None]:
    """Issues the flat all-gather of ``inp`` through ``comm``: its output and work."""
    out = comm.allocate((world_size * inp.numel(),), dtype=inp.dtype, device=inp.device)
    group = mesh_info.mesh.get_group(mesh_info.shard_mesh_dim)
    return out, comm(output_tensor=out, input_tensor=inp, group=group, async_op=True)


def reduce_scatter(
    comm: Any, full: torch.Tensor, op: str, world_size: int, mesh_info: MeshInfo
) -> torch.Tensor:
    """Reduce-scatters ``full`` (1-D) through ``comm`` with a sum, then divides for
    ``op == "avg"``; returns this rank's part."""
    out = comm.allocate((full.numel() // world_size,), dtype=full.dtype, device=full.device)
    group = mesh_info.mesh.get_group(mesh_info.shard_mesh_dim)
    work = comm(output_tensor=out, input_tensor=full, group=group,
                op=dist.ReduceOp.SUM, async_op=False)
    if work is not None:
        work.wait()
    return out.div_(world_size) if op == "avg" else out
