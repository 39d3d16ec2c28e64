"""Per-rank bodies of tests/test_reliability.py (importable by spawned ranks)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
import traceable_hsdp.passes._graph as G
from traceable_hsdp.debug._recorder import current_compile
from _dist import full_tensor
from traceable_hsdp.demo.models import Llama, LlamaConfig

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


# --------------------------------------------------------------- uneven shards
# Widths chosen for the edges: on 4 shard ranks (1-D) the first weight's 3 rows are
# held 1, 1, 1, 0; the last layer's single row 1, 0, 0, 0; the middle weights are
# sharded on dim 1 (shard_placement_fn): 3 columns (1, 1, 1, 0) and 7 columns (2, 2,
# 2, 1: uneven, none empty). On 2x2 (HSDP, shard groups of 2): 2, 1; 1, 0 (a 0-row
# rank in HSDP); 2, 1; 4, 3.
UNEVEN_WIDTHS = (8, 3, 7, 5, 1)
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

    middle = {2, 4}  # module indices of the Linear layers sharded on dim 1
    out: dict[str, Any] = {}
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


# ------------------------------------------------ Inductor, every feature at once
# The body of tests/test_inductor_features.py.

# Tied embeddings: the output head is the token embedding (one parameter in the root).
FAT_CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=True)
FAT_SEQ, FAT_BATCH_PER_RANK, FAT_STEPS, FAT_MICRO, FAT_LR = 8, 2, 3, 2, 0.05
# hsdp(bucket_size=...) in MiB: the whole model's gathered fp32 parameters are
# ~0.1 MiB, so adjacent units of one dtype merge into one bucket.
FAT_BUCKET_MB = 1
FAT_BF16 = th.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               output_dtype=torch.float32)


def _fat_build(mesh: Any) -> Llama:
    """Block 0: hsdp level2 (reshard_after_forward=False; the RMSNorm weights, under
    threshold=1 KiB, kept whole and all-reduced), which also turns comm_fusion on with
    a bucket cap. Block 1: fully_shard in bf16 (reduce in fp32, output fp32),
    reshard_after_forward=True. Root: the tied embedding/output and the final norm
    (kept whole: threshold=1 KiB), through hsdp level1 (its gathered storage is never
    freed; each forward refills it from the shards)."""
    torch.manual_seed(0)
    model = Llama(FAT_CFG)
    assert model.output.weight is model.tok_embeddings.weight
    th.hsdp(model.layers[0], threshold=1, optimizer_level="level2", comm_fusion=True,
            bucket_size=FAT_BUCKET_MB, mesh=mesh)
    th.fully_shard(model.layers[1], mesh=mesh, mp_policy=FAT_BF16, reshard_after_forward=True)
    # The same pass configuration again: hsdp() sets it for the whole process.
    th.hsdp(model, threshold=1, optimizer_level="level1", comm_fusion=True,
            bucket_size=FAT_BUCKET_MB, mesh=mesh)
    return model


def _fat_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(FAT_STEPS):
        tok = torch.randint(0, FAT_CFG.vocab_size, (8 * FAT_BATCH_PER_RANK * FAT_MICRO, FAT_SEQ + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def _any_all_gather(node: torch.fx.Node) -> bool:
    from traceable_hsdp.passes import _graph as P

    return P.collective_family(node) == "all_gather"


def _any_reduce_scatter(node: torch.fx.Node) -> bool:
    from traceable_hsdp.passes import _graph as P

    return P.collective_family(node) == "reduce_scatter"


def _fat_counts(graph: torch.fx.Graph) -> dict[str, int]:
    from traceable_hsdp.passes import _graph as P
    from traceable_hsdp.passes import _rewrite as R

    c = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce", "fsdp_copy", "resize"), 0)
    for n in graph.nodes:
        # An all-gather in either form (on CPU each is issued into a buffer: [Note:
        # CPU all-gathers into buffers] in passes/gloo/gather_into_buffers.py), and a
        # reduce-scatter (over two gloo ranks an exchange: [Note: gloo
        # reduce-scatters as an exchange] in passes/gloo/exchange.py).
        for key, pred in (("all_gather", _any_all_gather), ("reduce_scatter", _any_reduce_scatter),
                          ("all_reduce", P.is_all_reduce), ("fsdp_copy", P.is_fsdp_copy),
                          ("resize", P.is_resize)):
            if pred(n):
                c[key] += 1
                v = R.tensor_val(n.args[0])
                c.setdefault(key + "_in", []).append(
                    (tuple(v.shape), str(v.dtype)) if v is not None else None)
    return c


def fat_worker(rank: int, world: int, mesh_shape: tuple[int, ...], ckpt: str) -> dict[str, Any]:
    """Trains the model of ``_fat_build`` eagerly, then compiled with Inductor (every pass
    on, compiled autograd), FAT_STEPS optimizer steps of FAT_MICRO micro-batches (gradient
    sync off on all but the last). Compiled, a DCP checkpoint is saved after step
    FAT_STEPS-1 and loaded back after step FAT_STEPS, which is then run again under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from _workers import dp_mesh

    mesh = dp_mesh(mesh_shape)
    graphs: list[dict[str, int]] = []

    class Record(CustomGraphPass):
        """Inductor's post-grad post-pass: each graph after our passes."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            graphs.append(_fat_counts(graph))

        def uuid(self) -> None:
            return None  # never from the FX cache: every graph is seen

    def run(compiled: bool) -> dict[str, Any]:
        model = _fat_build(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=FAT_LR, momentum=0.9)
        fwd = model
        if compiled:
            torch._inductor.config.post_grad_custom_post_pass = Record()
            th.enable_compiled_autograd()
            fwd = torch.compile(model, fullgraph=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            xs, ys = x.chunk(world)[rank].chunk(FAT_MICRO), y.chunk(world)[rank].chunk(FAT_MICRO)
            total = torch.zeros(())
            for i in range(FAT_MICRO):
                model.set_requires_gradient_sync(i == FAT_MICRO - 1)
                loss = F.cross_entropy(fwd(xs[i]).flatten(0, 1), ys[i].flatten()) / FAT_MICRO
                loss.backward()
                total += loss.detach()
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(total)
            return total.item() / world

        losses, graphs_after_step = [], []
        data = _fat_data()
        try:
            for i, (x, y) in enumerate(data):
                if compiled and i == FAT_STEPS - 1:
                    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                             checkpoint_id=ckpt)
                losses.append(step(x, y))
                graphs_after_step.append(len(graphs))
            out = dict(losses=losses, graphs_after_step=graphs_after_step,
                       params={k: full_tensor(v) for k, v in model.state_dict().items()})
            if compiled:
                # Resume: load the checkpoint into the same model and optimizer (in
                # place), and run the last step again, with dynamo's guards skipped
                # (docs/compile.md, "Steps without guards"): its graphs (the forward,
                # the backwards with gradient sync off and on) were all compiled in
                # step 1, so only the guards that tell them apart may pick each one.
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=ckpt)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out["resumed_loss"] = step(*data[-1])
                out["resumed_graphs"] = len(graphs)
                out["resumed_params"] = {k: full_tensor(v) for k, v in model.state_dict().items()}
            return out
        finally:
            if compiled:
                th.disable_compiled_autograd()
                torch._inductor.config.post_grad_custom_post_pass = None

    eager = run(compiled=False)
    compiled = run(compiled=True)
    return dict(eager=eager, compiled=compiled, graphs=graphs,
                placements={k: str(v.placements) for k, v in _fat_build(mesh).state_dict().items()})


# ------------------------------------------------------------- a rank that dies
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


# ---------------------------------------------------------- the tests' gathering
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
