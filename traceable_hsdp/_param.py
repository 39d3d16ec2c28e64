"""One managed parameter: its sharded DTensor and its unsharded placeholder.

[Note: Sharded parameter and unsharded placeholder]
Each managed parameter has two ``nn.Parameter``s:

- ``sharded_param``: a ``DTensor`` sharded on dim 0 (``torch.chunk`` layout, replicated
  over the replicate dim for HSDP): what the optimizer steps, ``state_dict()`` returns
  and the module holds between uses. Collectives pad the local rows to ``chunk_rows``.
- ``unsharded_param``: a plain ``nn.Parameter`` of the full shape whose storage is
  resized to full before use and to 0 bytes after, and filled with
  ``torch.ops.fsdp.copy_``. Neither op is functionalized, so both stay in the traced
  graphs, in order, for the passes to rewrite. Autograd saves this placeholder, so
  resizing it to 0 frees the memory; the backward re-gathers into the same storage.

[Note: The module holds the placeholder only in forward]
The modules hold the placeholder from a unit's pre-forward to its post-forward, between
``unshard()`` and ``reshard()``, and, eagerly, from the unit's pre-backward (or the end
of a forward with ``reshard_after_forward=False``) until its backward is done, for
activation checkpointing's recompute (as torch's FSDP2). Otherwise they hold the
sharded parameter, also when the data stays gathered, so ``state_dict()`` and
``clip_grad_norm_`` see it between steps. A compiled backward registers nothing:
swapping ``module._parameters`` inside a compiled-autograd graph fails in dynamo.

[Note: Changes after fully_shard]
What a user does to a parameter after ``fully_shard`` is honoured, as in torch's FSDP2,
or refused at the next forward; never silently dropped. ``reset_sharded_param`` re-reads
it in ``FSDPModule._apply`` (``model.to``, ``to_empty``), ``load_state_dict(assign=True)``
and at each pre-forward where ``user_change`` finds a change: a freeze is followed, an
assigned DTensor adopted, a plain tensor (``TypeError``) or a shard off the mesh's
device (``ValueError``) refused. Applying a change is dynamo-disabled (a graph break;
under ``fullgraph=True``, dynamo's error naming the change), but a traced freeze needs
none: the placeholder keeps requiring grad and its hook drops the gradient.

[Note: Changes while the modules hold the gathered parameter]
A unit that stays gathered after forward (the root, by default) has its modules hold
the gathered parameter ([Note: The module holds the placeholder only in forward]); a
change made there would be lost at the next reshard. So ``user_change`` and
``register_sharded`` refuse a replacement (``RuntimeError`` naming the fix) and carry a
``requires_grad_`` over to the sharded parameter (compared with its value at
registration). A TP view made while tracing is not kept (it would become a forward
output), so it is not checked.

[Note: Replicated parameters]
``hsdp(threshold=..., replicate_params=...)`` keeps small parameters whole on every
rank as ``DTensor``s replicated on every mesh dim: no gather, and the gradient is
all-reduced over both groups. They still go through the placeholder, so lifecycle and
graphs keep one shape.

[Note: Reshard to a smaller world]
``reshard_after_forward=k`` (k divides the shard group's size S) frees the placeholder
after forward but keeps on each rank block j of k of the padded gathered rows, j being
its index in a group of k consecutive ranks. The backward re-gathers over those k ranks
(intra-node on a cluster): less memory than ``False``, a smaller gather than ``True``.
``k == S`` is ``True``; ``k == 1`` is ``False``.

[Note: Shard dim and offload]
``shard_placement_fn`` may return ``Shard(d)`` with ``d != 0``; the sharded DTensor
holds ``torch.chunk(full, ws, d)[rank]``, the standard layout. The collectives work on
dim 0: the all-gather input is the shard with ``d`` moved first, and the gathered rows
are moved back (a view) before ``fsdp.copy_``; the gradient goes the same way.

``CPUOffloadPolicy`` keeps the sharded parameter and its gradient on the CPU: the
all-gather input is copied to the device first and the reduced gradient back. The
placeholder lives on the device. ``pin_memory=True`` pins only when an accelerator is
present.

[Note: Hooks on the sharded parameter]
Post-accumulate-grad hooks on a sharded ``DTensor`` are never reached by autograd, so,
as torch's ``foreach_reduce`` does, the runtime calls them once the gradient is fully
reduced (not while reduction is held back): an optimizer step in backward works.
Traced, dynamo sees the fake tensor's hooks (none), so each sharded parameter gets an
empty ``OrderedDict`` up front, which the traced path reads and dynamo guards on.

[Note: Offload copies and the CPU]
A non-blocking device-to-host copy returns before it runs; a CPU read before then reads
stale memory silently. So ``_grad_to_cpu`` copies asynchronously only when nothing on
the CPU reads the gradient during backward (eager, pinned, nothing to add to, no hook),
recording an event that ``wait_grad_offload`` waits for at the root's end of backward;
otherwise it blocks. The host-to-device copy needs no event (same-stream reader). After
a forward without backward, call ``torch.accelerator.synchronize()`` before writing the
CPU shards, as with torch's FSDP2.

[Note: FSDP x TP]
A parameter that is already a ``DTensor`` (``parallelize_module`` over a ``tp`` mesh)
is sharded over the ``dp`` mesh as torch's FSDP2 shards it, so state dicts, DCP and
``clip_grad_norm_`` see torch's layout:

- FSDP gathers and reduces the TP-local tensor (``orig_size``; ``global_size`` is the
  DTensor's), over the dp group only;
- the sharded parameter lives on the concatenated ``(dp, tp)`` mesh (slices of one named
  ``init_device_mesh``) with placements ``(Shard(d), *tp_placements)``, or
  ``_StridedShard(d, split_factor=k)`` when TP already shards dim ``d``, after a
  ``Replicate()`` for an HSDP dp mesh;
- the placeholder stays a plain tensor; the modules hold a ``DTensor.from_local`` view
  of it on the TP mesh, whose backward hands the placeholder a TP-local gradient. Unlike
  torch, ``module.weight`` is a non-leaf DTensor during forward; the numbers are the
  same (tests/test_tp.py: bitwise equal to torch's fully_shard on a (2, 2, 2) mesh).

[Note: A TP-replicated gradient is reduced over TP in reduce_dtype]
Under a ``reduce_dtype`` wider than ``param_dtype``, torch 2.15 gives a parameter whose
TP placements hold a ``Replicate`` (a SequenceParallel norm weight) an unsharded
``grad_dtype`` of ``reduce_dtype``: its gradient may be ``Partial`` over TP, and is
upcast before that TP all-reduce (torch 2.13 and 2.14 all-reduce it in ``param_dtype``,
as ours does there). On 2.15 ours gathers such a parameter in ``reduce_dtype``
(``dtype``) and its TP view casts to ``param_dtype`` (``view_dtype``): the forward
computes with the values torch's does, and the cast's backward upcasts the gradient
before the view's backward all-reduces it. No ``grad_dtype`` is set, which compiled
autograd does not read, so the compiled step reduces in the same order. The cost is
one all-gather per unit in ``reduce_dtype`` for these (small) parameters.
tests/test_tp.py checks the bf16 step bitwise against torch's fully_shard eagerly, and
the compiled step against the eager one.

Refused at ``fully_shard``: an int ``reshard_after_forward`` with a DTensor parameter
(torch refuses it too), ``Partial`` or ``_StridedShard`` TP placements, more than two
mesh dims, and a TP parameter that ``hsdp()`` would replicate.

[Note: The SPMD-mesh form]
``fully_shard(block, mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
replicate=...))`` is torch's other spelling of the same layout: every parameter is
already a ``DTensor`` on the full mesh, ``Replicate()`` on the named data-parallel
dims (``distribute_module``, or ``parallelize_module`` over ``world_mesh["tp"]``...
on the full mesh's dims). It runs on the FSDP x TP machinery above:

- the unit's mesh is the data-parallel part, named slices of ``world_mesh`` (several
  names flattened into one dim; for HSDP the replicate and shard parts concatenated),
  and FSDP gathers and reduces the local tensor over it, as for TP;
- the sharded parameter stays on ``world_mesh`` itself, its placements the original
  ones with ``Shard(d)`` on the shard dim (``_StridedShard(d, split_factor=k)`` when
  dims to its right already shard ``d``), as torch's; with several shard dims, as
  torch's, on ``world_mesh`` with those dims replaced by the flattened one;
- the modules hold a ``DTensor.from_local`` view of the placeholder with the
  parameter's original spec (full mesh, ``Replicate()`` on the data-parallel dims), so
  the model computes with DTensors on the full mesh, as under torch's;
- ``replicate=`` alone is DDP: every parameter stays whole ([Note: Replicated
  parameters]) and its gradient is all-reduced.

The view's backward hands the placeholder the gradient redistributed to the
parameter's placements: a ``Replicate()`` gradient on the data-parallel dims (each
rank's batch labelled replicated, torch's tests) is reduced as it is, as torch's; a
``Partial()`` one (a batch sharded over the data-parallel dims, or DTensor's choice
under TP even for replicated inputs) is all-reduced first, so the gradient is the
one-process model's. torch's ``fully_shard`` reduce-scatters those partial sums with
an average: its gradients are ours divided by the data-parallel size
(tests/test_dp_mesh_dims.py pins both). Compiled, a unit whose mesh has a
non-data-parallel dim of more than one rank (TP in this form) is refused
(``_compile_checks.SPMD_TP_COMPILE_FIX``): its compiled backward computes wrong
gradients; the submesh form compiles. Refused at ``fully_shard``, with
torch's exceptions and messages: a plain parameter, a parameter on another mesh
object, a non-``Replicate()`` placement on a data-parallel dim, an int
``reshard_after_forward``, a mesh without dim names, names not in it; ours also
refuses ``Partial`` or ``_StridedShard`` on the other dims and a
``ShardPlacementResult`` (another mesh).

[Note: The forward reads the local shard, not the DTensor]
The all-gather input is read from ``sharded_param._local_tensor``, not ``to_local()``,
as torch's FSDP2 does: through the DTensor, the leaf would get a gradient edge into the
compiled forward, and compiled autograd would graph-break fakeifying it. The hook sets
the gradient, so no edge is needed.

[Note: A lean traced path]
Dynamo traces the runtime once per parameter in forward and again in backward, and each
op costs a fake-tensor dispatch. So the traced path reads per-parameter constants from
attributes set at init (``_shard_size``, ``_shard_group_name``, ``_replicate_*``,
``_sharded_stride``; see also [Note: Ints read while tracing]) instead of going through
``DeviceMesh.get_group`` or DTensor's ``stride()``, and skips no-op casts and narrows by
a test on static dtype or size. ``_sharded_stride`` follows ``reset_sharded_param``; the
group names cannot change.

[Note: Ints read while tracing]
A plain int attribute read while tracing is a graph constant only while its frame
compiles once. A graph break in a unit's forward makes dynamo compile
``FSDPState.forward`` per unit; the second compile sees new values and automatic dynamic
shapes make them symbolic. Inductor cannot lower a storage resize to a symbolic size, so
the grow in ``fill_unsharded`` uses the placeholder's own size (``unsharded_nbytes``),
which stays static (``force_parameter_static_shapes``). Tested by
``tests/test_reliability.py`` (a unit that breaks the graph, under Inductor).

[Note: Version counters in a traced step]
Eagerly, the placeholder's fill and free run under
``torch.autograd._unsafe_preserve_version_counter``, so the re-gather before backward
does not look like an in-place change of a saved tensor. While tracing they run without
it (``_hide_version_change``): AOTAutograd drops those version ops from the graphs it
hands the backend, so they would only cost tracing. The conformance test counts none in
the captured graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed.fsdp  # noqa: F401  registers torch.ops.fsdp.copy_
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement

from ._api import REDUCE_IN_GRAD_DTYPE, CPUOffloadPolicy, MixedPrecisionPolicy
from ._collectives import all_gather_start, all_reduce, reduce_scatter, wait_all_gather
from ._common import MeshInfo, PostForwardInfo, ShardedState, SpmdLayout, compiling
from ._extension import (
    POST,
    PRE,
    ExtensionState,
    as_plain,
    contiguous_stride,
    find_hooks,
    refuse_subclass_compiled,
    shard_mesh,
)
from ._optim_check import register_placeholder, register_replaced
from ._torch_internals import DTensorSpec, _concatenate, _StridedShard


class UserChange(Enum):
    """What :meth:`FSDPParam.user_change` found. See [Note: Changes after fully_shard]."""

    NONE = auto()
    """Nothing changed since the unit last read the sharded parameter."""
    FROZEN = auto()
    """Only ``requires_grad`` went to ``False``, which a compiled step follows unapplied."""
    OTHER = auto()
    """Replaced, unfrozen, cast, or moved: re-read it."""


@dataclass(frozen=True)
class ParamModuleInfo:
    """Where the parameter is registered: ``module._parameters[param_name]``."""

    module: nn.Module
    param_name: str


def _hide_version_change(p: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Keeps ``p``'s version counter across a resize or fill, eagerly. While dynamo
    traces, nothing: see [Note: Version counters in a traced step]."""
    if compiling():
        return contextlib.nullcontext()
    return torch.autograd._unsafe_preserve_version_counter(p)


