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

[Note: The module holds the placeholder only in forward]
The modules hold the placeholder from a unit's pre-forward to its post-forward,
between an explicit ``unshard()`` and ``reshard()``, and, eagerly, from the unit's
pre-backward (its re-gather) until its backward is done and from the end of a forward
with ``reshard_after_forward=False`` (as torch's: its parameters are the unsharded
ones then) until its backward is done; at every other time they hold the sharded
parameter, whether or not the placeholder's storage is full. The eager backward needs it for activation checkpointing: the recompute calls
the modules' forward again, which must read the gathered parameters (torch's FSDP2
registers its unsharded parameters there too). A compiled backward does not
register them: autograd reads saved tensors, a checkpointed region compiled with the
forward is recomputed inside the compiled graphs from those, and swapping
``module._parameters`` inside a compiled-autograd graph trips a dynamo bug on torch
2.13 (the swap is replayed after the graph by indexing the graph's ``inputs`` list,
which compiled autograd has already emptied: ``IndexError: list index out of
range``, seen with gradient sync off). Finishing a unit's backward registers the
sharded parameters again even when it keeps the data gathered
(``set_reshard_after_backward(False)``), so ``state_dict()``, ``parameters()`` and
``clip_grad_norm_`` see the sharded parameters between steps. Compiled, a forward
with ``reshard_after_forward=False`` registers the sharded parameters again at its
end, so that backward swaps nothing.

[Note: Changes after fully_shard]
What a user does to a parameter after ``fully_shard`` is honoured, as in torch's FSDP2,
or refused at the next forward; never silently dropped. The unit reads the sharded
parameter again (``FSDPParam.reset_sharded_param``):

- in ``nn.Module._apply`` (``FSDPModule._apply``): ``model.to(dtype)``, ``.double()``,
  ``to_empty(device=...)`` after building on the meta device. ``_apply`` swaps the
  DTensor's data in place; the unit follows the new dtype (a new 0-byte placeholder
  in the new compute dtype) and device;
- at each unit's pre-forward, when a cheap check (``user_change``: identity,
  ``requires_grad``, dtype and device of the sharded parameter, attribute reads that
  trace to no ops) finds a change: ``p.requires_grad_(False)`` on a sharded
  parameter freezes it (the placeholder follows, so no gradient is computed or
  reduced and the optimizer skips it), a DTensor assigned to the module is adopted,
  a plain tensor assigned is refused (``TypeError``), and a shard left on the meta
  device or moved off the mesh's device is refused (``ValueError``).

Dynamo cannot trace ``requires_grad_`` (a graph break), so a change is applied by a
dynamo-disabled function: eagerly at once; while tracing, that is a graph break in
the step that sees the change (dynamo's guards on the parameters then recompile the
next step, which sees none). Freezing, the common case, needs no break: while
tracing, a parameter frozen after ``fully_shard`` keeps a placeholder that requires
grad, and its post-accumulate-grad hook drops the gradient instead of reducing it
(the right numbers; the gradient is computed and thrown away until an eager forward
applies the change). So ``torch.compile(model, fullgraph=True)`` trains on through a
freeze; unfreezing, a cast or an assigned DTensor under ``fullgraph=True`` raise
dynamo's graph-break error, whose reason names the change (compile without
``fullgraph``, or run one step eagerly).

The same path serves ``load_state_dict(assign=True)``.

