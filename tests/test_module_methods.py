"""FSDPModule methods that torch 2.13's FSDPModule has: set_all_reduce_hook,
reset_iter_state, set_post_optim_event, set_reduce_scatter_unused_params, and the
communication-tuning methods that raise NotImplementedError here.

Tolerances: the reset_iter_state run against a run that skipped the failed steps is
bitwise (the same ops in the same order). The all-reduce hook that doubles the
reduce-scatter output is bitwise against twice the plain sum (doubling and halving
are exact). Runs against one process on the global batch (the hook doing DDP over
replicas, the unused-parameter run) use the tolerance of test_runtime.py: losses rtol
1e-5, parameters atol 2e-5 (reductions in another order, amplified by AdamW).
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor, run_child, run_ranks
from _workers import (
    CFG,
    LR,
    GraphRecorder,
    _data,
    _loss,
    _managed,
    _mean_over_ranks,
    _placeholder_bytes,
    dp_mesh,
    full_state,
)
from traceable_hsdp._common import TrainingState
from traceable_hsdp.demo.models import Llama, shard_llama

NOT_SUPPORTED = {
    "set_separate_reduce_scatter_group": (),
    "set_symm_mem_for_comm": (),
}


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)))


def test_every_torch_method_exists_with_torch_signature() -> None:
    """A method torch adds to FSDPModule fails here until ours defines it too (our
    class inherits torch's, so ``hasattr`` would hold without it), with torch's
    signature."""
    for name in _public_methods(torch_fsdp.FSDPModule):
        assert name in vars(th.FSDPModule), f"traceable_hsdp.FSDPModule lacks torch's {name}"
        ours = inspect.signature(vars(th.FSDPModule)[name]).parameters.values()
        theirs = inspect.signature(getattr(torch_fsdp.FSDPModule, name)).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [
            (p.name, p.kind, p.default) for p in theirs
        ], name


def test_fully_shard_takes_torch_arguments() -> None:
    """fully_shard takes every argument torch's takes, by the same names (torch 2.13
    added ``dp_mesh_dims``; code passing it failed with "unexpected keyword
    argument"), and torch's defaults."""
    ours = inspect.signature(th.fully_shard).parameters
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()]

    def same(a: Any, b: Any) -> bool:
        # A policy default compares by torch's fields (ours may have newer ones).
        if dataclasses.is_dataclass(b):
            return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(b))
        return repr(a) == repr(b)

    differ = {n for n, p in theirs.items() if not same(ours[n].default, p.default)}
    assert not differ, differ


def test_units_are_torch_fsdp_modules_with_every_member_ours() -> None:
    """Our mixin subclasses torch's FSDPModule (isinstance checks in user code and
    torch's helpers see our units), and overrides every method torch's defines,
    private ones included, so none of torch's runtime runs on our units."""
    assert issubclass(th.FSDPModule, torch_fsdp.FSDPModule)
    for name, member in vars(torch_fsdp.FSDPModule).items():
        if callable(member) and not (name.startswith("__") and name != "__new__"):
            assert name in vars(th.FSDPModule), f"torch's FSDPModule.{name} is not overridden"


def _tiny(mesh) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    th.fully_shard(m[0], mesh=mesh)
    return th.fully_shard(m, mesh=mesh)


def test_not_supported_methods_raise(one_rank) -> None:
    m = _tiny(one_rank)
    for name, args in NOT_SUPPORTED.items():
        with pytest.raises(NotImplementedError, match=f"does not support FSDPModule.{name}: "):
            getattr(m, name)(*args)
    # torch's copy-in cap: checked and recorded, as torch's (per unit, recurse).
    from traceable_hsdp._state import state_of

    groups = [state_of(u).param_group for u in (m, m[0])]
    assert [g.reduce_scatter_max_input_buffers for g in groups] == [1, 1]
    m.set_reduce_scatter_max_input_buffers(3, recurse=False)
    assert [g.reduce_scatter_max_input_buffers for g in groups] == [3, 1]
    m.set_reduce_scatter_max_input_buffers(2)
    assert [g.reduce_scatter_max_input_buffers for g in groups] == [2, 2]
    # Turning an option off asks for what happens anyway: accepted.
    m.set_allocate_memory_from_process_group_for_comm(False)
    m.set_separate_reduce_scatter_group(False, recurse=False)
    # Values torch refuses are refused first, as torch does.
    with pytest.raises(TypeError, match="max_input_buffers must be an int"):
        m.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="positive int"):
        m.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="enable must be a bool"):
        m.set_separate_reduce_scatter_group(1)


