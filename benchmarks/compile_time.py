#!/usr/bin/env python
"""First-step compile time of a training step, cold and warm, on one or more ranks.

    python benchmarks/compile_time.py --out DIR [--layers 4,8,16] [--repeats N] [--world N]
                                      [--variants a,b] [--compile-threads N]
                                      [--model demo|hf_llama]

For each layer count, each repeat and each variant, two fresh processes run one after
the other on one Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``), new and empty
for that repeat and variant: the first compiles **cold** (empty cache), the second
**warm** (what a restart of the same job gets). Each process joins a gloo group
of ``--world`` ranks (default 1; ``--world 2`` starts two processes per phase on the
one cache directory, so the sharded variants gather and reduce, and reports the
slower rank's first step; ``plain_whole`` stays on one rank), builds the model from
the same seed (``--model demo``: the demo Llama of
``traceable_hsdp.demo.models``, dim 64, 4 heads; ``--model hf_llama``: Hugging Face
``LlamaForCausalLM``, hidden 64, 4 heads, MLP 128, ``use_cache=False``, built by
``_harness.build_hf_llama``, as ``step_time.py --model hf_llama`` builds it; both vocab
256, seq 32, batch 2, ``--layers`` blocks), and times its first training step (forward, cross-entropy,
backward, AdamW step, ``zero_grad``), then a second one. Variants (a "block" is a
decoder layer):

- ``plain_whole``: the unsharded model under ``torch.compile(model, fullgraph=True)``,
  compiled autograd on (no sharding);
- ``torch_block_compiled``: torch's ``fully_shard`` per block and root, each block
  ``torch.compile(block, fullgraph=True)`` first (torchtitan's recipe): each block's
  forward and backward compiled, one graph reused by every block;
- ``ours_compiled``: ``traceable_hsdp.fully_shard`` per block and root,
  ``torch.compile(model, fullgraph=True)`` with ``enable_compiled_autograd()``;
- ``ours_per_block``: ``traceable_hsdp.fully_shard`` per block and root, then
  ``traceable_hsdp.compile_block(block, fullgraph=True)`` on each block, compiled
  autograd off (the units' collectives in each block's forward and backward graphs,
  one pair of graphs for every block; the root eager);
- ``ours_compiled_nofix``: the same with ``TRACEABLE_HSDP_STABLE_MESH_KEY=0`` (the
  ``DeviceMesh`` reducer off; see [Note: FX graph cache keys across processes] in
  ``traceable_hsdp/_cache.py``);
- ``ours_compiled_torch_fwd_key``: ``ours_compiled`` with
  ``TRACEABLE_HSDP_FORWARD_CACHE_KEY=0`` (torch's own key for the forward, which
  bypasses the FX graph cache; see [Note: The forward's BackwardState and the FX
  graph cache key] in ``traceable_hsdp/_cache.py``);
- ``ours_compiled_side_effect_info``: ``ours_compiled`` with
  ``TRACEABLE_HSDP_QUIET_SIDE_EFFECTS=0`` (torch's default ``"info"`` policy for
  dynamo's side-effect messages, formatted though nothing reads them; see [Note:
  Dynamo's side-effect messages] in ``traceable_hsdp/_compile.py``).

Each time is broken down with torch's own timers (``compilation_time_metrics``, read
through :class:`traceable_hsdp._cache.CompileTimes`: dynamo tracing, AOTAutograd,
Inductor lowering and codegen, C++ kernel compiles) and each compile's cache use is
counted from ``torch._dynamo.utils.counters`` (:class:`~traceable_hsdp._cache.CacheCounts`).
``--compile-threads`` (default 1) sets ``TORCHINDUCTOR_COMPILE_THREADS``: with one
thread the kernels compile in the timed process, so the kernel column is theirs.

Writes ``<out>/compile_time_<model>.md`` (the table, also printed), ``.json`` (every
process's numbers) and ``.png`` (when matplotlib is importable) to the folder ``--out``
names (required). Names and empty cells as in ``_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _report as R  # noqa: E402

RESULT_TAG = "COMPILE_TIME_RESULT "
PHASES = ("dynamo", "aot", "inductor", "kernels")
PHASE_LABELS = {"dynamo": "dynamo", "aot": "AOT", "inductor": "Inductor", "kernels": "kernels"}
# The goals at this layer count: ours / plain_whole, warm and cold.
GOAL_LAYERS, GOAL_WARM, GOAL_COLD = 8, 3.0, 1.5
# The per-block mode's goals: at this layer count ours_per_block / torch_block_compiled
# at most these, cold and warm; and its first steps within FLAT of the smallest layer
# count's (issue 70).
BLOCK_GOAL_LAYERS, BLOCK_GOAL_COLD, BLOCK_GOAL_WARM, FLAT = 24, 1.5, 2.0, 0.15
TORCH_BLOCK = "torch_block_compiled"


@dataclass(frozen=True)
class CompileVariant:
    """One way of compiling the step.

    Args:
        name: label in the report.
        impl, compile: as :class:`_harness.Variant` (what is built and compiled).
        compiled_autograd: turn compiled autograd on before the first step.
        env: environment of both processes (on top of the parent's).
    """

    name: str
    impl: str
    compile: str
    compiled_autograd: bool
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def harness_variant(self) -> Any:
        import _harness as H

        return H.Variant(self.name, self.impl, self.compile)  # type: ignore[arg-type]


# The library's three switches that change compile time; every variant of ours sets
# each of them, on ("1") unless the variant turns it off.
_SWITCHES = ("TRACEABLE_HSDP_STABLE_MESH_KEY", "TRACEABLE_HSDP_FORWARD_CACHE_KEY",
             "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS")


def _ours(name: str, off: str | None = None) -> CompileVariant:
    """Our whole-model compile with every switch of ``_SWITCHES`` on but ``off``."""
    env = tuple((k, "0" if k == off else "1") for k in _SWITCHES)
    return CompileVariant(name, "ours", "whole", compiled_autograd=True, env=env)


VARIANTS = (
    CompileVariant("plain_whole", "unsharded", "whole", compiled_autograd=True),
    CompileVariant("torch_block_compiled", "torch", "blocks", compiled_autograd=False),
    _ours("ours_compiled"),
    CompileVariant("ours_per_block", "ours", "per_block", compiled_autograd=False,
                   env=tuple((k, "1") for k in _SWITCHES)),
    _ours("ours_compiled_nofix", off="TRACEABLE_HSDP_STABLE_MESH_KEY"),
    _ours("ours_compiled_torch_fwd_key", off="TRACEABLE_HSDP_FORWARD_CACHE_KEY"),
    _ours("ours_compiled_side_effect_info", off="TRACEABLE_HSDP_QUIET_SIDE_EFFECTS"),
)
BY_NAME = {v.name: v for v in VARIANTS}
REF = "plain_whole"


def shape_for(layers: int) -> Any:
    import _harness as H

    return H.Shape(f"compile{layers}", layers=layers, dim=64, heads=4, vocab=256, seq=32, batch=2)


def _int_list(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}")
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"layer counts must be >= 1, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import _harness as H

    p = argparse.ArgumentParser(
        prog="compile_time.py",
        description=(
            "First-step compile time, cold and warm (fresh processes sharing an Inductor "
            "cache dir), of the plain model compiled whole, torch's fully_shard with "
            "per-block compile, and traceable_hsdp compiled whole and per block, on "
            "--world ranks, with torch's own breakdown and cache counters."
        ),
    )
    p.add_argument("--layers", type=_int_list, default=[4, 8, 16],
                   help="comma-separated layer counts (default 4,8,16)")
    p.add_argument("--repeats", type=int, default=1,
                   help="cold+warm pairs per variant and layer count; medians over them "
                        "(default 1)")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                   help=f"comma list (default all: {', '.join(v.name for v in VARIANTS)})")
    p.add_argument("--compile-threads", type=int, default=1,
                   help="TORCHINDUCTOR_COMPILE_THREADS of every process (default 1)")
    p.add_argument("--model", choices=H.MODELS, default="demo",
                   help="demo: traceable_hsdp.demo.models.Llama; hf_llama: transformers' "
                        "LlamaForCausalLM (default demo)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--world", type=int, default=1,
                   help="ranks of the sharded variants, each a process, all on one cache "
                        "dir; the slower rank's first step is reported (default 1; "
                        "plain_whole always runs on 1)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    p.add_argument("--device", choices=H.DEVICE_CHOICES, default="auto",
                   help="auto: cuda when torch.cuda.is_available(), else cpu (default auto); "
                        "the one rank runs on cuda:0 or the CPU")
    p.add_argument("--timeout", type=int, default=3600,
                   help="seconds one process may take before it counts as failed (default 3600)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one process
    R.add_out_argument(p, required=False)  # required of the parent, checked below
    a = p.parse_args(argv)
    if a.child is None:
        if a.out is None:
            p.error("the following arguments are required: --out")
        names = [n.strip() for n in a.variants.split(",") if n.strip()]
        bad = [n for n in names if n not in BY_NAME]
        if bad or not names:
            p.error(f"unknown variant(s) {bad or names}; known: {', '.join(BY_NAME)}")
        a.variant_list = [BY_NAME[n] for n in names]
        if a.repeats < 1:
            p.error(f"--repeats must be >= 1, got {a.repeats}")
        if a.world < 1:
            p.error(f"--world must be >= 1, got {a.world}")
        if a.compile_threads < 1:
            p.error(f"--compile-threads must be >= 1, got {a.compile_threads}")
        try:
            a.device_type = H.resolve_device(a.device)
        except ValueError as e:
            p.error(str(e))
    return a


# ------------------------------------------------------------------- one process


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: build, turn on what the variant needs, run two steps; what
    the first one compiled and how long each took."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import _harness as H
    from traceable_hsdp._cache import CacheCounts, CompileTimes, stable_mesh_key_installed

    v = BY_NAME[spec["variant"]]
    shape = shape_for(spec["layers"])
    backend, seed = spec["backend"], spec["seed"]
    rank, world = spec["rank"], spec["world"]
    # Ranks placed as the step-time harness places them: cuda:rank on NCCL, or the CPU
    # on gloo.
    placement = H.Placement(spec["device"], world)
    device = placement.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(placement.backend, init_method=f"file://{spec['store']}",
                            rank=rank, world_size=world)
    try:
        import traceable_hsdp

        mesh = init_device_mesh(placement.device_type, (world,), mesh_dim_names=("shard",))
        model, fwd = H.build_model(v.harness_variant(), shape, mesh, device, backend, seed,
                                   model=spec["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=H.LR)
        if v.compiled_autograd:
            traceable_hsdp.enable_compiled_autograd(backend=backend)
        steps, losses = [], []
        counts0, times0 = CacheCounts.now(), CompileTimes.now()
        first: dict[str, Any] = {}
        for step in range(2):
            x, y = H.batch_for(shape, step, seed, rank, world, device)
            t0 = time.perf_counter()
            loss = H.loss_fn(fwd(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            H.sync(device)
            steps.append(time.perf_counter() - t0)
            losses.append(float(loss))
            if step == 0:
                first = dict(
                    cache=dataclasses.asdict(CacheCounts.now() - counts0),
                    compile=dataclasses.asdict(CompileTimes.now() - times0),
                    graphs=H.compile_counts()[0],
                )
        recompiled = H.compile_counts()[0] - first["graphs"]
        traceable_hsdp.disable_compiled_autograd()
    finally:
        dist.destroy_process_group()
    return dict(
        first_step_s=steps[0], second_step_s=steps[1], losses=losses, recompiles=recompiled,
        stable_mesh_key=stable_mesh_key_installed(), **first,
    )


def spawn_child(
    v: CompileVariant, layers: int, cache_dir: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Runs :func:`run_child` in fresh ``python`` processes, one per rank, on
    ``cache_dir``: rank 0's result with the slowest rank's first step, or
    ``{"error": ...}``."""
    env = dict(os.environ)
    env.update(v.env)
    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(args.compile_threads)
    world = 1 if v.impl == "unsharded" else args.world
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="compile_time_") as d, contextlib.ExitStack() as files:
        procs = []
        for rank in range(world):
            spec = dict(variant=v.name, layers=layers, backend=args.backend, seed=args.seed,
                        model=args.model, device=args.device_type, rank=rank, world=world,
                        store=os.path.join(d, "store"))
            # Files, not pipes: a rank blocked on a full pipe would stall the others'
            # collectives while this process waits on rank 0.
            out_f = files.enter_context(open(os.path.join(d, f"rank{rank}.out"), "w+"))
            err_f = files.enter_context(open(os.path.join(d, f"rank{rank}.err"), "w+"))
            procs.append((subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                stdout=out_f, stderr=err_f, text=True, env=env,
            ), out_f, err_f))

        def failed(error: str) -> dict[str, Any]:
            for q, _, _ in procs:  # the other ranks would wait in a collective forever
                q.kill()
                q.wait()
            return dict(error=error, wall_s=time.time() - t0)

        outs = []
        for rank, (proc, out_f, err_f) in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                return failed(f"timed out after {args.timeout} s")
            out_f.seek(0)
            err_f.seek(0)
            stdout, stderr = out_f.read(), err_f.read()
            lines = [l for l in stdout.splitlines() if l.startswith(RESULT_TAG)]
            if proc.returncode != 0 or not lines:
                tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
                return failed(f"rank {rank} exit {proc.returncode}: {tail}")
            outs.append(json.loads(lines[-1][len(RESULT_TAG):]))
    out = outs[0]
    out["rank_first_step_s"] = [o["first_step_s"] for o in outs]
    out["first_step_s"] = max(out["rank_first_step_s"])
    out["world"] = world
    out["wall_s"] = time.time() - t0
    return out


