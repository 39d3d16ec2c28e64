#!/usr/bin/env python
"""Training step time of traceable_hsdp against torch's fully_shard, on 2 gloo ranks
(CPU) or one NCCL rank per GPU (CUDA).

    python benchmarks/step_time.py --out DIR [--shape overhead|compute|both] [--steps N]
                                   [--rounds R] [--processes N] [--smoke] [--backend B]
                                   [--model demo|hf_llama] [--vocab N] [--heap]
                                   [--device auto|cpu|cuda] [--world N]

Spawns the ranks (``--device auto``: CUDA when ``torch.cuda.is_available()``, else the
CPU; 2 gloo ranks of one thread each on the CPU, one NCCL rank per visible GPU on
CUDA; see [Note: Where the ranks run] in ``_harness.py``) and, in one run, times these
variants of the
same step (forward, cross-entropy, backward, AdamW step, zero_grad) on the same model
(same seed) and the same batches, alternating round-robin between them (see
[Note: Round-robin timing] in ``_harness.py``), or, with ``--processes N``, each alone
in its own ranks, N times (see [Note: One model per process]):

- ``ours_eager``: ``traceable_hsdp.fully_shard`` per block then root, eager;
- ``ours_compiled``: the same under ``torch.compile(model, fullgraph=True)`` with
  ``traceable_hsdp.enable_compiled_autograd()``, all passes on;
- ``ours_compiled_nopasses`` (and ``ours_compiled_no_<pass>`` per switchable pass);
- ``ours_compiled_per_unit``, ``ours_compiled_cap1mb``, ``ours_compiled_cap16mb``:
  every pass, with one bucket per unit (``bucket_cap_mb=None``) or adjacent units'
  collectives merged up to 1 or 16 MiB, beside ``ours_compiled``'s default of 4 MiB
  (see [Note: The default bucket cap] in ``passes/bucket_collectives.py``). These and
  the pass switches above compile the same graphs as ``ours_compiled`` with other
  passes, so they run only when named, and beside ``ours_compiled`` only with
  ``--processes`` (see [Note: Variants that would share compiled graphs]);
- ``ours_compiled_local_adamw``: ``ours_compiled`` stepping with
  ``traceable_hsdp.optim.AdamW`` (torch's AdamW numbers on the local shards);
- ``ours_compiled_reshard_root``: ``ours_compiled`` with ``reshard_after_forward=True``
  on every unit, the root too (its backward re-gathers the root; the default, ``None``
  as torch's, keeps the root gathered from forward to backward);
- ``ours_block_compiled``: torchtitan's per-block recipe (below) with
  ``traceable_hsdp.fully_shard``: the blocks compiled, the unit's gathers and
  reductions run eagerly around them (no compiled autograd);
- ``ours_block_compiled_ca``: the same recipe in its in-place form
  (``block.compile(fullgraph=True)``) with compiled autograd on: each block's
  gathers traced in its graph (one graph for every block), the backward one
  compiled-autograd graph;
- ``torch_eager``: ``torch.distributed.fsdp.fully_shard`` per block then root, eager;
- ``torch_block_compiled_local_adamw``: ``torch_block_compiled`` with the same
  optimizer (it steps torch's ``fully_shard`` parameters just as well);
- ``torch_block_compiled``: torchtitan's recipe, every block
  ``torch.compile(block, fullgraph=True)`` then torch's fully_shard: each block's
  forward and backward compiled, fully_shard's collectives run between the blocks;
- ``unsharded_compiled_1rank``: the plain model compiled, on rank 0 alone with the same
  per-rank batch (the other ranks wait in a barrier meanwhile): the no-communication
  floor.

The model (``--model``): ``demo``, the Llama of ``traceable_hsdp.demo.models`` (MLP four
times the width); ``hf_llama``, Hugging Face ``transformers``' ``LlamaForCausalLM`` of
the same shape (MLP twice the width, ``use_cache=False``, random weights, nothing
downloaded; ``_harness.build_hf_llama``, which ``compile_time.py`` builds too). Either
is sharded per block (decoder layer) then the root, in every variant alike. The
shapes' vocabulary is 256, so their output projection is small; ``--vocab N`` runs
them with another (the shape is then named ``<shape>_vocab<N>``, and no goal applies),
for a head as large as a real LM's.

Writes ``<out>/step_time_<shape>_<model>.md`` (the table, also printed), ``.json``
(every raw step time, every rank, losses, graph and collective counts, the device and
the memory metric) and ``.png`` (when matplotlib is importable: step time and compile
time per variant, the torch version and CPU in its title) into the folder ``--out``
names (required). Tables and plots name the variants as ``_report.label`` does ([Note:
Report names] in ``_report.py``), and a cell that cannot be measured says why ([Note:
Cells that cannot be measured]). The memory column is the peak
RSS on the CPU (with ``--heap``, each variant's heap peak above its blocks' start) and
``torch.cuda.max_memory_allocated()`` on CUDA (see [Note: Memory per variant] in
``_harness.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _report as R  # noqa: E402

LOSS_TOL = 1e-4
# Timing defaults: every variant steps once per round, for many rounds ([Note:
# Round-robin timing] in _harness.py).
DEFAULT_STEPS, DEFAULT_ROUNDS, DEFAULT_WARMUP = 1, 20, 0
REF_BLOCK, REF_EAGER = "torch_block_compiled", "torch_eager"
# The step-time issue's goals, per shape: (variant, reference, the most its median step
# may be as a multiple of the reference's).
GOALS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "overhead": (("ours_compiled", REF_BLOCK, 0.5), ("ours_eager", REF_EAGER, 1.15)),
    "compute": (("ours_compiled", REF_BLOCK, 0.65), ("ours_eager", REF_EAGER, 1.15)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import _harness as H

    p = argparse.ArgumentParser(
        prog="step_time.py",
        description=(
            "Step time of traceable_hsdp (eager, compiled, per pass) against torch's "
            "fully_shard (eager, per-block compiled) and an unsharded 1-rank floor, on 2 "
            "spawned gloo ranks (CPU) or one NCCL rank per GPU (CUDA), alternating "
            "round-robin between variants."
        ),
    )
    H.add_placement_args(p)
    p.add_argument("--vocab", type=int, default=None, metavar="N",
                   help="the vocabulary (and so the output projection) of the shapes run, "
                        "named <shape>_vocab<N> in the report, where no goal applies "
                        "(default: the shape's, 256; a real LM's head is far larger)")
    p.add_argument("--shape", choices=("overhead", "compute", "both"), default="both",
                   help="overhead: 16 layers, dim 64, seq 32; compute: 4 layers, dim 256, "
                        "seq 128; both batch 2 per rank, 4 heads, vocab 256 (default both)")
    # Defaults: one step per variant per round, many rounds; see [Note: Round-robin
    # timing] in _harness.py for why the variants alternate step by step.
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per variant per round (default {DEFAULT_STEPS}; --smoke 2)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds (default {DEFAULT_ROUNDS}; --smoke 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per variant at the start of each round, after the "
                        f"compile step of round 1 (default {DEFAULT_WARMUP}; --smoke 1)")
    R.add_out_argument(p, required=False)  # required unless --table-from, checked below
    p.add_argument("--table-from", nargs="+", default=None, metavar="JSON",
                   help="run nothing: print the short table docs/benchmarks.md shows (with "
                        "the run's date, commit, torch, CPU, load and the goals) of each "
                        "step_time_*.json named")
    p.add_argument("--model", choices=H.MODELS, default="demo",
                   help="demo: traceable_hsdp.demo.models.Llama; hf_llama: transformers' "
                        "LlamaForCausalLM of the same shape, MLP twice the width (default demo)")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of every compiled variant (default inductor; "
                        "collectives are only counted with inductor)")
    p.add_argument("--variants", default=None,
                   help="comma list of variant names to run, in that order within each "
                        "round (default: all in the harness's order but the pass switches "
                        "and bucket caps, ours_compiled_no_*, _nopasses, _per_unit, _cap*, "
                        "which need --processes beside ours_compiled: [Note: Variants that "
                        "would share compiled graphs] in _harness.py)")
    p.add_argument("--processes", type=int, default=0, metavar="N",
                   help="run each variant alone in its own spawned ranks, N times, the order "
                        "reversed every other time, instead of all variants in one set of "
                        "ranks (a user's process holds one model; see [Note: One model per "
                        "process] in _harness.py). Default 0: all in one set, round-robin")
    H.add_adamw_argument(p)
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny check of the harness: 2 layers, dim 32, seq 16, 2 steps, 1 round")
    p.add_argument("--no-graph-count", action="store_true",
                   help="skip the extra profiled step per compiled variant that counts graph calls")
    p.add_argument("--keep-inductor-cache", action="store_true",
                   help="use the usual Inductor cache dir instead of a fresh one (compile "
                        "times then depend on earlier runs)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--heap", action="store_true",
                   help="CPU: the memory column is each variant's heap peak above its "
                        "blocks' start, counted in the ranks by benchmarks/heap_peak.c "
                        "(built with the C compiler, loaded with LD_PRELOAD; see [Note: A "
                        "heap peak on the CPU] in _heap.py) instead of the process's peak RSS")
    a = p.parse_args(argv)
    if a.out is None and a.table_from is None:
        p.error("the following arguments are required: --out")
    for name, default, smoke in (("steps", DEFAULT_STEPS, 2), ("rounds", DEFAULT_ROUNDS, 1),
                                 ("warmup", DEFAULT_WARMUP, 1)):
        if getattr(a, name) is None:
            setattr(a, name, smoke if a.smoke else default)
    for name in ("steps", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if a.processes < 0:
        p.error(f"--processes must be >= 0, got {a.processes}")
    if a.vocab is not None and a.vocab < 1:
        p.error(f"--vocab must be >= 1, got {a.vocab}")
    a.placement = H.placement_from_args(p, a)
    if a.heap:
        if a.placement.device_type != "cpu":
            p.error("--heap is for the CPU (on CUDA the memory column is "
                    "torch.cuda.max_memory_allocated() already)")
        if a.processes:
            p.error("--heap takes the variants round-robin in one set of ranks; "
                    "leave out --processes")
        a.placement = dataclasses.replace(a.placement, heap=True)
    return a


# ---------------------------------------------------------------------- report


def _rounds_phrase(rounds: int, steps: int) -> str:
    """``20 rounds x 1 timed step``."""
    return (f"{rounds} round{'s' if rounds != 1 else ''} x {steps} timed "
            f"step{'s' if steps != 1 else ''}")


def _warmup_phrase(warmup: int) -> str:
    if warmup == 0:
        return "no warm-up after round 1's compile step"
    return f"+{warmup} warm-up step{'s' if warmup != 1 else ''} per round"


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _variant_memory(v: dict[str, Any], metric_key: str) -> tuple[float | None, float | None]:
    """(the variant's memory figure, its peak above the block's start) on one rank, for
    the run's memory metric (its ``key``). See [Note: Memory per variant] in
    ``_harness.py``: the CPU's peak RSS after round 1 (no second number); on CUDA the
    largest max-allocated over the variant's blocks and the largest peak above a block's
    start; the CPU's heap peak both times the largest peak above a block's start over
    the blocks after the first (the compile's), or the first when there is no other."""
    import _harness as H

    peaks, starts = v["peak_mem_mib"], v["allocated_at_start_mib"]
    if not peaks:
        return None, None
    if metric_key == H.PEAK_RSS.key:
        return peaks[0], None
    above = [p - a for p, a in zip(peaks, starts) if a is not None]
    if metric_key == H.HEAP_PEAK.key:
        figure = max(above[1:] or above) if above else None
        return figure, figure
    return max(peaks), (max(above) if above else None)


def summarize(shape: Any, ranks: list[dict[str, Any]], placement: Any) -> dict[str, Any]:
    """Per-variant numbers from the ranks' raw results (rank 0's clock; per-rank lists
    in rank order)."""
    import _harness as H

    world = len(ranks)
    r0 = ranks[0]
    rows: dict[str, dict[str, Any]] = {}
    failed: dict[str, dict[str, Any]] = {}
    for name in r0["order"]:
        vs = [r["variants"][name] for r in ranks]
        v0 = vs[0]
        times = [t for rnd in v0["timed"] for t in rnd]
        own = [r for r, v in enumerate(vs) if v["error"] and v["error"] != H.FAILED_ELSEWHERE]
        err = next((v["error"] for v in vs if v["error"]), None) or (
            None if times else "no complete timed round"
        )
        if err:
            mine = vs[own[0]] if own else v0
            failed[name] = dict(
                error=mine["error"] or err, traceback=mine["traceback"] or "",
                failed_on_rank=own, steps_done=len(v0["losses"]), losses_rank0=v0["losses"],
            )
            continue
        med = statistics.median(times)
        unsharded = name.startswith("unsharded")
        tokens = shape.batch * shape.seq * (1 if unsharded else world)
        recompiles = [v["compiles_after"][0] + v["compiles_after"][1] for v in vs]
        mem = [_variant_memory(v, placement.memory_metric.key) for v in vs]
        rows[name] = dict(
            median_s=med,
            p25_s=_q(times, 0.25),
            p75_s=_q(times, 0.75),
            n_timed=len(times),
            round_medians_s=[statistics.median(r) for r in v0["timed"]],
            tokens_per_s=tokens / med,
            first_step_s=v0["first_step_s"],
            compile_s=R.compile_seconds(v0["first_step_s"], med),
            recompiles_after_warmup=recompiles,
            compiles_first_step=v0["compiles_first_step"],
            graph_calls=v0["graph_calls"],
            profiled_step_compiles=v0["profiled_step_compiles"],
            collectives=v0["collectives"],
            # per rank, the placement's memory metric (summary["memory_metric"])
            peak_mem_mib=[m[0] for m in mem],
            peak_above_block_start_mib=[m[1] for m in mem],
            first_step_s_per_process=v0.get("first_step_s_per_process"),
            losses_same_in_every_process=all(v.get("losses_same_in_every_process", True) for v in vs),
            loss_step1=v0["losses"][0],
            losses_rank0=v0["losses"],
            losses_rank1=vs[1]["losses"] if world > 1 else [],
        )
    for ref in (REF_BLOCK, REF_EAGER):
        if ref in rows:
            for row in rows.values():
                row[f"vs_{ref}"] = row["median_s"] / rows[ref]["median_s"]
    # Correctness: step-1 local loss of rank 0 on every variant (same weights, same
    # batch); sharded variants also compared over all steps against torch_eager.
    l1 = {k: r["loss_step1"] for k, r in rows.items()}
    l1.update({k: f["losses_rank0"][0] for k, f in failed.items() if f["losses_rank0"]})
    spread = max(l1.values()) - min(l1.values()) if len(l1) > 1 else 0.0
    traj: dict[str, float] = {}
    if REF_EAGER in rows:
        ref = rows[REF_EAGER]["losses_rank0"]
        for k, r in rows.items():
            if not k.startswith("unsharded"):
                n = min(len(ref), len(r["losses_rank0"]))
                traj[k] = max(abs(a - b) for a, b in zip(ref[:n], r["losses_rank0"][:n]))
    return dict(
        rows=rows,
        failed=failed,
        loss_step1=l1,
        loss_step1_spread=spread,
        loss_ok=spread <= LOSS_TOL,
        loss_compared=len(l1),
        loss_traj_max_diff_vs_torch_eager=traj,
        peak_rss_mib=[r["peak_rss_mib"] for r in ranks],
        memory_metric=dict(vars(placement.memory_metric)),
        incomplete=r0.get("incomplete"),
    )


def _fmt(x: float | None, spec: str) -> str:
    return R.num(x, spec)


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _coll_cells(name: str, r: dict[str, Any]) -> tuple[str, str]:
    # A per-block variant's fully_shard (torch's or ours) issues its collectives
    # between the compiled blocks: outside any Inductor graph, whatever the graphs
    # hold. See [Note: Cells that cannot be measured] (_report.py). A row saved
    # before the compile mode was recorded names it: torch's variants only.
    c = r["collectives"]
    compile_mode = r.get("compile", "blocks" if name.startswith("torch") else None)
    if compile_mode in ("blocks_ca", "per_block"):
        return R.NOT_COUNTED_PER_BLOCK, R.NOT_COUNTED_PER_BLOCK
    if compile_mode == "blocks" or not c or not c.get("inductor_graphs"):
        return R.NOT_COUNTED, R.NOT_COUNTED
    per = c["per_step"]
    n = "/".join(str(per.get(k, {}).get("count", 0)) for k in ("all_gather", "reduce_scatter", "all_reduce"))
    mb = sum(v["bytes"] for v in per.values()) / 2**20
    return n, f"{mb:.2f}"


def ranks_label(world: int) -> str:
    """Which ranks a per-rank cell shows: ``r0``, ``r0/r1``, or rank 0 and the largest
    of the others (``r0/max r1-r7``)."""
    if world == 1:
        return "r0"
    if world == 2:
        return "r0/r1"
    return f"r0/max r1-r{world - 1}"


def per_rank_cell(values: list[Any], spec: str, sep: str = " / ", idle: str | None = None) -> str:
    """``values`` (one per rank) as :func:`ranks_label` lists them; ``idle`` in place of
    the other ranks when only rank 0 ran (the unsharded variant)."""
    first = _fmt(values[0], spec)
    if len(values) == 1:
        return first
    if idle is not None:
        return f"{first}{sep}{idle}"
    rest = [v for v in values[1:] if v is not None]
    return f"{first}{sep}{_fmt(max(rest) if rest else None, spec)}"


def payback_cell(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """After how many steps a compiled variant's extra compile time against torch's
    per-block compiled ``fully_shard`` (``ref``) is paid back by its faster steps."""
    if ref is None or row is ref:
        return "–"
    if not row.get("compiled", True):
        return R.NO_COMPILE
    if row["compile_s"] is None or ref["compile_s"] is None:
        return "–"
    extra = row["compile_s"] - ref["compile_s"]
    saved = ref["median_s"] - row["median_s"]
    if extra <= 0:
        return "0 (compiles faster)"
    if saved <= 0:
        return "never (steps not faster)"
    import math

    return str(math.ceil(extra / saved))


def device_line(dev: dict[str, Any]) -> str:
    """Where the ranks ran, from ``meta["device"]``."""
    world = dev["world"]
    ranks = f"{world} {dev['backend']} rank{'s' if world != 1 else ''}"
    if dev["type"] == "cuda":
        names = sorted(set(dev["names"]))
        return (
            f"Device `cuda`: {ranks}, one per GPU, on {world} of {dev['visible']} visible "
            f"GPU(s) ({', '.join(names)})"
        )
    return f"Device `cpu` ({dev['names'][0]}): {ranks} x 1 thread on {dev['cpus']} CPU cores"


def markdown(shape: Any, args: argparse.Namespace, s: dict[str, Any], meta: dict[str, Any]) -> str:
    rows = s["rows"]
    world = meta["device"]["world"]
    metric = s["memory_metric"]
    import _harness as H

    lines = [
        f"### Shape `{shape.name}`: {H.model_description(meta.get('model', 'demo'), shape)}, "
        f"{shape.layers} layers, {shape.heads} heads, "
        f"vocab {shape.vocab}, seq {shape.seq}, batch {shape.batch} per rank",
        "",
        f"{device_line(meta['device'])}"
        + (f"; CPU {meta['cpu']}" if meta.get("cpu") else "") + "; torch "
        f"{meta['torch']}; backend `{args.backend}`; "
        + (f"each variant alone in its own ranks, {args.processes} processes of it "
           f"(the order reversed every other time; one Inductor cache: the first compiles "
           f"cold), each {_rounds_phrase(args.rounds, args.steps)} "
           if args.processes else f"{_rounds_phrase(args.rounds, args.steps)} per variant ")
        + f"({_warmup_phrase(args.warmup)}); medians over all "
        f"{max([r['n_timed'] for r in rows.values()] or [0])} timed steps, rank 0's clock; "
        f"{H.adamw_phrase(args.adamw)}. {meta['passes']}.",
        "",
        "| variant | median step (ms) | p25-p75 (ms) | tokens/s "
        f"| vs {R.label(REF_BLOCK)} | vs {R.label(REF_EAGER)} | compile (s) "
        f"| steps to pay back the compile vs {R.label(REF_BLOCK)} "
        f"| recompiles after warm-up ({ranks_label(world).replace('/', ', ')}) "
        "| graphs/step (dynamo / inductor) | collectives/step AG/RS/AR | collective MiB/step "
        f"| {metric['column']}, {ranks_label(world)} | loss step 1 (rank 0) |",
        "|" + "---|" * 14,
    ]
    for name, r in rows.items():
        gc = r["graph_calls"]
        compiled = r.get("compiled", True)
        graphs = (f"{gc['dynamo_frames']} / {gc['inductor_graphs']}" if gc
                  else R.NO_COMPILE if not compiled
                  else "not counted (--no-graph-count)" if args.no_graph_count else "–")
        coll_n, coll_mb = _coll_cells(name, r)
        unsharded = name.startswith("unsharded")
        mem_spec = ".1f" if metric["key"] == H.HEAP_PEAK.key else ".0f"
        mem_cell = per_rank_cell(r["peak_mem_mib"], mem_spec, idle="idle" if unsharded else None)
        recompiles_cell = per_rank_cell(
            r["recompiles_after_warmup"], "d", sep=", ", idle="–" if unsharded else None
        )
        compile_cell = _fmt(r["compile_s"], ".1f") if compiled else R.NO_COMPILE
        payback = payback_cell(r, rows.get(REF_BLOCK))
        lines.append(
            f"| {R.row_name(name)} | {r['median_s'] * 1e3:.1f} "
            f"| {r['p25_s'] * 1e3:.1f}-{r['p75_s'] * 1e3:.1f} "
            f"| {r['tokens_per_s']:.0f}{' (1 rank)' if unsharded else ''} "
            f"| {_ratio(r.get('vs_' + REF_BLOCK))} | {_ratio(r.get('vs_' + REF_EAGER))} "
            f"| {compile_cell} | {payback} | {recompiles_cell} "
            f"| {graphs} | {coll_n} | {coll_mb} | {mem_cell} | {r['loss_step1']:.6f} |"
        )
    for name, f in s["failed"].items():
        first = f["error"].splitlines()[0][:160]
        lines.append(
            f"| {R.row_name(name)} | FAILED after {f['steps_done']} step(s) on rank(s) "
            f"{f['failed_on_rank']}: `{first}` |" + " |" * 13
        )
    lines.append("")
    if s.get("incomplete"):
        lines.append(f"**Incomplete run**: {s['incomplete']}. The table holds the complete rounds.")
    verdict = (
        "OK" if s["loss_ok"] and s["loss_compared"] > 1
        else "MISMATCH" if not s["loss_ok"] else "nothing to compare"
    )
    lines.append(
        f"Loss check (step 1, rank 0, every variant that got through step 1, from the same "
        f"weights and batch): spread {s['loss_step1_spread']:.2e} (tolerance {LOSS_TOL:g}): "
        f"**{verdict}**."
    )
    if s["loss_traj_max_diff_vs_torch_eager"]:
        worst = max(s["loss_traj_max_diff_vs_torch_eager"].items(), key=lambda kv: kv[1])
        lines.append(
            f"Sharded variants over all their steps vs {R.label(REF_EAGER)}: max |loss diff| "
            f"{worst[1]:.2e} ({R.label(worst[0])})."
        )
    if args.processes:
        lines.append(
            "First step of each process, in run order (s): "
            + "; ".join(f"{R.label(n)} " + ", ".join(_fmt(t, ".1f") for t in r["first_step_s_per_process"])
                        for n, r in rows.items())
            + ". Losses the same in every process of a variant: "
            + ("**yes**" if all(r["losses_same_in_every_process"] for r in rows.values()) else "**NO**")
            + "."
        )
    lines.extend(goal_lines(shape.name, rows))
    lines.append(f"Memory metric: {metric['label']}: {metric['what']}"
                 + ("; here every variant ran in its own processes, and the figure is the "
                    "largest over them." if args.processes else "."))
    above = {
        name: r["peak_above_block_start_mib"][0] for name, r in rows.items()
        if r["peak_above_block_start_mib"][0] is not None
    }
    if above and metric["key"] == H.GPU_MAX_ALLOCATED.key:
        lines.append(
            "GPU peak above the allocation at the block's start (the variant's own model, "
            "optimizer state and activations in its first block), rank 0: "
            + ", ".join(f"{R.label(n)} +{v:.0f} MiB" for n, v in above.items()) + "."
        )
    rss_end = ", ".join(f"rank {i} {v:.0f} MiB" for i, v in enumerate(s["peak_rss_mib"]))
    host = " (host)" if meta["device"]["type"] == "cuda" else ""
    lines.append(f"Peak RSS per process at the end{host}"
                 f"{' (the largest over all processes of the rank)' if args.processes else ''}: {rss_end}.")
    return "\n".join(lines) + "\n"


def goal_lines(shape_name: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """One line per goal of :data:`GOALS` for this shape: the ratio of medians and
    whether it is met, or why it cannot be said."""
    out = []
    for name, ref, most in GOALS.get(shape_name, ()):
        what = f"Goal: {R.label(name)} at most {most:g}x {R.label(ref)}"
        if name not in rows or ref not in rows:
            out.append(f"{what}: not measured in this run.")
            continue
        ratio = rows[name]["median_s"] / rows[ref]["median_s"]
        out.append(f"{what}: {ratio:.2f}x, **{'met' if ratio <= most else 'not met'}**.")
    return out


def doc_table(report: dict[str, Any]) -> str:
    """The short table of one ``step_time_*.json`` that ``docs/benchmarks.md`` shows:
    where and when it ran, and per variant the median step, its ratios to torch's
    per-block compiled and eager ``fully_shard``, the first step and the compile time
    in it, the steps to pay that back, and the collectives per step; then the loss
    check and the goals. Every number is read from the report."""
    import _harness as H

    meta, s, args = report["meta"], report["summary"], report["args"]
    shape = H.Shape(**report["shape"])
    rows = s["rows"]
    commit = R.code_line(meta["code"]).removeprefix("Code: ")
    lb, la = meta["loadavg_before"], meta["loadavg_after"]
    lines = [
        f"Run started {meta.get('started_utc', '?')}, {commit}; "
        f"{H.model_description(meta.get('model', 'demo'), shape)}, {shape.layers} layers, "
        f"{shape.heads} heads, vocab {shape.vocab}, seq {shape.seq}, batch {shape.batch} "
        f"per rank; {device_line(meta['device'])}; CPU {meta.get('cpu', '?')}; torch "
        f"{meta['torch']}; backend `{args['backend']}`; "
        f"{_rounds_phrase(args['rounds'], args['steps'])} per variant, round-robin, "
        f"medians of rank 0's clock; {H.adamw_phrase(args.get('adamw', 'default'))}; "
        f"{'Inductor cache as left by earlier runs' if args.get('keep_inductor_cache') else 'fresh Inductor cache'}. Load average (1 min) {lb[0]:.1f} at the start, {la[0]:.1f} "
        f"at the end ({la[2]:.1f} over the last 15 min); wall time {meta['wall_s'] / 60:.0f} min.",
        "",
        f"| variant | median step (ms) | p25-p75 (ms) | vs {R.label(REF_BLOCK)} "
        f"| vs {R.label(REF_EAGER)} | first step (s) | compile (s) "
        f"| steps to pay back vs {R.label(REF_BLOCK)} | collectives/step AG/RS/AR |",
        "|" + "---|" * 9,
    ]
    for name, r in rows.items():
        compiled = r.get("compiled", True)
        coll_n, _ = _coll_cells(name, r)
        lines.append(
            f"| {R.label(name)} | {r['median_s'] * 1e3:.1f} "
            f"| {r['p25_s'] * 1e3:.1f}-{r['p75_s'] * 1e3:.1f} "
            f"| {_ratio(r.get('vs_' + REF_BLOCK))} | {_ratio(r.get('vs_' + REF_EAGER))} "
            f"| {_fmt(r['first_step_s'], '.1f')} "
            f"| {_fmt(r['compile_s'], '.1f') if compiled else R.NO_COMPILE} "
            f"| {payback_cell(r, rows.get(REF_BLOCK))} | {coll_n} |"
        )
    for name, f in s["failed"].items():
        lines.append(f"| {R.label(name)} | FAILED: `{f['error'].splitlines()[0][:120]}` |"
                     + " |" * 7)
    lines.append("")
    verdict = "OK" if s["loss_ok"] and s["loss_compared"] > 1 else "MISMATCH"
    lines.append(
        f"Loss check: step-1 loss of rank 0 equal across the {s['loss_compared']} variants "
        f"within {LOSS_TOL:g} (spread {s['loss_step1_spread']:.1e}): **{verdict}**."
    )
    goals = goal_lines(shape.name, rows)
    if goals:
        lines.append("")
        lines.extend(f"- {g}" for g in goals)
    return "\n".join(lines) + "\n"


def plot(shape: Any, s: dict[str, Any], path: str, where: str, about: str = "") -> str | None:
    """Writes the step-time and compile-time chart to ``path``; ``None`` without
    matplotlib."""
    fig = figure(shape, s, where, about)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(shape: Any, s: dict[str, Any], where: str, about: str = "") -> Any:
    """The step-time bar chart (left) and the compile time of each variant's first step
    (right): one bar per variant, by name, coloured by implementation with a legend;
    ``about`` (the model, torch version, CPU, commit) goes in the title. ``None``
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(s["rows"])
    med = [s["rows"][n]["median_s"] * 1e3 for n in names]
    lo = [m - s["rows"][n]["p25_s"] * 1e3 for m, n in zip(med, names)]
    hi = [s["rows"][n]["p75_s"] * 1e3 - m for m, n in zip(med, names)]
    from matplotlib.patches import Patch

    groups = [R.group(n) for n in names]
    colors = [R.GROUP_COLORS[g] for g in groups]
    labels = [R.label(n) for n in names]
    fig, (ax, cax) = plt.subplots(
        1, 2, figsize=(14, 0.5 * len(names) + 2.6), sharey=True,
        gridspec_kw=dict(width_ratios=[3, 2]),
    )
    ax.barh(labels, med, xerr=[lo, hi], color=colors, capsize=3)
    for y, (m, h) in enumerate(zip(med, hi)):
        ax.text(m + h, y, f"  {m:.0f}", va="center", ha="left", fontsize=7)
    ax.legend(handles=[Patch(color=R.GROUP_COLORS[g], label=g) for g in dict.fromkeys(groups)],
              loc="lower right", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms), bars p25-p75")
    ax.set_title("step time")
    comp = [s["rows"][n].get("compile_s") for n in names]
    cax.barh(labels, [c if c is not None else 0.0 for c in comp], color=colors)
    for y, c in enumerate(comp):
        cax.text(c if c is not None else 0.0, y,
                 f" {c:.1f}" if c is not None else f" {R.NO_COMPILE}",
                 va="center", ha="left", fontsize=7)
    cax.margins(x=0.25)
    cax.set_xlabel("compile (s): first step\nminus median step, cold cache")
    cax.set_title("compile time")
    title = f"shape {shape.name} ({shape.layers} layers, dim {shape.dim}), {where}"
    fig.suptitle(title + (f"\n{about}" if about else ""), fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------ main


def run_shape(shape_name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import _harness as H

    shape = H.SHAPES[shape_name]
    if args.vocab is not None:
        # Another shape: its own name, so no goal of GOALS applies to it.
        shape_name = f"{shape_name}_vocab{args.vocab}"
        shape = dataclasses.replace(shape, name=shape_name, vocab=args.vocab)
    variants, passes_line = H.all_variants()
    if args.variants:
        try:
            variants = H.pick_variants(variants, args.variants)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    else:
        variants = H.default_variants(variants)
    shared = H.graph_sharing_conflicts(variants)
    if shared and not args.processes:
        pairs = ", ".join(f"{a} and {b}" for a, b in shared)
        raise SystemExit(
            f"step_time: {pairs} compile the same model with different passes; in one "
            f"set of processes the later one would run the graphs the earlier one compiled "
            f"(dynamo and compiled autograd do not key on the passes: [Note: Variants that "
            f"would share compiled graphs] in benchmarks/_harness.py). Run them with "
            f"--processes N (each variant alone in its own ranks), or in separate runs."
        )
    variants = [dataclasses.replace(v, adamw=args.adamw) for v in variants]
    print(f"== step_time: model {args.model}, shape {shape_name}, variants {[v.name for v in variants]}; {passes_line}",
          flush=True)
    t0 = time.time()
    load_before = os.getloadavg()
    placement = args.placement
    run_args = dict(
        shape=shape, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
        backend=args.backend, seed=args.seed, progress=not args.no_progress,
        count_graphs=not args.no_graph_count, model=args.model,
    )
    with contextlib.ExitStack() as stack:
        if placement.heap:
            import _heap

            stack.enter_context(_heap.counting_children())  # the ranks are spawned
        if args.processes:
            ranks = H.run_isolated(placement, variants, args.processes, **run_args)
        else:
            ranks = H.run_spawned(placement, variants=variants, **run_args)
    wall = time.time() - t0
    device = dict(
        type=placement.device_type, backend=placement.backend, world=placement.world,
        names=[r["device"]["name"] for r in ranks],
        visible=torch.cuda.device_count() if placement.device_type == "cuda" else None,
        cpus=os.cpu_count(),
    )
    meta = dict(
        code=R.code_state(), device=device, memory_metric=dict(vars(placement.memory_metric)),
        world=placement.world, cpus=os.cpu_count(), torch=torch.__version__,
        python=platform.python_version(), machine=platform.platform(), passes=passes_line,
        wall_s=wall, inductor_cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default"),
        compile_threads=os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
        loadavg_before=load_before, loadavg_after=os.getloadavg(),
        model=args.model, cpu=R.cpu_name(),
        started_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
    )
    s = summarize(shape, ranks, placement)
    for v in variants:  # eager variants compile nothing: no compile time, no payback
        if v.name in s["rows"]:
            s["rows"][v.name]["compiled"] = v.compiled
            s["rows"][v.name]["compile"] = v.compile
            if not v.compiled:
                s["rows"][v.name]["compile_s"] = None
    md = markdown(shape, args, s, meta)
    stem_name = f"step_time_{shape_name}_{args.model}{H.adamw_suffix(args.adamw)}"
    code = meta["code"]
    dirty = code["dirty_runtime"]
    md += ((f"Code: commit {code['head']}" if code["head"] else f"Code: {code['root']} (not a git checkout)")
           + (f", with uncommitted changes in: {' '.join(l.split()[-1] for l in dirty.splitlines())}"
              f" (diff sha256 {code['diff_sha256']}, saved as {stem_name}.code.diff)"
              if dirty else (", runtime and passes as committed" if code["head"] else ""))
           + f". Started {meta['started_utc']}; wall time of this shape's run: {wall:.0f} s; "
           f"load average (1 min) "
           f"{meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after, "
           f"{meta['loadavg_after'][2]:.1f} over the last 15 min.\n")
    print()
    print(md, flush=True)
    for name, f in s["failed"].items():
        print(f"!! {name} FAILED on rank(s) {f['failed_on_rank']}:\n{f['traceback']}",
              file=sys.stderr, flush=True)
    if not s["loss_ok"]:
        l1 = s["loss_step1"]
        print("!" * 78 + f"\n!! LOSS MISMATCH at step 1 (spread {s['loss_step1_spread']:.3e} > "
              f"{LOSS_TOL:g}): {l1}\n" + "!" * 78, file=sys.stderr, flush=True)
    stem = R.write_report(args.out, stem_name, md, dict(
        args={**vars(args), "placement": dict(vars(placement))}, shape=vars(shape),
        meta=meta, summary=s, raw=ranks))
    if meta["code"]["diff"]:
        with open(stem + ".code.diff", "w") as f:
            f.write(meta["code"]["diff"] + "\n")
    about = (f"{H.model_description(args.model, shape).replace('`', '')}; torch {meta['torch']}; "
             f"CPU {meta['cpu']}, {meta['cpus']} cores"
             + (f"; GPU {device['names'][0]}" if placement.device_type == "cuda" else "")
             + ("" if args.adamw == "default" else f"; AdamW {args.adamw}=True")
             + (f"; commit {code['head']}" + (" + uncommitted changes" if dirty else "")
                if code["head"] else ""))
    png = plot(shape, s, stem + ".png", f"{placement.world} {placement.backend} ranks "
               f"({placement.device_type})", about)
    print(f"wrote {stem}.md, {stem}.json" + (f", {png}" if png else " (no matplotlib: no plot)"),
          flush=True)
    return s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # puts HERE on sys.path
    if args.table_from:
        for path in args.table_from:
            with open(path) as f:
                print(doc_table(json.load(f)))
        return 0
    if args.placement.device_type == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the ranks fill the cores
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiled step: no kineto chatter
    tmp_cache = None
    if not args.keep_inductor_cache:
        # Cold compiles for every run: a fresh cache dir (the ranks inherit it).
        tmp_cache = tempfile.TemporaryDirectory(prefix="step_time_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp_cache.name
    shapes = ["smoke"] if args.smoke else (["overhead", "compute"] if args.shape == "both" else [args.shape])
    ok = True
    try:
        for name in shapes:
            summary = run_shape(name, args)
            ok &= summary["loss_ok"] and not summary["failed"]
    finally:
        if tmp_cache is not None:
            tmp_cache.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