def test_all_reduce_hook_errors(one_rank) -> None:
    m = _tiny(one_rank)
    with pytest.raises(TypeError, match="expects a callable"):
        m.set_all_reduce_hook(3)
    with pytest.raises(TypeError, match="expects a torch.Stream"):
        m.set_all_reduce_hook(lambda t: None, stream="s")
    with pytest.raises(ValueError, match=r"Stream on cpu for a unit on cpu; pass torch.get_device_module\('cpu'\).Stream\(\)"):
        m.set_all_reduce_hook(lambda t: None, stream=torch.Stream(device="cpu"))
    hsdp_mesh = dp_mesh((1, 1))
    h = th.fully_shard(nn.Linear(2, 2), mesh=hsdp_mesh)
    with pytest.raises(ValueError, match="^stream cannot be set when using native HSDP$"):
        h.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())
    # A CPU mesh's stream is the current one while the hook runs, as in torch.
    stream, seen = torch.cpu.Stream(), []
    m.set_all_reduce_hook(lambda t: seen.append(torch.cpu.current_stream()), stream=stream)
    m(torch.randn(3, 4)).sum().backward()
    assert seen == [stream, stream], seen
    assert torch.cpu.current_stream() is not stream
    # None removes the hook.
    calls = []
    m.set_all_reduce_hook(calls.append)
    m(torch.randn(3, 4)).sum().backward()
    assert len(calls) == 2  # the root unit's two trainable parameters
    m.set_all_reduce_hook(None)
    m(torch.randn(3, 4)).sum().backward()
    assert len(calls) == 2


class RecordingEvent(torch.Event):
    """A torch.Event that counts ``wait()`` calls instead of waiting (a CPU event
    cannot be recorded or waited on: "cpu backend doesn't support events")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waits = 0

    def wait(self, stream: Any = None) -> None:
        self.waits += 1


def test_post_optim_event(one_rank) -> None:
    m = _tiny(one_rank)
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="expects a torch.Event"):
        m.set_post_optim_event(object())
    e = RecordingEvent(device="cpu")
    m.set_post_optim_event(e)
    m.set_post_optim_event(e)  # set twice before a forward: one wait
    m(x)
    m(x)
    assert e.waits == 1  # once, then dropped
    assert not m._forward_pre_hooks  # the one-shot hook is gone
    # On a nested unit it is the root's event: waited before the root's forward.
    e2 = RecordingEvent(device="cpu")
    m[0].set_post_optim_event(e2)
    m[0](x)
    assert e2.waits == 0
    m(x)
    assert e2.waits == 1
    # A real torch.Event is accepted. On the CPU it cannot be recorded ("cpu backend
    # doesn't support events"); waiting on an unrecorded one is a no-op.
    m.set_post_optim_event(torch.Event(device="cpu"))
    m(x)
    assert not m._forward_pre_hooks
    # What torch.cpu.current_stream().record_event() returns (None) clears a pending
    # event: nothing is waited for.
    e3 = RecordingEvent(device="cpu")
    m.set_post_optim_event(e3)
    m.set_post_optim_event(torch.cpu.current_stream().record_event())
    m(x)
    assert e3.waits == 0 and not m._forward_pre_hooks


def test_post_optim_event_step_compiled_whole(one_rank) -> None:
    """A step compiled whole (torch._dynamo.config.compiled_autograd): dynamo
    inlines the model's call and ignores hooks added after it compiled, so the root's
    pre-forward waits instead; once per event, and a new event each step compiles
    nothing new (dynamo guards on a bool, not on the event)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    m = _tiny(one_rank)
    x = torch.randn(3, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = m(x).sum()
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    waits, frames = [], []
    try:
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled = torch.compile(step, backend=counter)
            for i in range(6):
                event = RecordingEvent(device="cpu")
                if i in (2, 3, 5):
                    m.set_post_optim_event(event)
                compiled(x)
                waits.append(event.waits)
                frames.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert waits == [0, 0, 1, 1, 0, 1], waits
    assert frames[2:] == [frames[2]] * 4, frames  # compiled by step 2, then no more


def test_reset_iter_state_single_rank(one_rank) -> None:
    m = _tiny(one_rank)
    with pytest.raises(RuntimeError, match="must be called on the root"):
        m[0].reset_iter_state()

    def boom(module, args):
        raise KeyError("boom")

    handle = m[2].register_forward_pre_hook(boom)
    with pytest.raises(KeyError):
        m(torch.randn(3, 4))
    # The root unit is mid-forward: its modules hold the gathered placeholders.
    assert not isinstance(m[2].weight, torch.distributed.tensor.DTensor)
    m.reset_iter_state()
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in m.parameters())
    handle.remove()
    m(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_reduce_scatter_unused_params_refused_compiled(one_rank) -> None:
    """Compiled backwards cannot reduce at the end of the backward: refused loudly
    in every way in, never silently wrong."""
    m = _tiny(one_rank)
    x = torch.randn(3, 4)
    with pytest.raises(TypeError, match="must be a bool"):
        m.set_reduce_scatter_unused_params("yes")
    m.set_reduce_scatter_unused_params(True)
    torch._dynamo.reset()
    th.enable_compiled_autograd(backend="aot_eager")
    try:
        # Eager forward, compiled autograd on: refused at the root's pre-forward.
        with pytest.raises(RuntimeError, match="set_reduce_scatter_unused_params"):
            m(x)
        m.reset_iter_state()
        # Compiled forward (fullgraph): refused while tracing, with the fix.
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match="set_reduce_scatter_unused_params"):
            compiled(x)
        m.reset_iter_state()
        # Turned on after an eager forward, before a compiled backward: the
        # backward's hook refuses it.
        m.set_reduce_scatter_unused_params(False)
        out = m(x).sum()
        m.set_reduce_scatter_unused_params(True)
        with pytest.raises(RuntimeError, match="set_reduce_scatter_unused_params"):
            out.backward()
        m.reset_iter_state()
    finally:
        th.disable_compiled_autograd()
        torch._dynamo.reset()
    # Eagerly it runs.
    m.zero_grad()
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


