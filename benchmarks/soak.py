"""A long compiled run with a varying sequence length: recompiles, resident memory, losses.

    python benchmarks/soak.py                    # 200 steps, seq 32/48/64 repeating
    python benchmarks/soak.py --steps 12 --out /tmp/soak.json

Spawns ``--world-size`` gloo ranks on the CPU (one thread each). Each trains the demo
Llama (``traceable_hsdp.demo.models``, nested ``fully_shard``: each block, then the root)
with AdamW, compiled (``torch.compile`` of the model, compiled autograd on, Inductor
by default), on synthetic tokens whose sequence length cycles through ``--lengths``.
Rank 0 reports, and the script exits 1 if a check fails:

- recompiles: dynamo graphs (``counters["stats"]["unique_graphs"]``: forward and
  compiled-autograd backward graphs) gained after the first pass over the lengths
  (warm-up: the first ``len(lengths)`` steps, where dynamo first sees each length
  and may recompile with a dynamic length). Check: at most ``--max-recompiles``
  (default 0) on every rank;
- resident memory: each rank's current RSS (``/proc/self/statm``) after every step;
  growth = the median RSS of the last ``--window`` steps over the median of the
  ``--window`` steps right after the warm-up (the first two passes over the lengths),
  in percent. Check: within ``--max-rss-growth`` (default 5) percent on every rank;
- losses: every step's loss (averaged over the ranks) finite.

Not a timing benchmark: step times are printed for orientation only. Nothing here
touches the runtime or the passes beyond the public API.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lengths", default="32,48,64",
                   help="sequence lengths, cycled step by step (default 32,48,64)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--window", type=int, default=20,
                   help="steps in each RSS median (default 20; shrunk to fit short runs)")
    p.add_argument("--max-recompiles", type=int, default=0,
                   help="allowed dynamo graphs after the first pass over the lengths (default 0)")
    p.add_argument("--max-rss-growth", type=float, default=5.0,
                   help="allowed RSS growth in percent (default 5)")
    p.add_argument("--out", default=None, help="write the per-rank records as JSON here")
    args = p.parse_args(argv)
    args.lengths = [int(s) for s in args.lengths.split(",")]
    if args.steps < 2 * len(args.lengths) + 2:
        p.error(f"--steps must be at least {2 * len(args.lengths) + 2} "
                "(two passes over the lengths, then steps to measure)")
    return args


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    import time

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import traceable_hsdp as th
    from traceable_hsdp.demo.models import Llama, LlamaConfig, shard_llama

    torch.set_num_threads(1)
    world = args.world_size
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    try:
        cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4,
                          max_seq_len=max(args.lengths))
        torch.manual_seed(0)
        model = shard_llama(Llama(cfg), th.fully_shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        th.enable_compiled_autograd(backend=args.backend)
        compiled = torch.compile(model, backend=args.backend)
        gen = torch.Generator().manual_seed(1234)
        rec: dict[str, list[Any]] = {"seq": [], "loss": [], "rss": [], "graphs": [], "seconds": []}
        for step in range(args.steps):
            seq = args.lengths[step % len(args.lengths)]
            tok = torch.randint(0, cfg.vocab_size, (world * args.batch_size, seq + 1), generator=gen)
            x, y = tok[:, :-1].chunk(world)[rank], tok[:, 1:].chunk(world)[rank]
            t0 = time.perf_counter()
            loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec["seconds"].append(time.perf_counter() - t0)
            t = loss.detach().clone()
            dist.all_reduce(t)
            rec["seq"].append(seq)
            rec["loss"].append(t.item() / world)
            rec["rss"].append(_rss_bytes())
            rec["graphs"].append(counters["stats"]["unique_graphs"])
            if rank == 0 and (step + 1) % 10 == 0:
                print(f"step {step + 1}/{args.steps}  seq {seq}  loss {rec['loss'][-1]:.4f}  "
                      f"rss {rec['rss'][-1] / 2**20:.1f} MiB  graphs {rec['graphs'][-1]}",
                      flush=True)
        th.disable_compiled_autograd()
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)
    finally:
        dist.destroy_process_group()


def summarize(args: argparse.Namespace, ranks: list[dict[str, list[Any]]]) -> dict[str, Any]:
    """The checks of the module docstring, per rank, from the per-step records."""
    n = len(args.lengths)
    window = max(1, min(args.window, (args.steps - 2 * n) // 2))
    out: dict[str, Any] = {"warmup_steps": n, "window": window, "ranks": []}
    for rec in ranks:
        after_warmup = rec["graphs"][-1] - rec["graphs"][n - 1]
        base = statistics.median(rec["rss"][2 * n: 2 * n + window])
        last = statistics.median(rec["rss"][-window:])
        out["ranks"].append(dict(
            graphs_in_warmup=rec["graphs"][n - 1],
            recompiles_after_warmup=after_warmup,
            rss_base_mib=base / 2**20,
            rss_last_mib=last / 2**20,
            rss_growth_pct=100 * (last - base) / base,
            median_step_s=statistics.median(rec["seconds"][2 * n:]),
        ))
    losses = ranks[0]["loss"]
    out["losses_finite"] = all(math.isfinite(v) for v in losses)
    out["first_loss"], out["last_loss"] = losses[0], losses[-1]
    out["ok"] = out["losses_finite"] and all(
        r["recompiles_after_warmup"] <= args.max_recompiles
        and abs(r["rss_growth_pct"]) <= args.max_rss_growth
        for r in out["ranks"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        mp.start_processes(_rank, args=(args, tmp), nprocs=args.world_size, start_method="spawn")
        ranks = []
        for r in range(args.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    s = summarize(args, ranks)
    print(f"soak: {args.steps} steps, lengths {args.lengths}, {args.world_size} ranks, "
          f"{args.layers} layers d{args.dim}, backend {args.backend}")
    for i, r in enumerate(s["ranks"]):
        print(f"rank {i}: dynamo graphs in the first pass {r['graphs_in_warmup']}, "
              f"after it {r['recompiles_after_warmup']}; RSS {r['rss_base_mib']:.1f} -> "
              f"{r['rss_last_mib']:.1f} MiB ({r['rss_growth_pct']:+.2f}%, medians of "
              f"{s['window']} steps); median step {r['median_step_s']:.3f} s")
    print(f"losses finite: {s['losses_finite']} ({s['first_loss']:.4f} -> {s['last_loss']:.4f})")
    print("soak: OK" if s["ok"] else
          f"soak: FAILED (allowed: {args.max_recompiles} recompiles, "
          f"{args.max_rss_growth}% RSS growth, finite losses)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "summary": s,
                       "ranks": ranks}, f, indent=1)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
