"""One managed parameter: its sharded DTensor and its unsharded placeholder.

[Note: Sharded parameter and unsharded placeholder]
Each managed parameter has two ``nn.Parameter``s:

- ``sharded_param``: a ``DTensor`` sharded on dim 0 over the mesh's shard dim (and
  replicated over the replicate dim for HSDP). This is what the optimizer steps,
  what ``state_dict()`` returns and what the module holds between uses. Its local
  tensor follows ``torch.chunk`` semantics (rank r holds rows
  ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / shard_size)``), so uneven first dims
  work and ``DTensor.full_tensor()`` and DCP see the usual layout. Collectives pad
  the local rows to ``c``.
- ``unsharded_param``: a plain ``nn.Parameter`` of the full shape whose storage is
  resized to full before use and to 0 bytes after
  (``untyped_storage().resize_``, traced as ``inductor.resize_storage_bytes_``) and
  filled with ``torch.ops.fsdp.copy_``. Neither op is functionalized, so both stay in
  the traced graphs, in program order, for our passes to rewrite. Autograd saves
  this placeholder (not the gathered buffer) for backward, so resizing it to 0
  really frees the memory; the backward re-gathers into the same storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed.fsdp  # noqa: F401  registers torch.ops.fsdp.copy_
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._collectives import all_gather, all_reduce_avg, reduce_scatter_avg
from ._common import MeshInfo, ShardedState


@dataclass(frozen=True)
class ParamModuleInfo:
    """Where the parameter is registered: ``module._parameters[param_name]``."""

    module: nn.Module
    param_name: str


def _set_param(info: ParamModuleInfo, param: nn.Parameter) -> None:
    # Plain dict assignment: traces under dynamo as a side effect on the module, and
    # skips nn.Module.__setattr__'s checks, which would reject swapping a parameter
    # for a different tensor type.
    info.module._parameters[info.param_name] = param


class FSDPParam:
    """The tensors and collectives of one managed parameter.

    Args:
        param: the original parameter (any floating dtype, on the mesh's device).
        fqn: its fully qualified name, for messages.
        module_infos: every (module, name) the parameter is registered under.
        mesh_info: the unit's mesh.
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        module_infos: list[ParamModuleInfo],
        mesh_info: MeshInfo,
    ) -> None:
        self.fqn = fqn
        self.module_infos = module_infos
        self.mesh_info = mesh_info
        self.orig_size = param.size()
        self.dtype = param.dtype
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard the 0-dim parameter {fqn!r} on dim 0. "
                "Keep it out with ignored_params={...} or make it 1-D."
            )
        ws, rank = mesh_info.shard_size, mesh_info.shard_rank
        n = param.size(0)
        self.chunk_rows = math.ceil(n / ws)  # rows of every padded shard
        self.local_rows = max(0, min(self.chunk_rows, n - rank * self.chunk_rows))
        start = min(rank * self.chunk_rows, n)
        with torch.no_grad():
            local = param.detach().narrow(0, start, self.local_rows).clone()
        placements = (
            (Shard(0),)
            if mesh_info.replicate_mesh_dim is None
            else (Replicate(), Shard(0))
        )
        self.placements = placements
        dtensor = DTensor.from_local(
            local,
            mesh_info.mesh,
            placements,
            run_check=False,
            shape=param.size(),
            stride=param.stride() if param.is_contiguous() else None,
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        # The placeholder starts with 0 bytes of storage. See
        # [Note: Sharded parameter and unsharded placeholder].
        self.unsharded_param = nn.Parameter(
            torch.empty(self.orig_size, dtype=param.dtype, device=param.device),
            requires_grad=param.requires_grad,
        )
        self.unsharded_param.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED
        for info in module_infos:
            _set_param(info, self.sharded_param)

    # ------------------------------------------------------------------ forward
    @property
    def unsharded_nbytes(self) -> int:
        return self.orig_size.numel() * self.dtype.itemsize

    def all_gather_input(self) -> torch.Tensor:
        """This rank's shard padded to ``chunk_rows`` rows (ND, like the parameter)."""
        local = self.sharded_param.to_local()
        pad = self.chunk_rows - self.local_rows
        if pad == 0:
            return local
        zeros = local.new_zeros((pad, *self.orig_size[1:]))
        return torch.cat([local, zeros], dim=0)

    def all_gather(self) -> torch.Tensor:
        """Issues and waits for this parameter's all-gather; returns the padded full
        tensor (``shard_size * chunk_rows`` rows)."""
        mi = self.mesh_info
        return all_gather(self.all_gather_input(), mi.shard_size, mi.shard_group_name)

    def fill_unsharded(self, gathered: torch.Tensor) -> None:
        """Grows the placeholder to full and copies the gathered rows into it."""
        if self.sharded_state is not ShardedState.SHARDED:
            raise AssertionError(
                f"{self.fqn}: fill_unsharded needs SHARDED, found {self.sharded_state}"
            )
        p = self.unsharded_param
        full = gathered.narrow(0, 0, self.orig_size[0])
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.untyped_storage().resize_(self.unsharded_nbytes)
            torch.ops.fsdp.copy_(p, full)
        self.to_unsharded()

    def to_unsharded(self) -> None:
        for info in self.module_infos:
            _set_param(info, self.unsharded_param)
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Frees the placeholder's storage and puts the sharded parameter back."""
        if self.sharded_state is ShardedState.SHARDED:
            return
        p = self.unsharded_param
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
            p.untyped_storage().resize_(0)
        for info in self.module_infos:
            _set_param(info, self.sharded_param)
        self.sharded_state = ShardedState.SHARDED

    # ----------------------------------------------------------------- backward
    def reduce_grad(self, unsharded_grad: torch.Tensor) -> None:
        """Reduce-scatters (avg) ``unsharded_grad`` over the shard group, all-reduces
        (avg) over the replicate group for HSDP, and accumulates the result into
        ``sharded_param.grad``."""
        mi = self.mesh_info
        ws = mi.shard_size
        grad = unsharded_grad
        pad = ws * self.chunk_rows - self.orig_size[0]
        if pad:
            grad = torch.cat([grad, grad.new_zeros((pad, *self.orig_size[1:]))], dim=0)
        local = reduce_scatter_avg(grad, ws, mi.shard_group_name)
        if mi.replicate_group_name is not None:
            local = all_reduce_avg(local, mi.replicate_group_name)
        if self.local_rows != self.chunk_rows:
            local = local.narrow(0, 0, self.local_rows)
        self.accumulate_sharded_grad(local)

    def accumulate_sharded_grad(self, local: torch.Tensor) -> None:
        sp = self.sharded_param
        if sp.grad is None:
            sp.grad = DTensor.from_local(
                local,
                self.mesh_info.mesh,
                self.placements,
                run_check=False,
                shape=self.orig_size,
                stride=sp.stride(),
            )
        else:
            sp.grad._local_tensor.add_(local)