STEPS = 3


def _states(model: nn.Module) -> list[Any]:
    out = []
    for m in model.modules():
        s = m.__dict__.get("_traceable_hsdp_state")
        if s is not None and s not in out:
            out.append(s)
    return out


# ------------------------------------------------------------ models
class _Branchy(nn.Module):
    """A unit whose second linear is skipped when ``use_b`` is False."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.use_b:
            h = h + self.b(h)
        return h


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Branchy() for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x).square().mean()


# ------------------------------------------------------------ all-reduce hook
def _replicate_hook(group: dist.ProcessGroup, world: int) -> Any:
    """DDP over ``group`` done by the hook: what torch's docs suggest the hook for
    (1-D FSDP within a replica, all-reduce across replicas)."""

    def hook(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=group)  # gloo has no AVG all-reduce: sum, divide
        reduced.div_(world)

    return hook


def _train_hooked(
    rank: int, world: int, mode: str, rec: GraphRecorder | None = None
) -> dict[str, Any]:
    """A small 3-unit net sharded over a size-1 shard group per rank (a (2, 1)
    mesh's shard dim), every unit's all-reduce hook all-reducing over the replicate
    dim: data parallel over the ranks, against one process on the global batch
    (AdamW). A new stand-in post-optimizer event is set every step."""
    mesh = dp_mesh((world, 1))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(world * 4, 8, generator=g) for _ in range(STEPS)]
    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(0)
    model = _Net()
    for blk in model.blocks:
        th.fully_shard(blk, mesh=mesh["shard"])
    th.fully_shard(model, mesh=mesh["shard"])
    hook = _replicate_hook(mesh.get_group("replicate"), world)
    for m in [*model.blocks, model]:
        m.set_all_reduce_hook(hook)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_losses = []
    for xb in batches:  # first: compiled autograd would compile its backward too
        ref_loss = ref(xb)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    fwd: Any = model
    if mode == "compiled":
        torch._dynamo.reset()
        th.enable_compiled_autograd(backend=rec)
        fwd = torch.compile(model, backend=rec, fullgraph=True)
    losses, waits, graphs_after_step, bytes_after_bwd = [], [], [], []
    for xb in batches:
        event = RecordingEvent(device="cpu")
        model.set_post_optim_event(event)
        loss = fwd(xb.chunk(world)[rank])
        loss.backward()
        bytes_after_bwd.append(_placeholder_bytes(model))
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world))
        waits.append(event.waits)
        if rec is not None:
            graphs_after_step.append((len(rec.forward), len(rec.backward)))
    if mode == "compiled":
        th.disable_compiled_autograd()
    return dict(
        losses=losses,
        ref_losses=ref_losses,
        params=full_state(model),
        ref_params={k: v.detach().clone() for k, v in ref.state_dict().items()},
        waits=waits,
        graphs_after_step=graphs_after_step,
        bytes_after_bwd=bytes_after_bwd,
    )


def _hook_eager(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"replicate_hook": _train_hooked(rank, world, "eager")}

    # 1-D FSDP over both ranks: the hook sees each reduce-scatter output (the local
    # shard, before the divide factor) and doubles it in place.
    x, y = _data(world, 1)[0]
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]

    def grads(setup: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Llama(CFG)
        shard_llama(model, th.fully_shard)
        setup(model)
        _loss(model(xs), ys).backward()
        return {k: full_tensor(p.grad) for k, p in model.named_parameters()}

    base = grads(lambda m: None)
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def doubling(reduced: torch.Tensor) -> None:
        seen.append((tuple(reduced.shape), reduced.dtype))
        reduced.mul_(2)

    local_shapes: list[tuple[int, ...]] = []

    def setup(m: Llama) -> None:
        m.layers[0].set_all_reduce_hook(doubling)  # this unit only
        # On the root only: its own parameters are summed, not averaged; the
        # blocks keep the average (torch's setter has no recurse: applied to every
        # unit inside, the blocks' gradients would be off by the world size).
        m.set_gradient_divide_factor(1.0)
        local_shapes.extend(
            tuple(fp.sharded_param.to_local().shape) for fp in _managed(m.layers[0])
        )

    doubled = grads(setup)
    out["hook_shapes"] = seen
    out["local_shapes"] = local_shapes
    out["doubled_diff"] = {
        k: (doubled[k] - (2 if k.startswith("layers.0.") else 1 if k.startswith("layers.") else world) * base[k])
        .abs()
        .max()
        .item()
        for k in base
    }

    # HSDP on a (2, 1) mesh: the hook sees the all-reduce output, which is what lands
    # in .grad (no divide factor).
    mesh = dp_mesh((world, 1))
    torch.manual_seed(0)
    lin = th.fully_shard(nn.Linear(4, 3), mesh=mesh)
    kept: list[torch.Tensor] = []
    lin.set_all_reduce_hook(lambda t: kept.append(t.clone()))
    torch.manual_seed(rank)
    lin(torch.randn(5, 4)).sum().backward()
    grads_local = [p.grad.to_local() for p in lin.parameters()]
    out["hsdp_hook_is_grad"] = len(kept) == 2 and all(
        torch.equal(a, b) for a, b in zip(sorted(kept, key=lambda t: t.dim()),
                                           sorted(grads_local, key=lambda t: t.dim()))
    )
    # ...and differs from this rank's own gradient (it was all-reduced).
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    torch.manual_seed(rank)
    ref(torch.randn(5, 4)).sum().backward()
    out["hsdp_differs_from_local"] = not torch.equal(ref.weight.grad, lin.weight.grad.to_local())
    return out


# ------------------------------------------------------------ reset_iter_state
class _Fail(Exception):
    pass


def _reset(rank: int, world: int) -> dict[str, Any]:
    """5 steps; step 1 raises inside layers[1]'s forward, step 3 raises in the
    backward (after the output head, the final norm and layers[1]'s parameters had
    their gradients reduced, with layers[0] re-gathered). Each is caught, reset_iter_state() and zero_grad() are
    called, and training goes on; against a run of steps 0, 2 and 4 only."""
    data = _data(world, 5)

    def build() -> tuple[Llama, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Llama(CFG)
        shard_llama(model, th.fully_shard)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def step(model: Llama, opt: Any, i: int) -> float:
        x, y = data[i]
        loss = _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    ref, ref_opt = build()
    ref_losses = [step(ref, ref_opt, i) for i in (0, 2, 4)]

    model, opt = build()
    fail = {"forward": False, "backward": False}

    def raise_in_forward(module: nn.Module, args: Any) -> None:
        if fail["forward"]:
            raise _Fail("forward")

    def raising_grad_hook(grad: torch.Tensor) -> torch.Tensor:
        raise _Fail("backward")

    def hook_output(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if fail["backward"]:
            output.register_hook(raising_grad_hook)

    model.layers[1].attn.register_forward_pre_hook(raise_in_forward)
    model.layers[0].register_forward_hook(hook_output)
    losses, caught, after_reset = [], [], []
    for i in range(5):
        fail["forward"], fail["backward"] = i == 1, i == 3
        try:
            losses.append(step(model, opt, i))
        except _Fail as e:
            # What the failure left behind, then the reset.
            left = dict(
                gathered_bytes=_placeholder_bytes(model),
                busy=sorted(str(s.training_state) for s in _states(model)
                            if s.training_state is not TrainingState.IDLE),
                sharded_grads=sum(fp.sharded_param.grad is not None for fp in _managed(model)),
            )
            model.reset_iter_state()
            opt.zero_grad()
            caught.append((str(e), left))
            after_reset.append(dict(
                gathered_bytes=_placeholder_bytes(model),
                busy=sum(s.training_state is not TrainingState.IDLE for s in _states(model)),
                module_holds_sharded=all(
                    isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters()
                ),
                placeholder_grads=sum(fp.unsharded_param.grad is not None for fp in _managed(model)),
            ))
    return dict(
        losses=losses,
        ref_losses=ref_losses,
        params=full_state(model),
        ref_params=full_state(ref),
        caught=caught,
        after_reset=after_reset,
        bytes_at_end=_placeholder_bytes(model),
    )


# ------------------------------------------------------------ unused params
def _unused(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 skips blocks[0].b (rank 0 uses it): with
    set_reduce_scatter_unused_params(True) both ranks reduce the same parameters, so
    the run finishes and matches one process that averages rank 0's gradient (with
    b) and rank 1's (without)."""
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(world, 4, 8, generator=g) for _ in range(STEPS)]

    torch.manual_seed(0)
    ref = _Net()
    torch.manual_seed(0)
    model = _Net()
    for blk in model.blocks:
        th.fully_shard(blk)
    th.fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    model.blocks[0].use_b = rank == 0
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, ref_losses, b_grad_on_rank1 = [], [], []
    for xb in batches:
        loss = model(xb[rank])
        loss.backward()
        b_grad_on_rank1.append(model.blocks[0].b.weight.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world))
        total = 0.0
        for r in range(world):
            ref.blocks[0].use_b = r == 0
            lr = ref(xb[r]) / world
            lr.backward()
            total += lr.item()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)
    return dict(
        losses=losses,
        ref_losses=ref_losses,
        params=full_state(model),
        ref_params={k: v.detach().clone() for k, v in ref.state_dict().items()},
        b_grad=b_grad_on_rank1,
        bytes_at_end=_placeholder_bytes(model),
    )