def _set_param(info: ParamModuleInfo, param: nn.Parameter) -> None:
    # Skips nn.Module.__setattr__, which rejects swapping in another tensor type.
    info.module._parameters[info.param_name] = param


class FSDPParam:
    """The tensors and collectives of one managed parameter.

    Args:
        param: the original parameter (any floating dtype, on the mesh's device).
        fqn: its fully qualified name, for messages.
        module_infos: every (module, name) the parameter is registered under.
        mesh_info: the unit's mesh.
        mp_policy: the unit's mixed precision: the placeholder and all-gather in
            ``param_dtype``, reduction in ``reduce_dtype``, sharded gradient in the
            original dtype.
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        module_infos: list[ParamModuleInfo],
        mesh_info: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        shard_dim: int = 0,
        offload: CPUOffloadPolicy | None = None,
        replicate: bool = False,
        keep_storage: bool = False,
        post_forward: PostForwardInfo | None = None,
        spmd: SpmdLayout | None = None,
    ) -> None:
        self.fqn = fqn
        # See [Note: Replicated parameters].
        self.replicate = replicate
        self.module_infos = module_infos
        self.mesh_info = mesh_info
        # See [Note: FSDP x TP]. The TP layout of a DTensor parameter, or None.
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        data = param._local_tensor if isinstance(param, DTensor) else param
        self.orig_size = data.size()  # what is gathered: the TP-local shape
        self.global_size = param.size()  # the sharded DTensor's shape
        self.mp_policy = mp_policy
        # Mesh dims of tp_spec that are data-parallel (the SPMD-mesh form), not TP.
        self._dp_dims = () if spmd is None else (*spmd.shard_dims, *spmd.replicate_dims)
        self._set_dtypes(param.dtype)
        if param.dim() == 0:
            raise ValueError(  # torch's words first
                f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D "
                "tensor with numel equal to 1, or keep it out with ignored_params={...}."
            )
        if not data.is_contiguous():
            # As torch's fully_shard: shards and collectives assume contiguity.
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet (torch's "
                f"fully_shard neither): {fqn!r} has "
                f"shape {tuple(data.shape)} and stride {data.stride()} (channels_last, or "
                "a transposed view). Make it contiguous before fully_shard "
                "(model.to(memory_format=torch.contiguous_format), or "
                "param.data = param.data.contiguous()), or keep it out with "
                "ignored_params={...}."
            )
        # See [Note: Shard dim and offload].
        self.shard_dim = shard_dim
        self.offload = offload
        self.device = mesh_info.device  # where gathers, compute and reduction run
        # Where the local shard lives once materialized (not on meta).
        self.shard_device = torch.device("cpu") if offload is not None else self.device
        # Read once here, not in the traced path: see [Note: A lean traced path].
        self._shard_size = mesh_info.shard_size
        self._shard_group_name = mesh_info.shard_group_name
        self._replicate_size = mesh_info.replicate_size
        self._replicate_group_name = mesh_info.replicate_group_name
        self._shard_rank = mesh_info.shard_rank
        ws, rank = (1, 0) if replicate else (self._shard_size, mesh_info.shard_rank)
        n = data.size(shard_dim)
        if shard_dim > 0 and n % ws:
            # torch's fully_shard refuses it with these words; padding would work
            # (dim 0 pads), but code written for torch relies on the refusal.
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {shard_dim}: "
                f"{data.size()} (world size: {ws}), as torch's fully_shard. Parameter "
                f"{fqn!r}: return Shard(0) (uneven dim 0 is padded) or a dim whose size "
                f"divides by {ws} from shard_placement_fn."
            )
        self.chunk_rows = math.ceil(n / ws)  # rows (along shard_dim) of every padded shard
        self.local_rows = max(0, min(self.chunk_rows, n - rank * self.chunk_rows))
        start = min(rank * self.chunk_rows, n)
        with torch.no_grad():
            local = data.detach().narrow(shard_dim, start, self.local_rows).clone()
            # A meta parameter stays on meta until module.to_empty().
            if offload is not None and not local.is_meta:
                local = local.cpu()
                if offload.pin_memory and torch.accelerator.is_available():
                    local = local.pin_memory()
        inner: Placement = Replicate() if replicate else Shard(shard_dim)
        self.sharded_mesh = mesh_info.mesh  # the sharded DTensor's mesh
        tp_placements: tuple[Placement, ...] = ()
        if spmd is not None:  # See [Note: The SPMD-mesh form].
            assert self.tp_spec is not None
            self.sharded_mesh = spmd.sharded_mesh
            self.placements = spmd_placements(
                spmd, mesh_info, tuple(self.tp_spec.placements), shard_dim, replicate
            )
        else:
            if self.tp_spec is not None:  # See [Note: FSDP x TP].
                self.sharded_mesh = spmd_mesh(mesh_info.mesh, self.tp_spec.mesh, fqn)
                tp_placements = self.tp_spec.placements
                split_factor = self.tp_spec.num_shards_map[shard_dim]
                if not replicate and split_factor > 1:
                    inner = _StridedShard(shard_dim, split_factor=split_factor)
            dp = (inner,) if mesh_info.replicate_mesh_dim is None else (Replicate(), inner)
            self.placements = (*dp, *tp_placements)
        dtensor = DTensor.from_local(
            local,
            self.sharded_mesh,
            self.placements,
            run_check=False,
            shape=param.size(),
            stride=param.stride() if param.is_contiguous() else None,
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        self.post_forward = post_forward
        # See [Note: All-gather extensions] (_extension.py).
        self.extension: ExtensionState | None = None
        if find_hooks(data) is not None and find_hooks(dtensor._local_tensor) is None:
            raise NotImplementedError(
                f"Parameter {fqn!r}: {type(data).__name__} defines {PRE} but its shard "
                "lost the type through DTensor.from_local (a subclass without "
                "__torch_dispatch__), so the all-gather extension would be skipped. Make "
                "it a wrapper subclass (torch.Tensor._make_wrapper_subclass, "
                "__torch_dispatch__, __tensor_flatten__), as torchao's float8 weights are."
            )
        self._refresh_extension(dtensor._local_tensor)
        self._track_grad_hooks()
        # See [Note: An optimizer must hold the model's sharded parameters].
        register_replaced(param, fqn)
        self._sharded_stride = self.sharded_param.stride()  # See [Note: A lean traced path].
        # 0 bytes of storage: [Note: Sharded parameter and unsharded placeholder].
        # Post-accumulate-grad hooks, registered again on a new unsharded parameter.
        self._acc_hooks: list[Callable[[torch.Tensor], None]] = []
        self._set_unsharded_param(
            nn.Parameter(self._empty_placeholder(), requires_grad=param.requires_grad)
        )
        self.sharded_state = ShardedState.SHARDED
        self.module_holds_unsharded = False
        # What register_unsharded gave the modules (the placeholder, or its TP view;
        # None for a TP view made while tracing), and its requires_grad then.
        self._held: torch.Tensor | None = self.unsharded_param
        self._held_requires_grad = self.unsharded_param.requires_grad
        # hsdp(optimizer_level="level1"): reshard keeps the placeholder's storage.
        self.keep_storage = keep_storage
        # After an int reshard_after_forward: this rank's block of the padded gathered
        # rows (ND, dim 0 = shard dim), or None. See [Note: Reshard to a smaller world].
        self.post_forward_shard: torch.Tensor | None = None
        # HSDP: the sharded grad awaits the all-reduce over the replicas.
        self.replicas_pending = False
        # Pending copy of the gradient to the CPU: [Note: Offload copies and the CPU].
        self.grad_offload_event: torch.Event | None = None
        # Gradient summed over backwards without sync, in reduce_dtype (ND), or None.
        self.accumulated_grad: torch.Tensor | None = None
        for info in module_infos:
            _set_param(info, self.sharded_param)

    def _set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """The dtypes that follow from the sharded parameter's dtype and the mixed
        precision policy (which applies to floating-point parameters only)."""
        self.orig_dtype = orig_dtype
        floating = orig_dtype.is_floating_point
        mp = self.mp_policy
        self.dtype = (mp.param_dtype if floating else None) or orig_dtype
        # See [Note: reduce_dtype follows the installed torch] (_api.py).
        default = orig_dtype if REDUCE_IN_GRAD_DTYPE else self.dtype
        self.reduce_dtype = (mp.reduce_dtype if floating else None) or default
        # The dtype the TP view computes in when it differs from the gathered one, or
        # None. See [Note: A TP-replicated gradient is reduced over TP in reduce_dtype].
        self.view_dtype: torch.dtype | None = None
        if (
            REDUCE_IN_GRAD_DTYPE
            and self.tp_spec is not None
            and any(
                isinstance(p, Replicate)
                for i, p in enumerate(self.tp_spec.placements)
                if i not in self._dp_dims
            )
            and self.reduce_dtype.itemsize > self.dtype.itemsize
        ):
            self.view_dtype, self.dtype = self.dtype, self.reduce_dtype

    def _empty_placeholder(self) -> torch.Tensor:
        """A tensor of the full shape in ``dtype`` on the compute device, with 0 bytes of
        storage (allocated full, never written, released at once)."""
        t = torch.empty(self.orig_size, dtype=self.dtype, device=self.device)
        t.untyped_storage().resize_(0)
        return t

    # ------------------------------------------------------------------ forward
    @property
    def unsharded_nbytes(self) -> int:
        """The placeholder's full size in bytes, from its own (static) shape and dtype:
        [Note: Ints read while tracing]."""
        p = self.unsharded_param
        return p.numel() * p.element_size()

    def all_gather_input(self) -> torch.Tensor:
        """This rank's shard in ``param_dtype`` on the compute device, with the shard
        dim moved first and padded to ``chunk_rows`` rows (ND)."""
        # See [Note: The forward reads the local shard, not the DTensor].
        local = self.sharded_param._local_tensor
        if local.device != self.device:  # CPU offload: copy in for the gather
            # Stream-ordered before its reader; see [Note: Offload copies and the CPU].
            local = local.to(self.device, non_blocking=True)
        if local.dtype != self.dtype:  # static while tracing: no node when equal
            local = local.to(self.dtype)
        if self.shard_dim != 0:
            local = local.movedim(self.shard_dim, 0)
        pad = self.chunk_rows - self.local_rows
        if pad == 0:
            return local
        zeros = local.new_zeros((pad, *local.shape[1:]))
        return torch.cat([local, zeros], dim=0)

    def all_gather_start(self) -> Any:
        """Issues this parameter's all-gather (none for a replicated parameter); the
        result is ready after :meth:`wait_gathered`."""
        if self.extension is not None:
            return self._extension_gather_start(self.extension)
        if self.replicate:
            return self.all_gather_input()
        if self.post_forward_shard is not None:
            pf = self.post_forward
            assert pf is not None
            return all_gather_start(self.post_forward_shard, pf.size, pf.group_name)
        return all_gather_start(self.all_gather_input(), self._shard_size, self._shard_group_name)

    def wait_gathered(self, issued: Any) -> Any:
        """Waits for what :meth:`all_gather_start` returned."""
        if self.extension is not None:
            outputs, metadata = issued
            if not self._issues_gather():
                return outputs, metadata
            return [wait_all_gather(t) for t in outputs], metadata
        if self.replicate or self._shard_size == 1:  # nothing was issued
            return issued
        return wait_all_gather(issued)

    # The flat eager all-gather: see [Note: One collective per unit, eagerly]
    # (_param_group.py) and [Note: Flat buffers] (_collectives.py).
    def flat_gather_group(self) -> tuple[str, int] | None:
        """The (group name, size) this parameter's all-gather runs over, or ``None``
        when it issues none (a replicated parameter, or a group of one rank). An
        extension parameter gathers on its own: see [Note: All-gather extensions]."""
        if self.replicate or self.extension is not None:
            return None
        if self.post_forward_shard is not None:
            pf = self.post_forward
            assert pf is not None
            return (pf.group_name, pf.size) if pf.size > 1 else None
        mi = self.mesh_info
        return (mi.shard_group_name, mi.shard_size) if mi.shard_size > 1 else None

    def flat_gather_source(self) -> tuple[torch.Tensor, int]:
        """This rank's all-gather input, shard dim first, not yet padded or cast (ND),
        and the padded rows of every rank's part."""
        if self.post_forward_shard is not None:
            return self.post_forward_shard, self.post_forward_shard.size(0)
        # See [Note: The forward reads the local shard, not the DTensor].
        local = self.sharded_param._local_tensor
        if local.device != self.device:  # CPU offload: copy in for the gather
            local = local.to(self.device, non_blocking=True)
        if self.shard_dim != 0:
            local = local.movedim(self.shard_dim, 0)
        return local, self.chunk_rows

    def flat_gather_target(self, world_size: int, numel: int) -> torch.Tensor:
        """Where the flat all-gather's ``(world_size, numel)`` part is copied: the
        grown placeholder when :meth:`_gathers_in_place`, else a new buffer."""
        if self.sharded_state is ShardedState.UNSHARDED:
            raise AssertionError(
                f"{self.fqn}: flat_gather_target needs a sharded state, found {self.sharded_state}"
            )
        if self._gathers_in_place():
            p = self.unsharded_param
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                p.untyped_storage().resize_(self.unsharded_nbytes)
            return p.view(world_size, numel)
        return torch.empty((world_size, numel), dtype=self.dtype, device=self.device)

    def flat_gather_done(self, target: torch.Tensor) -> None:
        """Finishes the unshard from the filled :meth:`flat_gather_target`."""
        if self._gathers_in_place():
            self.post_forward_shard = None
            self.sharded_state = ShardedState.UNSHARDED
            return
        rest = self._moved_rest()
        self.fill_unsharded(target.view(target.numel() // math.prod(rest), *rest))

    def _gathers_in_place(self) -> bool:
        """Whether the gathered rows are exactly the placeholder's (a dim-0 shard
        that needs no padding), so the flat all-gather copies straight into it."""
        rows = self.orig_size[0]
        return self.shard_dim == 0 and rows == self.mesh_info.shard_size * self.chunk_rows

    def _moved_rest(self) -> tuple[int, ...]:
        """The sizes of the dims other than the shard dim, in order."""
        return tuple(s for i, s in enumerate(self.orig_size) if i != self.shard_dim)

    def fill_unsharded(self, gathered: Any) -> None:
        """Grows the placeholder to full and copies the gathered rows into it."""
        if self.sharded_state is ShardedState.UNSHARDED:
            raise AssertionError(
                f"{self.fqn}: fill_unsharded needs a sharded state, found {self.sharded_state}"
            )
        self.post_forward_shard = None
        rows = self.orig_size[self.shard_dim]
        if self.extension is not None:
            full = self._extension_unsharded(self.extension, *gathered)
            if full is None:  # the subclass parameter holds it
                self.sharded_state = ShardedState.UNSHARDED
                return
        else:
            full = gathered
        p = self.unsharded_param
        if full.size(0) != rows:  # static while tracing: no node without padding
            full = full.narrow(0, 0, rows)
        if self.shard_dim != 0:
            full = full.movedim(0, self.shard_dim)
        with torch.no_grad(), _hide_version_change(p):
            p.untyped_storage().resize_(self.unsharded_nbytes)
            torch.ops.fsdp.copy_(p, full)
        self.sharded_state = ShardedState.UNSHARDED

    def register_unsharded(self) -> None:
        """Makes the modules hold the (filled) placeholder. See
        [Note: The module holds the placeholder only in forward]."""
        if self.sharded_state is not ShardedState.UNSHARDED:
            raise AssertionError(f"{self.fqn}: register_unsharded needs UNSHARDED data")
        if not self.module_holds_unsharded:
            held = self.unsharded_param if self.tp_spec is None else self._tp_view()
            for info in self.module_infos:
                _set_param(info, held)
            # See [Note: Changes while the modules hold the gathered parameter].
            keep = self.tp_spec is None or not compiling()
            self._held = held if keep else None
            self._held_requires_grad = held.requires_grad
            self.module_holds_unsharded = True

    def _tp_view(self) -> DTensor:
        """The placeholder as a DTensor on the TP mesh with the TP placements, what
        the TP modules compute with. See [Note: FSDP x TP]."""
        spec = self.tp_spec
        assert spec is not None
        # Grad on inside an eager backward too, so a checkpoint recompute matches.
        with torch.enable_grad():
            view = DTensor.from_local(
                self.unsharded_param,
                spec.mesh,
                spec.placements,
                run_check=False,
                shape=self.global_size,
                stride=spec.stride,
            )
            return view if self.view_dtype is None else view.to(self.view_dtype)

    def register_sharded(self) -> None:
        """Makes the modules hold the sharded parameter again. Idempotent.

        Raises:
            RuntimeError: a module's gathered parameter was replaced meanwhile (see
                [Note: Changes while the modules hold the gathered parameter])."""
        if self.module_holds_unsharded:
            self._follow_gathered_changes()
            for info in self.module_infos:
                _set_param(info, self.sharded_param)
            self.module_holds_unsharded = False

    def post_forward_reshard(self) -> None:
        """Keeps this rank's 1/k block of the gathered rows and frees the placeholder.
        See [Note: Reshard to a smaller world]."""
        pf = self.post_forward
        if pf is None or self.replicate:
            self.reshard()
            return
        self.register_sharded()
        if self.sharded_state is not ShardedState.UNSHARDED:
            return
        with torch.no_grad():
            full = self.unsharded_param.detach()
            if self.shard_dim != 0:
                full = full.movedim(self.shard_dim, 0)
            rows = self.mesh_info.shard_size * self.chunk_rows
            if rows != full.size(0):
                full = torch.cat([full, full.new_zeros((rows - full.size(0), *full.shape[1:]))])
            block = rows // pf.size
            kept = full.narrow(0, pf.index * block, block).clone()
        self.reshard()
        self.post_forward_shard = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Frees the placeholder's storage (and any post-forward shard); the modules
        hold the sharded parameter."""
        self.register_sharded()
        self.post_forward_shard = None
        if self.sharded_state is not ShardedState.UNSHARDED:
            self.sharded_state = ShardedState.SHARDED
            return
        if self.keep_storage:
            pass
        elif self.extension is not None and self.extension.subclass:
            self.extension.free()
        else:
            p = self.unsharded_param
            with torch.no_grad(), _hide_version_change(p):
                p.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

    # ------------------------------------------------------ all-gather extensions
    # See [Note: All-gather extensions] (_extension.py).
    def _issues_gather(self) -> bool:
        return not self.replicate and self._shard_size > 1

    def _extension_gather_start(self, ext: ExtensionState) -> tuple[list[torch.Tensor], Any]:
        """The pre-all-gather hook's tensors, all-gathered (issued), and its metadata."""
        if ext.subclass and compiling():
            refuse_subclass_compiled(f"Parameter {self.fqn!r}.")
        local = self.sharded_param._local_tensor
        if local.device != self.device:  # CPU offload: copy in for the hook
            local = local.to(self.device, non_blocking=True)
        inputs, metadata = ext.hooks.pre_all_gather(
            local, ext.mesh, self.orig_size, self.module_infos[0].module, self.mp_policy
        )
        padded = (self.chunk_rows, *self.orig_size[1:])
        if self.local_rows != self.chunk_rows and any(tuple(t.shape) != padded for t in inputs):
            raise AssertionError(
                "When a parameter is unevenly sharded by FSDP (orig size="
                f"{self.orig_size}, FSDP world size={self._shard_size}), "
                "fsdp_pre_all_gather must return all-gather inputs with the padded sharded "
                f"size {torch.Size(padded)} but got {[t.size() for t in inputs]} "
                f"(parameter {self.fqn!r})"
            )
        if not self._issues_gather():
            # Gathered buffers of their own: a subclass result may keep them.
            return [t if compiling() else t.clone() for t in inputs], metadata
        ws, group = self._shard_size, self._shard_group_name
        return [all_gather_start(as_plain(t), ws, group) for t in inputs], metadata

    def _extension_unsharded(
        self, ext: ExtensionState, outputs: list[torch.Tensor], metadata: Any
    ) -> torch.Tensor | None:
        """Runs the post-all-gather hook: its plain result to copy into the
        placeholder, or ``None`` once a subclass parameter holds it."""
        local = self.sharded_param._local_tensor
        if ext.subclass:  # eager: refill the same buffers, then out= the parameter
            ext.alloc()
            for buf, new in zip(ext.outputs, outputs):
                buf.copy_(new)
            ext.hooks.post_all_gather(
                local, ext.outputs, metadata, self.dtype, out=self.unsharded_param
            )
            if ext.hooks.release_outputs:
                ext.free(outputs_only=True)
            return None
        result, to_free = ext.hooks.post_all_gather(local, outputs, metadata, self.dtype)
        if type(result) is not torch.Tensor:
            if compiling():
                refuse_subclass_compiled(f"Parameter {self.fqn!r}: got {type(result).__name__}.")
            ext.subclass = True
            ext.outputs, ext.inner = outputs, tuple(to_free)
            unsharded = torch.as_strided(
                result, self.orig_size, contiguous_stride(self.orig_size), storage_offset=0
            )
            self._set_unsharded_param(
                nn.Parameter(unsharded, requires_grad=self.sharded_param.requires_grad)
            )
            if ext.hooks.release_outputs:
                ext.free(outputs_only=True)
            return None
        if result.dtype != self.dtype or result.numel() < self.orig_size.numel():
            raise ValueError(
                f"Parameter {self.fqn!r}: fsdp_post_all_gather returned a tensor of dtype "
                f"{result.dtype} and shape {tuple(result.shape)}; expected param_dtype "
                f"{self.dtype} (its third argument) and at least shape "
                f"{tuple(self.orig_size)}. Return the unsharded tensor in param_dtype."
            )
        if not compiling():  # a traced write would change a guarded value: a recompile
            ext.subclass = False
        rows = self.orig_size[0]
        if tuple(result.shape[1:]) == tuple(self.orig_size[1:]) and result.size(0) >= rows:
            return result
        return torch.as_strided(
            result, self.orig_size, contiguous_stride(self.orig_size), storage_offset=0
        )

    def _refresh_extension(self, local: torch.Tensor) -> None:
        """Reads the local shard's all-gather extension again; a new one starts from
        the plain placeholder. See [Note: All-gather extensions]."""
        hooks = find_hooks(local)
        ext = self.extension
        if ext is not None and hooks == ext.hooks and local is ext.local:
            return
        if ext is not None and ext.subclass:
            ext.free()
            self._set_unsharded_param(
                nn.Parameter(self._empty_placeholder(), requires_grad=self.sharded_param.requires_grad)
            )
        self.extension = None
        if hooks is None:
            return
        what = None
        if self.tp_spec is not None:
            what = "a DTensor (tensor-parallel) parameter"
        elif self.shard_dim != 0:
            what = f"Shard({self.shard_dim}) from shard_placement_fn"
        elif self.post_forward is not None:
            what = "an int reshard_after_forward (torch's fully_shard refuses it too)"
        if what is not None:
            raise NotImplementedError(
                f"Parameter {self.fqn!r}: its local tensor ({type(local).__name__}) defines "
                f"{PRE}, torch's FSDP2 all-gather extension, which traceable_hsdp does not "
                f"support with {what}. Shard it on dim 0 over the data-parallel mesh with "
                "reshard_after_forward True or False, or turn the extension off (torchao: "
                "Float8LinearConfig(enable_fsdp_float8_all_gather=False))."
            )
        self.extension = ExtensionState(hooks, shard_mesh(self.mesh_info, self.fqn), local)

    def _extension_changed(self, local: torch.Tensor) -> bool:
        """Whether the local shard's hooks differ from the ones read last."""
        if compiling():
            # dynamo's hasattr is right on a plain tensor only (see the Note).
            return self.extension is None and type(local) is torch.Tensor and hasattr(local, PRE)
        ext = self.extension
        if ext is None:
            return hasattr(local, PRE) or hasattr(local, POST)
        return local is not ext.local or find_hooks(local) != ext.hooks

    def _set_unsharded_param(self, param: nn.Parameter) -> None:
        """Makes ``param`` the unsharded parameter, with the post-accumulate-grad
        hooks registered so far."""
        self.unsharded_param = param
        register_placeholder(param, self.fqn)
        for hook in self._acc_hooks:
            param.register_post_accumulate_grad_hook(hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Registers ``hook`` on the unsharded parameter, and on any later one."""
        self._acc_hooks.append(hook)
        self.unsharded_param.register_post_accumulate_grad_hook(hook)

    # ----------------------------------------------------------------- backward
    def reduce_grad(
        self,
        unsharded_grad: torch.Tensor,
        divide_factor: float | None,
        all_reduce_replicas: bool = True,
        reduced_hook: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Reduce-scatters ``unsharded_grad`` over the shard group (and, for HSDP,
        all-reduces over the replicate group) in ``reduce_dtype``, and accumulates the
        result, in the original dtype, into ``sharded_param.grad``.

        ``divide_factor=None`` averages over all data-parallel ranks; a number sums
        and divides by it. ``all_reduce_replicas=False`` skips the all-reduce and keeps
        the shard-reduced sum for the next one. ``reduced_hook`` gets the fully reduced
        local gradient before division, to change in place. See [Note: The all-reduce
        hook] in ``_param_group.py``.
        """
        # Group names and sizes read at init: see [Note: A lean traced path].
        ws = self._shard_size
        replicate_group = self._replicate_group_name
        op = "avg" if divide_factor is None else "sum"
        grad = unsharded_grad
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.replicate:  # DDP-style: all-reduce over every data-parallel rank
            local = all_reduce(grad, op, self._shard_group_name, ws)
            if replicate_group is not None:
                local = all_reduce(local, op, replicate_group, self._replicate_size)
            self._finish_reduced(local, divide_factor, reduced_hook)
            return
        if self.shard_dim != 0:
            grad = grad.movedim(self.shard_dim, 0)
        pad = ws * self.chunk_rows - grad.size(0)
        if pad:
            grad = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))], dim=0)
        local = reduce_scatter(grad, op, ws, self._shard_group_name, self._shard_rank)
        if self.local_rows != self.chunk_rows:
            local = local.narrow(0, 0, self.local_rows)
        if self.shard_dim != 0:
            local = local.movedim(0, self.shard_dim).contiguous()
        if replicate_group is not None:
            if not all_reduce_replicas:
                # Not divided yet: the division comes with the all-reduce, once.
                self._accumulate_reduced(local)
                self.replicas_pending = True
                return
            if self.replicas_pending:
                # Fold in what earlier backwards reduced without the all-reduce.
                self.wait_grad_offload()
                sp = self.sharded_param
                local = sp.grad.to_local().to(local.device, local.dtype) + local
                sp.grad = None
                self.replicas_pending = False
            local = all_reduce(local, op, replicate_group, self._replicate_size)
        self._finish_reduced(local, divide_factor, reduced_hook)

    # The flat eager reduction, ``reduce_grad`` per part of the unit's buffer: see
    # [Note: One collective per unit, eagerly] and [Note: Flat buffers].
    def flat_reduce_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (in ``reduce_dtype``, full shape) with the shard dim first (ND)."""
        return grad if self.shard_dim == 0 else grad.movedim(self.shard_dim, 0)

    @property
    def flat_numel(self) -> int:
        """Elements of this parameter's padded part of one rank's row in the flat
        buffers (``chunk_rows`` rows)."""
        return self.chunk_rows * math.prod(self._moved_rest())

    def flat_reduced_local(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's gradient shard in the sharded layout, as a view of ``part``
        (its ``flat_numel`` elements of the reduce-scatter output, 1D)."""
        local = part.view(self.chunk_rows, *self._moved_rest())
        if self.local_rows != self.chunk_rows:
            local = local.narrow(0, 0, self.local_rows)
        if self.shard_dim != 0:
            local = local.movedim(0, self.shard_dim)
        return local

    def fold_replicas_pending(self, local: torch.Tensor) -> None:
        """HSDP: adds into ``local`` what earlier backwards reduced without the
        all-reduce, as ``reduce_grad`` does."""
        if not self.replicas_pending:
            return
        self.wait_grad_offload()  # see [Note: Offload copies and the CPU]
        sp = self.sharded_param
        local.add_(sp.grad.to_local().to(local.device, local.dtype))
        sp.grad = None
        self.replicas_pending = False

    def hold_for_replicas(self, local: torch.Tensor) -> None:
        """HSDP with ``set_requires_all_reduce(False)``: accumulates the shard-reduced
        ``local`` without the all-reduce (nor the division), as ``reduce_grad`` does."""
        self._accumulate_reduced(local.contiguous())
        self.replicas_pending = True

    def finish_flat_reduced(
        self,
        local: torch.Tensor,
        divide_factor: float | None,
        reduced_hook: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """The end of the reduction of ``local`` (fully reduced, sharded layout), as
        ``reduce_grad`` ends it."""
        self._finish_reduced(local.contiguous(), divide_factor, reduced_hook)

    def _finish_reduced(
        self,
        local: torch.Tensor,
        divide_factor: float | None,
        reduced_hook: Callable[[torch.Tensor], None] | None,
    ) -> None:
        """The end of every full reduction: the hook, the divide factor, then
        accumulation into the sharded gradient."""
        if reduced_hook is not None:
            reduced_hook(local)
        if divide_factor is not None:
            local = local / divide_factor
        self._accumulate_reduced(local)
        self._run_sharded_grad_hooks()

    def _run_sharded_grad_hooks(self) -> None:
        """Runs the sharded parameter's post-accumulate-grad hooks. See [Note: Hooks
        on the sharded parameter]."""
        sp = self.sharded_param
        # Traced, read the tracked dict: the fake tensor's attribute is None.
        hooks = self._grad_hooks if compiling() else sp._post_accumulate_grad_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                hook(sp)

    def _track_grad_hooks(self) -> None:
        """Gives the sharded parameter its hook dict now. See [Note: Hooks on the
        sharded parameter]."""
        sp = self.sharded_param
        if sp._post_accumulate_grad_hooks is None:
            sp._post_accumulate_grad_hooks = OrderedDict()
        self._grad_hooks = sp._post_accumulate_grad_hooks

    def _accumulate_reduced(self, local: torch.Tensor) -> None:
        if local.dtype != self.orig_dtype:
            local = local.to(self.orig_dtype)
        if self.offload is not None:  # CPU offload: the sharded grad lives on the CPU
            local = self._grad_to_cpu(local)
        self.accumulate_sharded_grad(local)

    def _grad_to_cpu(self, local: torch.Tensor) -> torch.Tensor:
        """The reduced gradient shard copied to the CPU. See [Note: Offload copies and
        the CPU]."""
        if local.device.type == "cpu":
            return local
        self.wait_grad_offload()  # the gradient read below must be complete
        sp = self.sharded_param
        assert self.offload is not None
        non_blocking = (
            not compiling()
            and self.offload.pin_memory
            and sp.grad is None
            and not getattr(sp, "_post_accumulate_grad_hooks", None)
        )
        cpu = local.to("cpu", non_blocking=non_blocking)
        if non_blocking:
            self.grad_offload_event = torch.accelerator.current_stream(local.device).record_event()
        return cpu

    def wait_grad_offload(self) -> None:
        """Blocks the CPU until the gradient's asynchronous copy to the CPU is done
        (eager, root's end of backward). See [Note: Offload copies and the CPU]."""
        if self.grad_offload_event is not None:
            self.grad_offload_event.synchronize()
            self.grad_offload_event = None

    def accumulate_sharded_grad(self, local: torch.Tensor) -> None:
        sp = self.sharded_param
        if sp.grad is not None:
            # Out of place: dynamo mis-orders an in-place add through ``_local_tensor``
            # in a compiled-autograd graph.
            local = sp.grad.to_local() + local
        sp.grad = DTensor.from_local(
            local,
            self.sharded_mesh,
            self.placements,
            run_check=False,
            shape=self.global_size,
            stride=self._sharded_stride,
        )

    def user_change(self) -> UserChange:
        """What the user changed in the sharded parameter since the unit last read it,
        by attribute reads only. See [Note: Changes after fully_shard]."""
        if self.module_holds_unsharded:
            # See [Note: Changes while the modules hold the gathered parameter].
            held = self._held
            if held is None:
                return UserChange.NONE
            for info in self.module_infos:
                if info.module._parameters[info.param_name] is not held:
                    return UserChange.OTHER
            if held.requires_grad is not self._held_requires_grad:
                return UserChange.OTHER
            return UserChange.NONE
        sp = self.sharded_param
        for info in self.module_infos:
            if info.module._parameters[info.param_name] is not sp:
                return UserChange.OTHER
        if sp.dtype is not self.orig_dtype or sp.device.type != self.shard_device.type:
            return UserChange.OTHER
        if self._extension_changed(sp._local_tensor):
            return UserChange.OTHER
        if sp.requires_grad is not self.unsharded_param.requires_grad:
            return UserChange.OTHER if sp.requires_grad else UserChange.FROZEN
        return UserChange.NONE

    def reset_sharded_param(self, check_device: bool = True, unit: str = "") -> None:
        """Re-reads the sharded parameter after the user changed it, as torch's FSDP2
        does. See [Note: Changes after fully_shard].

        Args:
            check_device: raise when the shard is not on the mesh's device (default
                ``True``; ``_apply`` and the load post-hook pass ``False``).
            unit: the unit's label, for the message ("layers.0" under a root).

        Raises:
            TypeError: a module now holds something other than a DTensor.
            ValueError: a DTensor of another shape, placements or mesh; the shard
                on another device than the mesh's (e.g. still on meta).
        """
        if self.module_holds_unsharded:
            self._follow_gathered_changes()
            return
        sp = self.sharded_param
        for info in self.module_infos:
            new = info.module._parameters[info.param_name]
            if new is not sp:
                register_replaced(sp, self.fqn)  # an optimizer holding it steps nothing
                sp = self._adopt(new, info)
                break
        self.sharded_param = sp
        self._refresh_extension(sp._local_tensor)
        self._track_grad_hooks()
        self._sharded_stride = sp.stride()
        for info in self.module_infos:
            _set_param(info, sp)
        if check_device and sp.device.type != self.shard_device.type:
            where = "the CPU (CPUOffloadPolicy)" if self.offload is not None else str(self.device)
            fix = (
                "Materialize it first: module.to_empty(device=...) and then initialize it "
                "(reset_parameters() or load a state dict)."
                if sp.device.type == "meta"
                else "Move the model before fully_shard, or build the mesh on "
                f"{sp.device.type!r}."
            )
            of_unit = f" of the fully_shard unit {unit}" if unit else ""
            raise ValueError(
                f"Parameter {self.fqn!r}{of_unit} is on {sp.device} but its fully_shard "
                f"unit gathers it from {where}. {fix}"
            )
        if sp.dtype != self.orig_dtype:
            self._set_dtypes(sp.dtype)
            with torch.no_grad():
                self.unsharded_param.data = self._empty_placeholder()
            self.sharded_state = ShardedState.SHARDED
            self.post_forward_shard = None
        if self.unsharded_param.requires_grad != sp.requires_grad:
            self.unsharded_param.requires_grad_(sp.requires_grad)

    def _follow_gathered_changes(self) -> None:
        """See [Note: Changes while the modules hold the gathered parameter]."""
        held = self._held
        if held is None:
            return
        for info in self.module_infos:
            if info.module._parameters[info.param_name] is not held:
                raise RuntimeError(
                    f"{type(info.module).__name__}.{info.param_name} ({self.fqn!r}) was "
                    "replaced while its fully_shard unit was gathered: between a forward "
                    "and its backward (or after a forward whose backward never ran) the "
                    "unit's modules hold the gathered parameters, as torch's fully_shard, "
                    "and the next reshard would drop the new one. Assign it after the "
                    "backward, after model.reshard(), or run that forward under "
                    "torch.no_grad()."
                )
        if held.requires_grad is not self._held_requires_grad:
            self.sharded_param.requires_grad_(held.requires_grad)
            self._held_requires_grad = held.requires_grad

    def _adopt(self, new: object, info: ParamModuleInfo) -> nn.Parameter:
        """``new``, found at ``info``, as the sharded parameter, if it can be one."""
        where = f"{type(info.module).__name__}.{info.param_name}"
        if not isinstance(new, DTensor):
            raise TypeError(
                f"{where} ({self.fqn!r}) was replaced after fully_shard by a "
                f"{type(new).__name__} (by load_state_dict(assign=True) or an assignment); "
                "a fully_shard parameter must stay a DTensor. Assign a DTensor laid out "
                "like the old one (the values state_dict() returns, or "
                "distribute_tensor(full, param.device_mesh, param.placements)), copy into "
                "it (param.data.copy_ / load_state_dict with assign=False), or make the "
                "change before calling fully_shard."
            )
        if (
            new.shape != self.global_size
            or tuple(new.placements) != tuple(self.placements)
            or new.device_mesh != self.sharded_mesh
        ):
            raise ValueError(
                f"{where} ({self.fqn!r}) was replaced after fully_shard by a DTensor of "
                f"shape {tuple(new.shape)}, placements {new.placements}; expected shape "
                f"{tuple(self.global_size)}, placements {self.placements} on the same mesh. "
                "Redistribute it first (value.redistribute(param.device_mesh, "
                "param.placements)), or make the change before calling fully_shard."
            )
        if not isinstance(new, nn.Parameter):
            new = nn.Parameter(new, requires_grad=self.sharded_param.requires_grad)
        return new



def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The mesh of a sharded TP parameter: ``dp_mesh``'s dims then ``tp_mesh``'s. See
    [Note: FSDP x TP].

    Raises:
        ValueError: the meshes have no dim names, come from different
            ``init_device_mesh`` calls, or overlap.
    """
    fix = (
        "Build one mesh and slice it: world_mesh = init_device_mesh(device_type, (dp, tp), "
        "mesh_dim_names=('dp', 'tp')); parallelize_module(model, world_mesh['tp'], plan); "
        "fully_shard(block, mesh=world_mesh['dp']). See docs/api.md."
    )
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"Parameter {fqn!r} is a DTensor on {tp_mesh} and fully_shard's mesh is "
            f"{dp_mesh}; composing FSDP with TP needs both meshes to be named slices of "
            f"one world mesh. {fix}"
        )
    if dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"Parameter {fqn!r} is a DTensor on a {tp_mesh.device_type} mesh but fully_shard's "
            f"mesh is on {dp_mesh.device_type}. {fix}"
        )
    try:
        return _concatenate([dp_mesh, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"Parameter {fqn!r} is a DTensor on {tp_mesh} (dims {tp_mesh.mesh_dim_names}), "
            f"which does not combine with fully_shard's mesh {dp_mesh} (dims "
            f"{dp_mesh.mesh_dim_names}): {e}. {fix}"
        ) from None


def check_tp_placements(param: DTensor, fqn: str) -> None:
    """Refuses a DTensor parameter whose layout fully_shard cannot shard further.
    See [Note: FSDP x TP].

    Raises:
        ValueError: a ``Partial`` or ``_StridedShard`` placement, or more than two
            mesh dims.
    """
    placements = tuple(param.placements)
    if len(placements) > 2:
        raise ValueError(
            f"Parameter {fqn!r} is a DTensor on a {len(placements)}-D mesh (placements "
            f"{placements}); fully_shard composes with 1-D tensor parallelism (or 2-D "
            "expert x tensor parallelism), as torch's. Apply parallelize_module over "
            "world_mesh['tp'] only."
        )
    for pl in placements:
        if isinstance(pl, (Partial, _StridedShard)):
            raise ValueError(
                f"Parameter {fqn!r} is a DTensor with placement {pl} (placements "
                f"{placements}); fully_shard shards parameters laid out with Shard or "
                "Replicate only (what parallelize_module's ColwiseParallel, "
                "RowwiseParallel and SequenceParallel produce). Redistribute it first: "
                "param.redistribute(param.device_mesh, [Shard(d) or Replicate()])."
            )


def spmd_placements(
    spmd: SpmdLayout,
    mesh_info: MeshInfo,
    orig: tuple[Placement, ...],
    shard_dim: int,
    replicate: bool,
) -> tuple[Placement, ...]:
    """The sharded parameter's placements on ``spmd.sharded_mesh``, as torch's
    ``fully_shard`` lays them out. See [Note: The SPMD-mesh form]."""
    mesh = spmd.mesh
    new = list(orig)
    for i in spmd.shard_dims:
        # The non-data-parallel dims to the right that shard the same tensor dim:
        # DTensor shards left to right, FSDP shards their local tensor.
        split_factor = 1
        for j in range(i + 1, mesh.ndim):
            pl = orig[j]
            if isinstance(pl, (Shard, _StridedShard)) and pl.dim == shard_dim:
                split_factor *= mesh.size(j)
        if replicate:
            new[i] = Replicate()
        elif split_factor > 1:
            new[i] = _StridedShard(shard_dim, split_factor=split_factor)
        else:
            new[i] = Shard(shard_dim)
    if len(spmd.shard_dims) <= 1:
        return tuple(new)
    # Several shard dims: one flattened dim (after the replicate one for HSDP), as
    # spmd.sharded_mesh is built.
    hsdp = mesh_info.replicate_mesh_dim is not None
    out: list[Placement] = []
    for i in range(mesh.ndim):
        if i == spmd.shard_dims[0]:
            out.extend((Replicate(), new[i]) if hsdp else (new[i],))
        elif i in spmd.shard_dims or (hsdp and i in spmd.replicate_dims):
            continue
        else:
            out.append(new[i])
    return tuple(out)


def check_spmd_param(param: nn.Parameter, fqn: str, spmd: SpmdLayout) -> None:
    """Refuses what the SPMD-mesh form cannot shard, with torch's exceptions and
    first words. See [Note: The SPMD-mesh form].

    Raises:
        ValueError: ``param`` is not a ``DTensor``, is on another mesh object than
            ``spmd.mesh``, is not ``Replicate()`` on a data-parallel dim, or is
            ``Partial``/``_StridedShard`` on another dim.
    """
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full "
            f"SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
            f"{fqn!r}. Distribute it first: distribute_module(model, mesh) replicates "
            "every parameter; parallelize_module(model, mesh['tp'], plan) shards TP ones."
        )
    mesh = spmd.mesh
    if param.device_mesh is not mesh:
        raise ValueError(
            "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
            f"got different mesh objects: {fqn!r} is on {param.device_mesh}, fully_shard "
            f"got {mesh}. Pass the mesh the parameters were distributed over."
        )
    names = mesh.mesh_dim_names
    assert names is not None
    placements = tuple(param.placements)
    for kind, idx in (("shard", spmd.shard_dims), ("replicate", spmd.replicate_dims)):
        for i in idx:
            if not isinstance(placements[i], Replicate):
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but "
                    f"got {placements[i]} for parameter {fqn!r} (placements {placements}). "
                    "FSDP shards over the data-parallel dims itself: distribute the "
                    "parameter with Replicate() on them."
                )
    dp = set(spmd.shard_dims) | set(spmd.replicate_dims)
    for i, pl in enumerate(placements):
        if i not in dp and isinstance(pl, (Partial, _StridedShard)):
            raise ValueError(
                f"Parameter {fqn!r} is a DTensor with placement {pl!r} on mesh dim "
                f"'{names[i]}' (placements {placements}); fully_shard shards parameters "
                "laid out with Shard or Replicate on the other dims only. Redistribute "
                "it first: param.redistribute(mesh, [Shard(d) or Replicate() per dim])."
            )
