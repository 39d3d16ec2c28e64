#!/usr/bin/env python
"""The time of one all-gather and one reduce-scatter by size: the latency/bandwidth
trade-off that the passes' default bucket cap is sized from (see [Note: The default
bucket cap] in ``passes/bucket_collectives.py``), and what traceable_hsdp's
reduce-scatter costs (over two gloo ranks an exchange: see [Note: gloo
reduce-scatters as an exchange] in ``passes/gloo/exchange.py``), and,
over two gloo ranks, what an all-gather costs as compiled graphs issue it (an
exchange too: [Note: gloo all-gathers as an exchange], the same module).

    python benchmarks/collective_latency.py --out DIR [--device auto|cpu|cuda]
                                            [--world N] [--iters N] [--max-mib M]

Spawns the ranks as ``step_time.py`` does (2 gloo ranks of one thread each on the
CPU, one NCCL rank per GPU on CUDA) and times ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (average) of float32 tensors, and the same reduction as
traceable_hsdp issues it (``traceable_hsdp._collectives.reduce_scatter``: torch's
op, except over two gloo ranks) and, over two gloo ranks, the all-gather as an
exchange (``all_to_all_single`` of the shard written twice, the doubling included),
from 4 KiB to ``--max-mib``
(default 256) MiB of unsharded size (the gathered output, the reduce-scatter input; what
``bucket_cap_mb`` counts). Each size runs ``--iters`` times after 2 untimed ones; a
time is the slowest rank's, the table shows medians. It reports, per collective, the
latency floor (the median time of the smallest size) and the smallest size whose time
is at least twice that floor: below it a collective is latency-bound, and merging two
of them saves nearly a whole latency.

Writes ``<out>/collective_latency_<device>.md`` (also printed) and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# Unsharded sizes in KiB: 4 KiB .. 256 MiB, by 4x.
SIZES_KIB = [4 * 4**i for i in range(9)]


def _rank(rank: int, placement: Any, iters: int, sizes_kib: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from traceable_hsdp._collectives import reduce_scatter
    from traceable_hsdp.passes.gloo.exchange import is_gloo_group

    device = placement.rank_device(rank)
    ws = placement.world
    group = dist.group.WORLD.group_name
    out: dict[str, list[list[float]]] = {
        "all_gather": [], "reduce_scatter": [], "ours": [], "all_gather_exchange": [],
        "all_gather_cpu": [], "all_gather_exchange_cpu": [],
    }
    c10d = torch.ops._c10d_functional
    exchange = ws == 2 and device.type == "cpu" and is_gloo_group(group)

    cpu: list[float] = []  # this rank's CPU time of each timed call (see _cpu_s)

    def timed(fn: Any) -> float:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        c0, t0 = _cpu_s(), time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        cpu.append(_cpu_s() - c0)
        dt = torch.tensor(t1 - t0, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)

    for kib in sizes_kib:
        numel = kib * 1024 // 4 // ws * ws
        full = torch.randn(numel, device=device)
        shard = torch.randn(numel // ws, device=device)
        gathered = torch.empty(numel, device=device)
        reduced = torch.empty(numel // ws, device=device)
        cpu.clear()
        ag = [timed(lambda: dist.all_gather_into_tensor(gathered, shard)) for _ in range(iters + 2)]
        out["all_gather_cpu"].append(cpu[2:])
        rs = [
            timed(lambda: dist.reduce_scatter_tensor(reduced, full, op=dist.ReduceOp.AVG))
            for _ in range(iters + 2)
        ]
        ours = [timed(lambda: reduce_scatter(full, "avg", ws, group)) for _ in range(iters + 2)]
        out["all_gather"].append(ag[2:])
        out["reduce_scatter"].append(rs[2:])
        out["ours"].append(ours[2:])
        if exchange:
            n = numel // ws
            cpu.clear()
            agx = [
                timed(lambda: c10d.wait_tensor(
                    c10d.all_to_all_single(torch.cat([shard, shard]), [n, n], [n, n], group)))
                for _ in range(iters + 2)
            ]
            out["all_gather_exchange"].append(agx[2:])
            out["all_gather_exchange_cpu"].append(cpu[2:])
    return out


def _cpu_s() -> float:
    """This process's CPU time so far, every thread (gloo's too), user and system."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _crossing(sizes_kib: list[int], medians: list[float]) -> int | None:
    """The smallest size (KiB) whose median is at least twice the smallest size's."""
    floor = medians[0]
    for kib, m in zip(sizes_kib, medians):
        if m >= 2 * floor:
            return kib
    return None


