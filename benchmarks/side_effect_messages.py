#!/usr/bin/env python
"""What dynamo's side-effect messages cost a compile of a fully_shard model.

    python benchmarks/side_effect_messages.py --out DIR [--layers 4,8] [--rounds 4]
        [--backend aot_eager]

With torch's default ``torch._dynamo.config.side_effect_replay_policy = "info"``,
dynamo formats a message, with its user stack, for every object a graph changes,
whether or not anything reads it; ``fully_shard`` sets ``"silent"`` while nothing does
(see [Note: Dynamo's side-effect messages] in ``traceable_hsdp/_compile.py``). This
script compiles the first training step (forward, ``.sum()``, backward; compiled
autograd on) of the demo Llama sharded per block and at the root, on one rank (gloo,
one thread), ``--rounds`` times under each policy, in one process. Between compiles
it calls ``torch._dynamo.reset()``. The two policies alternate compile by compile
(ABBA: info, silent, silent, info, ...), so both see the same machine within a
compile of each other; fresh processes move by more than the effect on these 2-core
machines. A first, untimed compile warms the process up (its first compile pays for lazy
set-up that later ones do not). It reports, for each policy, the median wall and CPU
seconds of a compile, how many messages it formatted, and the seconds dynamo spent
emitting the side effects (``SideEffects.codegen_update_mutated``, where ``"info"``
formats them): the work the policy removes, timed apart from the machine's noise.

Writes ``<out>/side_effect_messages.md`` (printed too) and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report as R  # noqa: E402

POLICIES = ("info", "silent")


def _order(rounds: int) -> list[str]:
    """ABBA order over ``rounds`` compiles of each policy."""
    out: list[str] = []
    for i in range(rounds):
        out += list(POLICIES if i % 2 == 0 else reversed(POLICIES))
    return out


def _measure(layers: int, rounds: int, backend: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch._dynamo.side_effects import SideEffects

    import traceable_hsdp as th
    from traceable_hsdp.models import Llama, LlamaConfig

    formatted = [0]
    emitting = [0.0]
    real_format = SideEffects._format_side_effect_message
    real_emit = SideEffects.codegen_update_mutated

    def counting_format(self: Any, var: Any) -> str:
        formatted[0] += 1
        return real_format(self, var)

    def timed_emit(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_emit(self, *args, **kwargs)
        finally:
            emitting[0] += time.perf_counter() - t0

    SideEffects._format_side_effect_message = counting_format  # type: ignore[method-assign]
    SideEffects.codegen_update_mutated = timed_emit  # type: ignore[method-assign]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = Llama(LlamaConfig(n_layers=layers, max_seq_len=32))
            for block in model.layers:
                th.fully_shard(block)
            th.fully_shard(model)
            x = torch.randint(0, 256, (2, 32))
            res: dict[str, dict[str, list[float]]] = {
                p: {"wall_s": [], "cpu_s": [], "messages": [], "emit_s": []} for p in POLICIES
            }
            for i, policy in enumerate(["warm-up", *_order(rounds)]):
                torch._dynamo.reset()  # also turns compiled autograd's compiler off
                th.disable_compiled_autograd()
                th.enable_compiled_autograd(backend=backend)
                torch._dynamo.config.side_effect_replay_policy = "info" if i == 0 else policy
                compiled = torch.compile(model, backend=backend, fullgraph=True)
                formatted[0], emitting[0] = 0, 0.0
                c0, t0 = time.process_time(), time.perf_counter()
                compiled(x).sum().backward()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                model.zero_grad(set_to_none=True)
                if i == 0:
                    continue
                res[policy]["wall_s"].append(wall)
                res[policy]["cpu_s"].append(cpu)
                res[policy]["messages"].append(formatted[0])
                res[policy]["emit_s"].append(emitting[0])
        finally:
            SideEffects._format_side_effect_message = real_format  # type: ignore[method-assign]
            SideEffects.codegen_update_mutated = real_emit  # type: ignore[method-assign]
            dist.destroy_process_group()
    return res


def _markdown(results: dict[int, dict[str, Any]], args: argparse.Namespace, code: dict[str, Any]) -> str:
    import torch

    lines = [
        f"### Dynamo's side-effect messages: a first compile, 1 rank, {args.backend}, "
        f"medians of {args.rounds} compiles per policy (ABBA order, one process)",
        "",
        f"torch {torch.__version__}, {R.cpu_name()}. Demo Llama (dim 64), fully_shard per "
        "block and root, forward + `.sum()` + backward, compiled autograd on.",
        "",
        "| layers | policy | compile wall (s) | compile CPU (s) | messages formatted "
        "| emitting side effects (s) | wall vs `info` |",
        "|---|---|---|---|---|---|---|",
    ]
    for layers, res in results.items():
        info_wall = statistics.median(res["info"]["wall_s"])
        for policy in POLICIES:
            r = res[policy]
            wall = statistics.median(r["wall_s"])
            lines.append(
                f"| {layers} | `{policy}` | {wall:.2f} | {statistics.median(r['cpu_s']):.2f} | "
                f"{statistics.median(r['messages']):.0f} | {statistics.median(r['emit_s']):.2f} | "
                f"{wall / info_wall:.2f}x |"
            )
    lines += ["", R.code_line(code) + "."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="4,8", help="comma list of block counts (default 4,8)")
    p.add_argument("--rounds", type=int, default=4, help="compiles per policy (default 4)")
    p.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend (the messages are dynamo's, before any backend; "
                        "aot_eager compiles fastest)")
    R.add_out_argument(p)
    a = p.parse_args(argv)
    try:
        a.layer_list = [int(n) for n in a.layers.split(",")]
    except ValueError:
        p.error(f"--layers {a.layers!r}: expected a comma list of ints")
    if a.rounds < 1 or any(n < 1 for n in a.layer_list):
        p.error("--rounds and every --layers value must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from step_time import _code_state

    results = {n: _measure(n, a.rounds, a.backend) for n in a.layer_list}
    code = _code_state()
    text = _markdown(results, a, code)
    print(text)
    R.write_report(a.out, "side_effect_messages", text, {
        "results": results, "rounds": a.rounds, "backend": a.backend, "code": code,
        "cpu": R.cpu_name()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