class _Trunk(nn.Module):
    """A unit with a frozen Linear: its backward also waits for its input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.frozen(x).relu())


class _TwoLosses(nn.Module):
    """Two losses on one trunk; ``shared`` is a unit called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.trunk = _Trunk()
        self.shared = nn.Linear(8, 8)
        self.h1 = nn.Linear(8, 1)
        self.h2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.trunk(self.inp(x))
        t = self.shared(self.shared(t).relu())
        return self.h1(t).sum(), self.h2(t).pow(2).mean()


def _retained(rank: int, world: int) -> dict[str, Any]:
    """Two backward calls through one graph (``retain_graph=True`` on the first), per
    step, for ours and torch's fully_shard; then ours refusing a graph older than the
    last backward's. See [Note: A second backward through a retained graph]."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {}
    for lib, fs in (("torch", torch_fully_shard), ("ours", th.fully_shard)):
        torch.manual_seed(0)
        model = _TwoLosses()
        model.trunk.frozen.requires_grad_(False)
        for unit in (model.trunk, model.shared, model):
            fs(unit)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        g = torch.Generator().manual_seed(11 + rank)
        losses = []
        for _ in range(STEPS):
            l1, l2 = model(torch.randn(4, 8, generator=g))
            l1.backward(retain_graph=True)
            l2.backward()
            opt.step()
            opt.zero_grad()
            losses.append((l1.item(), l2.item()))
        out[lib] = dict(losses=losses, params=full_state(model), bytes_at_end=_placeholder_bytes(model))
        if lib == "ours":
            old, _ = model(torch.randn(4, 8, generator=g))
            old.backward(retain_graph=True)
            new, _ = model(torch.randn(4, 8, generator=g))
            new.backward()
            try:
                old.backward()
                out["refused"] = None
            except RuntimeError as e:
                out["refused"] = str(e)
            model.reset_iter_state()
    return out


def eager_worker(rank: int, world: int) -> dict[str, Any]:
    return dict(
        hook=_hook_eager(rank, world),
        reset=_reset(rank, world),
        unused=_unused(rank, world),
        retained=_retained(rank, world),
    )


def test_methods_eager_2_ranks() -> None:
    """set_all_reduce_hook, reset_iter_state, set_reduce_scatter_unused_params and
    set_post_optim_event, eagerly on 2 gloo ranks; and a second backward through a
    graph kept with retain_graph=True (two losses on one trunk, a unit with a frozen
    parameter, a unit called twice), bitwise equal to torch's fully_shard."""
    results = run_ranks(eager_worker, 2)
    for rank, r in enumerate(results):
        # --- all-reduce hook doing DDP over replicas = data parallel (+ event)
        h = r["hook"]["replicate_hook"]
        torch.testing.assert_close(h["losses"], h["ref_losses"], rtol=1e-5, atol=0)
        for k, v in h["ref_params"].items():
            torch.testing.assert_close(h["params"][k], v, rtol=0, atol=2e-5, msg=k)
        assert h["waits"] == [1, 1, 1] and h["bytes_after_bwd"] == [0, 0, 0]
        # --- the hook sees each reduce-scatter output (local shard, before the
        # divide factor), once per parameter of its unit only, and may change it.
        hook = r["hook"]
        shapes = sorted(shape for shape, _ in hook["hook_shapes"])
        assert len(shapes) == 9 and shapes == sorted(hook["local_shapes"]), hook
        assert {dtype for _, dtype in hook["hook_shapes"]} == {torch.float32}
        assert max(hook["doubled_diff"].values()) == 0, hook["doubled_diff"]
        # HSDP: the hook sees the all-reduce output, which is what lands in .grad.
        assert hook["hsdp_hook_is_grad"] and hook["hsdp_differs_from_local"]

        # --- reset_iter_state: bitwise against the run without the failed steps
        s = r["reset"]
        assert s["losses"] == s["ref_losses"], (s["losses"], s["ref_losses"])
        for k, v in s["ref_params"].items():
            torch.testing.assert_close(s["params"][k], v, rtol=0, atol=0, msg=k)
        (fwd_msg, fwd_left), (bwd_msg, bwd_left) = s["caught"]
        assert fwd_msg == "forward" and bwd_msg == "backward"
        # What each failure left behind (so the reset had work to do)...
        assert fwd_left["gathered_bytes"] > 0 and "TrainingState.FORWARD" in fwd_left["busy"]
        assert bwd_left["gathered_bytes"] > 0 and "TrainingState.PRE_BACKWARD" in bwd_left["busy"]
        assert bwd_left["sharded_grads"] > 0  # the root unit and layers[1] had reduced
        # ...and what the reset left.
        for a in s["after_reset"]:
            assert a == dict(gathered_bytes=0, busy=0, module_holds_sharded=True, placeholder_grads=0), a
        assert s["bytes_at_end"] == 0

        # --- unused params: rank 1 skips blocks[0].b; same collectives on both ranks
        u = r["unused"]
        torch.testing.assert_close(u["losses"], u["ref_losses"], rtol=1e-5, atol=0)
        for k, v in u["ref_params"].items():
            torch.testing.assert_close(u["params"][k], v, rtol=0, atol=2e-5, msg=k)
        # Rank 1 did not use b but got its (averaged) gradient: zeros joined the sum.
        assert u["b_grad"] == [True] * 3
        assert u["bytes_at_end"] == 0

        # --- a second backward through a retained graph: bitwise equal to torch's
        t, o = r["retained"]["torch"], r["retained"]["ours"]
        assert o["losses"] == t["losses"], (o["losses"], t["losses"])
        for k, v in t["params"].items():
            torch.testing.assert_close(o["params"][k], v, rtol=0, atol=0, msg=k)
        assert o["bytes_at_end"] == 0
        assert "ran again through the graph of an earlier forward" in str(r["retained"]["refused"])