# ------------------------------------------------------------------------ report


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per (layers, variant, cold/warm) over the repeats, the cache counts (and
    whether they agreed across repeats), and the ratios to ``plain_whole``."""
    rows: dict[str, dict[str, Any]] = {}
    for r in runs:
        key = f"{r['layers']}/{r['variant']}"
        row = rows.setdefault(key, dict(layers=r["layers"], variant=r["variant"], errors=[]))
        for phase in ("cold", "warm"):
            res = r[phase]
            slot = row.setdefault(phase, dict(
                first_step_s=[], compile={p: [] for p in ("total", *PHASES)}, cache=[],
                recompiles=[],
            ))
            if "error" in res:
                row["errors"].append(f"{phase}: {res['error']}")
                continue
            slot["first_step_s"].append(res["first_step_s"])
            for p in slot["compile"]:
                slot["compile"][p].append(res["compile"][p])
            slot["cache"].append(res["cache"])
            slot["recompiles"].append(res["recompiles"])
    for row in rows.values():
        for phase in ("cold", "warm"):
            slot = row[phase]
            xs = slot["first_step_s"]
            slot["median_s"] = statistics.median(xs) if xs else None
            slot["min_s"], slot["max_s"] = (min(xs), max(xs)) if xs else (None, None)
            slot["compile_median_s"] = {
                p: (statistics.median(v) if v else None) for p, v in slot["compile"].items()
            }
            caches = slot["cache"]
            slot["cache_counts"] = caches[0] if caches else None
            slot["cache_agrees"] = all(c == caches[0] for c in caches)
    for row in rows.values():
        for key, name in (("vs_plain", REF), ("vs_torch_block", TORCH_BLOCK)):
            ref = rows.get(f"{row['layers']}/{name}")
            for phase in ("cold", "warm"):
                mine, base = row[phase]["median_s"], ref[phase]["median_s"] if ref else None
                row[phase][key] = mine / base if mine is not None and base else None
    goals = {}
    for name in (v.name for v in VARIANTS if v.impl == "ours"):
        row = rows.get(f"{GOAL_LAYERS}/{name}")
        if row is None or row["warm"]["vs_plain"] is None or row["cold"]["vs_plain"] is None:
            continue
        goals[name] = dict(
            warm_ratio=row["warm"]["vs_plain"], warm_goal=GOAL_WARM,
            warm_met=row["warm"]["vs_plain"] <= GOAL_WARM,
            cold_ratio=row["cold"]["vs_plain"], cold_goal=GOAL_COLD,
            cold_met=row["cold"]["vs_plain"] <= GOAL_COLD,
        )
    return dict(rows=rows, goals=goals, block_goals=_block_goals(rows))


def _block_goals(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ours_per_block against torch's per-block recipe at ``BLOCK_GOAL_LAYERS``, and
    its flatness in depth (the deepest over the shallowest layer count measured)."""
    name = "ours_per_block"
    mine = sorted((r for r in rows.values() if r["variant"] == name), key=lambda r: r["layers"])
    out: dict[str, Any] = {}
    row = rows.get(f"{BLOCK_GOAL_LAYERS}/{name}")
    if row is not None and row["cold"]["vs_torch_block"] and row["warm"]["vs_torch_block"]:
        out.update(
            cold_ratio=row["cold"]["vs_torch_block"], cold_met=row["cold"]["vs_torch_block"] <= BLOCK_GOAL_COLD,
            warm_ratio=row["warm"]["vs_torch_block"], warm_met=row["warm"]["vs_torch_block"] <= BLOCK_GOAL_WARM,
        )
    if len(mine) >= 2:
        lo, hi = mine[0], mine[-1]
        for phase in ("cold", "warm"):
            a, b = lo[phase]["median_s"], hi[phase]["median_s"]
            if a and b:
                out[f"{phase}_growth"] = b / a - 1
                out[f"{phase}_flat"] = b / a - 1 <= FLAT
        out["layers"] = (lo["layers"], hi["layers"])
    return out


