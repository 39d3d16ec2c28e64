#!/usr/bin/env python
"""One variant's step time under two values of an environment variable, A/B in fresh
CPU ranks.

    python benchmarks/env_ab.py --env NAME [--values A,B] --out DIR [--variant ours_compiled]
        [--shape compute] [--model demo] [--pairs 6] [--steps 30] [--warmup 3]
        [--adamw {default,foreach,fused}]

For a lever behind an environment variable: a switch of the library
(``--env TRACEABLE_HSDP_BUCKET_CAP_MB --values unset,1``, where ``unset`` leaves the
variable unset), or an experimental change applied to a checkout whose variable turns
it on. Each of ``--pairs`` pairs starts the variant twice in its own 2 spawned
gloo ranks (:func:`_harness.run_rank`: the harness's own step loop), once under each
value, the order reversed every other pair, so both values see the machine within a
few minutes of each other; fresh processes move by more than these effects on 2-core
machines, hence many pairs and medians. Each rank reports the value it started with,
and a run whose ranks saw another stops with an error.

Each value's processes share an Inductor cache of their own, new for the run: the
variable is not in Inductor's cache keys, so one shared cache would hand one value's
compiled graphs to the other. The first process of each value compiles cold and the
later ones warm; the report gives each process's first step (the compile) apart from
its steps.

Writes ``<out>/env_ab_<NAME>_<shape>.md`` (printed too) and ``.json``: per value, each
process's median step (rank 0's clock, after ``--warmup`` steps), the median over its
processes, their ratio (B over A), each process's first step and step-1 loss, and the
commit with a hash of any uncommitted change to the runtime and passes (a patched run
says so). Never a timed test.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H  # noqa: E402
import _report as R  # noqa: E402

UNSET = "unset"
"""A ``--values`` entry that leaves the variable unset."""


def _rank(rank: int, placement: Any, env: str, **kwargs: Any) -> dict[str, Any]:
    """One spawned rank: the value of ``env`` it was started with, and the harness's
    loop (:func:`_harness.run_rank`)."""
    return {"seen": os.environ.get(env), "result": H.run_rank(rank, placement, **kwargs)}


def order(pairs: int) -> list[int]:
    """Which value (0: A, 1: B) each run takes: AB, BA, AB, ..."""
    return [i if p % 2 == 0 else 1 - i for p in range(pairs) for i in (0, 1)]


def summarize(values: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per value: each process's median step (ms), their median, and the ratio B/A."""
    out: dict[str, Any] = {"values": values, "per_value": {}}
    for i, v in enumerate(values):
        mine = [r for r in runs if r["value"] == i]
        medians = [statistics.median(r["steps_s"]) * 1e3 for r in mine]
        out["per_value"][v] = {
            "process_medians_ms": medians,
            "median_ms": statistics.median(medians) if medians else None,
            "first_step_s": [r["first_step_s"] for r in mine],
            "loss_step1": [r["loss_step1"] for r in mine],
        }
    a, b = (out["per_value"][v]["median_ms"] for v in values)
    out["ratio_b_over_a"] = b / a if a and b else None
    return out


def table(args: argparse.Namespace, summary: dict[str, Any], code: dict[str, Any]) -> str:
    """The markdown report."""
    shown = [f"`{args.env}` unset" if v == UNSET else f"`{args.env}={v}`"
             for v in summary["values"]]
    lines = [
        f"### `{args.variant}`, shape `{args.shape}` ({args.model}): `{args.env}` A/B",
        "",
        f"2 gloo ranks x 1 thread; CPU {R.cpu_name()}; {args.pairs} pairs of fresh processes "
        f"(AB, BA, ...), each the harness's loop: a compile step, {args.warmup} warm-up "
        f"steps, {args.steps} timed steps, rank 0's clock; {H.adamw_phrase(args.adamw)}; "
        "each value's own Inductor cache (its first process compiles cold).",
        "",
        "| value | median step (ms) | each process's median (ms) | first step of each "
        "process (s) | step-1 loss |",
        "|---|---|---|---|---|",
    ]
    for v, label in zip(summary["values"], shown):
        p = summary["per_value"][v]
        lines.append(
            f"| {label} | {R.num(p['median_ms'], '.1f')} | "
            + ", ".join(R.num(m, ".1f") for m in p["process_medians_ms"]) + " | "
            + ", ".join(R.num(s, ".1f") for s in p["first_step_s"]) + " | "
            + ", ".join(R.num(x, ".6f") for x in sorted(set(p["loss_step1"]))) + " |"
        )
    lines += [
        "",
        f"B over A ({shown[1]} over {shown[0]}): "
        f"**{R.num(summary['ratio_b_over_a'], '.3f')}x** (medians of process medians).",
        "",
        R.code_line(code) + (f" (runtime/passes diff sha256 {code['diff_sha256']})"
                             if code.get("diff_sha256") else "") + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="the environment variable to switch")
    ap.add_argument("--values", default="0,1",
                    help=f"A,B (default 0,1; {UNSET!r} leaves the variable unset)")
    ap.add_argument("--variant", default="ours_compiled")
    ap.add_argument("--shape", default="compute", choices=tuple(H.SHAPES))
    ap.add_argument("--model", default="demo", choices=tuple(H.MODELS))
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    H.add_adamw_argument(ap)
    R.add_out_argument(ap)
    args = ap.parse_args(argv)
    values = args.values.split(",")
    if len(values) != 2 or len(set(values)) != 2:
        ap.error(f"--values {args.values!r}: give two different values, A,B")
    if args.pairs < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--pairs and --steps must be at least 1, --warmup at least 0")
    try:
        (variant,) = H.pick_variants(H.all_variants()[0], args.variant)
    except ValueError as e:
        ap.error(str(e))
    variant = dataclasses.replace(variant, adamw=args.adamw)
    placement = H.Placement("cpu", 2)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="env_ab_") as caches:
        for n, i in enumerate(order(args.pairs)):
            value = values[i]
            with H.set_env(args.env, None if value == UNSET else value, keep_none=False), \
                    H.set_env("TORCHINDUCTOR_CACHE_DIR", os.path.join(caches, str(i))):
                ranks = H.run_spawned_fn(
                    _rank, placement, env=args.env, shape=H.SHAPES[args.shape],
                    variants=[variant], rounds=1, steps=args.steps, warmup=args.warmup,
                    backend="inductor", seed=args.seed, progress=False, count_graphs=False,
                    model=args.model,
                )
            seen = [r["seen"] for r in ranks]
            if seen != [None if value == UNSET else value] * len(ranks):
                raise SystemExit(f"the ranks saw {args.env}={seen}, not {value!r}")
            res = ranks[0]["result"]["variants"][variant.name]
            if res["error"]:
                raise SystemExit(f"{variant.name} with {args.env}={value} failed:\n"
                                 f"{res['traceback']}")
            runs.append(dict(value=i, seen=seen[0], steps_s=res["timed"][0],
                             first_step_s=res["first_step_s"], loss_step1=res["losses"][0]))
            print(f"run {n + 1}/{2 * args.pairs}: {args.env}={value}: median "
                  f"{statistics.median(res['timed'][0]) * 1e3:.1f} ms", flush=True)
    summary = summarize(values, runs)
    code = R.code_state()
    text = table(args, summary, code)
    print(text)
    R.write_report(args.out, f"env_ab_{args.env}_{args.shape}", text,
                   dict(args=vars(args), runs=runs, summary=summary, code=code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
