#!/usr/bin/env python
"""Where a training step's time goes: torch.profiler on rank 0 of 2 gloo ranks (CPU) or
of one NCCL rank per GPU (CUDA).

    python benchmarks/profile_step.py --out DIR [--shape overhead|compute]
        [--variants ours_compiled,torch_block_compiled] [--warmup 3] [--steps 5]
        [--trace] [--device auto|cpu|cuda] [--world N]

Builds the named variants exactly as ``step_time.py`` does (``_harness.Runner``, on
the ranks and devices of ``--device``/``--world`` as there), one after the other, each
compiling its own graphs (dynamo is reset before each: [Note: Variants that would share
compiled graphs] in ``_harness.py``), warms each up, times
``--steps`` unprofiled steps, then profiles ``--steps`` more on every rank with the
step split into phases (``forward``, ``loss``, ``backward``,
``optimizer`` = AdamW step + zero_grad) and reports, per phase and per step, from rank
0's main thread (the CPU autograd engine runs the backward on the calling thread):

- ``graph``: time inside compiled graphs (``## Call CompiledFxGraph`` events), split
  into ``collectives`` (the functional collective ops and their ``wait_tensor``
  inside the graph: issue + wait on the critical path, gloo being synchronous here)
  and ``compute`` (the rest of the graph: Inductor's C++ kernels and extern calls);
- outside graphs: ``collectives`` (c10d / functional collective ops called eagerly),
  ``aten`` (top-level ATen ops: eager compute and DTensor's local ops) and
  ``guards`` (dynamo's cache lookups, ``TorchDynamo Cache Lookup`` events: the guards
  of the compiled forward and of the compiled-autograd backward, evaluated on every
  call) and ``python/framework`` (the rest: Python, AOTAutograd's wrappers, compiled
  autograd's graph walk and its own cache lookup, DTensor dispatch, hooks).

For each variant the report then names what its compiled graphs spend that time on:
the outermost profiler events inside each graph call (matmuls and other extern
calls, collectives and their waits, the copy-out), summed per name, with the graph
time none of them covers; run with ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`` to
name Inductor's C++ kernels too.

On CUDA these categories are the host's timeline (kernels run asynchronously: a
graph's or a collective's time is then its launch, and waits block only where the host
synchronizes); the profiler also records the GPU (``ProfilerActivity.CUDA``), and the
report adds the GPU time per step: NCCL kernels and all other kernels and copies,
summed per kind (kernels on different streams overlap, so the two may add up to more
than the step), how many ran, and the ten kernels that took the most time. The
``record_function`` ranges that the profiler mirrors onto the GPU's timeline are spans,
not work, and are left out.

[Note: Where the CPU goes]
On the CPU the ranks, and gloo's threads that move their bytes, share the machine's
cores: a collective overlapped with compute still takes CPU from it. So the report
also gives, over the unprofiled timed steps, the CPU time of rank 0's main thread
and of all its other threads (gloo's worker and TCP threads), each as user and
system time (``/proc/self/task/*/stat``, in clock ticks: 10 ms on most kernels, so
use ``--steps`` of 10 or more). A rank whose threads use about as much CPU as its
step's wall time, on a machine with one core per rank, is bound by the CPU, not by
waiting. The same file gives each thread's minor page faults, also reported per
step: a fault is a page of memory the kernel maps and zeroes on its first touch,
paid as system time by the thread that touches it. A step that frees its buffers
and allocates them again faults each step when the allocator has given the memory
back in between (glibc trims the top of its heap; docs/benchmarks.md, "Step
time"); gloo's threads fault where they receive into a fresh
collective output. Only on Linux; elsewhere the table is left out.

Writes ``<out>/profile_<shape>.md`` (printed too) and ``.json`` into the folder
``--out`` names (required), with the commit the code ran at; ``--trace`` also writes a
Chrome trace per variant. Names as in ``_report.py``.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _report as R  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")
_COLL_OPS = (
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_reduce", "_c10d_functional::all_to_all_single",
    "_c10d_functional::wait_tensor", "c10d::alltoall_base_",
    "traceable_hsdp::all_to_all_single",  # the exchanges' pooled all-to-all (passes/gloo/_pool.py)
    "c10d::allgather", "c10d::_allgather_base", "c10d::reduce_scatter",
    "c10d::_reduce_scatter_base", "c10d::allreduce", "c10d::barrier",
    "c10d::allgather_into_tensor_coalesced", "c10d::reduce_scatter_tensor_coalesced",
)


def _is_coll(name: str) -> bool:
    return name.startswith(_COLL_OPS) or name.startswith("gloo:")


def _profile_rank(rank: int, placement: Any, shape_name: str, variants: list[str], warmup: int,
                  steps: int, out: str, trace: bool, backend: str,
                  adamw: str = "default") -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import _harness as H

    torch._dynamo.config.recompile_limit = 64
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    from torch.distributed.device_mesh import init_device_mesh

    shape = H.SHAPES[shape_name]
    known, _ = H.all_variants()
    by_name = {v.name: v for v in known}
    world = placement.world
    device = placement.rank_device(rank)
    mesh = init_device_mesh(placement.device_type, (world,), mesh_dim_names=("shard",))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    default_rv, default_pre = fconfig.recompute_views, iconfig.post_grad_custom_pre_pass
    results: dict[str, Any] = {}
    for name in variants:
        v = dataclasses.replace(by_name[name], adamw=adamw)
        # Each variant compiles its own graphs, even where an earlier one's would pass
        # its guards ([Note: Variants that would share compiled graphs] in _harness.py).
        torch._dynamo.reset()
        runner = H.Runner(v, shape, mesh, rank, backend, 0, default_rv, default_pre, device)
        dist.barrier()
        if runner.runs_here:
            with runner.active():
                first: float | None = None  # no warm-up step: no compile time
                for i in range(warmup):
                    x, y = H.batch_for(shape, runner.steps_done, 0, rank, world, device)
                    H.sync(device)
                    t0 = time.perf_counter()
                    runner.step(x, y)
                    H.sync(device)
                    if i == 0:  # the compile, as step_time.py counts it
                        first = time.perf_counter() - t0
                plain = []
                threads_before = _thread_cpu()
                for _ in range(steps):
                    x, y = H.batch_for(shape, runner.steps_done, 0, rank, world, device)
                    H.sync(device)
                    t0 = time.perf_counter()
                    runner.step(x, y)
                    H.sync(device)
                    plain.append(time.perf_counter() - t0)
                cpu = _cpu_split(threads_before, _thread_cpu(), steps)
                before = H.compile_counts()
                walls = []
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        x, y = H.batch_for(shape, runner.steps_done, 0, rank, world, device)
                        H.sync(device)
                        t0 = time.perf_counter()
                        with record_function("phase::forward"):
                            logits = runner.fwd(x)
                        with record_function("phase::loss"):
                            loss = H.loss_fn(logits, y)
                        with record_function("phase::backward"):
                            loss.backward()
                        with record_function("phase::optimizer"):
                            runner.opt.step()
                            runner.opt.zero_grad()
                        H.sync(device)
                        runner.steps_done += 1
                        walls.append(time.perf_counter() - t0)
                after = H.compile_counts()
            if rank == 0:
                results[name] = _breakdown(prof.events(), steps)
                results[name]["unprofiled_median_ms"] = statistics.median(plain) * 1e3
                results[name]["first_step_s"] = first
                results[name]["compiled"] = v.compiled
                results[name]["cpu_ms_per_step"] = cpu
                results[name]["profiled_median_ms"] = statistics.median(walls) * 1e3
                results[name]["compiles_while_profiling"] = [after[0] - before[0], after[1] - before[1]]
                if trace:
                    os.makedirs(out, exist_ok=True)
                    prof.export_chrome_trace(os.path.join(out, f"trace_{shape_name}_{name}.json"))
        dist.barrier()
    return {
        "device": {"type": device.type, "backend": placement.backend, "world": world,
                   "name": H.device_name(device)},
        "variants": results,
    }


def _thread_cpu() -> dict[int, tuple[int, int, int]]:
    """User and system CPU time (in clock ticks) and minor page faults of each thread
    of this process so far, by thread id (Linux ``/proc/self/task``; empty
    elsewhere)."""
    out: dict[int, tuple[int, int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]), int(fields[12]), int(fields[7]))  # utime, stime, minflt
    return out


def _cpu_split(before: dict[int, tuple[int, int, int]],
               after: dict[int, tuple[int, int, int]], steps: int,
               main: int | None = None) -> dict[str, float] | None:
    """Per step over the unprofiled steps: CPU ms of the main thread (the one that runs
    the step: the CPU autograd engine runs the backward on it; by default the calling
    thread) apart from every other thread (gloo's, on the CPU), each as user and
    system time, and the minor page faults of each side. See [Note: Where the CPU
    goes]."""
    import threading

    if not after:
        return None
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    if main is None:
        main = threading.get_native_id()
    out = {"main_user": 0.0, "main_system": 0.0, "other_user": 0.0, "other_system": 0.0,
           "main_faults": 0.0, "other_faults": 0.0}
    for tid, (u, s, f) in after.items():
        u0, s0, f0 = before.get(tid, (0, 0, 0))
        who = "main" if tid == main else "other"
        out[f"{who}_user"] += (u - u0) * tick_ms / steps
        out[f"{who}_system"] += (s - s0) * tick_ms / steps
        out[f"{who}_faults"] += (f - f0) / steps
    return out


def _cpu_ms(c: dict[str, float]) -> float:
    """All threads' CPU ms of one :func:`_cpu_split` result (its fault counts left out)."""
    return sum(v for k, v in c.items() if not k.endswith("_faults"))


def _breakdown(events: Any, steps: int) -> dict[str, Any]:
    """Per-step milliseconds by phase and category (see the module docstring)."""
    evs = [e for e in events if e.device_type.name == "CPU"]
    threads: dict[int, int] = {}
    for e in evs:
        if e.name.startswith("phase::"):
            threads[e.thread] = threads.get(e.thread, 0) + 1
    main = max(threads, key=threads.get)
    evs = [e for e in evs if e.thread == main]

    def span(e: Any) -> tuple[float, float]:
        return e.time_range.start, e.time_range.end

    phases = [(e.name.split("::", 1)[1], *span(e)) for e in evs if e.name.startswith("phase::")]
    graphs = [span(e) for e in evs if e.name.startswith("## Call CompiledFxGraph")]
    lookups = [span(e) for e in evs if e.name == "TorchDynamo Cache Lookup"]
    colls = [(e.name, *span(e)) for e in evs if _is_coll(e.name)]
    atens = sorted((span(e) for e in evs if e.name.startswith("aten::")), key=lambda s: (s[0], -s[1]))
    # Top-level ATen ops only (not nested in another ATen op).
    top_aten: list[tuple[float, float]] = []
    for s, t in atens:
        if top_aten and s >= top_aten[-1][0] and t <= top_aten[-1][1]:
            continue
        top_aten.append((s, t))

    def inside(s: float, t: float, spans: list[tuple[float, float]]) -> bool:
        return any(a <= s and t <= b for a, b in spans)

    out: dict[str, dict[str, float]] = {}
    n_coll: dict[str, int] = {}
    for ph in PHASES:
        spans = [(s, t) for n, s, t in phases if n == ph]
        wall = sum(t - s for s, t in spans)
        g_in = [(s, t) for s, t in graphs if inside(s, t, spans)]
        graph_t = sum(t - s for s, t in g_in)
        c_in = [(n, s, t) for n, s, t in colls if inside(s, t, spans)]
        # Collectives may nest (c10d op inside a functional op): count outermost only.
        c_top: list[tuple[str, float, float]] = []
        for n, s, t in sorted(c_in, key=lambda c: (c[1], -c[2])):
            if c_top and s >= c_top[-1][1] and t <= c_top[-1][2]:
                continue
            c_top.append((n, s, t))
        coll_graph = sum(t - s for n, s, t in c_top if inside(s, t, g_in))
        coll_out = sum(t - s for n, s, t in c_top if not inside(s, t, g_in))
        for n, s, t in c_top:
            if not n.endswith("wait_tensor"):
                n_coll[n] = n_coll.get(n, 0) + 1
        aten_out = sum(
            t - s for s, t in top_aten
            if inside(s, t, spans) and not inside(s, t, g_in)
            and not any(cs <= s and t <= ct for _, cs, ct in c_top)
            and not any(s <= cs and ct <= t for _, cs, ct in c_top)
        )
        guard_t = sum(t - s for s, t in lookups if inside(s, t, spans) and not inside(s, t, g_in))
        out[ph] = {
            "wall": wall / steps / 1e3,
            "graph_collectives": coll_graph / steps / 1e3,
            "graph_compute": (graph_t - coll_graph) / steps / 1e3,
            "eager_collectives": coll_out / steps / 1e3,
            "eager_aten": aten_out / steps / 1e3,
            "guards": guard_t / steps / 1e3,
            "python_framework": (wall - graph_t - coll_out - aten_out - guard_t) / steps / 1e3,
        }
    gpu = _gpu_ms(events, steps)
    return {
        "ms_per_step": out,
        "collective_calls_per_step": {k: v / steps for k, v in n_coll.items()},
        "graph_ops_per_step": _graph_ops([(e.name, *span(e)) for e in evs], steps),
        **({"gpu_ms_per_step": gpu} if gpu is not None else {}),
    }


def _graph_ops(events: list[tuple[str, float, float]], steps: int,
               top: int = 12) -> dict[str, Any]:
    """What the compiled graphs spend their time on, from one thread's ``(name,
    start, end)`` events: the outermost events inside each ``## Call CompiledFxGraph``
    span, summed per name (ms and count per step), the ``top`` names by time, and the
    graph time no such event covers. Extern calls (matmuls, collectives and their
    waits, the copy-out) are events of their own; Inductor's C++ kernels are events
    only with ``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`` (else their time is in
    ``uncovered``, with the wrapper's Python). On CUDA these are host times: launches, not the
    kernels (see the GPU table)."""
    graphs = sorted((s, t) for n, s, t in events if n.startswith("## Call CompiledFxGraph"))
    # Sorted once by start (outer events first), so each graph reads only the events
    # that start inside it: linear in the events, not their number times the graphs'.
    ordered = sorted(events, key=lambda e: (e[1], -e[2]))
    starts = [s for _, s, _ in ordered]
    by_name: dict[str, list[float]] = {}
    covered = 0.0
    for gs, gt in graphs:
        lo, hi = bisect.bisect_left(starts, gs), bisect.bisect_right(starts, gt)
        inner = [(n, s, t) for n, s, t in ordered[lo:hi] if t <= gt and (s, t) != (gs, gt)]
        last_end = gs
        for n, s, t in inner:
            if s < last_end:  # nested in an outer event already counted
                continue
            by_name.setdefault(n, []).append(t - s)
            covered += t - s
            last_end = t
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "top": [{"name": n[:120], "ms": sum(ts) / steps / 1e3, "count": len(ts) / steps}
                for n, ts in ranked],
        "uncovered": (sum(t - s for s, t in graphs) - covered) / steps / 1e3,
    }