def _f(x: float | None, spec: str = ".1f") -> str:
    return R.num(x, spec)


def _phases(slot: dict[str, Any]) -> str:
    c = slot["compile_median_s"]
    return " / ".join(_f(c[p]) for p in PHASES)


def _cache_cell(slot: dict[str, Any], kind: str) -> str:
    c = slot["cache_counts"]
    if c is None:
        return "–"
    cell = "/".join(str(c[f"{kind}_{k}"]) for k in ("hit", "miss", "bypass"))
    return cell if slot["cache_agrees"] else cell + " (varied)"


def markdown(s: dict[str, Any], meta: dict[str, Any], args: argparse.Namespace) -> str:
    model = ("demo Llama (`traceable_hsdp.demo.models`), dim 64" if args.model == "demo"
             else "HF `LlamaForCausalLM`, hidden 64, MLP 128")
    ranks = "1 rank" if args.world == 1 else f"{args.world} ranks (the unsharded model: 1)"
    lines = [
        f"### Compile time, first training step, {ranks} on {meta.get('device', 'the CPU')} "
        f"({meta['cpu']}, {meta['cpus']} cores; torch {meta['torch']}, Python {meta['python']})",
        "",
        f"Model: {model}, 4 heads, vocab 256, seq 32, batch 2; backend `{args.backend}`; "
        f"`TORCHINDUCTOR_COMPILE_THREADS={args.compile_threads}`; medians over "
        f"{args.repeats} repeat(s), each a cold process on an empty cache dir then a warm one "
        "on the same dir. Phases (s) from `torch._dynamo.utils.compilation_time_metrics`: "
        "dynamo = `bytecode_tracing`, AOT = `create_aot_dispatcher_function` - "
        "`compile_fx_inner`, Inductor = `compile_fx_inner` - `compile_file`, kernels = "
        "`compile_file`. Caches (hit/miss/bypass, one count per graph) from "
        "`torch._dynamo.utils.counters`.",
        "",
        "| layers | variant | cold first step (s) | warm first step (s) | cold vs unsharded "
        "| warm vs unsharded | cold vs torch per-block | warm vs torch per-block "
        "| cold: dynamo / AOT / Inductor / kernels | warm: dynamo / AOT / "
        "Inductor / kernels | FX cache cold | FX cache warm | AOT cache warm |",
        "|" + "---|" * 13,
    ]
    for row in sorted(s["rows"].values(), key=lambda r: (r["layers"], _order(r["variant"]))):
        c, w = row["cold"], row["warm"]
        lines.append(
            f"| {row['layers']} | {R.row_name(row['variant'])} | {_f(c['median_s'])} "
            f"| {_f(w['median_s'])} "
            f"| {_f(c['vs_plain'], '.2f')}x | {_f(w['vs_plain'], '.2f')}x "
            f"| {_f(c['vs_torch_block'], '.2f')}x | {_f(w['vs_torch_block'], '.2f')}x | {_phases(c)} "
            f"| {_phases(w)} | {_cache_cell(c, 'fx')} | {_cache_cell(w, 'fx')} "
            f"| {_cache_cell(w, 'aot')} |"
        )
    lines.append("")
    for row in s["rows"].values():
        for e in row["errors"]:
            first = e.splitlines()[0][:200]
            lines.append(f"- **{row['layers']} layers, {R.label(row['variant'])} failed** ({first})")
    if s["goals"]:
        lines.append(f"Goals at {GOAL_LAYERS} layers (against {R.label(REF)}):")
        for name, g in s["goals"].items():
            lines.append(
                f"- {R.label(name)}: warm {g['warm_ratio']:.2f}x (goal <= {g['warm_goal']:g}x): "
                f"**{'met' if g['warm_met'] else 'not met'}**; cold {g['cold_ratio']:.2f}x "
                f"(goal <= {g['cold_goal']:g}x): **{'met' if g['cold_met'] else 'not met'}**."
            )
    else:
        lines.append(f"Goals: not evaluated ({GOAL_LAYERS} layers not measured).")
    bg = s.get("block_goals") or {}
    if "cold_ratio" in bg:
        lines.append(
            f"- {R.label('ours_per_block')} at {BLOCK_GOAL_LAYERS} layers against "
            f"{R.label(TORCH_BLOCK)}: cold {bg['cold_ratio']:.2f}x (goal <= {BLOCK_GOAL_COLD:g}x): "
            f"**{'met' if bg['cold_met'] else 'not met'}**; warm {bg['warm_ratio']:.2f}x "
            f"(goal <= {BLOCK_GOAL_WARM:g}x): **{'met' if bg['warm_met'] else 'not met'}**."
        )
    if "layers" in bg:
        lo, hi = bg["layers"]
        lines.append(
            f"- {R.label('ours_per_block')}, {lo} to {hi} layers: cold "
            f"{bg.get('cold_growth', float('nan')):+.0%}, warm {bg.get('warm_growth', float('nan')):+.0%} "
            f"(goal within {FLAT:.0%})."
        )
    code = meta["code"]
    lines.append(
        (f"Code: commit {code['head']}" if code.get("head") else f"Code: {code.get('root')}")
        + (", with uncommitted changes" if code.get("dirty_runtime") else "")
        + f". Wall time {meta['wall_s']:.0f} s; load average (1 min) "
        f"{meta['loadavg_before'][0]:.1f} before, {meta['loadavg_after'][0]:.1f} after."
    )
    return "\n".join(lines) + "\n"


