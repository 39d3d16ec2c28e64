#!/usr/bin/env python
"""What dynamo's guards cost per step, and which of them: the cache lookups of a
compiled fully_shard step against the unsharded model's.

    python benchmarks/guard_cost.py --out DIR [--shape overhead] [--steps 20]
        [--backend aot_eager]

Every compiled call first evaluates the guards of its cached graph (``TorchDynamo
Cache Lookup`` in the profiler): the forward's, and the compiled-autograd backward's.
A fully_shard model's forward traces the runtime's Python, so its guards also check
the runtime state that Python read (each parameter's sizes, dtypes, flags, its
``DTensor`` and the module that holds it). This script measures those lookups on one
rank (gloo, one thread), the demo Llama of ``--shape`` sharded per block and at the
root, compiled whole with compiled autograd, and SGD (the optimizer does not matter
here): the median over ``--steps`` profiled steps of each lookup, forward and
backward.

To say which guards the time goes to, some variants compile the forward with a
``guard_filter_fn`` (a ``torch.compile`` option) that drops one kind of guard on the
runtime's state. **Dropping guards is unsafe** (a change they watch would no longer
recompile); it is done here only to measure their cost, and nothing in the library
does it. Variants, each in a fresh process:

- ``unsharded``: the same model without fully_shard (the floor);
- ``ours``: every guard;
- ``ours_no_dtensor_spec``: without the per-``DTensor`` spec guards
  (``DTENSOR_SPEC_MATCH``, a Python function each);
- ``ours_no_state_constants``: without the constant and equality guards
  (``CONSTANT_MATCH``, ``EQUALS_MATCH``) on sources under the unit state
  (``_traceable_hsdp_state``);
- ``ours_no_aliasing``: without the guards that check that two paths still reach
  the same object (``DUPLICATE_INPUT``: a Python ``is`` check each, e.g. a module
  reached through the model and through a parameter's record);
- ``ours_no_state``: without any guard under the unit state (what is left is the
  model's own guards).

The backward's guards come from the compiled-autograd graph, which the filter does
not reach: its column is the same kind of measure for every variant.

What the guards cost a step, measured as a step rather than from the profiler: after
the profiled steps, each variant runs ``2 * --steps`` more steps, alternating step by
step between every guard and ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
(torch's switch that evaluates only the guards telling a frame's cached entries
apart: none here, each frame holds one entry), and reports both medians. One model in
one process, so the two halves see the same machine within a step of each other.
Unsafe too (docs/compile.md, "Steps without guards", says when a user may set it).

Writes ``<out>/guard_cost_<shape>.md`` (printed too) and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import _report as R  # noqa: E402

VARIANTS = ("unsharded", "ours", "ours_no_dtensor_spec", "ours_no_state_constants",
            "ours_no_aliasing", "ours_no_state")
_STATE = "_traceable_hsdp_state"


def _keep(variant: str, entry: Any) -> bool:
    """Whether ``variant`` keeps the guard ``entry`` (a ``GuardFilterEntry``)."""
    if variant == "ours_no_dtensor_spec":
        return entry.guard_type != "DTENSOR_SPEC_MATCH"
    if variant == "ours_no_state_constants":
        return not (_STATE in entry.name and entry.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH"))
    if variant == "ours_no_aliasing":
        return entry.guard_type != "DUPLICATE_INPUT"
    if variant == "ours_no_state":
        return _STATE not in entry.name
    return True


def _measure(variant: str, shape_name: str, steps: int, backend: str) -> dict[str, Any]:
    """One variant in this process: guard counts and lookup times."""
    from collections import Counter

    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    import _harness as H
    from traceable_hsdp import disable_compiled_autograd, enable_compiled_autograd, fully_shard
    from traceable_hsdp.demo.models import Llama

    shape = H.SHAPES[shape_name]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = Llama(shape.model_config())
            if variant != "unsharded":
                for block in model.layers:
                    fully_shard(block)
                fully_shard(model)
            optim = torch.optim.SGD(model.parameters(), lr=1e-3)
            kinds: Counter[str] = Counter()

            def guard_filter(entries: list[Any]) -> list[bool]:
                keep = [_keep(variant, e) for e in entries]
                kinds.update(e.guard_type for e, k in zip(entries, keep) if k)
                return keep

            enable_compiled_autograd(backend=backend)
            try:
                fwd = torch.compile(model, backend=backend, options={"guard_filter_fn": guard_filter})
                x = torch.randint(0, shape.vocab, (shape.batch, shape.seq))

                def step() -> None:
                    fwd(x).float().pow(2).mean().backward()
                    optim.step()
                    optim.zero_grad()

                for _ in range(3):
                    step()
                with profile() as prof:
                    for _ in range(steps):
                        step()
                timed: dict[bool, list[float]] = {False: [], True: []}
                for i in range(2 * steps):
                    skip = i % 2 == 1
                    with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                        t0 = time.perf_counter()
                        step()
                        timed[skip].append(time.perf_counter() - t0)
            finally:
                disable_compiled_autograd()
        finally:
            dist.destroy_process_group()
    lookups = [e.cpu_time_total / 1e3 for e in prof.events() if e.name == "TorchDynamo Cache Lookup"]
    if len(lookups) != 2 * steps:
        raise RuntimeError(f"{variant}: expected 2 cache lookups per step, saw {len(lookups)} in {steps}")
    return {
        "forward_ms": statistics.median(lookups[0::2]),
        "backward_ms": statistics.median(lookups[1::2]),
        "step_ms": statistics.median(timed[False]) * 1e3,
        "step_skipped_ms": statistics.median(timed[True]) * 1e3,
        "forward_guards": dict(kinds.most_common()),
    }


def _markdown(shape_name: str, res: dict[str, Any], args: argparse.Namespace, code: dict[str, Any]) -> str:
    import _harness as H
    import torch

    s = H.SHAPES[shape_name]
    floor = res.get("unsharded")  # absent when --variants leaves it out
    lines = [
        f"### Guard cost, shape `{shape_name}` ({s.layers} layers, dim {s.dim}), 1 rank, "
        f"{args.backend}, median of {args.steps} steps",
        "",
        f"torch {torch.__version__}, {R.cpu_name()}. Dropping guards is unsafe: the "
        "filtered variants only measure what those guards cost.",
        "",
        "| variant | forward lookup ms | backward lookup ms | step's lookups ms | over the unsharded model "
        "| forward guards kept | step ms | step ms, guards skipped | saved ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        total = r["forward_ms"] + r["backward_ms"]
        if name == "unsharded":
            over_cell = "(the floor)"
        elif floor is None:
            over_cell = "(not run)"
        else:
            over_cell = f"{total - floor['forward_ms'] - floor['backward_ms']:+.2f}"
        lines.append(
            f"| `{name}` | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {total:.2f} | "
            f"{over_cell} | {sum(r['forward_guards'].values())} | {r['step_ms']:.1f} "
            f"| {r['step_skipped_ms']:.1f} | {r['step_ms'] - r['step_skipped_ms']:.1f} |"
        )
    lines += ["", R.code_line(code) + "."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="overhead", choices=("overhead", "compute", "smoke"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend (the guards do not depend on it; aot_eager compiles fastest)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one variant, JSON out
    R.add_out_argument(p, required=False)
    a = p.parse_args(argv)
    if a.one is None and a.out is None:
        p.error("the following arguments are required: --out")
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.one is not None:
        print(json.dumps(_measure(a.one, a.shape, a.steps, a.backend)))
        return 0

    res: dict[str, Any] = {}
    for v in a.variants.split(","):
        # A fresh process per variant: dynamo's caches and counters start empty.
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", v, "--shape", a.shape,
             "--steps", str(a.steps), "--backend", a.backend],
            capture_output=True, text=True, check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"variant {v} failed:\n{out.stderr[-4000:]}")
        res[v] = json.loads(out.stdout.strip().splitlines()[-1])
    code = R.code_state()
    text = _markdown(a.shape, res, a, code)
    print(text)
    R.write_report(a.out, f"guard_cost_{a.shape}", text, {
        "results": res, "shape": a.shape, "steps": a.steps, "backend": a.backend, "code": code})
    return 0


if __name__ == "__main__":
    sys.exit(main())