def _gpu_ms(events: Any, steps: int, top: int = 10) -> dict[str, Any] | None:
    """GPU time per step from the profiler's CUDA events (kernels, copies): NCCL's
    kernels and the rest, each summed; how many such events run per step; and the
    ``top`` kernel names by time (ms and count per step), so that a difference between
    two variants can be named. User annotations are left out. ``None`` when there are
    none (a CPU run)."""
    gpu = [e for e in events if e.device_type.name == "CUDA"]
    if not gpu:
        return None
    # The profiler mirrors each record_function range (the phases, the optimizer's
    # step) onto the GPU's timeline as a user annotation with the CUDA device type: a
    # span, not work, and as long as the host took. Counted, they made the first CUDA
    # profile report about 6 ms of "GPU time" per step for a step whose kernels take
    # about 1.2 ms.
    gpu = [e for e in gpu if not getattr(e, "is_user_annotation", False)]
    nccl = sum(e.time_range.elapsed_us() for e in gpu if "nccl" in e.name.lower())
    other = sum(e.time_range.elapsed_us() for e in gpu if "nccl" not in e.name.lower())
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "nccl": nccl / steps / 1e3,
        "other": other / steps / 1e3,
        "events": len(gpu) / steps,
        "top": [
            {"name": n[:120], "ms": sum(ts) / steps / 1e3, "count": len(ts) / steps}
            for n, ts in ranked
        ],
    }