def _order(name: str) -> int:
    return [v.name for v in VARIANTS].index(name) if name in BY_NAME else len(VARIANTS)


def plot(s: dict[str, Any], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = s["rows"]
    layers = sorted({r["layers"] for r in rows.values()})
    names = sorted({r["variant"] for r in rows.values()}, key=_order)
    colors = {"plain_whole": "tab:gray", "torch_block_compiled": "tab:orange",
              "ours_compiled": "tab:blue", "ours_compiled_nofix": "tab:cyan",
              "ours_per_block": "tab:red",
              "ours_compiled_torch_fwd_key": "tab:purple",
              "ours_compiled_side_effect_info": "tab:green"}  # by key
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    width = 0.8 / max(1, len(names))
    for ax, phase in zip(axes, ("cold", "warm")):
        for i, name in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for j, n in enumerate(layers):
                row = rows.get(f"{n}/{name}")
                if row is None or row[phase]["median_s"] is None:
                    continue
                m = row[phase]["median_s"]
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(m)
                lo.append(m - row[phase]["min_s"])
                hi.append(row[phase]["max_s"] - m)
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=R.label(name),
                   color=colors.get(name, None))
        ax.set_xticks(range(len(layers)), [f"{n} layers" for n in layers])
        ax.set_ylabel("first step (s), median; bars min-max")
        where = "empty cache dir" if phase == "cold" else "same cache dir, new process"
        ax.set_title(f"{phase} ({where})")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------- main