def _size(kib: int) -> str:
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, HERE)
    import _harness as H
    import _report as R

    p = argparse.ArgumentParser(prog="collective_latency.py", description=__doc__.split("\n\n")[0])
    H.add_placement_args(p)
    p.add_argument("--iters", type=int, default=10, help="timed calls per size (default 10)")
    p.add_argument("--max-mib", type=int, default=256,
                   help="largest unsharded size in MiB (default 256)")
    R.add_out_argument(p)
    a = p.parse_args(argv)
    if a.iters < 1:
        p.error(f"--iters must be >= 1, got {a.iters}")
    sizes = [k for k in SIZES_KIB if k <= a.max_mib * 1024]
    if not sizes:
        p.error(f"--max-mib must be >= 1, got {a.max_mib}")
    placement = H.placement_from_args(p, a)
    res = H.run_spawned_fn(_rank, placement, iters=a.iters, sizes_kib=sizes)[0]
    # CPU times are counted in scheduler ticks on some kernels: a mean, not a median.
    med = {k: [(statistics.fmean if k.endswith("_cpu") else statistics.median)(ts) for ts in v]
           for k, v in res.items()}
    where = (f"{placement.world} {placement.backend} ranks on {placement.device_type} "
             f"({H.device_name(placement.rank_device(0))})")
    lines = [
        f"# Collective time by size: {where}",
        "",
        f"torch {torch.__version__}; float32; median of {a.iters} calls of the slowest rank, "
        "after 2 untimed ones. Size: the unsharded tensor (the all-gather's output, the "
        "reduce-scatter's input).",
        "",
        "| size | all-gather (ms) | reduce-scatter (ms) | traceable_hsdp's reduce-scatter (ms) "
        "| all-gather as an exchange (ms) | CPU per all-gather, gloo's / exchange (ms) |",
        "|---|---|---|---|---|---|",
    ]
    agx, cpu, cpux = (med[k] for k in ("all_gather_exchange", "all_gather_cpu",
                                       "all_gather_exchange_cpu"))
    for i, kib in enumerate(sizes):
        lines.append(f"| {_size(kib)} | {1e3 * med['all_gather'][i]:.3f} | "
                     f"{1e3 * med['reduce_scatter'][i]:.3f} | {1e3 * med['ours'][i]:.3f} | "
                     + (f"{1e3 * agx[i]:.3f} | {1e3 * cpu[i]:.3f} / {1e3 * cpux[i]:.3f} |" if agx
                        else "– (two gloo ranks only) | – |"))
    lines.append("")
    lines.append(
        "CPU per all-gather: the mean of rank 0's process CPU time (every thread, "
        "gloo's too; user and system) over each call, the exchange's doubling of the "
        "shard included."
    )
    lines.append("")
    names = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
             "ours": "traceable_hsdp's reduce-scatter",
             "all_gather_exchange": "all-gather as an exchange"}  # times, not CPU
    for k, name in names.items():
        if not med[k]:
            continue
        c = _crossing(sizes, med[k])
        lines.append(
            f"- {name}: latency floor {1e3 * med[k][0]:.3f} ms; twice the floor "
            f"first at {_size(c) if c else 'no size measured'}."
        )
    text = "\n".join(lines)
    print(text)
    R.write_report(a.out, f"collective_latency_{placement.device_type}", text, {
        "sizes_kib": sizes, "times_s": res, "torch": torch.__version__, "where": where})
    return 0


if __name__ == "__main__":
    sys.exit(main())