[Note: Changes while the modules hold the gathered parameter]
Between a unit's forward and its backward, when it stays gathered (the root, under
the default ``reshard_after_forward``), the modules hold the gathered parameter
([Note: The module holds the placeholder only in forward]), and so does whatever the
user reads from them then: a forward whose backward never ran (a validation pass
without ``torch.no_grad()``, a warm-up forward) leaves the root in that state until
the next backward. A change made to the gathered parameter there would be lost when
the unit registers the sharded one again (torch 2.13's ``fully_shard`` loses it).
So, at the next pre-forward (``user_change``) and where
the modules get the sharded parameter back (``register_sharded``):

- a replaced parameter (``module.weight = ...``) raises ``RuntimeError`` naming it and
  the fix (assign after the backward, after ``reshard()``, or run the forward under
  ``torch.no_grad()``, which reshards the root);
- ``requires_grad_`` on the gathered parameter (a change from what it was when the
  modules got it) is made on the sharded one too, and then followed as any freeze or
  unfreeze. (Compared with the value at registration, not with the sharded
  parameter's: a compiled step leaves a frozen parameter's placeholder requiring
  grad, see above, and that must not unfreeze it. A TP view is not a leaf, so it
  cannot be frozen.)

With FSDP x TP the modules hold a TP view of the placeholder, made at each gather;
one made while dynamo traces is not kept (kept on the FSDPParam, it became an extra
forward output that no gradient reaches, and AOTAutograd's backward failed), so a
replacement inside a compiled TP step is not checked.

An optimizer built from ``model.parameters()`` in that window lists the gathered
parameters; ``traceable_hsdp/_optim_check.py`` refuses it at its first step.

[Note: Replicated parameters]
``hsdp(threshold=..., replicate_params=...)`` keeps some parameters whole on every
rank (small ones, where a collective per parameter costs more than the memory it
saves). Such a parameter is a ``DTensor`` with ``Replicate()`` on every mesh dim;
its "gather" is its local tensor (no collective), and its gradient is all-reduced
(DDP-style) over the shard group and then the replicate group, averaging over every
data-parallel rank like the sharded ones. It still goes through the placeholder
(grow, ``fsdp.copy_``, free), so the lifecycle and the graphs keep one shape.

[Note: Reshard to a smaller world]
``reshard_after_forward=k`` (an int dividing the shard group's size S) frees the
placeholder after forward but keeps, on each rank, one block of the gathered rows:
the shard group's ranks are split into S/k groups of k consecutive ranks, and the
rank at index j of its group keeps block j of k of the padded gathered tensor (S/k
original shards). The backward re-gathers over that group of k ranks, whose blocks
in order are exactly the padded gathered tensor: less memory than keeping it whole
(``False``), and a gather over k ranks (intra-node, on a GPU cluster) instead of S.
``k == S`` is ``True``; ``k == 1`` keeps the whole parameter, which is ``False``.

[Note: Shard dim and offload]
``shard_placement_fn`` may shard a parameter on a dim ``d`` other than 0
(``Shard(d)``). The sharded DTensor then holds ``torch.chunk(full, ws, d)[rank]``,
the standard layout, so ``full_tensor()`` and DCP see nothing special. The
collectives always work on dim 0: the all-gather input is the local shard with
``d`` moved first (``movedim``, then made contiguous and padded to ``chunk_rows``),
and the gathered rows are moved back (``movedim(0, d)``, a view) before
``fsdp.copy_`` fills the placeholder; the gradient goes the same way through the
reduce-scatter. The numbers are those of a dim-0 shard of the transposed tensor.

``CPUOffloadPolicy`` keeps the sharded parameter (what the optimizer steps) and its
gradient on the CPU: the all-gather input is copied to the mesh's device first, and
the reduced gradient shard is copied back. The placeholder lives on the device.
With ``pin_memory=True`` the CPU shard is pinned when an accelerator is present
(pinning needs one; on a CPU-only machine it is skipped).

[Note: Hooks on the sharded parameter]
A hook registered with ``register_post_accumulate_grad_hook`` on a parameter of a
sharded module is registered on the sharded ``DTensor``, which autograd never reaches
(the placeholder takes the gradient). As torch's FSDP2 does (``foreach_reduce``), the
runtime calls those hooks itself, once the parameter's gradient is fully reduced into
``sharded_param.grad``: after the reduce-scatter (and the all-reduce over the replicas
for HSDP), per parameter, in eager and in traced backwards alike. They do not run when
the reduction is held back (``set_requires_gradient_sync(False)``, or HSDP's
``set_requires_all_reduce(False)``), as in torch. This is how an optimizer step in
backward (one optimizer per parameter, stepped in the hook, as torchtitan does) works
on sharded parameters; without it the step was silently never taken.

Traced (compiled autograd), dynamo answers ``sharded_param._post_accumulate_grad_hooks``
from the parameter's fake tensor, which has no hooks: it reads None, and the hooks
would silently not run (torch 2.13). So when a sharded parameter is made or adopted,
the runtime gives it an empty ``OrderedDict`` there if it has none
(``register_post_accumulate_grad_hook`` then adds to that same dict) and keeps a
reference to it; the traced path reads that reference, and dynamo guards on its
contents, so registering or removing a hook recompiles.

[Note: Offload copies and the CPU]
A device-to-host copy with ``non_blocking=True`` returns a CPU tensor before the copy
ran (torch allocates it pinned); reading it on the CPU before the device's stream
reaches the copy reads stale memory, with no error. So, as torch's FSDP2 does in its
reduce-scatter epilogue, the reduced gradient is copied back to the CPU
(``_grad_to_cpu``):

- asynchronously only when nothing on the CPU reads it during the backward: eager,
  ``pin_memory=True``, no gradient to add it to, and no post-accumulate-grad hook on
  the sharded parameter (optimizer-in-backward reads ``.grad`` there). Then an event
  is recorded on the current stream after the copy, and the root's end-of-backward
  callback waits for it on the CPU (``wait_grad_offload``), before ``backward()``
  returns and so before the optimizer step; the CPU never reads the gradient
  earlier. A later read that comes first (a pending event when the gradient is
  reduced again) waits for it too;
- blocking otherwise: when accumulating (the CPU add reads the copy at once), with
  a hook, without pinned memory, and while tracing (a compiled backward has no
  end-of-backward callback to wait in).

The copy in (``all_gather_input``, host to device, ``non_blocking=True`` as torch's)
needs no event: its reader is the next op on the same stream, which the stream
orders after it. Its source, the CPU shard, is written only by the optimizer or the
user after ``backward()``, and by then the CPU has waited for the stream to pass the
forward's copies (the blocking gradient copy, or the event above, both come after
them on the stream). A forward with no backward (evaluation) is followed by no such
wait: writing the CPU shards right after it, before the device finished the
forward, needs ``torch.accelerator.synchronize()`` first, as with torch's FSDP2.

[Note: FSDP x TP]
A parameter that is already a ``DTensor`` (from ``parallelize_module`` over a tensor-
parallel mesh ``tp``, or expert parallelism) is sharded over the data-parallel mesh
``dp`` as torch's FSDP2 shards it, so state dicts, DCP and ``clip_grad_norm_`` see
torch's layout:

- what FSDP gathers and reduces is the TP-local tensor (``orig_size`` is its shape;
  ``global_size`` the DTensor's). The collectives run over the dp group only, on
  TP-local tensors, exactly as for a plain parameter of that shape;
- the sharded parameter is a DTensor on the concatenation of the two meshes,
  ``(dp, tp)`` (both must be slices of one ``init_device_mesh`` with dim names),
  with placements ``(Shard(d), *tp_placements)``, or ``_StridedShard(d,
  split_factor=k)`` when TP already shards dim ``d`` over ``k`` ranks (FSDP then
  shards each TP shard, not the whole tensor; ``full_tensor()`` knows the order),
  after a ``Replicate()`` for an HSDP dp mesh (below);
- the unsharded placeholder stays a plain tensor (its storage resized and filled by
  ``fsdp.copy_`` as for any parameter, so the passes and the gradient hooks see no
  difference). What the modules hold in forward is a DTensor on the TP mesh with the
  TP placements made from it by ``DTensor.from_local`` (a view; differentiable), so
  the TP module computes as it would on its own. Its backward redistributes the
  gradient to the TP placements (a ``Partial`` becomes ``Replicate``) and hands the
  placeholder a plain TP-local gradient, which is reduce-scattered over dp. torch's
  FSDP2 instead registers an ``nn.Parameter`` DTensor wrapping the gathered tensor and
  redistributes its gradient the same way; the numbers are the same. The difference
  a user can see: during forward ``module.weight`` is a non-leaf DTensor, not an
  ``nn.Parameter``.

With a 2-D ``(replicate, shard)`` dp mesh (HSDP x TP, 3-D in all) nothing changes
but the leading ``Replicate()`` and the all-reduce over the replicate group after the
reduce-scatter, as for a plain parameter; the layout is torch's for the same mesh
(tests/test_tp.py: bitwise equal to torch's fully_shard on a (2, 2, 2) mesh).

Not supported, refused at ``fully_shard``: an int ``reshard_after_forward`` (other
than the shard-group size or 1) with a DTensor parameter (torch refuses it too), TP
placements ``Partial`` or ``_StridedShard``, a DTensor on more than two mesh dims,
and a TP parameter that ``hsdp()`` would keep whole (replicated over dp).

[Note: The forward reads the local shard, not the DTensor]
The all-gather input is read from the sharded parameter's ``_local_tensor`` (a plain
tensor that does not require grad and shares the DTensor's storage, so optimizer
steps and in-place loads are seen), not through ``to_local()``. Through the DTensor,
the sharded parameter, a leaf that requires grad, becomes an input of the compiled
forward: AOTAutograd's autograd node gets an edge to its AccumulateGrad, and compiled
autograd lifts the DTensor as an input of the backward graph. Lifting fakeifies it
(``DTensor.__tensor_unflatten__``, from ``begin_capture`` -> ``wrap_fake`` in
``torch/_dynamo/compiled_autograd.py``) in Python while the whole step's
``torch.compile`` is active, so dynamo compiles that frame on its own and
graph-breaks on ``DTensor(local, spec, requires_grad)`` ("Failed to convert
args/kwargs to proxy", twice per step compiled whole). Through ``_local_tensor`` the
forward graph has no DTensor input and no gradient edge to the sharded parameter
(none is needed: the post-accumulate-grad hook sets its gradient). torch's FSDP2
gathers from the local tensor too.

[Note: A lean traced path]
Dynamo traces the runtime's Python once per parameter, in the forward and again in
the compiled-autograd backward, and every op it meets costs a fake-tensor dispatch
and a node. So the traced path reads what is constant for the parameter from plain
attributes set at init (``_shard_size``, ``_shard_group_name``, ``_replicate_*``,
``_sharded_stride``) instead of recomputing them (but see [Note: Ints read while
tracing]):
``MeshInfo.shard_group_name`` goes through ``DeviceMesh.get_group`` (traced each
time), and ``sp.stride()`` on the sharded DTensor for ``DTensor.from_local`` was
the costliest single call of the backward (dynamo dispatches it through DTensor).
Casts and narrows that do nothing are skipped by a test on the tensor's dtype or
size, which is static while tracing (no node, no guard beyond the tensor's own);
eagerly ``.to`` of the same dtype and a full ``narrow`` return the input, so the
numbers are the same. ``_sharded_stride`` follows the sharded parameter
(``reset_sharded_param``); the group names cannot change (the mesh is fixed at
``fully_shard``). The graphs keep the same collectives, ``fsdp.copy_`` and resizes in
the same order, with fewer nodes to trace.

[Note: Ints read while tracing]
A plain int attribute that dynamo reads in our runtime is a constant of the graph
only as long as its frame compiles once. With ``torch.compile(model, fullgraph=True)``
it does: the whole model is one frame. A graph break inside a unit's forward (torch's
default is ``fullgraph=False``, and a ``print`` or an ``.item()`` in a user's forward
breaks) makes dynamo compile the frames on the stack on their own, among them
``FSDPState.forward``, whose code every unit shares. Its second compile (the block,
after the root) finds ints of the same source with new values, and dynamo's
automatic dynamic shapes make them symbolic (the source is a local plain object, so
none of its rules to specialize ints applies). Inductor lowers symbolic sizes in
views, narrows and collectives, but not a storage resize: ``resize_storage_bytes_``
asserts an int ("TODO: dynamic shapes"; torch 2.13), so the grow in
``fill_unsharded`` cannot take an int stored at init. It takes the placeholder's own
size (``unsharded_nbytes``): the placeholder is an
``nn.Parameter``, whose shapes dynamo keeps static
(``force_parameter_static_shapes``), so the product is an int in every compile;
eagerly it is the same number. (The free is a resize to 0.)
``tests/test_reliability.py`` trains a unit that breaks the graph, under Inductor.

[Note: Version counters in a traced step]
Eagerly, the placeholder's grow and fill (``fill_unsharded``) and its free
(``reshard``) run inside ``torch.autograd._unsafe_preserve_version_counter``:
autograd saved the placeholder for backward (a linear saves its weight), and the
re-gather before that backward must not look like an in-place change of a saved
tensor. While dynamo traces, they run without it (``_hide_version_change``). Dynamo
records the context as ``prims._tensor_version`` (an unbacked SymInt each) and
``prims._unsafe_set_version_counter``, two nodes per fill and per free. AOTAutograd
runs them on its fake tensors as it traces and leaves them out of the graphs it hands
the backend (torch's ``torch._dynamo.tensor_version_op``: a version means nothing on a
functional tensor), so no compiled step ever ran them; they cost only tracing. Every
compiled test trains as before without them (the aot_eager runs bitwise equal to
eager), and the conformance test counts none in the graphs dynamo captures. Leaving
them out saves dynamo's tracing of two nodes per fill and free
(``benchmarks/compile_ab.py --lever version_counters``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed.fsdp  # noqa: F401  registers torch.ops.fsdp.copy_
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement

from ._api import REDUCE_IN_GRAD_DTYPE, CPUOffloadPolicy, MixedPrecisionPolicy
from ._collectives import all_gather_start, all_reduce, reduce_scatter, wait_all_gather
from ._common import MeshInfo, PostForwardInfo, ShardedState, compiling
from ._optim_check import register_placeholder, register_replaced
from ._torch_internals import DTensorSpec, _StridedShard


class UserChange(Enum):
    """What :meth:`FSDPParam.user_change` found. See [Note: Changes after fully_shard]."""

    NONE = auto()
    """Nothing changed since the unit last read the sharded parameter."""
    FROZEN = auto()
    """Only ``requires_grad`` went to ``False``: the one change a compiled step follows
    without applying it (the placeholder still requires grad; its gradient is dropped
    instead of reduced)."""
    OTHER = auto()
    """Replaced on a module, unfrozen, cast, or moved (left on meta): re-read it."""


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
        mp_policy: the unit's mixed precision: the placeholder (and so the forward and
            backward compute and the all-gather) is in ``param_dtype``, gradients are
            reduced in ``reduce_dtype``, and the sharded gradient is in the original
            dtype, as the optimizer expects.
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
        self._set_dtypes(param.dtype)
        if param.dim() == 0:
            raise ValueError(  # torch's words first
                f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D "
                "tensor with numel equal to 1, or keep it out with ignored_params={...}."
            )
        if not data.is_contiguous():
            # torch's fully_shard refuses these too: the shards, the gathered
            # parameter and the flat collectives assume the contiguous layout.
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet (torch's "
                f"fully_shard neither): {fqn!r} has "
                f"shape {tuple(data.shape)} and stride {data.stride()} (channels_last, or "
                "a transposed view). Make it contiguous before fully_shard "
                "(model.to(memory_format=torch.contiguous_format), or "
                "param.data = param.data.contiguous()), or keep it out with "
                "ignored_params={...}."
            )
        refuse_all_gather_extension(fqn, data)
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
        ws, rank = (1, 0) if replicate else (self._shard_size, mesh_info.shard_rank)
        n = data.size(shard_dim)
        self.chunk_rows = math.ceil(n / ws)  # rows (along shard_dim) of every padded shard
        self.local_rows = max(0, min(self.chunk_rows, n - rank * self.chunk_rows))
        start = min(rank * self.chunk_rows, n)
        with torch.no_grad():
            local = data.detach().narrow(shard_dim, start, self.local_rows).clone()
            # A meta parameter stays on meta until module.to_empty(); see [Note:
            # Changes after fully_shard].
            if offload is not None and not local.is_meta:
                local = local.cpu()
                if offload.pin_memory and torch.accelerator.is_available():
                    local = local.pin_memory()
        inner: Placement = Replicate() if replicate else Shard(shard_dim)
        self.sharded_mesh = mesh_info.mesh  # the sharded DTensor's mesh
        tp_placements: tuple[Placement, ...] = ()
        if self.tp_spec is not None:  # See [Note: FSDP x TP].
            self.sharded_mesh = spmd_mesh(mesh_info.mesh, self.tp_spec.mesh, fqn)
            tp_placements = self.tp_spec.placements
            split_factor = self.tp_spec.num_shards_map[shard_dim]
            if not replicate and split_factor > 1:
                inner = _StridedShard(shard_dim, split_factor=split_factor)
        placements = (inner,) if mesh_info.replicate_mesh_dim is None else (Replicate(), inner)
        self.placements = (*placements, *tp_placements)
        dtensor = DTensor.from_local(
            local,
            self.sharded_mesh,
            self.placements,
            run_check=False,
            shape=param.size(),
            stride=param.stride() if param.is_contiguous() else None,
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=param.requires_grad)
        self._track_grad_hooks()
        # An optimizer built before fully_shard holds ``param``: see [Note: An optimizer
        # must hold the model's sharded parameters] (_optim_check.py).
        register_replaced(param, fqn)
        # The sharded gradient's global stride (see [Note: A lean traced path]).
        self._sharded_stride = self.sharded_param.stride()
        # The placeholder starts with 0 bytes of storage. See
        # [Note: Sharded parameter and unsharded placeholder].
        self.unsharded_param = nn.Parameter(
            self._empty_placeholder(), requires_grad=param.requires_grad
        )
        # No optimizer may hold it: see [Note: An optimizer must hold the model's sharded
        # parameters] (_optim_check.py).
        register_placeholder(self.unsharded_param, self.fqn)
        self.sharded_state = ShardedState.SHARDED
        self.module_holds_unsharded = False
        # What register_unsharded gave the modules (the placeholder, or its TP view;
        # None for a TP view made while tracing), and its requires_grad then.
        self._held: torch.Tensor | None = self.unsharded_param
        self._held_requires_grad = self.unsharded_param.requires_grad
        # hsdp(optimizer_level="level1"): reshard keeps the placeholder's storage (the
        # parameter stays whole in memory across steps; the next unshard refills it).
        self.keep_storage = keep_storage
        # After an int reshard_after_forward: this rank's block of the padded gathered
        # rows (ND, dim 0 = shard dim), or None. See [Note: Reshard to a smaller world].
        self.post_forward_shard: torch.Tensor | None = None
        self.post_forward = post_forward
        # HSDP: the sharded grad holds shard-reduced gradients not yet all-reduced
        # over the replicas (set_requires_all_reduce(False)).
        self.replicas_pending = False
        # An asynchronous copy of the reduced gradient to the CPU not yet waited for.
        # See [Note: Offload copies and the CPU].
        self.grad_offload_event: torch.Event | None = None
        # Unsharded gradient summed over backwards without gradient sync, in
        # reduce_dtype (ND, full shape), or None.
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

    def _empty_placeholder(self) -> torch.Tensor:
        """A tensor of the full shape in ``dtype`` on the compute device, with 0 bytes of
        storage. Its full-size storage is allocated, never written, and released at
        once (torch has no way to make a tensor of that size without a storage to
        match); a CPU allocator leaves the pages untouched, and a caching GPU
        allocator gets the block back for the next one."""
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

    def all_gather_start(self) -> torch.Tensor:
        """Issues this parameter's all-gather; the result (``shard_size * chunk_rows``
        rows) is ready after :meth:`wait_gathered`. A replicated parameter needs no
        collective: its local tensor is the result."""
        if self.replicate:
            return self.all_gather_input()
        if self.post_forward_shard is not None:
            pf = self.post_forward
            assert pf is not None
            return all_gather_start(self.post_forward_shard, pf.size, pf.group_name)
        return all_gather_start(self.all_gather_input(), self._shard_size, self._shard_group_name)

    def wait_gathered(self, issued: torch.Tensor) -> torch.Tensor:
        """Waits for what :meth:`all_gather_start` returned."""
        if self.replicate or self._shard_size == 1:  # nothing was issued
            return issued
        return wait_all_gather(issued)

    # The flat eager all-gather: see [Note: One collective per unit, eagerly]
    # (_param_group.py) and [Note: Flat buffers] (_collectives.py).
    def flat_gather_group(self) -> tuple[str, int] | None:
        """The (group name, size) this parameter's all-gather runs over, or ``None``
        when it issues none (a replicated parameter, or a group of one rank)."""
        if self.replicate:
            return None
        if self.post_forward_shard is not None:
            pf = self.post_forward
            assert pf is not None
            return (pf.group_name, pf.size) if pf.size > 1 else None
        mi = self.mesh_info
        return (mi.shard_group_name, mi.shard_size) if mi.shard_size > 1 else None

    def flat_gather_source(self) -> tuple[torch.Tensor, int]:
        """What this rank puts into the all-gather, with the shard dim first, not yet
        padded or cast to ``dtype`` (ND), and the rows every rank's part has once
        padded. The flat buffer's copy pads and casts as :meth:`all_gather_input`."""
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
        """Where the flat all-gather's ``(world_size, numel)`` part for this parameter
        is copied: the placeholder itself (grown to full) when its rows are exactly
        the gathered rows (dim-0 shard, no padding), else a new buffer that
        :meth:`flat_gather_done` copies from."""
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
        """Finishes the unshard from the ``target`` of :meth:`flat_gather_target`,
        filled."""
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

    def fill_unsharded(self, gathered: torch.Tensor) -> None:
        """Grows the placeholder to full and copies the gathered rows into it."""
        if self.sharded_state is ShardedState.UNSHARDED:
            raise AssertionError(
                f"{self.fqn}: fill_unsharded needs a sharded state, found {self.sharded_state}"
            )
        self.post_forward_shard = None
        p = self.unsharded_param
        full = gathered
        rows = self.orig_size[self.shard_dim]
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
            # A TP view made while dynamo traces is not kept: stored on this object it
            # would become an extra output of the forward graph (one the backward never
            # gets a gradient for). Its changes are then not checked.
            keep = self.tp_spec is None or not compiling()
            self._held = held if keep else None
            self._held_requires_grad = held.requires_grad
            self.module_holds_unsharded = True

    def _tp_view(self) -> DTensor:
        """The placeholder as a DTensor on the TP mesh with the TP placements, what
        the TP modules compute with. See [Note: FSDP x TP]."""
        spec = self.tp_spec
        assert spec is not None
        # Recorded with grad on also inside an eager backward (the modules are
        # re-registered for activation checkpointing's recompute), so that the
        # recompute sees the same graph as the forward.
        with torch.enable_grad():
            return DTensor.from_local(
                self.unsharded_param,
                spec.mesh,
                spec.placements,
                run_check=False,
                shape=self.global_size,
                stride=spec.stride,
            )

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
        if not self.keep_storage:
            p = self.unsharded_param
            with torch.no_grad(), _hide_version_change(p):
                p.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

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
        and divides by it instead. ``all_reduce_replicas=False`` (HSDP,
        ``set_requires_all_reduce(False)``) skips the all-reduce: the shard-reduced
        gradient accumulates locally, and the next backward that all-reduces
        all-reduces the accumulated sum with it. ``reduced_hook`` is called with the
        fully reduced local gradient (this rank's shard in ``reduce_dtype``, before
        the division by ``divide_factor``) and may change it in place; it is not
        called when the all-reduce is skipped. See [Note: The all-reduce hook] in
        ``_param_group.py``.
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
        local = reduce_scatter(grad, op, ws, self._shard_group_name)
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

    # The flat eager reduction: see [Note: One collective per unit, eagerly]
    # (_param_group.py) and [Note: Flat buffers] (_collectives.py). Each step does
    # what ``reduce_grad`` does to one parameter, on its part of the unit's buffer.
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
        (this parameter's ``flat_numel`` elements of the reduce-scatter output, 1D);
        not contiguous for a shard dim other than 0."""
        local = part.view(self.chunk_rows, *self._moved_rest())
        if self.local_rows != self.chunk_rows:
            local = local.narrow(0, 0, self.local_rows)
        if self.shard_dim != 0:
            local = local.movedim(0, self.shard_dim)
        return local

    def fold_replicas_pending(self, local: torch.Tensor) -> None:
        """HSDP: adds into ``local`` (the view of :meth:`flat_reduced_local`, before
        the all-reduce over the replicas) what earlier backwards reduced without it,
        as ``reduce_grad`` does."""
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
        """The post-accumulate-grad hooks registered on the sharded parameter (an
        optimizer step in backward), once its gradient is reduced. See [Note: Hooks on
        the sharded parameter]."""
        sp = self.sharded_param
        # Traced, dynamo reads the attribute from the fake tensor (None): the dict
        # tracked at adoption is the same object, and dynamo guards on its contents.
        hooks = self._grad_hooks if compiling() else sp._post_accumulate_grad_hooks
        if hooks:
            for hook in tuple(hooks.values()):
                hook(sp)

    def _track_grad_hooks(self) -> None:
        """Gives the sharded parameter its hook dict now, so that later registrations
        land in a dict the traced path holds. See [Note: Hooks on the sharded
        parameter]."""
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
        """The reduced gradient shard copied to the CPU, asynchronously only when no
        CPU read comes before :meth:`wait_grad_offload`. See [Note: Offload copies
        and the CPU]."""
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
            # Out of place: dynamo mis-orders an in-place add through the DTensor's
            # ``_local_tensor`` inside a compiled-autograd graph (torch 2.13).
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
        """What the user changed in the sharded parameter since the unit last read it:
        replaced it on a module, flipped its ``requires_grad``, cast it, or left it on
        the meta device. Only attribute reads (traced without ops). See
        [Note: Changes after fully_shard]."""
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
        if sp.requires_grad is not self.unsharded_param.requires_grad:
            return UserChange.OTHER if sp.requires_grad else UserChange.FROZEN
        return UserChange.NONE

    def reset_sharded_param(self, check_device: bool = True, unit: str = "") -> None:
        """Re-reads the sharded parameter after the user changed it, as torch's FSDP2
        does: adopts a DTensor assigned to the module (``load_state_dict(assign=True)``
        or ``module.weight = ...``), follows a cast (``model.to(torch.float64)``) and
        ``requires_grad``. See [Note: Changes after fully_shard].

        Args:
            check_device: raise when the shard is not on the mesh's device (default
                ``True``; ``nn.Module._apply`` and the load post-hook pass ``False``,
                since a list unit's other modules may not be moved or loaded yet).
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
        refuse_all_gather_extension(self.fqn, sp._local_tensor)
        self.sharded_param = sp
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
        """While the modules hold the gathered parameter: refuses a replacement of it,
        and makes the sharded parameter follow a freeze or unfreeze of it. See
        [Note: Changes while the modules hold the gathered parameter]."""
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



# [Note: All-gather extensions are refused]
# torch's FSDP2 lets a parameter's local tensor define ``fsdp_pre_all_gather`` and
# ``fsdp_post_all_gather`` (a tensor subclass such as torchao's float8 training
# weights, or methods set on the tensor): FSDP then gathers what the first returns,
# in its dtype and layout, and builds the unsharded parameter with the second. This
# runtime gathers the local tensor as it is and never calls them, so such a
# parameter would be gathered in the wrong dtype or layout with no error (seen: a
# bf16-quantizing pair ignored, the forward then 7.8e-4 off torch's). It is refused
# where the local tensor is first read or replaced: ``fully_shard``, and
# ``reset_sharded_param`` (``to_empty``, ``model.to(...)``, an assigned parameter,
# ``load_state_dict(assign=True)``); and, eagerly, at each unit's pre-forward (with
# the check for other changes, ``FSDPState._sync_user_changes``), which catches
# methods set on a tensor after those (they are instance attributes that nothing
# else reads). A compiled forward does not re-check, since a traced
# ``hasattr`` on each local tensor would add a guard per parameter to every step.


def refuse_all_gather_extension(fqn: str, local: torch.Tensor) -> None:
    """Raises NotImplementedError if ``local`` (a parameter's local shard) defines
    torch's FSDP all-gather extension. See [Note: All-gather extensions are refused]."""
    if hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather"):
        raise NotImplementedError(
            f"Parameter {fqn!r}: its local tensor ({type(local).__name__}) defines "
            "fsdp_pre_all_gather/fsdp_post_all_gather, torch's FSDP2 all-gather "
            "extension (used by float8 training, e.g. torchao's "
            "enable_fsdp_float8_all_gather). traceable_hsdp does not call it, so the "
            "parameter would be gathered without it. Turn the extension off (for "
            "torchao: Float8LinearConfig(enable_fsdp_float8_all_gather=False)), or use "
            "torch.distributed.fsdp.fully_shard for this model."
        )


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
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
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