def _one_line(res: dict[str, Any]) -> str:
    if "error" in res:
        return f"FAILED: {res['error'].splitlines()[0]}"
    c = res["cache"]
    return (f"{res['first_step_s']:.1f} s (FX cache hit/miss/bypass "
            f"{c['fx_hit']}/{c['fx_miss']}/{c['fx_bypass']})")


def main(argv: list[str] | None = None) -> int:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    args = parse_args(argv)
    if args.child is not None:
        result = run_child(json.loads(args.child))
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    import torch


    t_start = time.time()
    load_before = os.getloadavg()
    loads: list[float] = []  # the 1-minute load average as each process ended
    runs: list[dict[str, Any]] = []

    def report() -> tuple[dict[str, Any], str, str]:
        """The report of what ran so far, written: a run stopped early keeps the
        layer counts it finished."""
        meta = dict(
            code=R.code_state(), torch=torch.__version__, python=platform.python_version(),
            cpu=R.cpu_name(), cpus=os.cpu_count(), machine=platform.platform(),
            device=(torch.cuda.get_device_name(0) if args.device_type == "cuda" else "the CPU"),
            wall_s=time.time() - t_start, loadavg_before=load_before,
            loadavg_after=os.getloadavg(), loadavg_during=loads,
        )
        s = summarize(runs)
        md = markdown(s, meta, args)
        stem = R.write_report(args.out, f"compile_time_{args.model}", md, dict(
            args={k: v for k, v in vars(args).items() if k != "variant_list"},
            variants=[v.name for v in args.variant_list], meta=meta, summary=s, raw=runs))
        return meta, md, stem

    with tempfile.TemporaryDirectory(prefix="compile_time_caches_") as caches:
        for layers in args.layers:
            for rep in range(args.repeats):
                for v in args.variant_list:  # interleaved: a slow minute hits every variant
                    cache = os.path.join(caches, f"{layers}_{rep}_{v.name}")
                    os.makedirs(cache)
                    run = dict(layers=layers, repeat=rep, variant=v.name)
                    for phase in ("cold", "warm"):
                        print(f"== {layers} layers, repeat {rep + 1}/{args.repeats}, {v.name}, "
                              f"{phase} ...", end=" ", flush=True)
                        run[phase] = res = spawn_child(v, layers, cache, args)
                        loads.append(os.getloadavg()[0])
                        print(_one_line(res), flush=True)
                    runs.append(run)
            report()
    meta, md, stem = report()
    s = summarize(runs)
    print()
    print(md, flush=True)
    png = plot(s, stem + ".png",
               f"first-step compile time, {args.model} model, {args.world} rank(s) on {meta['device']}, "
               f"torch {meta['torch']}")
    print(f"wrote {stem}.md, {stem}.json" + (f", {png}" if png else " (no matplotlib: no plot)"))
    failed = any(row["errors"] for row in s["rows"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
