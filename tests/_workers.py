"""Per-rank bodies of the multi-process runtime tests (importable by spawned ranks)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
from _dist import full_tensor
from traceable_hsdp.demo.models import Llama, LlamaConfig, shard_llama
from traceable_hsdp.debug._recorder import PostGradRecorder, current_compile
from traceable_hsdp.debug._table import collective_table, graph_counts
from traceable_hsdp.passes._graph import (
    bound_args,
    collective_family,
    is_fsdp_copy,
    is_resize,
    is_version_counter_op,
)

# vocab 65: the embedding and output head have an uneven first dim (padded shards).
CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
# One block: for compiled checks that two blocks do not add to (every block costs
# compile time; see [Note: The suite's time is compile time] in conftest.py).
CFG1 = dataclasses.replace(CFG, n_layers=1)
SEQ, BATCH_PER_RANK, STEPS, LR = 8, 2, 5, 1e-2
# The root unit's parameters (embedding, final norm, output head). The default
# reshard_after_forward (None, as torch's) keeps them gathered from a training
# forward to its backward: the backward re-gathers the blocks only.
ROOT_PARAMS = 3
ROOT_BYTES = (2 * CFG.vocab_size * CFG.dim + CFG.dim) * 4  # fp32, unsharded


def dp_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU mesh for data parallelism: 1-D named ``("shard",)``, 2-D named
    ``("replicate", "shard")`` (HSDP)."""
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _data(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, CFG.vocab_size, (world * BATCH_PER_RANK, SEQ + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def break_after(module: torch.nn.Module) -> None:
    """Makes ``module``'s forward end with a graph break (as a ``print`` or an
    ``.item()`` in a user's forward does), on this instance only."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        torch._dynamo.graph_break()
        return out

    module.forward = forward


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def reference_run(
    world: int, steps: int = STEPS, cfg: LlamaConfig = CFG
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: the ground truth."""
    torch.manual_seed(0)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _data(world, steps):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


_FAMILY_KEY = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}


def dynamo_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """What the runtime tests count in a graph dynamo produced, by the graph
    vocabulary: each collective family under its plain op's name
    (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``; waits
    excluded), ``fsdp.copy_``, ``resize_storage_bytes_`` (both directions), and
    ``version_counter`` (dynamo's version-counter ops: none while the runtime traces;
    [Note: Version counters in a traced step] in traceable_hsdp/_param.py)."""
    counts: Counter[str] = Counter()
    for n in graph.nodes:
        family = collective_family(n)
        if family is not None:
            counts[_FAMILY_KEY[family]] += 1
        elif is_fsdp_copy(n):
            counts["fsdp.copy_"] += 1
        elif is_resize(n):
            counts["resize_storage_bytes_"] += 1
        elif is_version_counter_op(n):
            counts["version_counter"] += 1
    return dict(counts)


class FunctionalCollectiveOps(TorchDispatchMode):
    """Records, in dispatch order, the name of each ``_c10d_functional`` op run eagerly
    while active (``all_gather_into_tensor``, ``all_gather_into_tensor_out``,
    ``wait_tensor``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "_c10d_functional":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class GraphRecorder:
    """A torch.compile backend (aot_eager underneath) that counts the collectives in
    every graph dynamo hands it (:func:`dynamo_counts`), split into forward and
    compiled-autograd graphs."""

    def __init__(self) -> None:
        self.forward: list[dict[str, int]] = []
        self.backward: list[dict[str, int]] = []
        self.reduce_ops: set[str] = set()  # the ops of every reduce-scatter and all-reduce

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for n in gm.graph.nodes:
            if collective_family(n) in ("reduce_scatter", "all_reduce"):
                self.reduce_ops.add(str(bound_args(n)["reduce_op"]))
        _, is_bwd = current_compile()
        (self.backward if is_bwd else self.forward).append(dynamo_counts(gm.graph))
        return aot_eager(gm, example_inputs)


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    """``value`` (a scalar tensor, e.g. this rank's loss) averaged over every rank."""
    t = value.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / world


def _managed(model: torch.nn.Module) -> list[Any]:
    """The FSDPParams of every fully_shard unit in ``model``, each unit once."""
    states = {}
    for m in model.modules():
        state = m.__dict__.get("_traceable_hsdp_state")
        if state is not None and state.param_group is not None:
            states[id(state)] = state
    return [fp for s in states.values() for fp in s.param_group.fsdp_params]


def graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph breaks since ``counters`` was last cleared: each reason's first
    line, and how often it broke."""
    return {k.splitlines()[0]: v for k, v in counters["graph_break"].items()}


def model_refs(model: torch.nn.Module) -> list[weakref.ref]:
    """Weak references to ``model`` and its parameters, for :func:`count_alive` once
    the caller has dropped its own references."""
    return [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]


def count_alive(refs: list[weakref.ref]) -> int:
    """How many of ``refs`` still resolve after a full garbage collection. Dropping a
    model frees it and its parameters, as torch's fully_shard's: a cycle through a
    hook that autograd holds in C++ is invisible to the garbage collector (see [Note:
    Parameter hooks hold their unit weakly] in traceable_hsdp/_state.py)."""
    gc.collect()
    return sum(r() is not None for r in refs)


def _placeholder_bytes(model: torch.nn.Module) -> int:
    """Storage bytes of every unsharded placeholder."""
    return sum(fp.unsharded_param.untyped_storage().nbytes() for fp in _managed(model))


def _post_forward_bytes(model: torch.nn.Module) -> int:
    """Storage bytes of every post-forward shard (an int reshard_after_forward)."""
    return sum(
        fp.post_forward_shard.untyped_storage().nbytes()
        for fp in _managed(model)
        if fp.post_forward_shard is not None
    )


def compile_for(model: torch.nn.Module, how: str, backend: Any) -> tuple[Any, Any]:
    """The two ways in (docs/compile.md): ``how="loop"`` turns compiled autograd on
    and returns ``(torch.compile(model, fullgraph=True), None)``; ``how="step"`` sets
    ``compiled_autograd = True`` and returns ``(model, compiled step(x, y) -> loss)``,
    forward, loss and backward in one compiled function. Anything else: ``(model,
    None)``, eager."""
    if how == "loop":
        th.enable_compiled_autograd(backend=backend)
        return torch.compile(model, backend=backend, fullgraph=True), None
    if how == "step":
        torch._dynamo.config.compiled_autograd = True

        def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _loss(model(x), y)
            loss.backward()
            return loss.detach()

        return model, torch.compile(step_fn, backend=backend)
    return model, None


def parity_worker(
    rank: int, world: int, mesh_shape: tuple[int, ...], mode: str, raf: bool | int = True
) -> dict[str, Any]:
    """Trains the sharded model for STEPS steps in ``mode`` ("eager"; "inductor": the
    plain loop with enable_compiled_autograd on Inductor with every pass, its final
    post-grad graphs recorded) and reports what the test asserts. (The compiled runs
    on aot_eager of this model are test_clip.py's.)"""
    if mode not in ("eager", "inductor"):
        raise ValueError(mode)
    mesh = dp_mesh(mesh_shape)
    torch.manual_seed(0)
    model = Llama(CFG)
    shard_llama(model, th.fully_shard, mesh=mesh, reshard_after_forward=raf)
    n_units = CFG.n_layers + 1
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    post_grad = PostGradRecorder()
    if mode == "inductor":
        torch._inductor.config.post_grad_custom_post_pass = post_grad
    counters.clear()
    fwd, _ = compile_for(model, "loop" if mode == "inductor" else "", "inductor")
    losses, bytes_after_fwd, bytes_after_bwd, graphs_after_step = [], [], [], []
    pf_bytes_after_fwd, pf_bytes_after_bwd = [], []
    out = None
    for x, y in _data(world, STEPS):
        # This rank's slice of the global batch: ranks are laid out (replicate, shard)
        # in row-major order, so the global rank is the data-parallel index.
        xs = x.chunk(world)[rank]
        ys = y.chunk(world)[rank]
        out = fwd(xs)
        bytes_after_fwd.append(_placeholder_bytes(model))
        pf_bytes_after_fwd.append(_post_forward_bytes(model))
        loss = _loss(out, ys)
        loss.backward()
        pf_bytes_after_bwd.append(_post_forward_bytes(model))
        bytes_after_bwd.append(_placeholder_bytes(model))
        kinds = [g.kind for g in post_grad.graphs]
        graphs_after_step.append((kinds.count("fwd"), kinds.count("bwd")))
        # Every managed parameter has its sharded grad, and only that.
        assert all(isinstance(p.grad, torch.distributed.tensor.DTensor) for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world))
    if mode == "inductor":
        th.disable_compiled_autograd()
    final = [(g.kind, g.final_graph()) for g in post_grad.graphs]
    full = {k: full_tensor(v) for k, v in model.state_dict().items()}
    sd_types = {type(v).__name__ for v in model.state_dict().values()}
    result = dict(
        losses=losses,
        params=full,
        sd_types=sd_types,
        bytes_after_fwd=bytes_after_fwd,
        bytes_after_bwd=bytes_after_bwd,
        graphs_after_step=graphs_after_step,
        n_units=n_units,
        n_params=len(list(model.parameters())),
        full_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        pf_bytes_after_fwd=pf_bytes_after_fwd,
        pf_bytes_after_bwd=pf_bytes_after_bwd,
        placements={k: tuple(str(p) for p in v.placements) for k, v in model.state_dict().items()},
        graph_breaks=graph_break_reasons(),
        # mode "inductor": per final post-grad graph, its kind, node counts and
        # collectives as (op, group size, unit).
        post_grad=[
            dict(
                kind=kind,
                counts=graph_counts(g),
                collectives=[(r.op, r.group_size, r.unit) for r in collective_table(g)],
            )
            for kind, g in final
        ],
    )
    refs = model_refs(model)
    del model, opt, fwd, out, loss
    result["alive_after_del"] = count_alive(refs)
    return result


# The variable-length test: one block (two units, so bucketing and overlap still
# have neighbours), sequence lengths up to max_seq_len. After step EVAL_AFTER, an
# evaluation forward under torch.inference_mode (what a frozen reference model's
# forward in DPO-style training does), then training goes on.
VARIABLE_CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
VARIABLE_LENGTHS = (8, 12, 16, 10, 14)
EVAL_AFTER = 4


def _variable_length_data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4321)
    out = []
    for s in VARIABLE_LENGTHS:
        shape = (world * BATCH_PER_RANK, s + 1)
        tok = torch.randint(0, VARIABLE_CFG.vocab_size, shape, generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def _variable_length_run(
    fwd: Any, opt: torch.optim.Optimizer, world: int, rank: int | None, mark: bool,
    after_step: Any = None,
) -> tuple[list[float], torch.Tensor]:
    """Trains on ``_variable_length_data`` (this rank's slice, or the global batch
    when ``rank`` is None), with the evaluation forward after step EVAL_AFTER; returns
    the losses (averaged over the ranks) and the evaluation logits."""
    losses: list[float] = []
    eval_logits = torch.empty(0)
    for step, (x, y) in enumerate(_variable_length_data(world), start=1):
        if rank is not None:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if mark:
            torch._dynamo.maybe_mark_dynamic(x, 1)
        loss = _loss(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() if rank is None else _mean_over_ranks(loss, world))
        if after_step is not None:
            after_step()
        if step == EVAL_AFTER:
            with torch.inference_mode():
                eval_logits = fwd(x).clone()
    return losses, eval_logits


def variable_length_reference(world: int) -> tuple[list[float], torch.Tensor]:
    """One process, the global batches: the losses and the evaluation logits."""
    torch.manual_seed(0)
    model = Llama(VARIABLE_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return _variable_length_run(model, opt, world, None, False)


def variable_length_worker(rank: int, world: int) -> dict[str, Any]:
    """Batches whose sequence length changes every step, the length marked dynamic
    (``torch._dynamo.maybe_mark_dynamic``), compiled whole on Inductor with every pass and
    compiled autograd, with an evaluation forward under ``torch.inference_mode``
    after step EVAL_AFTER. Reports the losses, this rank's evaluation logits, and the
    post-grad graphs compiled after each step (counted before that step's
    evaluation)."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Llama(VARIABLE_CFG)
    shard_llama(model, th.fully_shard, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    post_grad = PostGradRecorder()
    torch._inductor.config.post_grad_custom_post_pass = post_grad
    counters.clear()
    fwd, _ = compile_for(model, "loop", "inductor")
    graphs: list[tuple[int, int]] = []

    def count() -> None:
        kinds = [g.kind for g in post_grad.graphs]
        graphs.append((kinds.count("fwd"), kinds.count("bwd")))

    try:
        losses, eval_logits = _variable_length_run(fwd, opt, world, rank, True, count)
    finally:
        th.disable_compiled_autograd()
        torch._inductor.config.post_grad_custom_post_pass = None
    return dict(losses=losses, graphs=graphs, eval_logits=eval_logits,
                graph_breaks=sum(counters["graph_break"].values()),
                counts=[(g.kind, graph_counts(g.final_graph())) for g in post_grad.graphs])


def _inputs_on_a_fake_gpu(gm: torch.fx.GraphModule) -> None:
    """Records every input of ``gm`` as a fake GPU tensor of its shape and dtype: the
    same graph, as the passes would see it on CUDA, for the cases they leave alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta["val"]
                n.meta["val"] = torch.empty(v.shape, dtype=v.dtype, device="cuda")


def _reduce_scatter_times_3(op: str, world: int, group: str) -> Any:
    c10d = torch.ops._c10d_functional
    return lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, op, world, group)) * 3


def exchange_worker(rank: int, world: int) -> dict[str, Any]:
    """The reduce-scatter-as-exchange rewrite on 2 gloo ranks (see [Note: gloo
    reduce-scatters as an exchange] in passes/gloo/exchange.py): for
    float32 and bfloat16, "sum" and "avg", a 1-D and a 2-D gradient, a traced graph
    of one reduce-scatter gives the same bits before and after the pass, and so does
    the eager runtime's ``reduce_scatter`` against the functional op; for each
    (dtype, op), one of the two shapes compiled by Inductor gives the bits of the
    uncompiled op. Cases the pass must leave alone ("max", no wait, a fake GPU input)
    are counted. Returns what each check found; the test asserts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp import passes
    from traceable_hsdp._collectives import reduce_scatter
    from traceable_hsdp.passes import reduce_scatter_by_exchange
    from traceable_hsdp.passes._graph import EXCHANGE_COUNT, REDUCE_SCATTER

    c10d = torch.ops._c10d_functional
    group = torch.distributed.group.WORLD.group_name
    out: dict[str, Any] = {"bitwise": {}, "inductor": {}, "eager": {}, "counts": {},
                           "left_alone": {}}
    passes.install()  # as fully_shard does: the pass runs on Inductor's graphs
    compiled = PostGradRecorder()  # the graphs Inductor compiled, after the passes
    torch._inductor.config.post_grad_custom_post_pass = compiled
    gen = torch.Generator().manual_seed(rank)
    shapes = ((10,), (6, 5))
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        for j, op in enumerate(("sum", "avg")):
            for k, shape in enumerate(shapes):
                x = torch.randn(shape, generator=gen).to(dtype)
                gm = make_fx(_reduce_scatter_times_3(op, world, group))(x)
                ref = gm(x)
                n = reduce_scatter_by_exchange(gm)
                key = f"{dtype}/{op}/{shape}"
                out["bitwise"][key] = (n, torch.equal(gm(x), ref))
                out["counts"][key] = graph_counts(gm)
                # Compiled by Inductor with a reader after it: bfloat16 is left alone
                # ([Note: Low-precision sums and fusion]), float32 gives the same bits.
                # One shape per (dtype, op), the two shapes alternating so that each
                # is compiled with each dtype and each op: the pass treats them alike
                # (both split evenly on dim 0), and a compile is the cost here.
                if k == (i + j) % len(shapes):
                    fn = _reduce_scatter_times_3(op, world, group)
                    torch._dynamo.reset()
                    same = torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))
                    final = graph_counts(compiled.graphs[-1].final_graph())
                    out["inductor"][key] = (same, final.get(EXCHANGE_COUNT, 0))
                eager = reduce_scatter(x, op, world, group, rank)
                plain = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, world, group))
                out["eager"][key] = torch.equal(eager, plain) and eager.dtype == plain.dtype
    x = torch.randn(8)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "max", world, group)))(x)
    out["left_alone"]["max"] = reduce_scatter_by_exchange(gm)
    gm = make_fx(lambda t: c10d.reduce_scatter_tensor(t, "sum", world, group))(x)
    out["left_alone"]["no_wait"] = reduce_scatter_by_exchange(gm)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "sum", world, group)))(x)
    _inputs_on_a_fake_gpu(gm)  # NCCL has a real reduce-scatter
    out["left_alone"]["gpu"] = reduce_scatter_by_exchange(gm)
    out["left_alone"]["reduce_scatters"] = sum(n.target is REDUCE_SCATTER for n in gm.graph.nodes)
    out["exchange_key"] = EXCHANGE_COUNT

    # Eagerly the PassConfig switch turns the exchange off too.
    config = passes.get_config()
    out["eager_ops"] = {}
    for on in (True, False):
        passes.set_config(dataclasses.replace(config, reduce_scatter_by_exchange=on))
        with FunctionalCollectiveOps() as ops:
            reduce_scatter(torch.randn(8), "avg", world, group, rank)
        out["eager_ops"][on] = ops.names
    passes.set_config(config)
    torch._inductor.config.post_grad_custom_post_pass = None
    return out


def _gather_times_3(world: int, group: str) -> Any:
    c10d = torch.ops._c10d_functional

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        bucket = torch.cat([a.reshape(-1), b])  # a bucket of two shards, as the passes make
        return c10d.wait_tensor(c10d.all_gather_into_tensor(bucket, world, group)) * 3

    return fn


def gather_exchange_worker(rank: int, world: int) -> dict[str, Any]:
    """The all-gather-as-exchange rewrite on 2 gloo ranks (see [Note: gloo all-gathers
    as an exchange] in passes/gloo/exchange.py): for float32 and
    bfloat16, a traced graph of one all-gather of a bucket (a ``cat`` of a 2-D and a
    1-D shard) and of one of a 2-D shard gives the same bits before and after the
    pass; the float32 bucket compiled by Inductor (the pass installed, a reader
    fused after it) gives the bits of the uncompiled op. Records the rewritten
    graph's op counts, what the exchange reads, and the cases left alone (no wait, a
    fake GPU input). Returns what each check found; the test asserts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp import passes
    from traceable_hsdp.passes import all_gather_by_exchange
    from traceable_hsdp.passes._graph import AG_EXCHANGE_COUNT, ALL_GATHER
    from traceable_hsdp.passes.gloo._pool import POOLED_ALL_TO_ALL

    c10d = torch.ops._c10d_functional
    group = torch.distributed.group.WORLD.group_name
    out: dict[str, Any] = {"bitwise": {}, "counts": {}, "exchange_input": {}, "left_alone": {}}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(3, 4, generator=gen).to(dtype)
        b = torch.randn(5, generator=gen).to(dtype)
        cases = {
            "bucket": (_gather_times_3(world, group), (a, b)),
            "2-D": (lambda t: c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group)), (a,)),
        }
        for name, (fn, args) in cases.items():
            gm = make_fx(fn, tracing_mode="fake")(*args)  # one fake mode for all values
            ref = gm(*args)
            n = all_gather_by_exchange(gm)
            got = gm(*args)
            key = f"{dtype}/{name}"
            out["bitwise"][key] = (n, torch.equal(got, ref) and got.shape == ref.shape)
            out["counts"][key] = graph_counts(gm)
            (ex,) = [x for x in gm.graph.nodes if x.target is POOLED_ALL_TO_ALL]
            cat = ex.args[0]
            out["exchange_input"][key] = (
                str(cat.target), [str(p.target) for p in cat.args[0]], list(ex.args[1:3]),
            )
    passes.install()  # as fully_shard does: the pass runs on Inductor's graphs
    compiled = PostGradRecorder()  # the graphs Inductor compiled, after the passes
    torch._inductor.config.post_grad_custom_post_pass = compiled
    a, b = torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)
    fn = _gather_times_3(world, group)
    torch._dynamo.reset()
    same = torch.equal(torch.compile(fn, fullgraph=True)(a, b), fn(a, b))
    out["inductor"] = (same, graph_counts(compiled.graphs[-1].final_graph()))
    torch._inductor.config.post_grad_custom_post_pass = None
    x = torch.randn(8)
    gm = make_fx(lambda t: c10d.all_gather_into_tensor(t, world, group))(x)
    out["left_alone"]["no_wait"] = all_gather_by_exchange(gm)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group)))(x)
    _inputs_on_a_fake_gpu(gm)  # NCCL writes the output
    out["left_alone"]["gpu"] = all_gather_by_exchange(gm)
    out["left_alone"]["all_gathers"] = sum(n.target is ALL_GATHER for n in gm.graph.nodes)
    out["exchange_key"] = AG_EXCHANGE_COUNT
    out["pool"] = _exchange_pool_checks(world, group, gen)
    return out


