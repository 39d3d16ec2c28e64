"""Tier 2: the passes inside a real compiled training step.

Two gloo ranks, a 2-block Llama (width 32) with nested fully_shard (3 units: 2
blocks and the root), reshard after forward, the whole step (forward, loss,
backward) compiled by Inductor with compiled autograd, with one bucket per unit
(``bucket_cap_mb=None``: the default 4 MiB cap would merge these small units into one
bucket and leave nothing to overlap). ``fully_shard`` installed
the passes as Inductor's post-grad pre-pass; a recording pass set as the post-grad
*post*-pass sees each graph after them and counts what is left, and checks the
order the overlap pass gave it (each all-gather issued before the previous unit's
compute, each reduce-scatter waited for after the next unit's compute). Two blocks
show every case: in forward the root's all-gather is first, layers.0's is prefetched
and prefetches layers.1's; in backward layers.0's re-gather is prefetched during
layers.1's compute, and two reduce-scatters (layers.1's, layers.0's) wait for the next
unit's compute.

The generated code of step 1 is checked too: the overlap must survive Inductor's
scheduler into the wrapper code that runs. It does only with
``torch._inductor.config.reorder_for_peak_memory = False``, which this test sets
(as torchtitan's SimpleFSDP does): that reordering picks the topological order of
least estimated peak memory and so moves every wait back next to its issue (see
[Note: Overlap and Inductor's scheduler] in ``passes/overlap.py``). So the parity
checks below also cover collectives really in flight during compute on gloo.

The steps run inside ``traceable_hsdp.dump_graphs``, compiled through its recording
backend (``dump.backend("inductor")``, also compiled autograd's, which reuses the
step's backend), so the same Inductor compile checks the dump's final schedule too.
The dump's recorders bracket our passes inside the post-grad *pre*-pass ([Note:
Hooking Inductor] in ``traceable_hsdp/debug/_dump.py``); the recording *post*-pass above
runs after Inductor's own post-grad passes, so the two compose. The generated code
checked above is the dump's copy (``scheduled/``) of each graph's code. For every
Inductor graph with collectives: the order of issues and waits read from that code
agrees with torch's ``inductor_collective_schedule``; each collective keeps its unit
and parameters (in the backward copied from dynamo's graph); its place in the order
and its overlap distance (kernels between issue and wait) agree with the order; at
most one all-gather is in flight; both ranks' dumps agree. After the steps, the
forward of a tiny two-block model alone, under ``no_grad``, with every pass off and
Inductor's default ``reorder_for_peak_memory``, shows the distances without the
passes: one all-gather per parameter, each waited for right after its issue.

Parity: losses against a single-process AdamW reference on the same global batch,
rtol 1e-5; final full parameters atol 1e-4. Not bitwise: the sharded run averages
gradients with reduce-scatters (another summation order), Inductor fuses and
reorders float math, and AdamW turns ~1e-7 gradient differences into larger
parameter ones. Before any update, each rank's step-1 loss is within 1e-6 (relative)
of the reference model's eager loss on that rank's batch: the same weights, only
Inductor's fp32 reorderings (the dump must not change what runs). The passes
themselves only move data (see test_passes_unit.py, where their effect is checked
bitwise).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from _dist import full_tensor, run_ranks
from _workers import _placeholder_bytes
from traceable_hsdp.debug._dump import compare_dumps

N_LAYERS, STEPS, SEQ, BATCH_PER_RANK, LR = 2, 3, 8, 2, 1e-2
N_UNITS = N_LAYERS + 1

def _overlap_order(graph: torch.fx.Graph) -> dict[str, Any]:
    """What the overlap pass did to a post-grad graph: for each all-gather but the
    first, whether it is issued after the previous all-gather's wait and before the
    first compute node that reads that wait's data (through the bucket's unpack:
    views and clones); for each reduce-scatter but the last, whether its wait comes
    after an mm that follows it and before the next reduce-scatter; the most
    all-gathers in flight at once."""
    from traceable_hsdp.passes import _graph as P

    aten = torch.ops.aten
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    def first_compute(wait: torch.fx.Node) -> int:
        stack, seen, found = [wait], {wait}, []
        while stack:
            for u in stack.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if P.is_view(u) or u.target is aten.clone.default:
                    stack.append(u)
                else:
                    found.append(pos[u])
        return min(found)

    ags = [n for n in nodes if P.collective_family(n) == "all_gather"]
    prefetched = []
    for prev, ag in zip(ags, ags[1:]):
        wait = P.single_wait(prev)
        prefetched.append(wait is not None and pos[wait] < pos[ag] < first_compute(wait))
    rss = [n for n in nodes if P.collective_family(n) == "reduce_scatter"]  # either form
    late = []
    for rs, nxt in zip(rss, rss[1:]):
        wait = P.single_wait(rs)
        mms = [n for n in nodes[pos[rs] : pos[nxt]] if n.target is aten.mm.default]
        late.append(wait is not None and bool(mms) and pos[mms[0]] < pos[wait] < pos[nxt])
    in_flight, most = set(), 0
    for n in nodes:
        if P.collective_family(n) == "all_gather":
            in_flight.add(n)
            most = max(most, len(in_flight))
        elif P.is_wait(n):
            in_flight.discard(n.args[0])
    return dict(ag_prefetched=prefetched, rs_late=late, ag_in_flight=most)


def _code_op(op: Any) -> str:
    """How Inductor's wrapper code calls ``op`` (a vocabulary OpOverload), as a regex."""
    return re.escape(f"torch.ops.{op}")


