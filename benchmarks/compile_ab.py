#!/usr/bin/env python
"""What one compile-time lever of fully_shard saves a first compile, side by side.

    python benchmarks/compile_ab.py --lever LEVER --out DIR [--layers 4,8] [--rounds 4]
        [--backend aot_eager]

Levers (the first variant is torch's behaviour or the alternative, the second ours):

- ``side_effects``: dynamo's ``side_effect_replay_policy``, torch's ``"info"`` against
  the ``"silent"`` that ``fully_shard`` sets while nothing reads the messages (see
  [Note: Dynamo's side-effect messages] in ``traceable_hsdp/_compile.py``).
- ``version_counters``: the placeholder's resize and fill inside
  ``torch.autograd._unsafe_preserve_version_counter`` while dynamo traces too
  (``"traced"``), against ours, which enters it only eagerly (``"skipped"``; see
  [Note: Version counters in a traced step] in ``traceable_hsdp/_param.py``).

The script compiles the first training step (forward, ``.sum()``, backward; compiled
autograd on) of the demo Llama sharded per block and at the root, on one rank (gloo,
one thread), ``--rounds`` times under each variant, in one process. Between compiles
it calls ``torch._dynamo.reset()``. The two variants alternate compile by compile
(ABBA), so both see the same machine within a compile of each other; fresh processes
move by more than these effects on 2-core machines. A first, untimed compile warms the
process up (its first compile pays for lazy set-up that later ones do not). It reports,
for each variant, the median wall and CPU seconds of a compile; the nodes of dynamo's
graphs (the forward and the compiled-autograd backward, counted as the backend
receives them); how many side-effect messages dynamo formatted; and the seconds it
spent emitting the side effects (``SideEffects.codegen_update_mutated``, where
``"info"`` formats them).

Writes ``<out>/<report>.md`` (printed too) and ``.json``; the report is
``side_effect_messages`` or ``version_counters``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _report as R  # noqa: E402


@dataclass(frozen=True)
class Lever:
    report: str  # the report's file stem
    variants: tuple[str, str]  # (torch's or the alternative, ours)
    what: str  # the table's caption


LEVERS = {
    "side_effects": Lever("side_effect_messages", ("info", "silent"),
                          "Dynamo's side-effect messages (`side_effect_replay_policy`)"),
    "version_counters": Lever("version_counters", ("traced", "skipped"),
                              "The placeholders' version counters kept while dynamo traces"),
}


def _order(variants: tuple[str, str], rounds: int) -> list[str]:
    """ABBA order over ``rounds`` compiles of each variant."""
    out: list[str] = []
    for i in range(rounds):
        out += list(variants if i % 2 == 0 else reversed(variants))
    return out


def _set_variant(lever: str, variant: str, shipped_hide: Callable[..., Any]) -> None:
    """Puts the process in ``variant`` of ``lever`` before a compile;
    ``shipped_hide`` is the library's own ``_param._hide_version_change``."""
    import torch

    import traceable_hsdp._param as P

    if lever == "side_effects":
        torch._dynamo.config.side_effect_replay_policy = variant
    elif lever == "version_counters":
        if variant == "traced":
            P._hide_version_change = torch.autograd._unsafe_preserve_version_counter
        else:
            P._hide_version_change = shipped_hide
    else:
        raise ValueError(f"unknown lever {lever!r}")