def _pool_frees(key: tuple[Any, ...], n: int, timeout_s: float = 10.0) -> bool:
    """Waits until the exchange pool holds ``n`` buffers of ``key`` that nothing else
    references; whether it did within ``timeout_s``."""
    import time

    from traceable_hsdp.passes.gloo import _pool

    deadline = time.monotonic() + timeout_s
    while True:
        with _pool._pool_lock:
            free = sum(_pool._unused(st) for st in _pool._pool.get(key, []))
        if free >= n or time.monotonic() > deadline:
            return free >= n
        time.sleep(0.001)


def _exchange_pool_checks(world: int, group: str, gen: torch.Generator) -> dict[str, Any]:
    """The exchange's pooled output ([Note: Exchange outputs from a pool] in
    passes/gloo/_pool.py), on one all-gather graph run op by op: a result the caller still
    holds is never written again, a freed one is reused, the pool's bytes, what
    :func:`release_exchange_buffers` drops, and torch's op with the pool off."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp.passes import (
        all_gather_by_exchange, exchange_pool_bytes, release_exchange_buffers,
    )
    from traceable_hsdp.passes.gloo import _pool

    c10d = torch.ops._c10d_functional

    def fn(t: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group))

    key = ((2 * 6,), torch.float32, torch.device("cpu"))  # this graph's output only

    def pooled_here() -> int:
        with _pool._pool_lock:
            return sum(st.nbytes() for st in _pool._pool.get(key, []))

    x1, x2 = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    gm = make_fx(fn, tracing_mode="fake")(x1)
    all_gather_by_exchange(gm)
    total = exchange_pool_bytes()
    kept = gm(x1)  # a view of its pooled buffer, held
    before = kept.clone()
    again = gm(x2)
    res: dict[str, Any] = {
        "held_intact": torch.equal(kept, before),
        "distinct": kept.data_ptr() != again.data_ptr(),
        "values": torch.equal(again, fn(x2)),
    }
    ptr = again.data_ptr()
    del again
    # gloo's worker can still hold a finished all-to-all's work (and so its output)
    # for a moment after the wait: the pool then hands out a new buffer, as it must.
    res["freed_in_time"] = _pool_frees(key, 1)
    third = gm(x1)
    res["reused"] = third.data_ptr() == ptr and torch.equal(third, before)
    res["bytes"] = pooled_here()
    res["total_grew_by_it"] = exchange_pool_bytes() - total == res["bytes"]
    del kept, third
    res["freed_in_time"] &= _pool_frees(key, 2)
    # The earlier cases' buffers may be dropped too, so at least this shape's bytes.
    res["released_all_of_it"] = release_exchange_buffers() >= res["bytes"]
    res["after"] = pooled_here()
    gm = make_fx(fn, tracing_mode="fake")(x1)
    all_gather_by_exchange(gm, pooled=False)
    res["unpooled"] = sorted(
        str(n.target) for n in gm.graph.nodes if str(n.target).endswith("all_to_all_single.default")
    )
    return res


class _ConvBlock(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x)).relu()


class TorchLayersNet(torch.nn.Module):
    """torch's own layers: a Conv2d stem, two blocks of Conv2d and BatchNorm2d, a
    ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``) over the pixels, a
    Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList([_ConvBlock(8) for _ in range(2)])
        self.encoder = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = self.encoder(x.flatten(2).transpose(1, 2))  # (batch, pixels, channels)
        return self.head(x.mean(1))