@pytest.mark.xfail(
    strict=True,
    raises=IndexError,
    reason="torch 2.13-2.15: a second backward through a graph kept with retain_graph=True "
    "fails under compiled autograd when the compiled forward registered a tensor hook "
    "(handed to the backward in a BackwardState): IndexError in the compiled backward's "
    "AOT prologue. Every fully_shard forward registers such hooks, so ours fails there "
    "too (docs/api.md). Strict: tells us when torch fixes it.",
)
def test_torch_compiled_autograd_second_backward_with_a_traced_hook() -> None:
    # In a child process: the failure is inside torch's compiled autograd, which may
    # leave its compile context entered for the rest of this process.
    code = textwrap.dedent(
        """
        import torch
        from torch._dynamo import compiled_autograd

        lin = torch.nn.Linear(4, 4)

        def fwd(x):
            h = lin(x)
            h.register_hook(lambda g: g)
            return h.relu()

        compiled = torch.compile(fwd, backend="aot_eager", fullgraph=True)
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            y = compiled(torch.ones(2, 4)).sum()
            y.backward(retain_graph=True)
            y.backward()
        """
    )
    run_child(code, IndexError)


def hook_compiled_worker(rank: int, world: int) -> dict[str, Any]:
    rec = GraphRecorder()
    out = _train_hooked(rank, world, "compiled", rec)
    out["fwd_counts"], out["bwd_counts"] = rec.forward, rec.backward
    return out


