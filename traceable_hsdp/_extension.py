"""torch FSDP2's all-gather extensions: a parameter whose local shard defines
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torchao's float8 all-gather).

[Note: All-gather extensions]
torch's FSDP2 all-gathers what the local shard's ``fsdp_pre_all_gather`` returns and
builds the unsharded parameter with ``fsdp_post_all_gather`` from the gathered
tensors ([Note: FSDP tensors] in torch's ``_fsdp_param.py``). This runtime calls the
same hooks with the same arguments (the shard mesh, a 1-D slice for HSDP; the 1- or
5-argument pre-all-gather; ``param_dtype`` or the original dtype) in the same order,
eagerly and traced, on two paths chosen by what ``fsdp_post_all_gather`` returns the
first time:

- a plain tensor (a cast back, a dequantization): it is copied into the placeholder
  with ``fsdp.copy_``, as a gathered parameter is ([Note: Sharded parameter and
  unsharded placeholder] in ``_param.py``), and the post-all-gather hook is called
  without ``out=`` at every gather. Traced, the pre-all-gather ops, the all-gathers
  and the post-all-gather ops are nodes of the graph that gathers, and the placeholder
  passes rewrite its uses to the post-all-gather output, which Inductor may fuse
  with its consumers;
- a tensor subclass (``TwoTensor``, torchao's ``Float8TrainingTensor``): as torch's,
  eagerly only. The subclass becomes the unsharded parameter at the first gather (its
  post-accumulate-grad hooks move to it); later gathers copy into the same gathered
  buffers, whose storage a reshard frees with the tensors the hook named, and call the
  hook with ``out=`` that parameter. A traced step refuses it: the placeholder
  mechanism needs a plain tensor whose storage can be resized inside the graph.

The placeholder keeps the dtype the hook is given: a plain result of another dtype
is refused (``ValueError``). Eagerly an extension parameter issues its own
all-gather per tensor the hook returns (not the unit's flat one); its gradient, which
may be a subclass, is copied into a plain tensor before the reduction, as torch's
copy into its flat reduce-scatter buffer does. Refused with ``NotImplementedError``
at ``fully_shard``: with TP (a ``DTensor`` parameter), ``Shard(d)`` with ``d != 0``,
and an int ``reshard_after_forward`` (torch refuses that one at the re-gather).

The hooks are found on the local shard at ``fully_shard``, at every
``reset_sharded_param`` (``to_empty``, ``load_state_dict(assign=True)``) and at each
eager pre-forward, as torch reads them at each all-gather. A traced pre-forward sees
hooks set on a plain local tensor since (a ``hasattr`` guard, then the change is
applied at a graph break); dynamo's ``hasattr`` on a wrapper subclass is wrong, so
hooks set on a subclass instance after the last eager read are not seen by a
compiled step (run one eager forward after setting them). Tested by
tests/test_all_gather_extensions.py and torch's test_fully_shard_extensions.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ._common import MeshInfo, refusal

PRE = "fsdp_pre_all_gather"
POST = "fsdp_post_all_gather"
RELEASE = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


@dataclass(frozen=True)
class ExtensionHooks:
    """The hooks of one local shard, unbound so that a traced step calls them on the
    local tensor it reads (equal hooks compare equal)."""

    pre: Callable[..., Any]
    post: Callable[..., Any]
    pre_takes_self: bool  # a method of the local tensor: called with it first
    post_takes_self: bool
    pre_nargs: int  # 1: fsdp_pre_all_gather(mesh); 5: (mesh, size, stride, module, mp)
    release_outputs: bool  # fsdp_should_release_all_gather_outputs_after_post_all_gather()

    def pre_all_gather(
        self, local: torch.Tensor, mesh: DeviceMesh, size: torch.Size, module: Any, mp: Any
    ) -> tuple[list[torch.Tensor], Any]:
        """The all-gather inputs (ND) and the metadata for the post-all-gather hook."""
        args: tuple[Any, ...] = (mesh,)
        if self.pre_nargs == 5:
            args = (mesh, size, contiguous_stride(size), module, mp)
        inputs, metadata = self.pre(local, *args) if self.pre_takes_self else self.pre(*args)
        if isinstance(inputs, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise TypeError(
                f"{PRE} must return (all_gather_inputs, metadata) with all_gather_inputs a "
                f"tuple of tensors, as torch's fully_shard expects; got {type(inputs).__name__}."
            )
        return list(inputs), metadata

    def post_all_gather(
        self,
        local: torch.Tensor,
        outputs: list[torch.Tensor],
        metadata: Any,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> Any:
        """The hook's result: ``(unsharded, tensors_to_free)``, or ``None`` with ``out``."""
        args = (tuple(outputs), metadata, dtype)
        kwargs = {} if out is None else {"out": out}
        if self.post_takes_self:
            return self.post(local, *args, **kwargs)
        return self.post(*args, **kwargs)