def _code_regexes() -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The issue of a collective in wrapper code (an all-gather in either form:
    ``bufN = all_gather_into_tensor(..)`` or on CPU ``all_gather_into_tensor_out(..,
    out=bufN)``, see [Note: CPU all-gathers into buffers]; a reduce-scatter; over two
    gloo ranks an ``all_to_all_single`` for either, see [Note: gloo reduce-scatters
    as an exchange] and [Note: gloo all-gathers as an exchange]), and a wait; group
    1 or 2 is the buffer the wait names, group 3 the first buffer the issue reads."""
    from traceable_hsdp.passes._graph import (
        ALL_GATHER, ALL_GATHER_OUT, ALL_TO_ALL, REDUCE_SCATTER, WAIT,
    )
    from traceable_hsdp.passes.gloo._pool import POOLED_ALL_TO_ALL

    reads = r"(?:reinterpret_tensor\()?(buf\d+|arg\d+_\d+)"
    return (
        re.compile(
            rf"(buf\d+) = (?:{_code_op(ALL_GATHER)}|{_code_op(REDUCE_SCATTER)}|"
            rf"{_code_op(ALL_TO_ALL)}|{_code_op(POOLED_ALL_TO_ALL)})\({reads}|"
            rf"{_code_op(ALL_GATHER_OUT)}\({reads}.*out=(buf\d+)\)"
        ),
        re.compile(rf"{_code_op(WAIT)}\((buf\d+)\)"),
    )

_CODE_KERNEL = re.compile(r"extern_kernels\.|cpp_fused_|torch\.ops\.aten\.")


def _code_overlap(code: str, families: list[str | None]) -> dict[str, Any]:
    """The same facts read from Inductor's generated wrapper code: for each
    all-gather but the first and each reduce-scatter but the last, how many kernel
    calls run between its issue and its wait; the most all-gathers in flight; how
    many all-gathers' inputs the code deletes or reuses before their wait.
    ``families`` names what the code's k-th collective does (the graph's rows, in
    the order Inductor keeps): an exchange is an ``all_to_all_single`` either way."""
    issue, wait = _code_regexes()
    lines = code[code.index("def call") :].splitlines()
    events: list[tuple[str, str, str, int]] = []  # (kind, buffer, input, line)
    issued = 0
    for n, line in enumerate(lines):
        if m := issue.search(line):
            out, inp = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            events.append((families[issued], out, inp, n))
            issued += 1
        elif m := wait.search(line):
            events.append(("wait", m.group(1), "", n))
        elif _CODE_KERNEL.search(line):
            events.append(("kernel", "", "", n))
    assert issued == len(families), families
    between: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    open_: dict[str, tuple[str, int, str, int]] = {}
    in_flight = most = freed_early = 0
    for i, (kind, buf, inp, n) in enumerate(events):
        if kind in between:
            open_[buf] = (kind, i, inp, n)
            if kind == "all_gather":
                in_flight += 1
                most = max(most, in_flight)
        elif kind == "wait" and buf in open_:
            what, start, src, first = open_.pop(buf)
            between[what].append(sum(1 for k, *_ in events[start:i] if k == "kernel"))
            if what == "all_gather":
                in_flight -= 1
                # Its input stays alive, not deleted or reused, until the wait: gloo
                # reads it until then ([Note: The input lives until the wait] in
                # passes/gloo/gather_into_buffers.py; an exchange is an allocating
                # collective, whose input Inductor keeps alive itself).
                freed_early += any(
                    re.search(rf"\b{src}\b", ln) for ln in lines[first + 1 : n]
                )
    return dict(
        ag_inputs_freed_early=freed_early,
        ag_kernels=between["all_gather"][1:],
        rs_kernels=between["reduce_scatter"][:-1],
        ag_in_flight=most,
        kind="bwd" if between["reduce_scatter"] else "fwd" if between["all_gather"] else None,
    )


def _counts(graph: torch.fx.Graph) -> dict[str, int]:
    from traceable_hsdp.passes import _graph as P

    from traceable_hsdp.passes.gloo._pool import POOLED_ALL_TO_ALL

    keys = ("all_gather", "ag_exchange", "reduce_scatter", "rs_exchange", "pooled",
            "fsdp_copy", "resize_full", "resize_0")
    c = dict.fromkeys(keys, 0)
    exchanges = (P.ALL_TO_ALL, POOLED_ALL_TO_ALL)
    for n in graph.nodes:
        c["pooled"] += n.target is POOLED_ALL_TO_ALL
        if P.collective_family(n) == "all_gather":  # any form
            c["all_gather"] += 1
            c["ag_exchange"] += n.target in exchanges
        elif P.collective_family(n) == "reduce_scatter":  # either form
            c["reduce_scatter"] += 1
            c["rs_exchange"] += n.target in exchanges
        elif P.is_fsdp_copy(n):
            c["fsdp_copy"] += 1
        elif P.is_resize(n):
            c["resize_0" if P.resize_nbytes(n) == 0 else "resize_full"] += 1
    return c


def _tiny_model() -> torch.nn.Module:
    """Two blocks of two linear layers, each a fully_shard unit, under a root that
    holds no parameter: the passes-off forward the dump reads (one all-gather per
    parameter: 0.weight, 0.bias, 2.weight, 2.bias of each block)."""
    from torch import nn

    import traceable_hsdp as th

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU()),
    )
    for block in model:
        th.fully_shard(block)
    th.fully_shard(model)
    return model


def _scheduled(dump: Any) -> list[Any]:
    """The dump's records of Inductor's final schedule, one per Inductor graph."""
    return [r for r in dump.records if r.stage == "scheduled"]


def _worker(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """The training steps inside ``dump_graphs(out_dir/rank<r>)``, then the tiny
    model's forward with every pass off (see the module docstring)."""
    import sys
    from dataclasses import asdict
    from unittest import mock

    import torch.nn.functional as F

    import traceable_hsdp as th
    from traceable_hsdp import dump_graphs, passes
    from traceable_hsdp.demo.models import Llama, LlamaConfig, shard_llama
    from traceable_hsdp.passes import TraceableHSDPPass
    from traceable_hsdp.debug._recorder import PostGradRecorder

    graphs: list[dict[str, Any]] = []
    # Its uuid() is None: never served from the FX cache, every graph is seen.
    torch._inductor.config.post_grad_custom_post_pass = PostGradRecorder(
        lambda rec: graphs.append({**_counts(rec.graph), **_overlap_order(rec.graph)}),
        keep=False,
    )
    # Keep the overlap in the generated code; see the module docstring.
    torch._inductor.config.reorder_for_peak_memory = False
    torch.manual_seed(0)
    # vocab 65: the embedding and the output head have padded shards.
    cfg = LlamaConfig(vocab_size=65, dim=32, n_layers=N_LAYERS, n_heads=2, max_seq_len=16)
    ref = Llama(cfg)
    model = copy.deepcopy(ref)
    shard_llama(model, th.fully_shard)
    installed = isinstance(torch._inductor.config.post_grad_custom_pre_pass, TraceableHSDPPass)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    torch._dynamo.config.compiled_autograd = True

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    gen = torch.Generator().manual_seed(1234)
    losses, ref_losses, graphs_after_step, bytes_after_step = [], [], [], []
    # Without depyf (optional: the dump writes every other file, and nothing here
    # reads depyf's): its decompilation of every frame and graph would add about a
    # third to this test. A whole step dumped with depyf on is
    # test_dump.py's test_dump_graphs_of_a_whole_step_compiled_with_compiled_autograd.
    with mock.patch.dict(sys.modules, {"depyf": None}), dump_graphs(
        f"{out_dir}/rank{rank}", print_summary=False
    ) as dump:
        # Compiled autograd compiles the backward with the step's backend.
        backend = dump.backend("inductor")
        compiled_step = torch.compile(step, backend=backend)
        for i in range(STEPS):
            tok = torch.randint(0, cfg.vocab_size, (world * BATCH_PER_RANK, SEQ + 1), generator=gen)
            x, y = tok[:, :-1], tok[:, 1:]
            xr, yr = x.chunk(world)[rank], y.chunk(world)[rank]
            if i == 0:  # the same weights, eager, in one process
                with torch.no_grad():
                    first_eager = loss_fn(ref(xr), yr).item()
            loss = compiled_step(xr, yr)
            if i == 0:
                first_compiled = loss.item()
            graphs_after_step.append(len(graphs))
            bytes_after_step.append(_placeholder_bytes(model))
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
        # Every graph of the step compiled in step 1: the generated code that ran.
        codes = [
            _code_overlap((dump.out_dir / r.file).read_text(), [c.family for c in r.collectives])
            for r in _scheduled(dump)
        ]
        step_graphs = dump.graph_names()
        # The tiny model's forward, every pass off, Inductor's default scheduler; the
        # post-pass recorder above counts the step's graphs only.
        torch._inductor.config.post_grad_custom_post_pass = None
        saved = passes.get_config()
        passes.set_config(passes.PassConfig(**{
            f.name: False for f in dataclasses.fields(passes.PassConfig)
            if isinstance(getattr(saved, f.name), bool)
        }))
        try:
            with torch.no_grad(), torch._inductor.config.patch(reorder_for_peak_memory=True):
                tiny_x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
                torch.compile(_tiny_model(), backend=backend)(tiny_x)
        finally:
            passes.set_config(saved)
    full = {k: full_tensor(v) for k, v in model.state_dict().items()}
    return dict(
        installed=installed,
        graphs=graphs,
        codes=codes,
        first_loss=(first_compiled, first_eager),
        step_graphs=step_graphs,
        passes_off_graphs=[n for n in dump.graph_names() if n not in step_graphs],
        scheduled=[
            {**asdict(r), "collectives": [asdict(c) for c in r.collectives]}
            for r in _scheduled(dump)
        ],
        summary=dump.summary(),
        graphs_after_step=graphs_after_step,
        bytes_after_step=bytes_after_step,
        losses=losses,
        ref_losses=ref_losses,
        param_diff={k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()},
    )