@pytest.mark.slow
def test_all_reduce_hook_compiled_2_ranks() -> None:
    """The all-reduce hook (a dist.all_reduce over the replicate group) traced into
    the compiled-autograd backward graph (aot_eager): data-parallel parity with one
    process; a new post-optimizer event every step is waited on outside the graph
    without recompiling."""
    for r in run_ranks(hook_compiled_worker, 2):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=0)
        for k, v in r["ref_params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=2e-5, msg=k)
        assert r["waits"] == [1, 1, 1]
        assert r["graphs_after_step"] == [(1, 1)] * 3, r["graphs_after_step"]
        n_params = 2 * 4 + 2  # two blocks of two linears, the head
        (fwd,), (bwd,) = r["fwd_counts"], r["bwd_counts"]
        assert "all_reduce" not in fwd, fwd
        # No collective over the size-1 shard group (see [Note: Groups of one rank]
        # in _collectives.py), and one hook all-reduce per parameter, in the
        # backward graph.
        assert "reduce_scatter_tensor" not in bwd and "all_gather_into_tensor" not in fwd, (fwd, bwd)
        assert bwd["all_reduce"] == n_params, bwd
        assert r["bytes_after_bwd"] == [0, 0, 0]


def test_held_gradient_of_a_parameter_unused_when_syncing(one_rank) -> None:
    """Gradient accumulation where a parameter is used in the no-sync micro-batch but
    not in the syncing one: eagerly its kept gradient is reduced at the end of the
    syncing backward (equal to a plain model's accumulated gradient, tolerance 1e-6);
    with a compiled backward the next forward raises instead of letting the
    gradient slip into a later step. See [Note: Held gradients of unused parameters]."""

    def build(b_unit: bool) -> tuple[nn.Module, nn.Module]:
        """``b_unit``: b is a unit of its own, whose forward does not run at all in
        the syncing micro-batch; else b is in the root unit, which runs."""
        torch.manual_seed(0)
        ref = _Branchy()
        model = _Branchy()
        model.load_state_dict(ref.state_dict())
        if b_unit:
            th.fully_shard(model.b, mesh=one_rank)
        th.fully_shard(model, mesh=one_rank)
        return model, ref

    xs = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))

    def micro_batches(model: nn.Module, fwd: Any) -> None:
        model.set_requires_gradient_sync(False)
        model.use_b = True
        fwd(xs[0]).sum().backward()
        model.set_requires_gradient_sync(True)
        model.use_b = False  # b gets no gradient in the syncing backward
        fwd(xs[1]).sum().backward()

    for b_unit in (False, True):
        model, ref = build(b_unit)
        micro_batches(model, model)
        ref.use_b = True
        ref(xs[0]).sum().backward()
        ref.use_b = False
        ref(xs[1]).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, (b_unit, name)
            torch.testing.assert_close(full_tensor(p.grad), q.grad, rtol=0, atol=1e-6,
                                       msg=f"{b_unit} {name}")
        assert _managed_grads_held(model) == []
        if b_unit:
            # Compiled, a unit that did not run at all is not checked (the known gap
            # in the Note).
            continue

        model, _ = build(b_unit)
        torch._dynamo.reset()
        th.enable_compiled_autograd(backend="aot_eager")
        try:
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
            micro_batches(model, compiled)
            assert _managed_grads_held(model) == ["b.weight", "b.bias"]
            with pytest.raises(Exception, match="set_requires_gradient_sync"):
                compiled(xs[0])
            model.reset_iter_state()
            assert _managed_grads_held(model) == []
            # Used in the syncing micro-batch too: nothing held, no error.
            model.use_b = True
            model.set_requires_gradient_sync(False)
            compiled(xs[0]).sum().backward()
            model.set_requires_gradient_sync(True)
            compiled(xs[1]).sum().backward()
            compiled(xs[0])
        finally:
            th.disable_compiled_autograd()
            torch._dynamo.reset()