def _compile_s(r: dict[str, Any]) -> float | None:
    """A variant's compile time, counted as ``step_time.py`` counts it
    (:func:`_report.compile_seconds`) against its unprofiled median step. ``None``
    without a warm-up step, and for results written before it was kept."""
    return R.compile_seconds(r.get("first_step_s"), r["unprofiled_median_ms"] / 1e3)


def _markdown(shape: Any, res: dict[str, Any], args: argparse.Namespace,
              device: dict[str, Any], code: dict[str, Any] | None = None) -> str:
    import _harness as H

    cats = ("graph_compute", "graph_collectives", "eager_collectives", "eager_aten", "guards",
            "python_framework")
    lines = [
        f"### Profile, shape `{shape.name}` ({shape.layers} layers, dim {shape.dim}, seq "
        f"{shape.seq}, batch {shape.batch}/rank), rank 0, ms per step (mean of {args.steps} "
        "profiled steps)",
        "",
        f"Device `{device['type']}` ({device['name']}), {device['world']} {device['backend']} "
        f"ranks; torch.profiler on rank 0; {H.adamw_phrase(args.adamw)}"
        + ("; the categories below are the host's timeline (see the GPU times after the "
           "table)." if device["type"] == "cuda" else "."),
        "",
        "| variant | phase | wall | graph: compute | graph: collectives | eager collectives "
        "| eager ATen | guards | Python / framework |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        tot = {c: 0.0 for c in ("wall", *cats)}
        for ph in PHASES:
            row = r["ms_per_step"][ph]
            for c in tot:
                tot[c] += row[c]
            lines.append(f"| {R.row_name(name)} | {ph} | {R.num(row['wall'], '.1f')} | "
                         + " | ".join(R.num(row[c], ".1f") for c in cats) + " |")
        lines.append(f"| **{R.row_name(name)}** | **step** | **{R.num(tot['wall'], '.1f')}** | "
                     + " | ".join(f"**{R.num(tot[c], '.1f')}**" for c in cats) + " |")
    lines.append("")
    for name, r in res.items():
        calls = ", ".join(f"{k.split('::')[-1]} {v:g}" for k, v in sorted(r["collective_calls_per_step"].items()))
        gpu = r.get("gpu_ms_per_step")
        compile_cell = (f"{R.num(_compile_s(r), '.1f')} s" if r.get("compiled", True)
                        else R.NO_COMPILE)
        gpu_part = (
            f"; GPU time per step: NCCL kernels {gpu['nccl']:.1f} ms, other kernels and "
            f"copies {gpu['other']:.1f} ms, {gpu['events']:g} of them" if gpu else ""
        )
        lines.append(
            f"- {R.label(name)}: compile (the first step less a median one, as in "
            f"step_time.py) {compile_cell}; unprofiled median step "
            f"{r['unprofiled_median_ms']:.1f} ms, profiled "
            f"{r['profiled_median_ms']:.1f} ms; collective calls per step (rank 0): {calls or 'none seen'}; "
            f"compiles while profiling (dynamo, inductor): {r['compiles_while_profiling']}{gpu_part}."
        )
    cpus = {name: r["cpu_ms_per_step"] for name, r in res.items() if r.get("cpu_ms_per_step")}
    if cpus:
        lines += ["", "CPU time per step on rank 0 over the unprofiled steps (ms), and minor page "
                  "faults per step (see [Note: Where the CPU goes] in "
                  "`benchmarks/profile_step.py`):", "",
                  "| variant | main thread: user | main thread: system | other threads: user "
                  "| other threads: system | all threads | unprofiled median step "
                  "| page faults: main thread | page faults: other threads |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, c in cpus.items():
            lines.append(
                f"| {R.row_name(name)} | {c['main_user']:.1f} | {c['main_system']:.1f} | "
                f"{c['other_user']:.1f} | {c['other_system']:.1f} | {_cpu_ms(c):.1f} | "
                f"{res[name]['unprofiled_median_ms']:.1f} | {c['main_faults']:.0f} | "
                f"{c['other_faults']:.0f} |"
            )
    for name, r in res.items():
        ops = r.get("graph_ops_per_step")
        if ops and ops["top"]:
            lines += ["", f"Inside the compiled graphs of {R.label(name)}, the most time first "
                      "(host time per step; Inductor's C++ kernels are named only with "
                      "`TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`):", "",
                      "| op | ms | count |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['ms']:.2f} | {k['count']:g} |" for k in ops["top"]]
            lines.append(f"| (not in an op: kernels not profiled, the wrapper's Python) | "
                         f"{ops['uncovered']:.2f} | |")
    for name, r in res.items():
        gpu = r.get("gpu_ms_per_step")
        if gpu and gpu.get("top"):
            lines += ["", f"GPU kernels of {R.label(name)}, the most time first (per step):", "",
                      "| kernel | ms | count |", "|---|---|---|"]
            lines += [f"| `{k['name']}` | {k['ms']:.3f} | {k['count']:g} |" for k in gpu["top"]]
    if code is not None:
        lines.append("")
        lines.append(R.code_line(code) + ".")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked; ``args.placement`` and ``args.names`` resolved. Bad values
    exit through ``argparse`` (status 2) with what was wrong."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import _harness as H

    p = argparse.ArgumentParser(prog="profile_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("overhead", "compute", "smoke"), default="overhead")
    p.add_argument("--variants", default="ours_compiled,torch_block_compiled")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    R.add_out_argument(p)
    p.add_argument("--trace", action="store_true", help="also write Chrome traces")
    H.add_adamw_argument(p)
    H.add_placement_args(p)
    args = p.parse_args(argv)
    args.placement = H.placement_from_args(p, args)
    try:
        args.names = [v.name for v in H.pick_variants(H.all_variants()[0], args.variants)]
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # puts HERE on sys.path
    if args.placement.device_type == "cpu":
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    import _harness as H

    names = args.names
    ranks = H.run_spawned_fn(
        _profile_rank, args.placement, shape_name=args.shape, variants=names, warmup=args.warmup,
        steps=args.steps, out=args.out, trace=args.trace, backend=args.backend,
        adamw=args.adamw,
    )

    res, device = ranks[0]["variants"], ranks[0]["device"]
    code = R.code_state()
    md = _markdown(H.SHAPES[args.shape], res, args, device, code)
    print(md)
    stem = R.write_report(args.out, f"profile_{args.shape}{H.adamw_suffix(args.adamw)}", md, dict(
        args={**vars(args), "placement": dict(vars(args.placement))},
        device=device, code=code, results=res))
    print(f"wrote {stem}.md, {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
