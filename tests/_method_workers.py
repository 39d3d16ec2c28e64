"""Per-rank bodies of tests/test_module_methods.py (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import traceable_hsdp as th
from _dist import full_tensor
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
)
from traceable_hsdp._common import TrainingState
from traceable_hsdp.demo.models import Llama, shard_llama

STEPS = 3


class RecordingEvent(torch.Event):
    """A torch.Event that counts ``wait()`` calls instead of waiting (a CPU event
    cannot be recorded or waited on: "cpu backend doesn't support events")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.waits = 0

    def wait(self, stream: Any = None) -> None:
        self.waits += 1


def _states(model: nn.Module) -> list[Any]:
    out = []
    for m in model.modules():
        s = m.__dict__.get("_traceable_hsdp_state")
        if s is not None and s not in out:
            out.append(s)
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v) for k, v in model.state_dict().items()}


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
        params=_full(model),
        ref_params={k: v.detach().clone() for k, v in ref.state_dict().items()},
        waits=waits,
        graphs_after_step=graphs_after_step,
        bytes_after_bwd=bytes_after_bwd,
    )


def hook_compiled_worker(rank: int, world: int) -> dict[str, Any]:
    rec = GraphRecorder()
    out = _train_hooked(rank, world, "compiled", rec)
    out["fwd_counts"], out["bwd_counts"] = rec.forward, rec.backward
    return out


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
        params=_full(model),
        ref_params=_full(ref),
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
        params=_full(model),
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
        out[lib] = dict(losses=losses, params=_full(model), bytes_at_end=_placeholder_bytes(model))
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
