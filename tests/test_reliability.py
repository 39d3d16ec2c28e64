"""Paths that could be silently wrong: CPU offload copies on a GPU, the order of
explicit prefetch, uneven shards at the edges, units compiled below an eager root, a
graph break inside a unit under Inductor, gradient hooks that compiled autograd runs
eagerly (``nested_compile_region`` blocks), and a rank that dies mid-step (the
survivors, and ``traceable-hsdp train``), the exit of a gloo job (its worker threads
joined before the interpreter finalizes), and the tests' own gathering (without
gloo's allocating all-gather, which crashes rarely). Each test states its reference
and tolerance. The Inductor feature tests are in test_inductor_features.py; the
placeholder ops in the real post-grad graphs before our passes are checked in
test_passes_e2e.py, on the fully_shard model of its two-models test (the same kind
of Inductor compile).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
import traceable_hsdp.passes._graph as G
from _dist import full_tensor
from traceable_hsdp.debug._recorder import current_compile
from traceable_hsdp.demo.models import Llama


# --------------------------------------------------------------- CPU offload
# See [Note: Offload copies and the CPU] (_param.py). No GPU here: the reduced
# gradient is a stand-in for a device tensor, and the stream and event calls are
# recorded, so the test pins the order of copy, record, synchronize and CPU read.


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


class _FakeStream:
    def __init__(self, log: list) -> None:
        self.log = log

    def record_event(self) -> _FakeEvent:
        self.log.append("record_event")
        return _FakeEvent(self.log)


class _DeviceGrad:
    """A reduced gradient shard as if on ``cuda:0``: ``.to`` a dtype is itself, ``.to``
    the CPU logs the copy and returns the data."""

    device = torch.device("cuda", 0)

    def __init__(self, data: torch.Tensor, log: list) -> None:
        self.data, self.log = data, log
        self.dtype = data.dtype

    def to(self, dest: Any, non_blocking: bool = False) -> Any:
        if isinstance(dest, torch.dtype):
            return self
        assert torch.device(dest).type == "cpu", dest
        self.log.append(("copy_to_cpu", non_blocking))
        return self.data.clone()


def _offloaded(one_rank, pin_memory: bool) -> tuple[nn.Module, Any]:
    m = th.fully_shard(nn.Linear(4, 3), mesh=one_rank,
                       offload_policy=th.CPUOffloadPolicy(pin_memory=pin_memory))
    return m, m._traceable_hsdp_state.param_group.fsdp_params[0]


@pytest.fixture
def stream_log(monkeypatch) -> list:
    log: list = []
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: _FakeStream(log))
    return log


def test_offload_grad_copy_waits_before_cpu_reads(one_rank, stream_log) -> None:
    log = stream_log
    _, fp = _offloaded(one_rank, pin_memory=True)
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4)
    # First reduction, nothing to add to: asynchronous copy, then an event.
    fp._accumulate_reduced(_DeviceGrad(g1, log))
    assert log == [("copy_to_cpu", True), "record_event"]
    assert fp.grad_offload_event is not None
    # The root's end-of-backward callback waits for it (before the optimizer).
    fp.wait_grad_offload()
    assert log[-1] == "synchronize" and fp.grad_offload_event is None
    # Accumulating: the CPU add reads the copy at once, so the copy blocks.
    log.clear()
    fp._accumulate_reduced(_DeviceGrad(g2, log))
    assert log == [("copy_to_cpu", False)]
    torch.testing.assert_close(fp.sharded_param.grad.to_local(), g1 + g2, rtol=0, atol=0)
    # A pending event when the gradient is reduced again is waited for first.
    fp.sharded_param.grad = None
    log.clear()
    fp._accumulate_reduced(_DeviceGrad(g1, log))
    fp._accumulate_reduced(_DeviceGrad(g2, log))
    assert log == [("copy_to_cpu", True), "record_event", "synchronize", ("copy_to_cpu", False)]


def test_offload_grad_copy_blocks_when_read_early(one_rank, stream_log, monkeypatch) -> None:
    log = stream_log
    # Not pinned: blocking (as torch's FSDP2).
    _, fp = _offloaded(one_rank, pin_memory=False)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None
    # A post-accumulate-grad hook on the sharded parameter reads .grad at once.
    log.clear()
    _, fp = _offloaded(one_rank, pin_memory=True)
    fp.sharded_param.register_post_accumulate_grad_hook(lambda p: None)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None
    # Traced (compiled backward): no end-of-backward callback to wait in.
    log.clear()
    _, fp = _offloaded(one_rank, pin_memory=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None


def test_offload_event_waited_before_backward_returns(one_rank) -> None:
    """The wiring: a real eager backward's end-of-backward callback waits for every
    pending copy, and reset_iter_state drops none unwaited."""
    log: list = []
    m, fp = _offloaded(one_rank, pin_memory=True)
    fp.grad_offload_event = _FakeEvent(log)
    m(torch.randn(2, 4)).sum().backward()
    assert log == ["synchronize"] and fp.grad_offload_event is None
    fp.grad_offload_event = _FakeEvent(log)
    m.reset_iter_state()
    assert log == ["synchronize", "synchronize"] and fp.grad_offload_event is None


# ------------------------------------------------------------------- prefetch
# Three units of distinct widths, so the numel of an all-gather's input names its
# unit: on 2 ranks the weight shards hold 24, 30, 20 elements and the bias shards 3,
# 5, 2 (a gather of a whole unit's flat shard: 27, 35, 22).
PREFETCH_WIDTHS = (8, 6, 10, 4)


def _prefetch_model(mesh: Any) -> nn.Sequential:
    torch.manual_seed(0)
    w = PREFETCH_WIDTHS
    model = nn.Sequential(*(nn.Linear(w[i], w[i + 1]) for i in range(len(w) - 1)))
    for layer in model:
        th.fully_shard(layer, mesh=mesh)
    th.fully_shard(model, mesh=mesh)
    return model


def _unit_of_numel(world: int) -> dict[int, int]:
    w = PREFETCH_WIDTHS
    out = {}
    for u in range(len(w) - 1):
        weight, bias = w[u] * w[u + 1] // world, w[u + 1] // world
        out.update({weight: u, bias: u, weight + bias: u})
    return out


def _compress(tokens: list[str]) -> list[str]:
    """Consecutive repeats folded: one unit's per-parameter gathers count once, as do
    back-to-back compute ops."""
    return [t for i, t in enumerate(tokens) if i == 0 or tokens[i - 1] != t]


class _OpOrder(TorchDispatchMode):
    """Records, in dispatch order, each all-gather (as ``ag<unit>``) and each matmul
    (``mm``) that runs eagerly."""

    def __init__(self, unit_of: dict[int, int]) -> None:
        super().__init__()
        self.unit_of, self.tokens = unit_of, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        if "all_gather_into_tensor" in name:
            self.tokens.append(f"ag{self.unit_of[args[0].numel()]}")
        elif name.split(".")[1] in ("mm", "addmm"):
            self.tokens.append("mm")
        return func(*args, **(kwargs or {}))


def _graph_order(gm: torch.fx.GraphModule, unit_of: dict[int, int]) -> list[str]:
    """The same tokens, in the program order of a captured graph."""
    tokens = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if G.is_all_gather(n):
            inp = n.args[0].meta
            tokens.append(f"ag{unit_of[inp.get('example_value', inp.get('val')).numel()]}")
        elif "linear" in name or name.split(".")[-2:-1] in (["mm"], ["addmm"]):
            tokens.append("mm")
    return tokens


def _set_prefetch(model: nn.Sequential) -> None:
    # Not the default order: unit 0 issues unit 2's gather before unit 1's, and unit
    # 2's backward issues unit 0's (unit 1's comes in its own pre-backward).
    model[0].set_modules_to_forward_prefetch([model[2], model[1]])
    model[2].set_modules_to_backward_prefetch([model[0]])


def prefetch_order_worker(rank: int, world: int) -> dict[str, Any]:
    """The order of all-gathers and matmuls: eagerly without and with explicit
    prefetch, and in the graphs compiled (aot_eager) with it; with the losses and
    gradients of both eager runs and the compiled run."""
    mesh = init_device_mesh("cpu", (world,))
    unit_of = _unit_of_numel(world)
    x = torch.randn(4, PREFETCH_WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for name in ("eager", "eager_prefetch"):
        model = _prefetch_model(mesh)
        if name == "eager_prefetch":
            _set_prefetch(model)
        fwd, bwd = _OpOrder(unit_of), _OpOrder(unit_of)
        with fwd:
            loss = model(x).square().sum()
        with bwd:
            loss.backward()
        out[name] = dict(fwd=_compress(fwd.tokens), bwd=_compress(bwd.tokens), loss=loss.item(),
                         grads=[full_tensor(p.grad) for p in model.parameters()])
    graphs: list[tuple[bool, list[str]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append((current_compile()[1], _compress(_graph_order(gm, unit_of))))
        return aot_eager(gm, example_inputs)

    model = _prefetch_model(mesh)
    _set_prefetch(model)
    th.enable_compiled_autograd(backend=backend)
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss = compiled(x).square().sum()
        loss.backward()
    finally:
        th.disable_compiled_autograd()
    out["compiled_prefetch"] = dict(
        fwd=[g for is_bwd, g in graphs if not is_bwd],
        bwd=[g for is_bwd, g in graphs if is_bwd],
        loss=loss.item(),
        grads=[full_tensor(p.grad) for p in model.parameters()],
    )
    return out


def test_explicit_prefetch_issue_order() -> None:
    """The order in which all-gathers are issued, read from the ops dispatched
    eagerly and from the program order of the captured graphs (aot_eager), for three
    Linear units in sequence. Unit 0 prefetches [unit 2, unit 1] in forward; unit 2
    prefetches [unit 0] in backward. Tokens: ``ag<u>`` an all-gather of unit u, ``mm``
    matmuls (consecutive repeats folded). Numbers: the prefetching runs' losses and
    gradients equal the plain eager run's, bitwise eagerly (same ops, reordered
    collectives) and within 1e-6 compiled (aot_eager may reorder float math)."""
    from _dist import run_ranks

    for r in run_ranks(prefetch_order_worker, 2):
        plain, pf, comp = r["eager"], r["eager_prefetch"], r["compiled_prefetch"]
        # Without prefetch: each unit gathers right before its own compute.
        assert plain["fwd"] == ["ag0", "mm", "ag1", "mm", "ag2", "mm"], plain
        assert plain["bwd"] == ["ag2", "mm", "ag1", "mm", "ag0", "mm"], plain
        # With it: the listed units' gathers are issued, in list order, before the
        # prefetching unit's compute.
        assert pf["fwd"] == ["ag0", "ag2", "ag1", "mm"], pf
        assert pf["bwd"] == ["ag2", "ag0", "mm", "ag1", "mm"], pf
        # Compiled: one forward and one backward graph, the same program order.
        assert comp["fwd"] == [pf["fwd"]] and comp["bwd"] == [pf["bwd"]], comp
        assert pf["loss"] == plain["loss"]
        for a, b, c in zip(plain["grads"], pf["grads"], comp["grads"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(c, a, rtol=0, atol=1e-6)
        assert abs(comp["loss"] - plain["loss"]) <= 1e-6


# --------------------------------------------------------------- uneven shards
# Widths chosen for the edges: on 4 shard ranks (1-D) the first weight's 3 rows are
# held 1, 1, 1, 0; the last layer's single row 1, 0, 0, 0; the third weight is
# sharded on dim 1 (shard_placement_fn; 8 columns: uneven Shard(1) is refused, as by
# torch). On 2x2 (HSDP, shard groups of 2): 2, 1; 1, 0 (a 0-row rank in HSDP).
UNEVEN_WIDTHS = (8, 3, 8, 5, 1)
UNEVEN_STEPS, UNEVEN_LR, UNEVEN_BATCH = 3, 0.1, 8


def _uneven_model() -> nn.Sequential:
    torch.manual_seed(0)
    w, layers = UNEVEN_WIDTHS, []
    for i in range(len(w) - 1):
        layers += [nn.Linear(w[i], w[i + 1]), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _uneven_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(UNEVEN_BATCH, UNEVEN_WIDTHS[0], generator=g),
             torch.randn(UNEVEN_BATCH, 1, generator=g)) for _ in range(UNEVEN_STEPS)]


def uneven_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch, SGD: the ground truth."""
    model = _uneven_model()
    opt = torch.optim.SGD(model.parameters(), lr=UNEVEN_LR)
    losses = []
    for x, y in _uneven_data():
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def uneven_worker(rank: int, world: int) -> dict[str, Any]:
    """Trains the edge-width model on a 1-D mesh of all ranks and on a 2 x (world/2)
    HSDP mesh, eagerly and compiled (aot_eager), on this rank's slice of the global
    batch (ranks are data-parallel index order on both meshes)."""
    from torch.distributed.tensor import Shard

    from _workers import GraphRecorder, dp_mesh

    middle = {4}  # module index of the Linear layer sharded on dim 1
    out: dict[str, Any] = {}
    with pytest.raises(NotImplementedError, match=re.escape(
        f"FSDP does not support uneven sharding on dim 1: torch.Size([8, 3]) (world size: {world})"
    )):
        th.fully_shard(nn.Linear(3, 8), mesh=dp_mesh((world,)),
                       shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    for mesh_name, shape in (("1d", (world,)), ("hsdp", (2, world // 2))):
        mesh = dp_mesh(shape)
        for mode in ("eager", "compiled"):
            model = _uneven_model()
            dim1 = {id(model[i].weight) for i in middle}
            for layer in model:
                if isinstance(layer, nn.Linear):
                    th.fully_shard(layer, mesh=mesh,
                                   shard_placement_fn=lambda p: Shard(1) if id(p) in dim1 else None)
            th.fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=UNEVEN_LR)
            rec = GraphRecorder()
            fwd = model
            if mode == "compiled":
                th.enable_compiled_autograd(backend=rec)
                fwd = torch.compile(model, backend=rec, fullgraph=True)
            losses = []
            try:
                for x, y in _uneven_data():
                    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
                    loss = (fwd(xs) - ys).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    t = loss.detach().clone()
                    torch.distributed.all_reduce(t)
                    losses.append(t.item() / world)
            finally:
                th.disable_compiled_autograd()
            sd = model.state_dict()
            out[f"{mesh_name}_{mode}"] = dict(
                losses=losses,
                params={k: full_tensor(v) for k, v in sd.items()},
                local_shapes={k: tuple(v.to_local().shape) for k, v in sd.items()},
                placements={k: str(v.placements) for k, v in sd.items()},
                graphs=(len(rec.forward), len(rec.backward)),
            )
    return out


@pytest.mark.slow
def test_uneven_shards_at_the_edges() -> None:
    """4 ranks, a chain of Linear units whose widths put ranks at the edges (see
    ``UNEVEN_WIDTHS``): ranks holding 0 rows on a 1-D mesh of 4, a Shard(1) weight
    (shard_placement_fn; an uneven one is refused with torch's words), and a 0-row
    rank in each HSDP shard group on 2x2.
    Eager and compiled (aot_eager, compiled autograd) runs against a one-process SGD
    reference on the same global batch: losses rtol 1e-6, parameters atol 1e-6 (not
    bitwise: averaging over ranks sums in another order; 3e-8 seen)."""
    from _dist import run_ranks

    results = run_ranks(uneven_worker, 4)
    ref_losses, ref_params = uneven_reference()
    # The edges are really there (local shard shapes on ranks 3 and 1).
    r3, r1 = results[3]["1d_eager"]["local_shapes"], results[1]["hsdp_eager"]["local_shapes"]
    assert r3["0.weight"] == (0, 8) and r3["0.bias"] == (0,), r3  # 3 rows over 4 ranks
    assert r3["4.weight"] == (5, 2), r3  # 8 columns over 4 ranks, Shard(1)
    assert r1["6.weight"] == (0, 5) and r1["6.bias"] == (0,), r1  # HSDP: 1 row over 2
    assert results[1]["1d_eager"]["placements"]["4.weight"] == "(Shard(dim=1),)"
    for r in results:
        for run, v in r.items():
            torch.testing.assert_close(v["losses"], ref_losses, rtol=1e-6, atol=0, msg=run)
            for k, ref in ref_params.items():
                torch.testing.assert_close(v["params"][k], ref, rtol=0, atol=1e-6, msg=f"{run} {k}")
            # Compiled: one forward and one backward graph over the 3 steps.
            assert v["graphs"] == ((1, 1) if run.endswith("compiled") else (0, 0)), (run, v["graphs"])


# ------------------------------------------------------ compiled below the root
def _below_root_model(frozen_block: bool) -> tuple[nn.Module, nn.Module]:
    """(reference, copy to shard): Linear, a block (Linear, Tanh, Linear, Tanh,
    Linear) whose middle Linear is a unit of its own (its output hooked inside the
    block's graph), Linear. ``frozen_block``: the block's parameters are frozen
    while its input needs grad (the first Linear is trainable)."""
    import copy

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), block, nn.Tanh(), nn.Linear(8, 4))
    if frozen_block:
        block.requires_grad_(False)
    return ref, copy.deepcopy(ref)


def below_root_worker(rank: int, world: int) -> dict[str, Any]:
    """Compiled units without compiled autograd (aot_eager): "nested" compiles the
    block (a unit holding another unit) alone, below an eager root; "frozen" the
    same with the block frozen; "root": the whole model compiled
    (``torch.compile(model)``); "frozen_root": a wholly frozen model compiled whole,
    fed by a trainable Linear outside it. Each against a one-process reference: losses, parameters and
    the outside Linear's gradient; and the placeholder bytes left after each forward
    and backward."""
    from _workers import _placeholder_bytes

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for case in ("nested", "frozen", "root", "frozen_root"):
        torch._dynamo.reset()  # each case its own dynamo caches (and recompile limit)
        ref, model = _below_root_model(frozen_block=case == "frozen")
        if case == "frozen_root":
            ref.requires_grad_(False)
            model.requires_grad_(False)
        torch.manual_seed(1)
        pre = nn.Linear(8, 8)  # outside fully_shard: its input gradient path
        ref_pre = nn.Linear(8, 8)
        ref_pre.load_state_dict(pre.state_dict())
        th.fully_shard(model[2][2], mesh=mesh)
        for i in (0, 2, 4):
            th.fully_shard(model[i], mesh=mesh)
        th.fully_shard(model, mesh=mesh)
        if case in ("root", "frozen_root"):
            fwd = torch.compile(model, backend="aot_eager")
        else:
            model[2] = torch.compile(model[2], backend="aot_eager")
            fwd = model
        params = [p for p in (*model.parameters(), *pre.parameters()) if p.requires_grad]
        ref_params = [p for p in (*ref.parameters(), *ref_pre.parameters()) if p.requires_grad]
        opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
        g = torch.Generator().manual_seed(2)
        losses, ref_losses, bytes_fwd, bytes_bwd = [], [], [], []
        for _ in range(3):
            x = torch.randn(4, 8, generator=g)
            y = fwd(pre(x.chunk(world)[rank]))
            bytes_fwd.append(_placeholder_bytes(model))
            loss = y.square().mean()
            loss.backward()
            bytes_bwd.append(_placeholder_bytes(model))
            # The outside Linear is replicated by hand: average its gradient.
            for p in pre.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
            ref_loss = ref(ref_pre(x)).square().mean()
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
        sd = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
        diff = {k: (full_tensor(sd[k]) - v).abs().max().item() for k, v in ref.state_dict().items()}
        diff.update({f"pre.{k}": (getattr(pre, k) - getattr(ref_pre, k)).abs().max().item()
                     for k in ("weight", "bias")})
        out[case] = dict(losses=losses, ref_losses=ref_losses, diff=diff,
                         bytes_fwd=bytes_fwd, bytes_bwd=bytes_bwd)
    return out


@pytest.mark.slow
def test_units_compiled_without_compiled_autograd_train_correctly() -> None:
    """Compiled with compiled autograd off, each unit's hooks run eagerly around the
    compiled compute ([Note: A unit compiled without compiled autograd] in
    _compile_checks.py), and train correctly (aot_eager, 2 ranks, 3 SGD steps): a unit holding
    another unit compiled on its own under an eager root (``torch.compile(model[2])``);
    the same with that block frozen while its input needs grad; the whole model
    compiled (``torch.compile(model)``, torchtitan's plain line); and a wholly frozen
    model compiled whole, fed by a trainable Linear outside it. Against a one-process
    reference: losses rtol 1e-6, parameters (and the outside Linear) atol 1e-6 (not
    bitwise: averaging over ranks sums in another order). Every placeholder is 0
    bytes after each forward and backward (a re-gather moved into the forward would
    leave the parameters gathered)."""
    from _dist import run_ranks

    for r in run_ranks(below_root_worker, 2):
        assert set(r) == {"nested", "frozen", "root", "frozen_root"}
        for case, v in r.items():
            torch.testing.assert_close(v["losses"], v["ref_losses"], rtol=1e-6, atol=0, msg=case)
            worst = max(v["diff"].items(), key=lambda kv: kv[1])
            assert worst[1] <= 1e-6, (case, worst)
            assert v["bytes_fwd"] == [0, 0, 0] and v["bytes_bwd"] == [0, 0, 0], (case, v)


# ------------------------------------------- a graph break inside a unit's forward
GRAPH_BREAK_STEPS = 4


class _WithLoss(nn.Module):
    """A model and its loss in one forward that returns both, as HF's causal LMs do
    when given labels: the log-probabilities and the loss taken from them come out of
    one graph, so the returned log-probabilities get no gradient of their own ([Note:
    An output hook that gets no gradient] in traceable_hsdp/_compile.py)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = self.model(x).log_softmax(-1)
        return F.nll_loss(logprobs.flatten(0, 1), y.flatten()), logprobs


def graph_break_worker(rank: int, world: int) -> dict[str, Any]:
    """A two-block Llama whose blocks' attention each end with a graph break, under a
    root that returns the loss and its log-probabilities (:class:`_WithLoss`), trained
    eagerly, then under ``torch.compile`` (Inductor, ``fullgraph=False``: torch's
    default) with compiled autograd: GRAPH_BREAK_STEPS AdamW steps each, the last
    of them, in the compiled run, with the model's forward called eagerly while
    compiled autograd stays on (as an uncompiled evaluation or debugging step would:
    the eager forward's backward captured by compiled autograd). Returns the
    losses and parameters of both runs, the placeholder bytes after each compiled
    step, the graph breaks, the graphs compiled after each step, and how many
    compiled entries dynamo holds for the units' forward (``FSDPState.forward``)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from _workers import CFG, _data, _placeholder_bytes, break_after
    from traceable_hsdp._state import FSDPState

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        llama = Llama(CFG)
        for block in llama.layers:
            break_after(block.attn)
            th.fully_shard(block, mesh=mesh)
        model = th.fully_shard(_WithLoss(llama), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fwd: Any = model
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            th.enable_compiled_autograd()
            fwd = torch.compile(model)
        run: dict[str, Any] = dict(losses=[], bytes_after=[], graphs=[])
        try:
            for i, (x, y) in enumerate(_data(world, GRAPH_BREAK_STEPS)):
                call = model if i == GRAPH_BREAK_STEPS - 1 else fwd
                loss, _ = call(x.chunk(world)[rank], y.chunk(world)[rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                t = loss.detach().clone()
                torch.distributed.all_reduce(t)
                run["losses"].append(t.item() / world)
                run["bytes_after"].append(_placeholder_bytes(model))
                run["graphs"].append(counters["stats"]["unique_graphs"])
        finally:
            if compiled:
                th.disable_compiled_autograd()
        run["params"] = {k: full_tensor(v) for k, v in model.state_dict().items()}
        run["graph_breaks"] = sum(counters["graph_break"].values())
        run["unit_forward_entries"] = len(_debug_get_cache_entry_list(FSDPState.forward.__code__))
        out["compiled" if compiled else "eager"] = run
    return out


@pytest.mark.slow
def test_graph_break_inside_a_unit_compiled_with_inductor() -> None:
    """``torch.compile(model)`` without ``fullgraph`` on a model whose blocks (units)
    break the graph in their forward: dynamo then compiles the units' forward as a
    frame of its own, once for the root and once for both blocks ([Note: One graph
    for every unit of a class] in _common.py), and on the second (the blocks after
    the root) its automatic dynamic shapes make the plain ints the runtime reads
    symbolic, which Inductor must lower in the placeholder's resize ([Note: Ints read
    while tracing] in _param.py). The root returns the loss and the
    log-probabilities it was taken from, as HF's causal LMs given labels return loss
    and logits: those get no gradient, and their hook, registered outside the graph
    after the break, must not fail torch's compiled autograd ("'NoneType' object has
    no attribute 'op'": [Note: An output hook that gets no gradient] in _compile.py).
    The last step calls the model's forward eagerly with compiled autograd still on:
    the backward graph then takes the placeholder autograd saved as an input of its
    own beside the one the re-gather fills, and must not read a freed storage after
    ``remove_resize_copy`` ([Note: Removing resize/copy regions]). 2 ranks, Inductor, compiled
    autograd, 4 AdamW steps, against the same model eager: losses rtol 1e-5,
    parameters atol 1e-5; every placeholder
    freed after each step; graphs compiled in step 1 only, and the last step's
    backward."""
    from _dist import run_ranks

    for r in run_ranks(graph_break_worker, 2):
        e, c = r["eager"], r["compiled"]
        torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-5, atol=0)
        assert c["params"].keys() == e["params"].keys()
        for k, v in e["params"].items():
            torch.testing.assert_close(c["params"][k], v, rtol=0, atol=1e-5, msg=k)
        assert c["bytes_after"] == [0] * GRAPH_BREAK_STEPS, c["bytes_after"]
        assert c["graph_breaks"] > 0, c  # the case this test is about happened
        # Graphs compiled in step 1 only, and in the last step (the eager forward) one
        # more: compiled autograd's backward of that forward.
        first = c["graphs"][0]
        assert c["graphs"] == [first] * (GRAPH_BREAK_STEPS - 1) + [first + 1], c["graphs"]
        assert c["unit_forward_entries"] == 2, c["unit_forward_entries"]


# --------------------------------------- hooks run eagerly by compiled autograd
def _train_region_case(world: int, rank: int, region: bool, compiled: bool = True) -> dict[str, Any]:
    """One case of :func:`region_block_worker`."""
    from _workers import CFG, LR, _data, _loss
    from torch._dynamo.utils import counters

    from traceable_hsdp.demo.models import Block

    class RegionBlock(Block):
        forward = torch.compiler.nested_compile_region(Block.forward)

    mesh = init_device_mesh("cpu", (world,))
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Llama(CFG)
    for block in model.layers:
        if region:
            block.__class__ = RegionBlock
        th.fully_shard(block, mesh=mesh)
    th.fully_shard(model, mesh=mesh)
    step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    with th.compiled_autograd(backend="aot_eager") if compiled else contextlib.nullcontext():
        for x, y in _data(world, 2):
            loss = _loss(step(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            grads.append({n: None if p.grad is None else full_tensor(p.grad)
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "graph_breaks": sum(counters["graph_break"].values())}


def region_block_worker(rank: int, world: int) -> dict[str, Any]:
    """The test Llama (``_workers.CFG``), 2 AdamW steps: "plain", its blocks as they
    are, eager (the reference); "region", its blocks' forward marked
    ``torch.compiler.nested_compile_region``, compiled whole with compiled autograd
    (aot_eager, dynamo's ``automatic_dynamic_shapes`` off), whose backward compiled
    autograd cannot trace whole on torch 2.13 (it graph-breaks at
    ``invoke_subgraph`` and runs the rest of its graph, hooks included, eagerly). Per
    case: the losses, each parameter's full gradient after every backward (``None``
    where it got none), and dynamo's graph-break count. "refused": the region model
    with the default configuration, the message its first step raised. See [Note: A
    compile region inside a unit] (``_compile_checks.py``)."""
    out: dict[str, Any] = {"plain": _train_region_case(world, rank, region=False, compiled=False)}
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        out["region"] = _train_region_case(world, rank, region=True)
    try:
        _train_region_case(world, rank, region=True)
        out["refused"] = None
    except Exception as e:  # the refusal, as dynamo raises it under fullgraph
        out["refused"] = str(e)
    return out


@pytest.mark.slow
def test_hooks_run_eagerly_by_compiled_autograd_reduce_every_gradient() -> None:
    """Compiled autograd runs what it cannot trace eagerly, hooks included: here the
    backward of blocks marked ``torch.compiler.nested_compile_region`` (a graph break
    at ``invoke_subgraph`` on torch 2.13), and after it the hook frames it compiles
    one by one until dynamo's recompile limit. One unit's gradients were then
    reduced partly traced and partly eagerly, and the eager ones, held for a flat
    reduction that never came, were lost: 2 of 21 parameters got no gradient (the
    embedding and one block weight), and the next steps' losses drifted. See
    [Note: Eager or traced] (``_common.py``).
    2 ranks, the test Llama, 2 AdamW steps: with region blocks, compiled whole
    (aot_eager, compiled autograd, ``automatic_dynamic_shapes`` off), every
    parameter gets its gradient in every step, bitwise equal to the same model's
    eager run without regions (aot_eager runs eager's ops, and a unit's flat eager
    reduction sums what per-parameter ones sum), and so are the losses. The region
    run must have graph-broken, or it did not test the eager hooks. With dynamo's
    default configuration the region model is refused at its first step, naming
    the modules and both fixes (on 2 ranks dynamo fails to compile the hook frames;
    see [Note: A compile region inside a unit] in ``_compile_checks.py``)."""
    from _dist import run_ranks

    for r in run_ranks(region_block_worker, 2):
        plain, region = r["plain"], r["region"]
        assert region["graph_breaks"] > 0, "no graph break: the eager hooks did not run"
        for step, (want, got) in enumerate(zip(plain["grads"], region["grads"])):
            missing = [n for n, g in got.items() if g is None]
            assert not missing, (step, missing)
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=(step, name))
        assert region["losses"] == plain["losses"], (region["losses"], plain["losses"])
        refused = r["refused"]
        assert refused is not None and "nested_compile_region" in refused, refused
        assert "automatic_dynamic_shapes = False" in refused and "layers.0" in refused, refused


# ---------------------------------------------------------- a rank that dies
PG_TIMEOUT_S = 30.0


def _two_linear_units(mesh: Any) -> nn.Module:
    """Linear(8, 8), Tanh, Linear(8, 4) from seed 0: each linear a unit, then the root."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    th.fully_shard(model[0], mesh=mesh)
    th.fully_shard(model[2], mesh=mesh)
    th.fully_shard(model, mesh=mesh)
    return model


DIE_AT_STEP = 2  # rank 1 exits after this step's forward, before its backward
DIE_EXIT_CODE = 17


def dying_rank_main(rank: int, world: int, tmp: str, compiled: bool, pg_timeout_s: float) -> None:
    """One rank (a spawned process) of a run where rank 1 exits mid-step: after step
    ``DIE_AT_STEP``'s forward, with its peers in that step's backward collectives.
    Every other rank writes what it raised and how long that step took to
    ``{tmp}/rank{rank}.json``."""
    import datetime
    import json
    import os
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=pg_timeout_s))
    mesh = init_device_mesh("cpu", (world,))
    model = _two_linear_units(mesh)
    fwd = model
    if compiled:
        th.enable_compiled_autograd(backend="aot_eager")
        fwd = torch.compile(model, backend="aot_eager", fullgraph=True)
    result: dict[str, Any] = {"error": None, "steps": 0}
    start = time.monotonic()
    try:
        for step in range(DIE_AT_STEP + 2):
            start = time.monotonic()
            loss = fwd(torch.randn(4, 8)).square().mean()
            if step == DIE_AT_STEP and rank == 1:
                os._exit(DIE_EXIT_CODE)  # no cleanup, as a crash
            loss.backward()
            result["steps"] += 1
    except Exception as e:  # what the survivor raised
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    result["seconds"] = time.monotonic() - start
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_rank_dying_mid_step_makes_the_others_raise(tmp_path, compiled: bool) -> None:
    """3 gloo ranks with a 30 s process-group timeout; rank 1 exits (os._exit, as a
    crash) after a step's forward. Ranks 0 and 2 are then in that step's backward
    collectives: each must raise within the timeout (gloo sees the peer's socket
    close), and exit, never hang. Eager, and compiled (aot_eager, compiled
    autograd: the collectives inside the compiled backward graph)."""
    import json
    import multiprocessing


    world = 3
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=dying_rank_main,
                         args=(r, world, str(tmp_path), compiled, PG_TIMEOUT_S))
             for r in range(world)]
    for p in procs:
        p.start()
    # Startup and (compiled) the first step's compile come before the failing step;
    # the bound below is generous for them, and the step itself is timed by the ranks.
    deadline = 240
    for p in procs:
        p.join(deadline)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {deadline} s"
    assert procs[1].exitcode == DIE_EXIT_CODE
    for r in (0, 2):
        assert procs[r].exitcode == 0, (r, procs[r].exitcode)
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["steps"] == DIE_AT_STEP, got  # the steps before it completed
        assert got["error"] is not None and "RuntimeError" in got["error"], got
        assert got["seconds"] < PG_TIMEOUT_S, got


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, in start (pid) order (Linux /proc)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:  # a spawned rank, not a tracker
            out.append(int(entry))
    return sorted(out)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="finds the ranks in /proc")
def test_train_cli_exits_nonzero_naming_the_dead_rank() -> None:
    """``traceable-hsdp train`` (2 spawned gloo ranks, eager, a long run): rank 1 is
    killed (SIGKILL) once steps are being printed. The command must exit with status 1
    at once and name the rank (torch.multiprocessing's error: "process 1 terminated
    with signal SIGKILL"); the survivor is terminated, nothing hangs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "traceable_hsdp.demo.cli", "train", "--eager", "--steps", "100000",
           "--no-progress", "--layers", "1", "--dim", "16", "--heads", "2", "--seq-len", "8",
           "--init", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # rank 0's step lines: training is under way
            if line.startswith("step 3/"):
                break
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)  # started second: rank 1
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "a rank died: process 1 terminated with signal SIGKILL" in err, err[-2000:]
    assert seconds < 30, seconds
    def running(pid: int) -> bool:  # alive and not a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert not [p for p in ranks if running(p)], ranks  # the survivor was terminated


# ------------------------------------------------------------------- exiting
# See [Note: Exiting with gloo worker threads] (_exit.py). The abort itself is a race
# (4 of 30 runs of examples/dcp_resume.py --eager on 2 busy cores before the fix, 0
# of 40 after); what removes it is deterministic: by the time the interpreter
# finalizes, the gloo group of a dropped model is destroyed and its worker threads
# are joined. The script counts this process's threads from an atexit function
# registered before fully_shard registers ours, so it runs after ours (LIFO). The
# control run unregisters our hook: the workers are then still there, which shows
# that the count can fail and that the hook is what joins them.

_EXIT_SCRIPT = """
import atexit, os, sys, tempfile
import torch
import torch.distributed as dist

torch.set_num_threads(1)
def threads():
    # gloo's threads (pt_gloo_runloop, gloo_tcp_loop) and any other but the autograd
    # engine's device threads (pt_autograd_N), which CUDA builds start at the first
    # backward and keep for the process, whatever the FSDP.
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(not n.startswith("pt_autograd_") for n in names)
base = threads()
atexit.register(lambda: print("extra threads at exit", threads() - base, flush=True))
from traceable_hsdp import fully_shard
from traceable_hsdp._exit import uninstall_exit_hook
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                        rank=0, world_size=1)

def main():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if sys.argv[1] == "compiled":  # dynamo's guards hold copies of the mesh
        import traceable_hsdp
        traceable_hsdp.enable_compiled_autograd()
        model = torch.compile(model, backend="aot_eager")
    model(torch.randn(2, 8)).sum().backward()
    torch.optim.AdamW(model.parameters()).step()  # DTensor ops: the caches hold the mesh
    print("extra threads while training", threads() - base, flush=True)
    dist.destroy_process_group()
    if sys.argv[1] == "control":
        uninstall_exit_hook()

main()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts threads in /proc")
def test_gloo_workers_are_joined_before_the_interpreter_finalizes(tmp_path) -> None:
    """No gloo thread is left at exit, eagerly and after a compiled step (aot_eager,
    compiled autograd), whose dynamo guards hold copies of the mesh that only the
    garbage collector reaches; without the exit hook the threads stay. See [Note:
    Exiting with gloo worker threads] in traceable_hsdp/_exit.py."""
    import re
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)

    def extra_threads(mode: str) -> tuple[int, int]:
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        training = re.search(r"extra threads while training (\d+)", proc.stdout)
        at_exit = re.search(r"extra threads at exit (\d+)", proc.stdout)
        assert training and at_exit, proc.stdout
        return int(training.group(1)), int(at_exit.group(1))

    for mode in ("hook", "compiled"):
        training, at_exit = extra_threads(mode)
        assert training > 0, "the gloo group started no worker threads: the test checks nothing"
        assert at_exit == 0, (mode, training, at_exit)
    control_training, control_at_exit = extra_threads("control")
    assert control_at_exit == control_training > 0, (control_training, control_at_exit)


# ------------------------------------------------------- the tests' own gathering
# See [Note: The tests gather without gloo's allocating all-gather] in tests/_dist.py.


def gather_helper_worker(rank: int, world: int) -> dict[str, Any]:
    """``_dist.full_tensor`` on a 2-D (2x2) mesh, uneven shards on each dim: its
    result against torch's ``full_tensor()`` and the unsharded tensor, and the
    functional collectives each issued (recorded by a dispatch mode below the
    helper's)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from _workers import FunctionalCollectiveOps

    torch.manual_seed(0)
    full = torch.randn(7, 5)
    mesh = init_device_mesh("cpu", (2, 2))
    out: dict[str, Any] = {}
    for name, placements in {"replicate_shard0": [Replicate(), Shard(0)], "shard0_shard1": [Shard(0), Shard(1)]}.items():
        dt = distribute_tensor(full, mesh, placements)
        ops: dict[str, list[str]] = {}
        results = {}
        for how, gather in (("torch", DTensor.full_tensor), ("helper", full_tensor)):
            with FunctionalCollectiveOps() as rec:
                results[how] = gather(dt)
            ops[how] = sorted(set(rec.names))
        out[name] = dict(ops=ops, torch_equal=torch.equal(results["torch"], full),
                         helper_equal=torch.equal(results["helper"], full))
    return out


def test_the_gather_helper_matches_torch_without_the_allocating_all_gather() -> None:
    """Reference: torch's ``full_tensor()`` and the unsharded tensor, bitwise, on a 2x2
    mesh with uneven shards. torch's own gather issues the allocating all-gather; the
    helper issues the ``_out`` one into a buffer and never the allocating one."""
    from _dist import run_ranks

    for r in run_ranks(gather_helper_worker, 4):
        for name, case in r.items():
            assert case["torch_equal"] and case["helper_equal"], (name, case)
            ag, ag_out = "all_gather_into_tensor", "all_gather_into_tensor_out"
            assert ag in case["ops"]["torch"], (name, case["ops"])  # else the check is empty
            assert ag_out in case["ops"]["helper"] and ag not in case["ops"]["helper"], (name, case["ops"])


def test_the_tests_gather_through_the_helper() -> None:
    """No test module gathers a DTensor by calling torch's method itself: every
    comparison goes through ``_dist.full_tensor``."""
    import pathlib

    needle = ".full_tensor(" + ")"
    here = pathlib.Path(__file__).parent
    calls = [f"{f.name}:{i}" for f in sorted(here.glob("*.py")) if f.name != "_dist.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if needle in line.split("#")[0]]
    assert calls == [], calls