def find_hooks(local: torch.Tensor) -> ExtensionHooks | None:
    """The all-gather extension ``local`` defines, checked as torch's fully_shard
    checks it, or ``None``.

    Raises:
        AssertionError: torch's refusals: one of the two hooks alone, the release
            hook without them or not returning a bool, a pre-all-gather hook taking
            other than 1 or 5 arguments.
    """
    has_pre, has_post = hasattr(local, PRE), hasattr(local, POST)
    release_fn = getattr(local, RELEASE, None)
    if has_pre != has_post:
        raise AssertionError(
            f"Both {PRE} and {POST} should be defined if using all-gather extensions: "
            f"{type(local).__name__} defines only {PRE if has_pre else POST}."
        )
    if release_fn is not None and not has_post:
        raise AssertionError(f"{RELEASE} requires {PRE} and {POST} to be defined.")
    if not has_pre:
        return None
    pre_m, post_m = getattr(local, PRE), getattr(local, POST)
    nargs = len(inspect.signature(pre_m).parameters)
    if nargs not in (1, 5):
        raise AssertionError(
            f"Invalid {PRE}: {inspect.signature(pre_m)}\nExpects {PRE}(self, mesh: "
            "DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: "
            "nn.Module, mp_policy: MixedPrecisionPolicy)"
        )
    release = False
    if release_fn is not None:
        release = release_fn()
        if not isinstance(release, bool):
            raise AssertionError(f"{RELEASE} must return a bool, got {type(release)}")
    pre, pre_self = _unbind(pre_m, local)
    post, post_self = _unbind(post_m, local)
    return ExtensionHooks(pre, post, pre_self, post_self, nargs, release)


def _unbind(method: Callable[..., Any], local: torch.Tensor) -> tuple[Callable[..., Any], bool]:
    if inspect.ismethod(method) and method.__self__ is local:
        return method.__func__, True
    return method, False


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def shard_mesh(mesh_info: MeshInfo, fqn: str) -> DeviceMesh:
    """The mesh the pre-all-gather hook gets: the shard dim's 1-D mesh, as torch's."""
    mesh = mesh_info.mesh
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"Parameter {fqn!r} defines {PRE}, which gets the shard mesh, a named slice "
            f"of the {mesh.ndim}-D mesh; this mesh has no dim names. Build it with "
            "init_device_mesh(..., mesh_dim_names=('dp_replicate', 'dp_shard'))."
        )
    return mesh[names[mesh_info.shard_mesh_dim]]


class ExtensionState:
    """One parameter's extension: its hooks and, once a post-all-gather hook returned
    a subclass, the buffers and tensors the eager path reuses. See [Note: All-gather
    extensions]."""

    def __init__(self, hooks: ExtensionHooks, mesh: DeviceMesh, local: torch.Tensor) -> None:
        self.hooks = hooks
        self.mesh = mesh
        self.local = local  # the local shard the hooks were read from
        # None until the first post-all-gather; then whether it returned a subclass.
        self.subclass: bool | None = None
        self.outputs: list[torch.Tensor] = []  # gathered buffers a subclass aliases (ND)
        self.inner: tuple[torch.Tensor, ...] = ()  # what the hook said to free

    def alloc(self) -> None:
        for t in (*self.outputs, *self.inner):
            size = t.numel() * t.itemsize
            if t.untyped_storage().size() != size:
                t.untyped_storage().resize_(size)

    def free(self, outputs_only: bool = False) -> None:
        for t in self.outputs if outputs_only else (*self.outputs, *self.inner):
            if t.untyped_storage().size() != 0:
                t.untyped_storage().resize_(0)


def as_plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: copied into one when it is a subclass, as torch's
    ``foreach_copy`` into its flat buffers does."""
    if type(t) is torch.Tensor:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


SUBCLASS_COMPILE_FIX = (
    "traceable_hsdp: this parameter's fsdp_post_all_gather returns a tensor subclass, "
    "which only the eager step supports (see [Note: All-gather extensions] in "
    "traceable_hsdp/_extension.py): the traced step fills a plain placeholder. Fix: "
    "return a plain tensor from fsdp_post_all_gather (e.g. dequantized), or run this "
    "model without compiled autograd (torch.compile of the blocks, fully_shard's "
    "hooks eager)."
)


refuse_subclass_compiled = refusal(SUBCLASS_COMPILE_FIX)
