"""How often gloo crashes or hangs with functional collectives in flight together.

Not a timing: a reliability measurement behind [Note: CPU all-gathers into buffers]
(``passes/gloo/gather_into_buffers.py``). Each run starts 2 gloo ranks (spawned, 1 thread
each) that repeat, ``--rounds`` times: issue the collectives of ``--pattern`` in order
without waiting, allocate and compute a little on the main thread (as a compiled
graph does between a collective's issue and its wait), drop the Python references to
the inputs, wait for every result and check it. A run that exits non-zero is a
crash (the first line of its error is printed); one that exceeds ``--timeout`` is a
hang; a crash's record keeps the Python stack that faulthandler printed (in the
loop, or at the rank's exit). Patterns, each a ``+``-separated list of what is issued:

- ``ag`` / ``ago``: an allocating all-gather (``all_gather_into_tensor``) / one into
  a buffer allocated beforehand (``all_gather_into_tensor_out``);
- ``ar``: an all-reduce; ``rs``: a reduce-scatter (both allocating, as the runtime
  and Inductor issue them);
- ``ex``: a reduce-scatter issued as an exchange (``all_to_all_single``, then the
  addition after its wait), as over two gloo ranks traceable_hsdp issues every
  reduce-scatter ([Note: gloo reduce-scatters as an exchange] in
  ``passes/gloo/exchange.py``);
- ``exg``: an all-gather issued as an exchange (``all_to_all_single`` of the input
  sent to every rank), as compiled graphs issue every all-gather over two gloo ranks
  ([Note: gloo all-gathers as an exchange], the same module).

Example (the rows of the Note's table)::

    python benchmarks/gloo_in_flight.py --pattern rs+ag --runs 4
    python benchmarks/gloo_in_flight.py --pattern rs+ago --runs 4
    python benchmarks/gloo_in_flight.py --pattern ag+ag+ag --runs 6
    python benchmarks/gloo_in_flight.py --pattern ex+ago --runs 4
    python benchmarks/gloo_in_flight.py --pattern ex+exg --runs 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

KINDS = ("ag", "ago", "ar", "rs", "ex", "exg")


def _rank(rank: int, placement: Any, *, pattern: list[str], rounds: int, numel: int) -> None:
    """One rank's loop, under ``_harness.run_spawned_fn`` (gloo, one thread, a native
    crash prints the Python stack)."""
    import torch
    import torch.distributed as dist

    world = placement.world
    c = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    for r in range(rounds):
        xs = [torch.full((numel,), float(rank + i)) for i in range(len(pattern))]
        issued = []
        for kind, x in zip(pattern, xs):
            if kind == "ag":
                issued.append(c.all_gather_into_tensor(x, world, group))
            elif kind == "ago":
                issued.append(c.all_gather_into_tensor_out(x, world, group, out=x.new_empty(world * numel)))
            elif kind == "ar":
                issued.append(c.all_reduce(x, "sum", group))
            elif kind in ("ex", "exg"):
                issued.append(c.all_to_all_single(
                    torch.cat([x] * world), [numel] * world, [numel] * world, group))
            else:
                issued.append(c.reduce_scatter_tensor(torch.cat([x] * world), "sum", world, group))
        junk = [torch.randn(1000) * 2 for _ in range(20)]  # main-thread allocation
        del junk, xs
        for i, (kind, t) in enumerate(zip(pattern, issued)):
            got = c.wait_tensor(t)
            if kind == "ex":
                got = got.view(world, numel).sum(0)
            if kind in ("ag", "ago", "exg"):
                want = torch.cat([torch.full((numel,), float(k + i)) for k in range(world)])
            else:
                want = torch.full((numel,), float(sum(k + i for k in range(world))))
            if not torch.equal(got, want):
                raise AssertionError(f"round {r}, collective {i} ({kind}): wrong values")


def _one_run(pattern: str, rounds: int, numel: int, timeout: float) -> dict[str, object]:
    """One 2-rank run in a fresh process: ``{"result": "ok"|"crash"|"hang", ...}``."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--_child", pattern, str(rounds), str(numel)],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"result": "hang", "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    if proc.returncode == 0:
        return {"result": "ok", "seconds": seconds}
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(" ")]
    first = next((ln for ln in lines if "malloc" in ln or "free(" in ln or "Fatal" in ln
                  or "Error" in ln), lines[-1] if lines else f"exit {proc.returncode}")
    # Where it died: the stack faulthandler printed (the rank's loop, or its exit).
    stack = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("File ")]
    return {"result": "crash", "seconds": seconds, "error": first, "stack": stack[:12]}


def _child(pattern: str, rounds: int, numel: int) -> None:
    import _harness as H

    H.run_spawned_fn(_rank, H.Placement("cpu", 2), pattern=pattern.split("+"), rounds=rounds,
                     numel=numel)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_child"]:
        _child(argv[1], int(argv[2]), int(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", required=True, help="e.g. rs+ag: " + ", ".join(KINDS))
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--numel", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    ap.add_argument("--out", help="write the runs as JSON here")
    args = ap.parse_args(argv)
    kinds = args.pattern.split("+")
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--pattern {args.pattern!r}: each part must be one of {', '.join(KINDS)}")
    runs = []
    for i in range(args.runs):
        r = _one_run(args.pattern, args.rounds, args.numel, args.timeout)
        runs.append(r)
        print(f"{args.pattern} run {i + 1}/{args.runs}: {r['result']} ({r['seconds']} s)"
              + (f": {r['error']}" if "error" in r else ""), flush=True)
    bad = sum(r["result"] != "ok" for r in runs)
    print(f"{args.pattern}: {bad} of {args.runs} runs crashed or hung "
          f"({args.rounds} rounds each, 2 gloo ranks)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(pattern=args.pattern, rounds=args.rounds, numel=args.numel,
                           runs=runs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
