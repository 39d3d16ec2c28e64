"""Conformance with torch's fully_shard: what users of torch's FSDP2 do after
``fully_shard`` and around it, eager, against torch's own ``fully_shard`` on the
same model and data, bitwise (atol=rtol=0): both gather, compute and reduce the
same tensors in the same order, so any drift is a semantic difference.

One 2-rank group runs every scenario (:func:`conformance_eager`):
- a unit called three times in one forward (weight reuse), resharding after
  forward or not: every use's backward must find the parameters gathered;
- dataclass activations (a frozen dataclass) passed between units (the
  pre-backward hooks must find the tensors inside them, and the inputs' gradient
  trigger must rebuild them); in ``_Mixed`` below, one of its tensors both units
  pass through unchanged, as T5's blocks pass the position bias (its gradient
  completes after the units' backward, whose hooks must then not gather them
  again: the compiled tests count the backward's all-gathers and check every
  placeholder freed);
- prefix tuning: frozen units given a learnable prefix (a leaf of the root) every
  step; their backward must not end before the ops that read their frozen weights,
  though every step adds a hook to the prefix;
- the three above in one model (``_Mixed``), the model the compiled tests compile;
  two of its units return views, and with ``inplace`` the root scales one such
  output in place, which drops the hook that re-gathers that unit for its backward
  (torch's fully_shard then fails; ours hooks the view's base too): ours in place
  against torch's on the same model with the op out of place ("mixed_inplace");
- ``model.to(torch.float64)`` after fully_shard: training follows the new dtype;
- parameters frozen after fully_shard (before the first forward);
- activation checkpointing: checkpoint_wrapper then fully_shard (torchtitan's
  order), fully_shard then checkpoint_wrapper, and selective AC saving matmuls;
- the meta-device flow (build on meta, fully_shard, to_empty, load a full state
  dict): the shards equal those of the model built on the CPU and sharded, no op
  allocates a parameter's full size, and training matches torch's same flow; a
  seeded random init of the shards matches torch's same flow;
- freezing and unfreezing between steps after the first forward: against a
  one-process model (tolerance below);
- torch's rank-0 broadcast flow (HF accelerate's FSDP2 loading): build on meta,
  fully_shard, load_state_dict of DTensors with assign=True;
- a frozen float8 parameter in a unit with fp32 ones (gloo's all-gather has no
  float8 type: the bytes are gathered);
- torch's ``replicate()`` (DDP) on the root over fully_shard blocks (it must leave
  our sharded parameters as they are);
- optimizer in backward (torchtitan's): an SGD per parameter, stepped by a
  post-accumulate-grad hook registered on the sharded parameter;
- HF accelerate's mixed precision: ``model.forward`` replaced, before fully_shard,
  by an instance method running it under ``torch.autocast(bfloat16)`` (that
  attribute must not hide the unit's forward wrapper);
- the root called twice before one backward (two batches, one summed loss);
- fp16 with ``torch.amp.GradScaler``, gradients unscaled and clipped, steps skipped
  on overflow (HF accelerate's fp16 with FSDP2).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import traceable_hsdp as th
from _dist import run_ranks
from _workers import (
    CFG,
    CFG1,
    LR,
    FunctionalCollectiveOps,
    _data,
    _loss,
    _managed,
    _placeholder_bytes,
    assert_same_run,
    dynamo_counts,
    full_state,
    hf_llama_config,
)
from traceable_hsdp.demo.models import Llama, RMSNorm

BITWISE = ["reuse_raf_True", "reuse_raf_False", "dataclass", "prefix", "mixed", "mixed_inplace", "cast_float64", "freeze_after_shard",
           "ac_wrap_then_shard", "ac_shard_then_wrap", "ac_selective", "meta_assign", "float8_frozen",
           "replicate_root", "optim_in_backward", "autocast", "root_twice"]


STEPS = 3
Build = Callable[[Callable[..., Any]], nn.Module]
Step = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def _fs(lib: str, mesh: Any = None) -> Callable[..., Any]:
    """``fully_shard`` of ``lib`` ("ours" or "torch"), bound to ``mesh`` when given."""
    fs = th.fully_shard if lib == "ours" else torch_fsdp.fully_shard
    return fs if mesh is None else functools.partial(fs, mesh=mesh)


def _llama_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _loss(model(x), y)


def _fp16_grad_scaler(rank: int, world: int) -> dict[str, Any]:
    """fp16 training as HF accelerate runs it with FSDP2: fp16 ``MixedPrecisionPolicy``,
    ``torch.amp.GradScaler``, ``unscale_`` then ``clip_grad_norm_`` on the sharded
    gradients, ``scaler.step``. The first scale (2**20) overflows fp16: seen, the
    first two steps skipped and the scale halved twice, two steps taken, then one
    more overflow. Both paths run."""
    out: dict[str, Any] = {}
    for lib in ("torch", "ours"):
        torch.manual_seed(0)
        mp = th.MixedPrecisionPolicy if lib == "ours" else torch_fsdp.MixedPrecisionPolicy
        policy = mp(param_dtype=torch.float16, reduce_dtype=torch.float32)
        model = _shard_llama(Llama(CFG), functools.partial(_fs(lib), mp_policy=policy))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
        losses, scales = [], []
        for x, y in _data(world, STEPS + 2):
            loss = _loss(model(x.chunk(world)[rank]).float(), y.chunk(world)[rank])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        out[lib] = (losses, full_state(model))
        out[f"{lib}_scales"] = scales
    return out


def _two_forwards_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Two forwards of the whole model before one backward (a contrastive pair, or
    DPO's chosen and rejected batches run apart): every block is gathered again in
    the second forward while the first one's backward is still to come."""
    return _loss(model(x), y) + _loss(model(x.flip(1)), y)


def _accelerate_autocast(fs: Callable[..., Any]) -> nn.Module:
    """HF accelerate's mixed precision: before fully_shard, ``model.forward`` becomes a
    bound method on the instance that runs the class's forward under
    ``torch.autocast(bfloat16)`` and returns fp32 (accelerate's ``prepare_model``)."""
    model = Llama(CFG)
    forward = type(model).forward

    @functools.wraps(forward)
    def autocast_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(self, *args, **kwargs).float()

    model.forward = types.MethodType(autocast_forward, model)
    return _shard_llama(model, fs)