def _managed_grads_held(model: nn.Module) -> list[str]:
    from _workers import _managed

    return [fp.fqn for fp in _managed(model) if fp.accumulated_grad is not None]


def test_register_fsdp_forward_method(one_rank) -> None:
    """A method other than forward that reads the parameters: without registration it
    meets the sharded DTensors (as with torch's fully_shard); registered, it gathers,
    trains and reshards like forward. A no-op on a module that is not sharded."""

    class Sampler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def sample(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.lin.weight) * 2

    plain = Sampler()
    th.register_fsdp_forward_method(plain, "sample")  # not sharded: nothing happens
    assert "sample" not in plain.__dict__
    m = th.fully_shard(Sampler(), mesh=one_rank)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        m.sample(x)
    with pytest.raises(ValueError, match="does not have a method 'nope'"):
        th.register_fsdp_forward_method(m, "nope")
    # Ours, and torch's own helper (which works through _get_fsdp_state's view; see
    # [Note: A subclass of torch's FSDPModule]).
    for register in (th.register_fsdp_forward_method, torch_fsdp.register_fsdp_forward_method):
        m = th.fully_shard(Sampler(), mesh=one_rank)
        register(m, "sample")
        w = full_tensor(m.lin.weight).clone()
        out = m.sample(x)
        torch.testing.assert_close(out, x @ w.T * 2, rtol=0, atol=0)
        out.sum().backward()
        grad = full_tensor(m.lin.weight.grad)
        torch.testing.assert_close(grad, 2 * x.sum(0).expand(4, 4), rtol=0, atol=0)
        assert isinstance(m.lin.weight, DTensor)  # resharded after the method


