#!/usr/bin/env python
"""The optimizer step of a sharded model: ``torch.optim.AdamW`` on the ``DTensor``
parameters against ``traceable_hsdp.optim.AdamW`` (the same update on their local
shards), with the single-tensor, the foreach and the fused implementation, side by side.

    python benchmarks/optimizer_step.py [--shape overhead|compute] [--steps N]
                                        [--rounds R] [--out DIR]

2 gloo ranks of one thread each; the model of ``step_time.py``'s shape sharded with
``traceable_hsdp.fully_shard`` per block and root; one backward fills the gradients,
then each variant's ``step()`` is timed alone (round-robin between the variants; the
slowest rank's time per step; medians). Every variant steps its own copy of the same
model, and the script checks that the parameters stay bitwise equal between ours and
torch's of the same implementation.
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


def _rank(rank: int, placement: Any, shape_name: str, steps: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import _harness as H
    import traceable_hsdp
    from traceable_hsdp import optim as th_optim
    from traceable_hsdp.demo.models import Llama

    shape = H.SHAPES[shape_name]
    mesh = init_device_mesh("cpu", (placement.world,))
    variants = {
        "torch_adamw": (torch.optim.AdamW, {}),
        "ours_adamw": (th_optim.AdamW, {}),
        "torch_adamw_foreach": (torch.optim.AdamW, {"foreach": True}),
        "ours_adamw_foreach": (th_optim.AdamW, {"foreach": True}),
        "torch_adamw_fused": (torch.optim.AdamW, {"fused": True}),
        "ours_adamw_fused": (th_optim.AdamW, {"fused": True}),
    }
    runs: dict[str, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    for name, (cls, kw) in variants.items():
        torch.manual_seed(0)
        model = Llama(shape.model_config())
        for block in model.layers:
            traceable_hsdp.fully_shard(block, mesh=mesh)
        traceable_hsdp.fully_shard(model, mesh=mesh)
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt = cls(model.parameters(), lr=1e-3, **kw)
        opt.step()  # creates the state
        runs[name] = dict(model=model, opt=opt, times=[])
    for _ in range(rounds):
        for r in runs.values():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                r["opt"].step()
                dt = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                r["times"].append(float(dt))
    same = {}
    for impl in ("adamw", "adamw_foreach", "adamw_fused"):
        a, b = runs[f"torch_{impl}"]["model"], runs[f"ours_{impl}"]["model"]
        same[impl] = all(
            torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters())
        )
    n = len(list(runs["ours_adamw"]["model"].parameters()))
    return dict(times={k: r["times"] for k, r in runs.items()}, same=same, n_params=n)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, HERE)
    import _harness as H
    import _report as R

    p = argparse.ArgumentParser(prog="optimizer_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=("overhead", "compute"), default="overhead")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="output folder (default: print only)")
    a = p.parse_args(argv)
    res = H.run_spawned_fn(_rank, H.resolve_placement("cpu", 2), shape_name=a.shape,
                           steps=a.steps, rounds=a.rounds)[0]
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    lines = [
        f"# AdamW step on a sharded model: {a.shape} shape, {res['n_params']} DTensor "
        "parameters, 2 gloo ranks",
        "",
        f"torch {torch.__version__}; {a.rounds} rounds x {a.steps} steps per variant, "
        "round-robin; median of the slowest rank.",
        "",
        "| variant | median step() (ms) | vs torch's, same implementation | parameters bitwise equal to torch's |",
        "|---|---|---|---|",
    ]
    for k, m in med.items():
        impl = k.split("_", 1)[1]
        lines.append(f"| {k} | {1e3 * m:.2f} | {m / med['torch_' + impl]:.2f}x | "
                     f"{'yes' if res['same'][impl] else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        R.write_report(a.out, f"optimizer_step_{a.shape}", text)
    return 0 if all(res["same"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
