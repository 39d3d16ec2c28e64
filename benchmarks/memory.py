"""Peak memory per rank, as the OS sees it, for each variant in processes of its own.

    python benchmarks/memory.py --out DIR [--variants torch_eager,ours_eager,...]
                                [--model hf_llama|demo] [--dim 1024 --layers 8 ...]
                                [--steps 5] [--device auto|cpu|cuda]

[Note: Peak resident memory per variant]
``step_time.py`` keeps every variant in one process, so its resident figure is a
high-water mark in run order and its heap figure leaves out what a process holds at
rest. An OOM killer reads neither: it reads the resident set. Here each variant runs
alone in freshly spawned ranks (the harness's ``run_spawned_fn``), builds and shards
its model and optimizer, then the rank resets the kernel's peak (``VmHWM``, by writing
5 to ``/proc/self/clear_refs``) and its heap peak (``benchmarks/_heap.py``) and runs
``--steps`` steps. Per rank it reports:

- ``rss_before_mib``: resident memory before the first step (model shards, optimizer,
  imports, the CUDA wheel's mappings);
- ``peak_rss_mib``: the peak over every step, the first's compile included: what the
  job needs;
- ``peak_rss_steady_mib``: the peak over the steps after the first (reset after it);
- ``heap_peak_steady_mib``: the most live heap over those steps above the heap at their
  start, the figure ``step_time.py --heap`` reports;
- on CUDA, ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the
  steps after the first;
- the losses, which must be equal in every variant of one implementation family.

Each variant compiles cold, in an Inductor cache of its own (``TORCHINDUCTOR_CACHE_DIR``,
a new folder), as a job's first run does, and without the harness's graph recorder
(``Runner(record_graphs=False)``): the recorder keeps every post-grad graph alive, which
a user's process does not.

The report (``DIR/memory.md``, ``DIR/memory.json``) gives each variant's figures per
rank and the ratio of its peak to torch's eager and per-block compile peaks, rank by
rank. ``tests/test_benchmarks.py`` runs a small shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import _heap  # noqa: E402
import _report as R  # noqa: E402

DEFAULT_VARIANTS = "torch_eager,torch_block_compiled,ours_eager,ours_compiled"
HF_SHAPE = H.Shape("hf_llama_1024", layers=8, dim=1024, heads=8, vocab=26500, seq=128, batch=2)
"""The issue's setting: HF Llama, 8 layers, width 1024 (138 M parameters)."""


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}: peak RSS needs Linux")


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_rank(
    rank: int, placement: H.Placement, variant: H.Variant, shape: H.Shape, model: str,
    steps: int, backend: str, seed: int,
) -> dict[str, Any]:
    """One variant on this rank: build, reset the peaks, ``steps`` steps."""
    import gc

    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    from torch.distributed.device_mesh import init_device_mesh

    device = placement.rank_device(rank)
    mesh = init_device_mesh(placement.device_type, (placement.world,), mesh_dim_names=("shard",))
    runner = H.Runner(variant, shape, mesh, rank, backend, seed, fconfig.recompute_views,
                      iconfig.post_grad_custom_pre_pass, device, model, record_graphs=False)
    out: dict[str, Any] = {"losses": []}
    with runner.active():
        gc.collect()
        torch.distributed.barrier()
        out["rss_before_mib"] = _status_mib("VmRSS")
        _reset_rss_peak()
        for step in range(steps):
            x, y = H.batch_for(shape, step, seed, rank, placement.world, device)
            out["losses"].append(float(runner.step(x, y)))
            H.sync(device)
            if step == 0:
                out["peak_rss_first_mib"] = _status_mib("VmHWM")
                gc.collect()
                _reset_rss_peak()
                H.reset_peak_memory(device)  # CUDA's counter, or the heap's
                start = H.allocated_mib(device, pooled=variant.pools_exchanges)
        out["peak_rss_steady_mib"] = _status_mib("VmHWM")
        out["peak_rss_mib"] = max(out["peak_rss_first_mib"], out["peak_rss_steady_mib"])
        if device.type == "cuda":
            out["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            out["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
        elif _heap.active():
            out["heap_peak_steady_mib"] = _heap.peak_mib() - start
        out["rss_after_mib"] = _status_mib("VmRSS")
    return out


def _table(variants: list[str], results: dict[str, list[dict[str, Any]]], world: int) -> str:
    cols = ["rss_before_mib", "peak_rss_mib", "peak_rss_steady_mib", "heap_peak_steady_mib",
            "cuda_max_allocated_mib", "cuda_max_reserved_mib"]
    cols = [c for c in cols if any(c in r for rs in results.values() for r in rs)]
    refs = [v for v in ("torch_eager", "torch_block_compiled") if v in results]
    head = ["variant", "rank", *[c.removesuffix("_mib").replace("_", " ") + " (MiB)" for c in cols],
            *[f"peak / {v}" for v in refs]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        for rank in range(world):
            r = results[v][rank]
            cells = [v, str(rank), *[f"{r[c]:,.0f}" if c in r else "" for c in cols]]
            cells += [f"{r['peak_rss_mib'] / results[ref][rank]['peak_rss_mib']:.2f}x" for ref in refs]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for memory.md and memory.json")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated harness variants (default {DEFAULT_VARIANTS})")
    p.add_argument("--model", choices=H.MODELS, default="hf_llama")
    p.add_argument("--layers", type=int, default=HF_SHAPE.layers)
    p.add_argument("--dim", type=int, default=HF_SHAPE.dim)
    p.add_argument("--heads", type=int, default=HF_SHAPE.heads)
    p.add_argument("--vocab", type=int, default=HF_SHAPE.vocab)
    p.add_argument("--seq", type=int, default=HF_SHAPE.seq)
    p.add_argument("--batch", type=int, default=HF_SHAPE.batch)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--seed", type=int, default=0)
    H.add_placement_args(p)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2: the steady peaks are read after the first step")
    placement = H.placement_from_args(p, args)
    all_variants, _ = H.all_variants()
    picked = H.pick_variants(all_variants, args.variants)
    if any(v.impl == "unsharded" for v in picked):
        p.error("the unsharded variant runs on rank 0 only; pick sharded variants")
    shape = H.Shape("custom", layers=args.layers, dim=args.dim, heads=args.heads,
                    vocab=args.vocab, seq=args.seq, batch=args.batch)
    results: dict[str, list[dict[str, Any]]] = {}
    for v in picked:
        print(f"{v.name} ...", file=sys.stderr, flush=True)
        kwargs = dict(variant=v, shape=shape, model=args.model, steps=args.steps,
                      backend=args.backend, seed=args.seed)
        with contextlib.ExitStack() as stack:
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="memory_inductor_"))
            stack.enter_context(H.set_env("TORCHINDUCTOR_CACHE_DIR", cache))
            if placement.device_type == "cpu":
                stack.enter_context(_heap.counting_children())
            results[v.name] = H.run_spawned_fn(measure_rank, placement, **kwargs)
    os.makedirs(args.out, exist_ok=True)
    names = [v.name for v in picked]
    meta = {
        "torch": torch.__version__, "model": H.model_description(args.model, shape),
        "shape": vars(shape), "steps": args.steps, "world": placement.world,
        "device": placement.device_type, "variants": names, "code": R.code_state(),
    }
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    report = (
        f"# Peak memory per rank\n\n{meta['model']}, {shape.layers} layers, seq {shape.seq}, "
        f"batch {shape.batch} per rank, {placement.world} {placement.device_type} ranks, "
        f"AdamW, {args.steps} steps, torch {torch.__version__}.\n\n"
        + _table(names, results, placement.world) + "\n"
    )
    losses = {v: results[v][0]["losses"] for v in names}
    report += "\nLosses (rank 0): " + "; ".join(
        f"{v} " + ", ".join(f"{x:.4f}" for x in ls) for v, ls in losses.items()) + "\n"
    code = meta["code"]
    report += (f"\nCode: commit {code['head']}" if code.get("head") else f"\nCode: {code['root']}") + (
        ", with uncommitted changes" if code.get("dirty_runtime") else "") + ".\n"
    with open(os.path.join(args.out, "memory.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