def torch_layers_inductor_worker(rank: int, world: int) -> dict[str, Any]:
    """TorchLayersNet with each block, the encoder and the root sharded, trained 3
    SGD steps eager and compiled whole (Inductor, every pass, compiled autograd) from
    the same init and data; then one evaluation forward. See [Note: Layout
    optimization and the placeholders] (passes/_install.py) and [Note: Frees after
    the last read] (passes/free_after_last_read.py). The compiled run turns Inductor's
    FX graph cache and AOTAutograd's cache off: a hit skips lowering, so the spy on
    ``decide_layout_opt`` would see nothing when an earlier run left these graphs in
    the cache (a CI machine keeps its default cache directory between runs)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    mesh = dp_mesh((world,))
    decisions: list[bool] = []
    out: dict[str, Any] = {}
    for mode in ("eager", "compiled"):
        torch.manual_seed(0)
        model = TorchLayersNet()
        for block in model.blocks:
            th.fully_shard(block, mesh=mesh)
        th.fully_shard(model.encoder, mesh=mesh)
        th.fully_shard(model, mesh=mesh)
        step = model
        if mode == "compiled":
            torch._dynamo.reset()
            th.enable_compiled_autograd(backend="inductor")
            step = torch.compile(model, backend="inductor", fullgraph=True)
            ours = GraphLowering.decide_layout_opt  # installed by fully_shard

            def spy(gm: Any, *, is_inference: bool) -> bool:
                decisions.append(ours(gm, is_inference=is_inference))
                return decisions[-1]

            GraphLowering.decide_layout_opt = staticmethod(spy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1 + rank)
        losses = []
        no_cache = contextlib.ExitStack()
        if mode == "compiled":
            no_cache.enter_context(inductor_config.patch(fx_graph_cache=False))
            no_cache.enter_context(functorch_config.patch(enable_autograd_cache=False))
        try:
            with no_cache:
                for _ in range(3):
                    loss = step(torch.randn(2, 3, 8, 8, generator=g)).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
        finally:
            if mode == "compiled":
                GraphLowering.decide_layout_opt = ours
                th.disable_compiled_autograd()
        model.eval()
        with torch.no_grad():
            evaluated = model(torch.ones(1, 3, 8, 8))
        out[mode] = dict(
            losses=losses,
            params={n: full_tensor(p.detach()) for n, p in model.named_parameters()},
            buffers={n: b.clone() for n, b in model.named_buffers()},
            evaluated=evaluated,
        )
    out["layout_decisions"] = decisions
    return out