@pytest.mark.slow
def test_passes_in_compiled_fsdp_step(tmp_path: Path, per_unit_buckets: None) -> None:
    """The passes in a compiled training step, and the dump's final schedule of the
    same compile: see the module docstring."""
    results = run_ranks(_worker, 2, str(tmp_path), spawn=True)
    for rank, r in enumerate(results):
        assert r["installed"]
        # One forward and one backward graph with collectives (plus the empty graph
        # after the backward() graph break), all compiled in step 1: no recompile.
        n = r["graphs_after_step"][0]
        assert r["graphs_after_step"] == [n] * STEPS, r["graphs_after_step"]
        fwd = [g for g in r["graphs"] if g["all_gather"] and not g["reduce_scatter"]]
        bwd = [g for g in r["graphs"] if g["reduce_scatter"]]
        assert len(fwd) == 1 and len(bwd) == 1, r["graphs"]
        # remove_resize_copy: the blocks, resharded after forward, have no copy into
        # a placeholder and no storage grown. The root's 3 parameters stay gathered
        # for backward (the default reshard_after_forward): its forward fills their
        # placeholders (a resize to full and an fsdp.copy_ each, kept: the backward
        # graph reads them), and its backward frees them.
        f, b = fwd[0], bwd[0]
        assert (f["fsdp_copy"], f["resize_full"], f["resize_0"]) == (3, 3, 0), f
        assert (b["fsdp_copy"], b["resize_full"], b["resize_0"]) == (0, 0, 3), b
        # Bucketing: one all-gather per unit forward, one per block backward, one
        # reduce-scatter per unit.
        assert fwd[0]["all_gather"] == N_UNITS, fwd[0]
        assert bwd[0]["all_gather"] == N_LAYERS, bwd[0]
        # Each as an exchange: 2 gloo ranks, see [Note: gloo all-gathers as an
        # exchange] in passes/gloo/exchange.py.
        assert f["ag_exchange"] == N_UNITS and b["ag_exchange"] == N_LAYERS, (f, b)
        assert bwd[0]["reduce_scatter"] == N_UNITS, bwd[0]
        # Each as an exchange: 2 gloo ranks, see [Note: gloo reduce-scatters as an
        # exchange] in passes/gloo/exchange.py.
        assert b["rs_exchange"] == N_UNITS, b
        # Every exchange's output from the pool (the default; [Note: Exchange outputs
        # from a pool] in passes/gloo/_pool.py): the losses below ran on pooled buffers.
        assert f["pooled"] == f["ag_exchange"], f
        assert b["pooled"] == b["ag_exchange"] + b["rs_exchange"], b
        # Overlap, in the post-grad graph: every all-gather but the first issued
        # before the previous unit's compute (forward, and the backward's
        # re-gathers), never two in flight (gloo); every reduce-scatter but the last
        # waited for after the next unit's compute.
        assert f["ag_prefetched"] == [True] * (N_UNITS - 1), f
        assert b["ag_prefetched"] == [True] * (b["all_gather"] - 1), b
        assert b["rs_late"] == [True] * (N_UNITS - 1), b
        assert f["ag_in_flight"] == b["ag_in_flight"] == 1, (f, b)
        # ... and in the generated code that ran: kernels between each issue and
        # its wait.
        code = {c["kind"]: c for c in r["codes"] if c["kind"]}
        assert set(code) == {"fwd", "bwd"}, r["codes"]
        assert len(code["fwd"]["ag_kernels"]) == N_UNITS - 1, code["fwd"]
        assert len(code["bwd"]["rs_kernels"]) == N_UNITS - 1, code["bwd"]
        for c in code.values():
            assert all(c["ag_kernels"]) and all(c["rs_kernels"]), c
            assert c["ag_in_flight"] == 1, c
            assert c["ag_inputs_freed_early"] == 0, c
        # No placeholder holds storage after a step.
        assert r["bytes_after_step"] == [0] * STEPS
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=0)
        worst = max(r["param_diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, worst
        compiled, eager = r["first_loss"]
        assert abs(compiled - eager) <= 1e-6 * abs(eager), r["first_loss"]  # fp32 reorderings
        _check_final_schedule(tmp_path / f"rank{rank}", r)
    coll = json.loads((tmp_path / "rank0" / "collectives.json").read_text())
    stages = [(g["name"], g["stage"]) for g in coll["graphs"]]
    assert {("00_fwd", "scheduled"), ("01_bwd", "scheduled"), ("03_fwd", "scheduled")} <= set(
        stages), stages
    assert compare_dumps([tmp_path / "rank0", tmp_path / "rank1"]).startswith("ranks agree")


def _check_final_schedule(dump_dir: Path, r: dict[str, Any]) -> None:
    """The dump's final schedule of one rank's Inductor graphs (``r["scheduled"]``):
    the step's forward (00_fwd) and backward (01_bwd), and the tiny model's
    passes-off forward (03_fwd)."""
    recs = {rec["name"]: rec for rec in r["scheduled"]}
    assert r["step_graphs"] == ["00_fwd", "01_bwd", "02_fwd"], r["step_graphs"]
    assert r["passes_off_graphs"] == ["03_fwd"], r["passes_off_graphs"]
    # 02_fwd, the step's rest after the backward() graph break (``loss.detach()``),
    # is dynamo's graph only: nothing in it for Inductor to lower or schedule.
    assert sorted(recs) == ["00_fwd", "01_bwd", "03_fwd"], sorted(recs)
    for rec in recs.values():
        assert (dump_dir / rec["file"]).read_text().count("def call(") == 1
        assert rec["schedule_note"].endswith(
            "are in the order torch logged (inductor_collective_schedule)"
        ), rec["schedule_note"]
        rows = rec["collectives"]
        # The final order: issues in graph order, each wait after its issue, every
        # collective waited for in its graph.
        issued = [c["issued_at"] for c in rows]
        assert issued == sorted(issued)
        assert all(c["waited_at"] > c["issued_at"] for c in rows), rows
        for c in rows:
            assert rec["schedule"][c["issued_at"]] == f"C{c['index']}"
            assert rec["schedule"][c["waited_at"]] == f"W{c['index']}"
            between = rec["schedule"][c["issued_at"] + 1 : c["waited_at"]]
            assert c["kernels_before_wait"] == sum(
                1 for e in between if not re.fullmatch(r"[CW](\d+|-)", e)
            )
            assert c["unit"] is not None and c["params"], c
    fwd, bwd = recs["00_fwd"]["collectives"], recs["01_bwd"]["collectives"]
    # One bucketed all-gather per unit: the root (labelled by its class) first, then
    # the blocks (by their path). Each but the first is issued before the previous
    # unit's compute (prefetch): kernels run before its wait. The first has no
    # compute of its own to overlap with: between its issue and the second's, one
    # kernel runs, the second bucket's copy-in, which Inductor places after the
    # first's wait (torch 2.13, 2.14) or before it (2.15). Over two gloo ranks each
    # all-gather is an exchange (all_gather_by_exchange).
    agx = ("all_to_all_single", "all_gather")
    assert [(c["op"], c["family"], c["unit"]) for c in fwd] == [(*agx, "Llama")] + [
        (*agx, f"layers.{i}") for i in range(N_LAYERS)
    ], fwd
    sched = recs["00_fwd"]["schedule"]
    first_to_second = sched[fwd[0]["issued_at"] + 1 : fwd[1]["issued_at"]]
    assert sum(1 for e in first_to_second if not re.fullmatch(r"[CW](\d+|-)", e)) == 1, sched
    assert all(c["kernels_before_wait"] >= 1 for c in fwd[1:]), sched
    # Over two gloo ranks each reduce-scatter is an exchange (see [Note: gloo
    # reduce-scatters as an exchange] in passes/gloo/exchange.py).
    rs = [c for c in bwd if (c["op"], c["family"]) == ("all_to_all_single", "reduce_scatter")]
    assert rs and any(c["kernels_before_wait"] >= 1 for c in rs), recs["01_bwd"]["schedule"]
    # Passes off: one all-gather per parameter, each waited for right after it is
    # issued (the runtime's order; Inductor's scheduler keeps it).
    off = recs["03_fwd"]["collectives"]
    assert [c["params"] for c in off] == [
        ("0.weight",), ("0.bias",), ("2.weight",), ("2.bias",)
    ] * 2, off
    assert all(c["kernels_before_wait"] == 0 for c in off), recs["03_fwd"]["schedule"]
    label = "all_to_all_single as all_gather"
    overlapped = N_UNITS - (fwd[0]["kernels_before_wait"] == 0)
    assert f"overlap: {label}: {overlapped} of {N_UNITS} with >=1 kernel" in r["summary"], (
        r["summary"])
    assert "wait after" in r["summary"]
    # The overlap pass keeps one all-gather in flight, and Inductor's scheduler does
    # not add one (the passes-off forward's are into buffers: every pass off).
    assert recs["00_fwd"]["in_flight"][label] == recs["01_bwd"]["in_flight"][label] == 1, [
        rec["in_flight"] for rec in recs.values()]
    assert recs["03_fwd"]["in_flight"]["all_gather_into_tensor_out"] == 1, recs["03_fwd"]


def _storage_events(graph: torch.fx.Graph) -> list[tuple[str, str]]:
    """The placeholder-storage events of a post-grad graph in node order: ``("grow",
    p)``, ``("copy", p)``, ``("free", p)``, with p the graph input written, and
    matmuls ``("mm", "")``."""
    from traceable_hsdp.passes import _graph as P
    from traceable_hsdp.passes import _rewrite as R

    out = []
    for n in graph.nodes:
        if P.is_resize(n):
            kind = "free" if P.resize_nbytes(n) == 0 else "grow"
        elif P.is_fsdp_copy(n):
            kind = "copy"
        elif n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            out.append(("mm", ""))
            continue
        else:
            continue
        base = R.alias_base(n.args[0])
        out.append((kind, base.name if base.op == "placeholder" else f"not an input: {base}"))
    return out


def _storage_lifecycle(events: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Per placeholder, its events in graph order, each followed by "mm" when a matmul
    came between it and that placeholder's next event."""
    seq: dict[str, list[str]] = {}
    for kind, name in events:
        if kind == "mm":
            for s in seq.values():
                if s and s[-1] != "free" and s[-1] != "mm":
                    s.append("mm")
        else:
            seq.setdefault(name, []).append(kind)
    return seq


def _two_models_worker(rank: int, world: int) -> dict[str, Any]:
    """An hsdp(comm_fusion=False) model, then a fully_shard model, each compiled by
    Inductor (forward, and backward under compiled autograd) in this one process; the
    collectives of every post-grad graph after our passes, by model. For the
    fully_shard model, a spy wrapped around our post-grad pre-pass also records the
    placeholder-storage events (:func:`_storage_events`) of each graph it is handed
    (the real post-grad graph, functionalized, before any of our passes), and how
    many storage events are left after our passes."""
    from torch import nn
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import traceable_hsdp as th
    from traceable_hsdp import passes
    from traceable_hsdp.passes import TraceableHSDPPass
    from traceable_hsdp.debug._recorder import PostGradRecorder
    from traceable_hsdp.debug._table import collective_totals
    from traceable_hsdp.passes._graph import annotation_of

    import logging

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("traceable_hsdp.passes._install").addHandler(Keep())
    config = passes.get_config()
    rec = PostGradRecorder()
    torch._inductor.config.post_grad_custom_post_pass = rec
    before: list[list[tuple[str, str]]] = []
    after: list[int] = []

    class Spy(CustomGraphPass):
        def __init__(self, ours: TraceableHSDPPass) -> None:
            self.ours = ours

        def __call__(self, graph: torch.fx.Graph) -> None:
            before.append(_storage_events(graph))
            self.ours(graph)
            after.append(sum(kind != "mm" for kind, _ in _storage_events(graph)))

        def uuid(self) -> None:
            return None  # never from the FX cache: every graph is seen

    out: dict[str, Any] = {}
    for name, shard in (
        ("hsdp_no_fusion", lambda m: th.hsdp(m, threshold=0)),
        ("fully_shard", th.fully_shard),
    ):
        rec.tag = name
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        for layer in (model[0], model[2], model):
            shard(layer)
        ours = torch._inductor.config.post_grad_custom_pre_pass
        assert isinstance(ours, TraceableHSDPPass), ours
        if name == "fully_shard":  # after the model's fully_shard calls, which install ours
            torch._inductor.config.post_grad_custom_pre_pass = Spy(ours)
        th.enable_compiled_autograd()
        try:
            compiled = torch.compile(model, fullgraph=True)
            compiled(torch.randn(4, 8)).sum().backward()
        finally:
            th.disable_compiled_autograd()
            torch._inductor.config.post_grad_custom_pre_pass = ours
        graphs = [g for g in rec.graphs if g.tag == name]
        out[name] = [
            dict(
                kind=g.kind,
                totals={k: v["count"] for k, v in collective_totals(g.final_graph()).items()},
                annotated=any(annotation_of(n) is not None for n in g.final_graph().nodes),
            )
            for g in graphs
        ]
    out["config_unchanged"] = passes.get_config() == config
    out["warnings"] = warnings
    out["storage_before_passes"], out["storage_after_passes"] = before, after
    return out


@pytest.mark.slow
def test_comm_fusion_off_per_model_and_placeholder_ops_before_passes(
    per_unit_buckets: None,
) -> None:
    """hsdp(comm_fusion=False) keeps its own units' collectives one per parameter and
    leaves bucketing on for a model compiled later in the same process
    (counted from the post-grad graphs after our passes, Inductor, 2 ranks). Two
    units of two parameters each (weight, bias) per model, under a root that holds
    none.

    The hsdp model's backward follows the process-wide PassConfig (all passes on):
    compiled-autograd backward graphs lose node annotations on torch 2.13 (see
    [Note: Collective annotations] in passes/_graph.py), so its reduce-scatters are
    bucketed per unit, and the passes log a warning saying so.

    The fully_shard model's real Inductor post-grad graphs (forward, and compiled
    autograd's backward), as our pre-pass receives them, i.e. after AOTAutograd's
    functionalization and before any of our passes: every placeholder (a graph
    input) is grown, filled by fsdp.copy_, read by a matmul, and freed, in that
    order; the forward does it for unit 0's two parameters before unit 2's, the
    backward (the re-gathers) in reverse. After our passes none of these nodes is
    left."""
    for r in run_ranks(_two_models_worker, 2):
        assert r["config_unchanged"]
        # ... and says so, once.
        assert len(r["warnings"]) == 1 and "carry no unit annotation" in r["warnings"][0], r["warnings"]
        for name, fwd_ag in (("hsdp_no_fusion", 4), ("fully_shard", 2)):
            fwd = [g for g in r[name] if g["kind"] == "fwd"]
            bwd = [g for g in r[name] if g["kind"] == "bwd"]
            assert len(fwd) == 1 and len(bwd) == 1, r[name]
            assert fwd[0]["annotated"] and not bwd[0]["annotated"], r[name]
            assert fwd[0]["totals"].get("all_gather") == fwd_ag, (name, fwd)
            assert bwd[0]["totals"].get("reduce_scatter") == 2, (name, bwd)
        # The fully_shard model before our passes: one forward, one backward graph.
        before = r["storage_before_passes"]
        assert len(before) == 2, before
        for events in before:
            life = _storage_lifecycle(events)
            assert len(life) == 4, events  # 2 units x (weight, bias)
            for name, seq in life.items():
                assert seq == ["grow", "copy", "mm", "free"], (name, events)
            # Unit by unit: both of a unit's placeholders are freed before the next
            # unit's are grown.
            order = [name for kind, name in events if kind == "grow"]
            frees = [name for kind, name in events if kind == "free"]
            grows_at = {n: i for i, (k, n) in enumerate(events) if k == "grow"}
            frees_at = {n: i for i, (k, n) in enumerate(events) if k == "free"}
            assert max(frees_at[n] for n in order[:2]) < min(grows_at[n] for n in order[2:]), events
            assert set(frees[:2]) == set(order[:2]), events
        assert r["storage_after_passes"] == [0, 0], r["storage_after_passes"]