def _measure(lever: str, layers: int, rounds: int, backend: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch._dynamo.side_effects import SideEffects

    import traceable_hsdp as th
    import traceable_hsdp._param as P
    from traceable_hsdp.demo.models import Llama, LlamaConfig

    variants = LEVERS[lever].variants
    formatted = [0]
    emitting = [0.0]
    nodes: list[int] = []
    real_format = SideEffects._format_side_effect_message
    real_emit = SideEffects.codegen_update_mutated
    compile_graph = torch._dynamo.lookup_backend(backend)

    def counting_format(self: Any, var: Any) -> str:
        formatted[0] += 1
        return real_format(self, var)

    def timed_emit(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_emit(self, *args, **kwargs)
        finally:
            emitting[0] += time.perf_counter() - t0

    def counting_backend(gm: Any, example_inputs: Any) -> Any:
        nodes.append(len(gm.graph.nodes))
        return compile_graph(gm, example_inputs)

    shipped_hide = P._hide_version_change
    SideEffects._format_side_effect_message = counting_format  # type: ignore[method-assign]
    SideEffects.codegen_update_mutated = timed_emit  # type: ignore[method-assign]
    torch.set_num_threads(1)
    with contextlib.ExitStack() as undo, tempfile.TemporaryDirectory() as d:
        undo.callback(setattr, SideEffects, "_format_side_effect_message", real_format)
        undo.callback(setattr, SideEffects, "codegen_update_mutated", real_emit)
        undo.callback(setattr, P, "_hide_version_change", shipped_hide)
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        undo.callback(dist.destroy_process_group)
        torch.manual_seed(0)
        model = Llama(LlamaConfig(n_layers=layers, max_seq_len=32))
        for block in model.layers:
            th.fully_shard(block)
        th.fully_shard(model)
        # Each variant sets the policy before its compile; afterwards, what fully_shard set.
        policy = torch._dynamo.config.side_effect_replay_policy
        undo.callback(setattr, torch._dynamo.config, "side_effect_replay_policy", policy)
        x = torch.randint(0, 256, (2, 32))
        res: dict[str, dict[str, list[float]]] = {
            v: {"wall_s": [], "cpu_s": [], "messages": [], "emit_s": [], "nodes": []}
            for v in variants
        }
        for i, variant in enumerate(["warm-up", *_order(variants, rounds)]):
            torch._dynamo.reset()  # also turns compiled autograd's compiler off
            th.disable_compiled_autograd()
            th.enable_compiled_autograd(backend=counting_backend)
            _set_variant(lever, variants[0] if i == 0 else variant, shipped_hide)
            compiled = torch.compile(model, backend=counting_backend, fullgraph=True)
            formatted[0], emitting[0] = 0, 0.0
            nodes.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            compiled(x).sum().backward()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            model.zero_grad(set_to_none=True)
            if i == 0:
                continue
            r = res[variant]
            r["wall_s"].append(wall)
            r["cpu_s"].append(cpu)
            r["messages"].append(formatted[0])
            r["emit_s"].append(emitting[0])
            r["nodes"].append(sum(nodes))
        th.disable_compiled_autograd()
    return res


def _markdown(results: dict[int, dict[str, Any]], args: argparse.Namespace, code: dict[str, Any]) -> str:
    import torch

    lever = LEVERS[args.lever]
    base = lever.variants[0]
    lines = [
        f"### {lever.what}: a first compile, 1 rank, {args.backend}, "
        f"medians of {args.rounds} compiles per variant (ABBA order, one process)",
        "",
        f"torch {torch.__version__}, {R.cpu_name()}. Demo Llama (dim 64), fully_shard per "
        "block and root, forward + `.sum()` + backward, compiled autograd on.",
        "",
        "| layers | variant | compile wall (s) | compile CPU (s) | dynamo graph nodes "
        f"| messages formatted | emitting side effects (s) | wall vs `{base}` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layers, res in results.items():
        base_wall = statistics.median(res[base]["wall_s"])
        for variant in lever.variants:
            r = res[variant]
            wall = statistics.median(r["wall_s"])
            lines.append(
                f"| {layers} | `{variant}` | {wall:.2f} | {statistics.median(r['cpu_s']):.2f} | "
                f"{statistics.median(r['nodes']):.0f} | {statistics.median(r['messages']):.0f} | "
                f"{statistics.median(r['emit_s']):.2f} | {wall / base_wall:.2f}x |"
            )
    lines += ["", R.code_line(code) + "."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lever", required=True, choices=sorted(LEVERS), help="what to compare")
    p.add_argument("--layers", default="4,8", help="comma list of block counts (default 4,8)")
    p.add_argument("--rounds", type=int, default=4, help="compiles per variant (default 4)")
    p.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend (both levers act in dynamo and AOTAutograd, "
                        "before any backend; aot_eager compiles fastest)")
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

    results = {n: _measure(a.lever, n, a.rounds, a.backend) for n in a.layer_list}
    code = R.code_state()
    text = _markdown(results, a, code)
    print(text)
    R.write_report(a.out, LEVERS[a.lever].report, text, {
        "lever": a.lever, "results": results, "rounds": a.rounds, "backend": a.backend,
        "code": code, "cpu": R.cpu_name()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