def _train(
    model: nn.Module,
    rank: int,
    world: int,
    step: Step = _llama_step,
    before_step: Callable[[int], None] | None = None,
    shards: int | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` AdamW steps on this rank's 1/``shards`` (default ``world``) of the
    global batch of ``world`` ranks; ``shards=1`` trains on all of it."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    shards = world if shards is None else shards
    losses = []
    for i, (x, y) in enumerate(_data(world, STEPS)):
        if before_step is not None:
            before_step(i)
        loss = step(model, x.chunk(shards)[rank], y.chunk(shards)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state(model)


def _both(
    rank: int, world: int, build: Build, step: Step = _llama_step, mesh: Any = None,
    torch_build: Build | None = None,
) -> dict[str, Any]:
    """``build(fully_shard)`` with torch's and with ours (on ``mesh``, default the
    1-D mesh over every rank), trained alike; torch's builds ``torch_build`` instead
    where given (the same numbers written in a form torch's fully_shard runs)."""
    out: dict[str, Any] = {}
    for lib in ("torch", "ours"):
        torch.manual_seed(0)
        model = (torch_build if lib == "torch" and torch_build is not None else build)(_fs(lib, mesh))
        out[lib] = _train(model, rank, world, step)
        if lib == "ours":
            out["bytes_after"] = _placeholder_bytes(model)
    return out


def _shard_llama(model: Llama, fs: Callable[..., Any], **kw: Any) -> Llama:
    for layer in model.layers:
        fs(layer, **kw)
    fs(model, **kw)
    return model


# ------------------------------------------------------- optimizer in backward
def _step_in_backward(
    model: nn.Module, params: list[nn.Parameter], traced: bool = False
) -> nn.Module:
    """Optimizer in backward, as torchtitan does it: each of ``params`` (the sharded
    parameters, after fully_shard) stepped by a post-accumulate-grad hook on it as
    soon as its gradient is reduced, by an SGD of its own or, with ``traced``, by the
    same update written out (torch's optimizers break the graph at each step, which
    would split a compiled backward at every parameter). The hook sets the gradient
    to None, so ``_train``'s AdamW steps nothing for them: hooks that did not run
    would leave AdamW to step them, with other numbers."""
    if traced:
        def hook(p: torch.Tensor) -> None:
            with torch.no_grad():
                p.add_(p.grad, alpha=-LR)
            p.grad = None
    else:
        opts = {p: torch.optim.SGD([p], lr=LR) for p in params}

        def hook(p: torch.Tensor) -> None:
            opts[p].step()
            opts[p].zero_grad()
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return model


def _optim_in_backward(fs: Callable[..., Any]) -> nn.Module:
    model = _shard_llama(Llama(CFG), fs)
    return _step_in_backward(model, list(model.parameters()))


# ------------------------------------------------------------ weight reuse
class _Sub(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, h) * 0.3)
        self.b = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A view of its result, as HF's OPT decoder layer returns.
        return torch.tanh(x @ self.w + self.b).view(x.shape)


class _Reuse(nn.Module):
    """Each unit runs three times in one forward, twice in a row, then once more
    after the others (weight reuse, as in the torch test of a unit called twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        self.layers = nn.ModuleList([_Sub(16) for _ in range(3)])
        self.head = nn.Linear(16, CFG.vocab_size)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        for layer in self.layers:
            x = layer(layer(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ------------------------------------------------------ dataclass activations
@dataclasses.dataclass(frozen=True)
class _Act:
    hidden: torch.Tensor
    skip: torch.Tensor
    note: str = "kept"
    # Passed through every block unchanged (a block adds it to its result), as T5's
    # position bias is: a unit output whose gradient is complete only after every
    # block's backward.
    bias: torch.Tensor | None = None


class _DCBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, act: _Act) -> _Act:
        hidden = torch.relu(self.a(act.hidden)) + act.skip
        if act.bias is not None:
            hidden = hidden + act.bias
        return _Act(hidden, self.b(act.skip), act.note, act.bias)


class _DCModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        self.blocks = nn.ModuleList([_DCBlock() for _ in range(2)])
        self.head = nn.Linear(16, CFG.vocab_size)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        act = _Act(x, x * 0.5)
        for block in self.blocks:
            act = block(act)
        return self.head(act.hidden + act.skip)


# ------------------------------------------------------ prefix tuning
class _PrefixBlock(nn.Module):
    """A frozen block that also takes a learnable prefix (prefix tuning), computed
    last so that its backward runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.requires_grad_(False)

    def forward(self, h: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        return (torch.relu(self.a(h)) + h + self.b(prefix).mean(0)).view(h.shape)


class _PrefixModel(nn.Module):
    """The base model frozen, a learnable prefix per block held by the root: a leaf
    (the root's placeholder) that every step passes to the same unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        self.prefixes = nn.ParameterList([nn.Parameter(torch.randn(4, 16)) for _ in range(2)])
        self.blocks = nn.ModuleList([_PrefixBlock() for _ in range(2)])
        self.head = nn.Linear(16, CFG.vocab_size)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.emb(tok)
        for block, prefix in zip(self.blocks, self.prefixes):
            h = block(h, prefix)
        return self.head(h)


# ------------------------------------------------------ the three, in one model
class _Mixed(nn.Module):
    """The structures of the three models above in one, for the compiled tests (one
    compile where there were three): a frozen unit fed a learnable prefix (a leaf of
    the root), two units passing a dataclass, and a unit called three times (twice
    in a row, then once more after the others). Units: ``pre``, ``blocks.0``,
    ``blocks.1``, ``sub``, in ``units`` for :func:`_shard_children`.

    ``blocks`` pass the dataclass's ``bias`` through unchanged (T5's position
    bias): its gradient is complete only after both blocks' backward. ``pre`` and
    ``sub`` return views. With ``inplace`` the root scales ``pre``'s
    output in place (``mul_``), which drops the hook that re-gathers ``pre`` for its
    backward (only its output reaches it); without, out of place, the same numbers
    (torch's fully_shard then fails: see [Note: An output that is a view] in
    traceable_hsdp/_state.py)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        self.prefix = nn.Parameter(torch.randn(4, 16))
        self.pre = _PrefixBlock()
        self.blocks = nn.ModuleList([_DCBlock() for _ in range(2)])
        self.sub = _Sub(16)
        self.head = nn.Linear(16, CFG.vocab_size)

    @property
    def units(self) -> list[nn.Module]:
        return [self.pre, *self.blocks, self.sub]

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.pre(self.emb(tok), self.prefix)
        h = h.mul_(0.5) if self.inplace else h * 0.5
        h = self.sub(self.sub(h))
        act = _Act(h, h * 0.5, bias=self.prefix.mean(0))
        for block in self.blocks:
            act = block(act)
        return self.head(self.sub(act.hidden + act.skip + act.bias))


def _shard_children(model: nn.Module, attr: str, fs: Callable[..., Any]) -> nn.Module:
    for m in getattr(model, attr):
        fs(m)
    fs(model)
    return model


# ------------------------------------------------------ activation checkpointing
def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _ac_llama(fs: Callable[..., Any], form: str, cfg: Any = CFG) -> Llama:
    """Our Llama (``cfg``) with activation checkpointing on every block:
    ``wrap_then_shard`` (torchtitan's order: checkpoint_wrapper, then fully_shard on
    the wrapper), ``shard_then_wrap`` (checkpoint_wrapper around the fully_shard
    block), ``selective`` (torchtitan's order, a policy that saves the matmuls)."""
    model = Llama(cfg)
    for i, layer in enumerate(model.layers):
        if form == "shard_then_wrap":
            model.layers[i] = checkpoint_wrapper(fs(layer))
            continue
        kw = {}
        if form == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        model.layers[i] = fs(checkpoint_wrapper(layer, **kw))
    fs(model)
    return model


# ------------------------------------------------------------- meta device
class _Allocs(TorchDispatchMode):
    """Records the storage (bytes) of every tensor an op outputs on a real device,
    with the op, and the largest one output by an op other than an allocation."""

    ALLOC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list[tuple[str, int]] = []
        self.written = 0  # the largest storage an op other than an allocation output

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                # A DTensor's own storage is a wrapper's: measure its local shard.
                local = t._local_tensor if isinstance(t, DTensor) else t
                nbytes = local.untyped_storage().nbytes()
                self.allocs.append((str(func), nbytes))
                if func not in self.ALLOC:
                    self.written = max(self.written, nbytes)
        return out


def _meta_flow(rank: int, world: int, lib: str, mesh: Any = None) -> dict[str, Any]:
    """FSDP2's meta-device flow: build on meta, shard, to_empty, load a full state
    dict (every rank passes the same full values); then train."""
    torch.manual_seed(0)
    cpu_model = Llama(CFG)
    full_sd = {k: v.detach().clone() for k, v in cpu_model.state_dict().items()}
    cpu_sharded = _shard_llama(cpu_model, _fs(lib, mesh))
    fs = _fs(lib, mesh)
    with torch.device("meta"):
        model = Llama(CFG)
    rec = _Allocs()
    with rec:
        _shard_llama(model, fs)
        model.to_empty(device="cpu")
    live = [p.to_local().untyped_storage().nbytes() for p in model.parameters()]
    if lib == "ours":
        live += [fp.unsharded_param.untyped_storage().nbytes() for fp in _managed(model)]
    # Buffers (the rotary tables) are not in the state dict: recompute them, as a
    # model's init_weights() does.
    model.rope_cos.copy_(cpu_model.rope_cos)
    model.rope_sin.copy_(cpu_model.rope_sin)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
    same_shards = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), cpu_sharded.parameters())
    )
    largest_param = max(p.numel() * p.element_size() for p in model.parameters())
    largest_shard = max(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    losses, params = _train(model, rank, world)
    return dict(
        run=(losses, params),
        same_shards=same_shards,
        largest_written=rec.written,
        full_size_allocs={op for op, n in rec.allocs if n > largest_shard},
        largest_live=max(live),
        largest_param=largest_param,
        largest_shard=largest_shard,
    )


def _meta_random_init(rank: int, world: int, lib: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Meta flow with a seeded random init of the shards (reset_parameters on DTensors)."""
    with torch.device("meta"):
        model = Llama(CFG)
    _shard_llama(model, _fs(lib))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.reset_parameters()
        elif isinstance(m, RMSNorm):
            with torch.no_grad():
                m.weight.fill_(1.0)
    ref = Llama(CFG)  # rotary tables as the model's __init__ computes them
    model.rope_cos.copy_(ref.rope_cos)
    model.rope_sin.copy_(ref.rope_sin)
    return _train(model, rank, world)


def _meta_assign(fs: Callable[..., Any]) -> nn.Module:
    """torch's rank-0 broadcast flow (HF accelerate's FSDP2 loading): build on meta,
    shard, then load_state_dict of DTensors laid out like the parameters, with
    assign=True. distribute_tensor sends rank 0's full values (every rank builds
    the same ones here, seeded)."""
    full_sd = Llama(CFG).state_dict()  # seeded by _both
    with torch.device("meta"):
        model = _shard_llama(Llama(CFG), fs)
    sd = {k: nn.Parameter(torch.distributed.tensor.distribute_tensor(full_sd[k], v.device_mesh, v.placements))
          for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    ref = Llama(CFG)  # the rotary tables (buffers outside the state dict)
    model.rope_cos = ref.rope_cos
    model.rope_sin = ref.rope_sin
    return model


def _replicate_root(fs: Callable[..., Any]) -> nn.Module:
    """fully_shard on the blocks and torch's replicate() (DDP) on the root, whose own
    parameters it all-reduces; it must leave the blocks' to fully_shard (torch's
    composable-API registry lists our units)."""
    from torch.distributed._composable import replicate

    model = Llama(CFG)
    for layer in model.layers:
        fs(layer)
    return replicate(model)


class _Float8Frozen(nn.Module):
    """A frozen float8 weight (quantized, as in a fine-tune beside quantized weights)
    in one unit with trainable fp32 ones: gathered in its own flat all-gather, as
    bytes on gloo (see [Note: Gathering bytes] in traceable_hsdp/_collectives.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        w8 = (torch.randn(16, 16) * 2).to(torch.float8_e4m3fn)
        self.w8 = nn.Parameter(w8, requires_grad=False)
        self.out = nn.Linear(16, CFG.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(x) @ self.w8.float()))


# ------------------------------------------------------------------ the run
def conformance_eager(rank: int, world: int) -> dict[str, Any]:
    """Every scenario, eager, torch's fully_shard and ours side by side."""
    out: dict[str, Any] = {}
    for raf in (True, False):
        out[f"reuse_raf_{raf}"] = _both(
            rank, world, lambda fs, raf=raf: _shard_children(_Reuse(), "layers", functools.partial(fs, reshard_after_forward=raf))
        )
    out["dataclass"] = _both(rank, world, lambda fs: _shard_children(_DCModel(), "blocks", fs))
    out["prefix"] = _both(rank, world, lambda fs: _shard_children(_PrefixModel(), "blocks", fs))
    out["mixed"] = _both(rank, world, lambda fs: _shard_children(_Mixed(), "units", fs))
    out["mixed_inplace"] = _both(
        rank, world, lambda fs: _shard_children(_Mixed(inplace=True), "units", fs),
        torch_build=lambda fs: _shard_children(_Mixed(), "units", fs),
    )

    def cast_after(fs: Callable[..., Any]) -> nn.Module:
        model = _shard_llama(Llama(CFG), fs)
        return model.to(torch.float64)

    out["cast_float64"] = _both(rank, world, cast_after)
    out["cast_dtypes"] = {str(v.dtype) for v in out["cast_float64"]["ours"][1].values()}

    def freeze_after(fs: Callable[..., Any]) -> nn.Module:
        # Frozen after fully_shard, before the first forward: torch honours it too.
        model = _shard_llama(Llama(CFG), fs)
        model.layers[0].requires_grad_(False)
        model.output.weight.requires_grad_(False)
        return model

    out["freeze_after_shard"] = _both(rank, world, freeze_after)
    for form in ("wrap_then_shard", "shard_then_wrap", "selective"):
        out[f"ac_{form}"] = _both(rank, world, functools.partial(_ac_llama, form=form))
    for lib in ("torch", "ours"):
        out[f"meta_{lib}"] = _meta_flow(rank, world, lib)
        out[f"meta_random_{lib}"] = _meta_random_init(rank, world, lib)
    out["freeze_midway"] = _freeze_midway(rank, world)
    out["meta_assign"] = _both(rank, world, _meta_assign)
    out["float8_frozen"] = _both(rank, world, lambda fs: fs(_Float8Frozen()))
    out["replicate_root"] = _both(rank, world, _replicate_root)
    out["optim_in_backward"] = _both(rank, world, _optim_in_backward)
    out["autocast"] = _both(rank, world, _accelerate_autocast)
    out["root_twice"] = _both(
        rank, world, lambda fs: _shard_llama(Llama(CFG), fs), _two_forwards_step
    )
    out["fp16_grad_scaler"] = _fp16_grad_scaler(rank, world)
    return out


def _freeze_midway(rank: int, world: int) -> dict[str, Any]:
    """Freezing and unfreezing between steps, after the first forward, against a
    one-process model on the global batch. ``norm.weight`` is frozen before
    fully_shard and unfrozen at step 2; block 1 and the output head are frozen at
    step 1."""
    results: dict[str, Any] = {}
    for lib in ("reference", "ours"):
        torch.manual_seed(0)
        model = Llama(CFG)
        model.norm.weight.requires_grad_(False)
        if lib == "ours":
            _shard_llama(model, th.fully_shard)
        frozen_at_1: dict[str, torch.Tensor] = {}

        def before(i: int, model: Llama = model, frozen_at_1: dict = frozen_at_1) -> None:
            if i == 1:
                model.layers[1].requires_grad_(False)
                model.output.weight.requires_grad_(False)
                frozen_at_1.update(full_state(model))
            if i == 2:
                model.norm.weight.requires_grad_(True)

        if lib == "reference":
            losses, params = _train(model, 0, world, before_step=before, shards=1)
        else:
            losses, params = _train(model, rank, world, before_step=before)
        results[lib] = (losses, params)
        results[f"{lib}_frozen_at_1"] = frozen_at_1
        if lib == "ours":
            results["trainable_placeholders"] = sum(
                fp.unsharded_param.requires_grad for fp in _managed(model)
            )
    return results


@pytest.mark.slow
def test_conformance_eager_vs_torch_fully_shard() -> None:
    results = run_ranks(conformance_eager, 2)
    for r in results:
        for name in BITWISE:
            assert_same_run(r[name]["ours"], r[name]["torch"], name)
            assert r[name]["bytes_after"] == 0, name  # every placeholder freed
        assert r["cast_dtypes"] == {"torch.float64"}
        # fp16 with GradScaler: bitwise, with the same scales as torch's; some steps
        # overflowed (the scale halved) and some were taken (it stayed).
        g = r["fp16_grad_scaler"]
        assert_same_run(g["ours"], g["torch"], "fp16_grad_scaler")
        scales = g["ours_scales"]
        assert scales == g["torch_scales"], (scales, g["torch_scales"])
        assert scales[0] < 2.0**20 and any(a == b for a, b in zip(scales, scales[1:])), scales
        # Meta flow: same shards as the CPU-built model, bitwise; no rank holds a
        # whole parameter: after to_empty every storage the model keeps is at most a
        # shard, no op wrote more than a shard, and the only full-size allocations
        # are the placeholders' (empty, released at once: see
        # FSDPParam._empty_placeholder); training as torch's.
        for lib in ("torch", "ours"):
            assert r[f"meta_{lib}"]["same_shards"], lib
        m = r["meta_ours"]
        assert m["largest_live"] <= m["largest_shard"] < m["largest_param"], m
        assert m["largest_written"] <= m["largest_shard"], m
        assert m["full_size_allocs"] <= {"aten.empty.memory_format"}, m["full_size_allocs"]
        assert_same_run(r["meta_ours"]["run"], r["meta_torch"]["run"], "meta")
        assert_same_run(r["meta_random_ours"], r["meta_random_torch"], "meta_random")
        # Freezing between steps: the frozen parameters did not move, got no
        # gradient, and the run matches a one-process model on the global batch
        # (sharded reductions sum in another order: atol 2e-5, as the parity tests).
        f = r["freeze_midway"]
        ours, ref = f["ours"][1], f["reference"][1]
        for k, v in ref.items():
            torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=2e-5, msg=k)
        for k in ("layers.1.attn.wq.weight", "layers.1.ffn.w2.weight", "output.weight"):
            assert torch.equal(ours[k], f["ours_frozen_at_1"][k]), k
        # norm.weight, frozen before fully_shard, trains once unfrozen.
        assert not torch.equal(ours["norm.weight"], f["ours_frozen_at_1"]["norm.weight"])
        # 21 managed parameters; block 1 (9) and the output head frozen at the end.
        assert f["trainable_placeholders"] == 21 - 9 - 1


def _hf_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _loss(model(input_ids=x).logits, y)


def _hf_shard(model: nn.Module, fs: Callable[..., Any]) -> nn.Module:
    for layer in model.model.layers:
        fs(layer)
    fs(model)
    return model


def _t5(fs: Callable[..., Any]) -> nn.Module:
    """HF ``T5ForConditionalGeneration``, every encoder and decoder block and the root
    sharded: the encoder's output is an input of every decoder block (cross-attention),
    so its gradient sums one contribution per unit."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(
        vocab_size=CFG.vocab_size, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, use_cache=False, dropout_rate=0.0,
    ))
    for block in [*model.encoder.block, *model.decoder.block]:
        fs(block)
    fs(model)
    return model


def _t5_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _loss(model(input_ids=x, labels=y.contiguous()).logits, y)


def conformance_hf(rank: int, world: int) -> dict[str, Any]:
    """HF ``LlamaForCausalLM`` from a small config (no weights): activation
    checkpointing inside each decoder layer (``gradient_checkpointing_enable``,
    non-reentrant) and the meta-device flow with a full state dict, each with torch's
    fully_shard and ours; and HF T5 (an input shared by several units)."""
    from transformers import LlamaForCausalLM

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    full_sd = {k: v.detach().clone() for k, v in LlamaForCausalLM(hf_llama_config()).state_dict().items()}

    def with_ac(fs: Callable[..., Any]) -> nn.Module:
        model = LlamaForCausalLM(hf_llama_config())
        model.load_state_dict(full_sd)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return _hf_shard(model, fs)

    out["hf_ac"] = _both(rank, world, with_ac, _hf_step)
    out["t5"] = _both(rank, world, _t5, _t5_step)
    # Ours again, one step with its all-gathers counted: each T5 block returns the
    # position bias it was given, whose gradient completes after the blocks' own
    # backward (see [Note: Output hooks after the unit's backward] in _state.py).
    torch.manual_seed(0)
    model = _t5(_fs("ours"))
    x, y = next(iter(_data(world, 1)))
    ops = FunctionalCollectiveOps()
    with ops:
        _t5_step(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
    out["t5_all_gathers"] = ops.names.count("all_gather_into_tensor_out")
    out["t5_units"] = sum(1 for m in model.modules() if isinstance(m, th.FSDPModule))
    for lib in ("torch", "ours"):
        with torch.device("meta"):
            model = LlamaForCausalLM(hf_llama_config())
        _hf_shard(model, _fs(lib))
        model.to_empty(device="cpu")
        rot = model.model.rotary_emb  # a buffer the state dict does not hold
        inv_freq, _ = rot.compute_default_rope_parameters(model.config)
        rot.inv_freq.copy_(inv_freq)
        rot.original_inv_freq.copy_(inv_freq)
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
        out[f"hf_meta_{lib}"] = _train(model, rank, world, _hf_step)
    return out


@pytest.mark.slow
def test_conformance_hf_llama_vs_torch_fully_shard() -> None:
    """HF transformers' LlamaForCausalLM as a client: activation checkpointing inside
    each decoder layer (gradient_checkpointing_enable, non-reentrant), and the
    meta-device flow loading a full state dict; and T5ForConditionalGeneration, whose
    encoder output every decoder block reads (its gradient is summed over the units
    in the order of their nodes: equal only with torch's node per unit, see [Note:
    When a unit's backward is done] in traceable_hsdp/_param_group.py), and whose
    blocks pass the position bias through (its all-gathers counted for one eager
    step). Bitwise against torch's fully_shard."""
    for r in run_ranks(conformance_hf, 2):
        assert_same_run(r["t5"]["ours"], r["t5"]["torch"], "t5")
        assert r["t5"]["bytes_after"] == 0
        # One flat all-gather per unit forward (4 blocks and the root) and one per
        # block backward; the position bias each block passes through gathered no
        # block again after its backward.
        assert r["t5_units"] == 5, r["t5_units"]
        assert r["t5_all_gathers"] == 5 + 4, r["t5_all_gathers"]
        assert_same_run(r["hf_ac"]["ours"], r["hf_ac"]["torch"], "hf_ac")
        assert r["hf_ac"]["bytes_after"] == 0
        assert_same_run(r["hf_meta_ours"], r["hf_meta_torch"], "hf_meta")


# ---------------------------------------------- compiled before fully_shard
def _canonical(trained: tuple[list[float], dict[str, torch.Tensor]]) -> tuple:
    """The state dict's names without torch.compile's ``_orig_mod`` (as HF accelerate
    canonicalizes them)."""
    losses, params = trained
    return losses, {
        k.replace("_orig_mod.", "").replace("._orig_mod", ""): v for k, v in params.items()
    }


# ------------------------------------- more HF transformers families, compiled whole
# Each brings what Llama does not: Gemma 2 ties its head to the embedding and soft-caps
# the attention and final logits, with a sliding window on every other layer; GPT-NeoX
# runs attention and MLP in parallel from one residual, with fused QKV and a partial
# rotary; BERT is an encoder whose masked-LM head is tied to the word embedding and has
# a bias of its own, with LayerNorm biases and position and token-type buffers.
HF_FAMILIES = ("gemma2", "gpt_neox", "bert")


def _hf_family(name: str) -> tuple[nn.Module, Any]:
    """A small model of ``name`` (no weights), and its list of layers."""
    import transformers as T

    common = dict(vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32)
    if name == "gemma2":
        m = T.Gemma2ForCausalLM(T.Gemma2Config(
            **common, num_key_value_heads=1, head_dim=16, sliding_window=8, use_cache=False,
        ))
        return m, m.model.layers
    if name == "gpt_neox":
        m = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            **common, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
        ))
        return m, m.gpt_neox.layers
    m = T.BertForMaskedLM(T.BertConfig(
        **common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))
    return m, m.bert.encoder.layer


def hf_families_compiled(rank: int, world: int) -> dict[str, Any]:
    """Per family of ``HF_FAMILIES``: torch's fully_shard eager, and ours with the whole
    step compiled (``fullgraph=True``, compiled autograd, ``aot_eager``), each layer
    and the root a unit; their runs, our graphs, and whether the head stayed tied."""
    out: dict[str, Any] = {}
    for name in HF_FAMILIES:
        for lib in ("torch", "ours"):
            torch._dynamo.reset()
            counters.clear()
            torch.manual_seed(0)
            model, layers = _hf_family(name)
            for layer in layers:
                _fs(lib)(layer)
            _fs(lib)(model)
            if lib == "torch":
                out[f"{name}_torch"] = _train(model, rank, world, _hf_step)
                continue
            th.enable_compiled_autograd(backend="aot_eager")
            try:
                compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
                out[name] = _canonical(_train(compiled, rank, world, _hf_step))
            finally:
                th.disable_compiled_autograd()
            out[f"{name}_graphs"] = counters["stats"]["unique_graphs"]
            head, embed = model.get_output_embeddings(), model.get_input_embeddings()
            out[f"{name}_tied"] = head.weight is embed.weight
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_hf_families_compiled_vs_torch_fully_shard() -> None:
    """HF transformers Gemma 2, GPT-NeoX and BERT (masked LM) as clients, the whole
    step compiled (aot_eager, fullgraph, compiled autograd), each layer and the root
    a unit: bitwise equal to torch's fully_shard eager over 3 AdamW steps, in one
    forward and one backward graph, with the tied heads still tied. Inductor runs
    the same graphs for HF Llama, GPT-2 and Mixtral in the other tests."""
    for r in run_ranks(hf_families_compiled, 2):
        for name in ("gemma2", "gpt_neox", "bert"):
            assert_same_run(r[name], r[f"{name}_torch"], name)
            assert r[f"{name}_graphs"] == 2, (name, r[f"{name}_graphs"])
        assert r["gemma2_tied"] and r["bert_tied"] and not r["gpt_neox_tied"], r


# _Mixed: the root's parameters (embedding, prefix, head weight and bias), and the
# calls of its reused unit per forward.
MIXED_ROOT, MIXED_CALLS = 4, 3


# ------------------------------------------------------------------ compiled
def conformance_compiled(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Compiled (``torch.compile(model, fullgraph=True)`` with compiled autograd)
    against the same flow eager: ``_Mixed`` (weight reuse, dataclass activations,
    prefix tuning: a frozen unit fed a learnable prefix that persists across steps;
    units returning views, one of them changed in place; ``blocks.1`` stepped in
    the backward by hooks on its sharded parameters),
    frozen in part after its first compiled step (``blocks.0`` and the head's weight),
    and HF ``MixtralForCausalLM``
    (mixture of experts: 3-D expert weights sharded on the expert dim, the grouped
    matmul a custom op with its own backward), also trained eager with torch's
    fully_shard. ``backend`` "aot_eager" records the collectives of every graph and
    adds Mixtral in bf16 mixed precision ("moe_bf16", also against torch's);
    "inductor" runs the passes, and adds "twice": a 1-block Llama whose root runs two
    forwards before one backward. "hf_ac" is HF ``LlamaForCausalLM`` with its own
    ``gradient_checkpointing_enable()`` (the checkpoint around each decoder layer's
    whole call, hence around a unit's hooks), its forward under
    ``torch.autocast(bfloat16)`` (HF accelerate's mixed precision), compiled with
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` set (see
    docs/compile.md, "Activation checkpointing")."""
    from transformers import LlamaForCausalLM

    from _workers import GraphRecorder

    def hf_ac() -> nn.Module:
        model = LlamaForCausalLM(hf_llama_config(layers=1))
        model.config.use_cache = False  # what a training script sets with checkpointing
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return _hf_shard(model, th.fully_shard)

    def freeze(model: nn.Module) -> Callable[[int], None]:
        def before(i: int) -> None:
            if i == 1:
                model.blocks[0].requires_grad_(False)
                model.head.weight.requires_grad_(False)
        return before

    def _mixed_step_in_backward() -> nn.Module:
        # blocks.1 stepped in backward by its own hooks (they run in the compiled
        # backward: without them AdamW would step blocks.1, and differ from eager).
        model = _shard_children(_Mixed(inplace=True), "units", th.fully_shard)
        return _step_in_backward(model, list(model.blocks[1].parameters()), traced=True)

    cases: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], Any]]] = {
        "mixed": (_mixed_step_in_backward, freeze),
        "moe": (lambda: _hf_shard(_mixtral(), th.fully_shard), lambda m: None),
        "hf_ac": (hf_ac, lambda m: None),
    }
    out: dict[str, Any] = {}
    if backend == "inductor":
        # Two forwards of the root before one backward (DPO's chosen and rejected
        # batches, a contrastive pair): each block is gathered again while the first
        # forward's backward is still to come. Inductor only: under aot_eager torch's
        # autograd refuses it, as docs/api.md says.
        cases["twice"] = (lambda: _shard_llama(Llama(CFG1), th.fully_shard), lambda m: None)
    if backend == "aot_eager":
        # torch's fully_shard, for the eager runs' bitwise checks (which the aot_eager
        # test makes; the Inductor test compares with our eager runs only).
        torch.manual_seed(0)
        out["moe_torch"] = _train(_hf_shard(_mixtral(), _fs("torch")), rank, world, _hf_step)
        # Mixtral in bf16: the experts run the native torch._grouped_mm, whose saved
        # view of the expert weight the partitioner once computed after the weight's
        # placeholder was freed (see [Note: Views of a placeholder are recomputed]).
        def bf16(lib: str) -> Callable[..., Any]:
            mp = th.MixedPrecisionPolicy if lib == "ours" else torch_fsdp.MixedPrecisionPolicy
            policy = mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            return functools.partial(_fs(lib), mp_policy=policy)

        cases["moe_bf16"] = (lambda: _hf_shard(_mixtral(), bf16("ours")), lambda m: None)
        torch.manual_seed(0)
        out["moe_bf16_torch"] = _train(_hf_shard(_mixtral(), bf16("torch")), rank, world, _hf_step)
    for name, (build, before) in cases.items():
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            model = build()
            rec = GraphRecorder() if backend == "aot_eager" else None
            fwd = model
            if mode == "compiled":
                torch._dynamo.reset()
                th.enable_compiled_autograd(backend=rec or backend)
                fwd = torch.compile(model, backend=rec or backend, fullgraph=True)

            def step(_m: nn.Module, x: torch.Tensor, y: torch.Tensor, fwd: Any = fwd,
                     hf: bool = name.startswith(("moe", "hf")),
                     amp: bool = name == "hf_ac") -> torch.Tensor:
                if name == "twice":
                    return _loss(fwd(x), y) + _loss(fwd(x.flip(1)), y)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    logits = fwd(input_ids=x).logits if hf else fwd(x)
                return _loss(logits.float() if amp else logits, y)

            skip = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = name == "hf_ac"
            try:
                # Under autocast Inductor keeps bf16 intermediates in fp32 unless told
                # to round as eager does; rounded, it is comparable with eager.
                with torch._inductor.config.patch(emulate_precision_casts=name == "hf_ac"):
                    out[f"{name}_{mode}"] = _train(
                        model, rank, world, step, before_step=before(model)
                    )
            finally:
                torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = skip
                if mode == "compiled":
                    th.disable_compiled_autograd()
            out[f"{name}_{mode}_bytes_after"] = _placeholder_bytes(model)
            if mode == "compiled" and rec is not None:
                out[f"{name}_graphs"] = (rec.forward, rec.backward)
    out["before_shard"] = compiled_before_shard(rank, world, backend)
    return out


# Three blocks under aot_eager: the per-block forms compile one graph for all of them
# (as torch's per-block compile does), which one block could not show. Inductor keeps
# one block (its tolerances are set for it; at three, AdamW took one element of
# layers.1's w2 4.4e-5 from torch's eager run, the losses within 1 ulp).
BEFORE_SHARD_CFG = dataclasses.replace(CFG, n_layers=3)


def compiled_before_shard(rank: int, world: int, backend: str) -> dict[str, Any]:
    """The other ways jobs compile with FSDP: the model or its blocks compiled first,
    fully_shard after, each against torch's fully_shard eager on the same model
    (``BEFORE_SHARD_CFG``, three blocks; under Inductor ``CFG1``, one).

    - "wrap": torchtitan's per-block compile in its older form, each block replaced by
      ``torch.compile(block, fullgraph=True)`` (an ``OptimizedModule``), compiled
      autograd off: the unit's gathers run around the compiled block, as torch's do
      (see [Note: A forward set on the instance] in traceable_hsdp/_fsdp_class.py).
    - "inplace": torchtitan's form today, ``block.compile(fullgraph=True)``, compiled
      autograd off: the unit's pre- and post-forward run eagerly and the block's own
      forward is compiled, as around torch's hooks (see [Note: A unit compiled in
      place] in traceable_hsdp/_compiled_call.py);
      "inplace_after": the same with ``block.compile`` called after fully_shard;
      "inplace_ca": compiled autograd on, the unit's gathers traced in the block's
      graph, one graph for the three blocks (see [Note: One graph for every unit
      of a class] in traceable_hsdp/_common.py);
      "inplace_ca_nested": the same with each block's feed-forward a unit of its own
      inside the block's (as torchtitan shards a block's MoE experts), also one graph
      for the blocks.
    - "root", "root_ca": HF accelerate's FSDP2 flow with a dynamo backend:
      ``torch.compile(model)``, then fully_shard on the blocks and on the compiled
      model; compiled autograd off (accelerate's way: the root gathers eagerly, and
      the blocks' hooks break the graph and run eagerly) and on. "root_fullgraph":
      the same with fullgraph=True and compiled autograd off, which cannot hold the
      blocks' eager hooks: the first forward fails with our message (its text).

    Inductor runs "wrap", "inplace" and "inplace_ca_nested" only (the others trace as
    the whole-model compile does)."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    cfg = CFG1 if backend == "inductor" else BEFORE_SHARD_CFG
    out["torch"] = _train(_shard_llama(Llama(cfg), _fs("torch")), rank, world)
    forms = ["wrap", "inplace", "inplace_ca_nested"] if backend == "inductor" else [
        "wrap", "inplace", "inplace_after", "inplace_ca", "inplace_ca_nested", "root", "root_ca",
        "root_fullgraph",
    ]
    for form in forms:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model: nn.Module = Llama(cfg)
        if form.startswith("root"):
            model = torch.compile(model, backend=backend, fullgraph=form == "root_fullgraph")
        blocks = model.layers
        for i, block in enumerate(list(blocks)):
            if form == "wrap":
                blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
            elif form in ("inplace", "inplace_ca", "inplace_ca_nested"):
                block.compile(backend=backend, fullgraph=True)
            if form == "inplace_ca_nested":
                th.fully_shard(block.ffn)
        _shard_llama(model, th.fully_shard)  # an OptimizedModule passes .layers through
        if form == "inplace_after":
            for block in blocks:
                block.compile(backend=backend, fullgraph=True)
        if "_ca" in form:
            th.enable_compiled_autograd(backend=backend)
        try:
            if form == "root_fullgraph":
                try:
                    _train(model, rank, world)
                    out[form] = "trained"
                except Exception as e:  # noqa: BLE001 - the test reads the text
                    out[form] = str(e)
                continue
            counters.clear()
            out[form] = _canonical(_train(model, rank, world))
            out[f"{form}_graphs"] = counters["stats"]["unique_graphs"]
            out[f"{form}_bytes_after"] = _placeholder_bytes(model)
        finally:
            th.disable_compiled_autograd()
    torch._dynamo.reset()
    return out


# ------------------------------------------------- HF transformers, a real client
MOE_LAYERS = 1  # one decoder layer and the root: two units, the layer re-gathered


def _mixtral() -> nn.Module:
    """HF ``MixtralForCausalLM``, ``MOE_LAYERS`` layers of 4 experts, top 2 (its default
    experts implementation: ``grouped_mm``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=MOE_LAYERS, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ))


@pytest.mark.slow
def test_conformance_compiled_aot_eager() -> None:
    """Compiled with compiled autograd (aot_eager: the same ops as eager, so bitwise
    equal to the eager run): weight reuse, dataclass activations and prefix tuning in
    one model (``_Mixed``, with its in-place op on a unit's output that is a view,
    whose eager run is bitwise equal to torch's fully_shard in the eager test; one
    unit's parameters stepped in the backward by hooks on them, which the compiled
    backward must run),
    frozen in part after the first compiled step (fullgraph=True
    holds: the change is applied before dynamo traces), HF Mixtral (mixture of experts) in fp32 and in bf16 mixed precision,
    whose eager runs are also bitwise equal to torch's fully_shard, and HF Llama with
    its own gradient checkpointing (the checkpoint around each unit's whole call;
    dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint on) and its forward under
    ``torch.autocast(bfloat16)``, as HF accelerate runs it. Collectives counted
    from the captured graphs, which hold no version-counter op. And the model or its
    blocks compiled before fully_shard (``compiled_before_shard``): torchtitan's two
    per-block forms and HF accelerate's compiled root, against torch's fully_shard."""
    for r in run_ranks(conformance_compiled, 2, "aot_eager"):
        for name in ("mixed", "moe", "moe_bf16", "hf_ac"):
            assert_same_run(r[f"{name}_compiled"], r[f"{name}_eager"], name)
            assert r[f"{name}_compiled_bytes_after"] == 0, name
        # No version-counter op in any graph dynamo captured: [Note: Version counters
        # in a traced step] (traceable_hsdp/_param.py).
        for name in ("mixed", "moe", "moe_bf16", "hf_ac"):
            fwd, bwd = r[f"{name}_graphs"]
            assert fwd and bwd and not any("version_counter" in g for g in fwd + bwd), name
        assert_same_run(r["moe_eager"], r["moe_torch"], "moe vs torch's fully_shard")
        # bf16 mixed precision: the saved views of the expert weights are recomputed
        # in the backward (they failed on the freed placeholder before).
        assert_same_run(r["moe_bf16_eager"], r["moe_bf16_torch"], "moe bf16 vs torch's fully_shard")
        assert [len(g) for g in r["moe_bf16_graphs"]] == [1, 1], r["moe_bf16_graphs"]
        # Mixtral: 9 parameters per layer (4 attention projections, 2 norms, the
        # router, the two 3-D expert weights) and 3 on the root; one forward and one
        # backward graph, every parameter gathered and reduced in them, the layers'
        # re-gathered (the root stays gathered for backward: the default
        # reshard_after_forward, None, as torch's).
        fwd, bwd = r["moe_graphs"]
        assert len(fwd) == len(bwd) == 1, (fwd, bwd)
        n_moe = MOE_LAYERS * 9 + 3
        assert fwd[0]["all_gather_into_tensor"] == n_moe, fwd
        assert bwd[0]["all_gather_into_tensor"] == n_moe - 3, bwd
        assert bwd[0]["reduce_scatter_tensor"] == n_moe, bwd
        # HF Llama (1 decoder layer), checkpointed around the layer's call: one graph
        # each way (fullgraph=True, no break), and the backward's recompute of the
        # layer adds no collective: the layer's 9 parameters re-gathered once, and
        # each parameter reduced once (9 in the layer, 3 on the root, which stays
        # gathered). The forward's layer gathers sit inside the
        # checkpoint subgraph, which these dynamo-level counts do not open.
        fwd, bwd = r["hf_ac_graphs"]
        assert len(fwd) == len(bwd) == 1, (fwd, bwd)
        assert bwd[0]["all_gather_into_tensor"] == 9, bwd
        assert bwd[0]["reduce_scatter_tensor"] == 9 + 3, bwd
        # _Mixed: units pre (4 parameters, frozen), blocks.0 and blocks.1 (4 each), sub
        # (2, called three times); the root holds 4 (embedding, prefix, head weight
        # and bias). Forward: every call gathers (each unit but the root resharded
        # after it). Backward: each unit but the root (kept gathered) re-gathered
        # once, the frozen pre too (for its input's
        # gradient, the embedding's), and kept until its first use's backward; every
        # trainable parameter reduced once. Freezing blocks.0 and the head's weight
        # after step 1 recompiles once (dynamo's guards on requires_grad), and the
        # backward after it reduces 5 fewer.
        fwd, bwd = r["mixed_graphs"]
        assert len(fwd) == len(bwd) == 2, (fwd, bwd)
        for f in fwd:
            assert f["all_gather_into_tensor"] == MIXED_ROOT + 4 + 2 * 4 + MIXED_CALLS * 2, fwd
        for b in bwd:
            assert b["all_gather_into_tensor"] == 4 + 2 * 4 + 2, bwd
        assert bwd[0]["reduce_scatter_tensor"] == MIXED_ROOT + 2 * 4 + 2, bwd
        assert bwd[1]["reduce_scatter_tensor"] == MIXED_ROOT + 2 * 4 + 2 - 4 - 1, bwd
        # Compiled before fully_shard (torchtitan's per-block forms, HF accelerate's
        # compiled root): bitwise equal to torch's fully_shard eager. torchtitan's
        # block.compile(fullgraph=True) without compiled autograd, before or after
        # fully_shard, compiles the block's forward alone: one graph for the three
        # blocks, as with torch's fully_shard. With compiled autograd on, one graph
        # for the blocks (their gathers in it) and one for the backward, with or
        # without a unit nested in each block.
        b = r["before_shard"]
        forms = ("wrap", "inplace", "inplace_after", "inplace_ca", "inplace_ca_nested", "root",
                 "root_ca")
        for form in forms:
            assert_same_run(b[form], b["torch"], form)
            assert b[f"{form}_bytes_after"] == 0, form
        assert b["inplace_graphs"] == b["inplace_after_graphs"] == 1, b
        assert b["inplace_ca_graphs"] == b["inplace_ca_nested_graphs"] == 2, b
        assert "fullgraph=True while compiled autograd is off" in b["root_fullgraph"], b["root_fullgraph"]


@pytest.mark.slow
def test_conformance_compiled_inductor() -> None:
    """The same three cases under Inductor with every pass on, and a fourth, "twice"
    (the root called twice before one backward, as DPO's chosen and rejected batches
    are; aot_eager cannot run it, docs/api.md), against the eager run:
    losses rtol 1e-5 and parameters atol 2e-5 (Inductor fuses and reorders float
    arithmetic), 1e-4 for Mixtral. AdamW divides each gradient element by its own
    running scale, so an element whose gradient is close to 0 (an expert that few
    tokens reach) turns a reordering error into a visible step: seen 2.4e-5 and
    2.1e-5 (with 2 decoder layers), on one element of each 3-D expert weight, with
    the losses equal; on "twice" torch 2.15's Inductor ends 2.5e-5 away on one element
    of a 0.2-sized weight, the losses equal. HF Llama runs under ``torch.autocast(bfloat16)``, where Inductor
    keeps bf16 intermediates in fp32 unless ``emulate_precision_casts`` is set: set
    for it, it was within 6e-8 of eager (without, the plain unsharded model moves
    0.026 from eager in 3 AdamW steps)."""
    for r in run_ranks(conformance_compiled, 2, "inductor"):
        for name in ("mixed", "moe", "hf_ac", "twice"):
            c, e = r[f"{name}_compiled"], r[f"{name}_eager"]
            torch.testing.assert_close(c[0], e[0], rtol=1e-5, atol=0, msg=name)
            atol = 1e-4 if name in ("moe", "twice") else 2e-5
            for k, v in e[1].items():
                torch.testing.assert_close(c[1][k], v, rtol=0, atol=atol, msg=f"{name} {k}")
            assert r[f"{name}_compiled_bytes_after"] == 0, name
        # torchtitan's per-block compile in its two forms (each block an
        # OptimizedModule, or block.compile(fullgraph=True) in place, then
        # fully_shard; no compiled autograd), and in place with compiled autograd and
        # the block's feed-forward a unit of its own (one graph each way), against
        # torch's fully_shard eager.
        b = r["before_shard"]
        assert b["inplace_ca_nested_graphs"] == 2, b["inplace_ca_nested_graphs"]
        for form in ("wrap", "inplace", "inplace_ca_nested"):
            torch.testing.assert_close(b[form][0], b["torch"][0], rtol=1e-5, atol=0)
            for k, v in b["torch"][1].items():
                torch.testing.assert_close(b[form][1][k], v, rtol=0, atol=2e-5, msg=f"{form} {k}")
            assert b[f"{form}_bytes_after"] == 0, form


def compiled_without_ca(rank: int, world: int) -> dict[str, Any]:
    """``torch.compile(model)`` with compiled autograd off (torchtitan's plain compile
    line): our Llama (one block) under Inductor and HF ``LlamaForCausalLM`` (one
    decoder layer) under aot_eager, each trained with ours compiled and with torch's
    fully_shard eager on the same model and data. The graphs dynamo hands the backend
    are counted (:func:`dynamo_counts`): the collectives run eagerly at the units'
    boundaries, so none is in them, as none of torch's is under the same line."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._inductor.compile_fx import compile_fx
    from transformers import LlamaForCausalLM

    cases: dict[str, tuple[Build, Step, Callable[..., Any]]] = {
        "llama": (lambda fs: _shard_llama(Llama(CFG1), fs), _llama_step, compile_fx),
        "hf_llama": (
            lambda fs: _hf_shard(LlamaForCausalLM(hf_llama_config(layers=1)), fs), _hf_step, aot_eager
        ),
    }
    out: dict[str, Any] = {}
    for name, (build, step, compiler) in cases.items():
        torch.manual_seed(0)
        out[f"{name}_torch"] = _train(build(_fs("torch")), rank, world, step)
        torch.manual_seed(0)
        model = build(_fs("ours"))
        graphs: list[dict[str, int]] = []

        def backend(gm: torch.fx.GraphModule, inputs: Any, graphs: list = graphs,
                    compiler: Callable[..., Any] = compiler) -> Any:
            graphs.append(dynamo_counts(gm.graph))
            return compiler(gm, inputs)

        torch._dynamo.reset()
        fwd = torch.compile(model, backend=backend)
        out[f"{name}_ours"] = _train(
            model, rank, world, lambda _m, x, y, fwd=fwd, step=step: step(fwd, x, y)
        )
        out[f"{name}_graphs"] = graphs
        out[f"{name}_bytes_after"] = _placeholder_bytes(model)
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_compiled_without_compiled_autograd_vs_torch() -> None:
    """``torch.compile(model)`` with compiled autograd off (:func:`compiled_without_ca`),
    against torch's fully_shard eager on the same model and
    data: our Llama under Inductor, losses rtol 1e-5 and parameters atol 1e-4 (Inductor
    fuses and reorders float arithmetic, which AdamW turns into steps); HF Llama under
    aot_eager, bitwise (the same ops in the same order as the eager runs, which the
    eager conformance tests find bitwise equal to torch's). No collective, resize or
    ``fsdp.copy_`` in any graph dynamo compiled (the units' hooks run eagerly around
    them); every placeholder freed after the steps."""
    for r in run_ranks(compiled_without_ca, 2):
        ours, ref = r["llama_ours"], r["llama_torch"]
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=0)
        for k, v in ref[1].items():
            torch.testing.assert_close(ours[1][k], v, rtol=0, atol=1e-4, msg=k)
        assert_same_run(r["hf_llama_ours"], r["hf_llama_torch"], "hf_llama")
        for name in ("llama", "hf_llama"):
            graphs = r[f"{name}_graphs"]
            assert graphs and all(g == {} for g in graphs), (name, graphs)
            assert r[f"{name}_bytes_after"] == 0, name