def test_share_comm_ctx_and_state(one_rank) -> None:
    """torch's module-level helpers: share_comm_ctx checks its argument as torch's and
    has no streams to share; fully_shard.state(module) returns the unit's state."""
    a = th.fully_shard(nn.Linear(2, 2), mesh=one_rank)
    b = th.fully_shard(nn.Linear(2, 2), mesh=one_rank)
    th.share_comm_ctx([a, b])
    with pytest.raises(ValueError, match="Expects list of FSDPModules"):
        th.share_comm_ctx([a, nn.Linear(2, 2)])
    # torch's share_comm_ctx reads torch's private state: a clear error, not a crash
    # deep in torch.
    assert isinstance(a, torch_fsdp.FSDPModule)
    with pytest.raises(AttributeError, match="traceable_hsdp: '_comm_ctx' is an attribute of torch's private"):
        torch_fsdp.share_comm_ctx([a, b])
    state = th.fully_shard.state(a)
    assert state is a._traceable_hsdp_state and state.is_root
    assert [fp.fqn for fp in state.param_group.fsdp_params] == ["weight", "bias"]
    assert th.fully_shard.state(nn.Linear(2, 2)) is None


def test_fully_shard_under_torch_public_name(one_rank) -> None:
    """A library that calls torch's public name (HF accelerate's fsdp2_prepare_model
    imports ``torch.distributed.fsdp.fully_shard`` when it runs) is switched by patching
    that name with ours. Ours then still registers the unit where torch's
    ``fully_shard.state`` looks (it keyed by the public name's ``__wrapped__``, and
    raised an AttributeError when the name was ours)."""
    from unittest import mock

    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fs

    with mock.patch("torch.distributed.fsdp.fully_shard", th.fully_shard):
        m = torch_fsdp.fully_shard(nn.Linear(2, 2), mesh=one_rank)
    assert torch_fsdp.fully_shard is torch_fs
    assert isinstance(m, th.FSDPModule) and th.fully_shard.state(m).is_root
    # torch's own accessor (pipelining's) finds the view of our state.
    assert torch_fs.state(m) is not None
    m(torch.randn(1, 2)).sum().backward()
    assert isinstance(m.weight.grad, DTensor)


def test_labels_a_frame_below_the_root_traces(one_rank) -> None:
    """The label a unit traces into its collectives' annotations is
    ``frame_labels[k - 1]`` when the frame being traced holds k unit forwards (a block
    compiled alone holds its own and its nested units'), its path beyond them, so that
    one frame serves every block ([Note: One graph for every unit of a class] in
    traceable_hsdp/_common.py; ``test_conformance_compiled_aot_eager`` counts the
    graphs): the unit's class, then its path below each enclosing unit, named by that
    unit's class."""
    from traceable_hsdp.demo.models import Llama

    from _workers import CFG

    model = Llama(CFG)
    for block in model.layers:
        th.fully_shard(block.ffn, mesh=one_rank)
        th.fully_shard(block, mesh=one_rank)
    th.fully_shard([model.norm, model.output], mesh=one_rank)
    th.fully_shard(model, mesh=one_rank)

    def labels(m: nn.Module) -> tuple[str, tuple[str, ...]]:
        group = th.fully_shard.state(m).param_group
        return group.label, group.frame_labels

    assert labels(model.layers[1].ffn) == ("layers.1.ffn", ("FeedForward", "Block.ffn"))
    assert labels(model.layers[1]) == ("layers.1", ("Block",))
    assert labels(model.norm) == ("[norm, output]", ("RMSNorm",))
    assert labels(model) == ("Llama", ("Llama",))
    # Eagerly no frame is traced: the path.
    assert th.fully_shard.state(model.layers[1].ffn).param_group.traced_label == "layers.1.ffn"