def conformance_2x2(rank: int, world: int) -> dict[str, Any]:
    """On a 2x2 (replicate, shard) mesh: the meta-device flow and the three AC forms,
    eager, torch's fully_shard and ours; and ours built on meta with checkpoint_wrapper
    on its block (one: ``CFG1``, for the compile's sake), compiled (aot_eager, plain
    loop) against the same eager."""
    from _workers import compile_for, dp_mesh

    mesh = dp_mesh((2, 2))
    out: dict[str, Any] = {}
    for form in ("wrap_then_shard", "shard_then_wrap", "selective"):
        out[f"ac_{form}"] = _both(rank, world, functools.partial(_ac_llama, form=form), mesh=mesh)
    for lib in ("torch", "ours"):
        out[f"meta_{lib}"] = _meta_flow(rank, world, lib, mesh)
    out["optim_in_backward"] = _both(rank, world, _optim_in_backward, mesh=mesh)
    for how in ("", "loop"):
        torch.manual_seed(0)
        full_sd = Llama(CFG1).state_dict()
        with torch.device("meta"):
            model = _ac_llama(_fs("ours", mesh), "wrap_then_shard", CFG1)
        model.to_empty(device="cpu")
        model.reset_buffers()
        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True))
        fwd, _ = compile_for(model, how, "aot_eager")
        try:
            out[f"meta_ac_{how or 'eager'}"] = _train(
                model, rank, world, lambda _m, x, y, fwd=fwd: _loss(fwd(x), y)
            )
        finally:
            th.disable_compiled_autograd()
            torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_conformance_hsdp_2x2() -> None:
    """On a 2x2 (replicate, shard) mesh, 4 ranks: the three AC forms, the meta flow
    and optimizer in backward bitwise against torch's fully_shard (eager); a model
    built on meta with AC on every block, compiled (aot_eager, plain loop), bitwise
    equal to the same eager."""
    for r in run_ranks(conformance_2x2, 4):
        for form in ("wrap_then_shard", "shard_then_wrap", "selective"):
            assert_same_run(r[f"ac_{form}"]["ours"], r[f"ac_{form}"]["torch"], form)
            assert r[f"ac_{form}"]["bytes_after"] == 0, form
        for lib in ("torch", "ours"):
            assert r[f"meta_{lib}"]["same_shards"], lib
        m = r["meta_ours"]
        assert m["largest_live"] <= m["largest_shard"] < m["largest_param"], m
        assert m["largest_written"] <= m["largest_shard"], m
        assert_same_run(r["meta_ours"]["run"], r["meta_torch"]["run"], "meta 2x2")
        assert_same_run(r["meta_ac_loop"], r["meta_ac_eager"], "meta + AC compiled vs eager")
        # Optimizer in backward: the hooks run once the gradient is all-reduced over
        # the replicas too.
        assert_same_run(r["optim_in_backward"]["ours"], r["optim_in_backward"]["torch"], "optim_in_backward")
        assert r["optim_in_backward"]["bytes_after"] == 0
