#!/usr/bin/env python
"""What activation checkpointing costs and saves, for traceable_hsdp and for torch's
fully_shard, measured side by side in one run.

    python benchmarks/ac_cost.py [--model demo|hf] [--shape compute|overhead]
                                 [--steps N] [--rounds R] [--out DIR] [--smoke]
                                 [--device auto|cpu|cuda] [--world N]

For each checkpointing form (``none``; ``full``: ``checkpoint_wrapper`` around every
block, before ``fully_shard``, torchtitan's order; ``selective``: the same with a policy
that saves the matmuls and recomputes the rest) it builds, from the same seed and on
the same batches:

- ``torch_eager_<ac>``: ``torch.distributed.fsdp.fully_shard`` per block then root;
- ``torch_block_compiled_<ac>``: torchtitan's recipe, each (wrapped) block
  ``torch.compile(block, fullgraph=True)`` and then torch's ``fully_shard``;
- ``ours_eager_<ac>``: ``traceable_hsdp.fully_shard`` the same way;
- ``ours_compiled_<ac>``: ours with ``enable_compiled_autograd()`` and
  ``torch.compile(model)`` (Inductor, every pass on; the plain loop).

and times each step (forward, cross-entropy, backward, AdamW, zero_grad), alternating
round-robin between the variants so that the machine's drift hits them all alike. It
reports the median step (the slowest rank's time per step), the first step of the
compiled variants (their compile time), what a step holds at its peak, and for each of
our compiled variants the bytes of activations its forward graphs save for the
backward, read from the partitioner's output (parameters and inputs not counted). The
memory of a step is the most memory above its start, on rank 0, the largest over the
timed steps: on CUDA from ``torch.cuda.max_memory_allocated()``, on the CPU from the
heap shim of ``_heap.py`` (built with the C compiler and preloaded into the ranks; see
[Note: A heap peak on the CPU] there). Writes ``<out>/ac_cost_<model>_<shape>.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
AC_KINDS = ("none", "full", "selective")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import _harness as H

    p = argparse.ArgumentParser(prog="ac_cost.py", description=__doc__.split("\n\n")[0])
    H.add_placement_args(p)
    p.add_argument("--model", choices=("demo", "hf"), default="demo",
                   help="demo: traceable_hsdp.demo.models.Llama; hf: transformers' "
                        "LlamaForCausalLM from a config of the same shape (default demo)")
    p.add_argument("--shape", choices=("compute", "overhead"), default="compute",
                   help="a shape of benchmarks/step_time.py (default compute)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--out", default=None, help="output folder (default: print only)")
    p.add_argument("--smoke", action="store_true", help="2 layers, dim 32, 2 steps, 1 round")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.steps, a.rounds = "smoke", 2, 1
    a.placement = H.placement_from_args(p, a)
    return a


# ------------------------------------------------------------------ the models


def _build(model: str, shape: Any, ac: str, impl: str, mesh: Any, device: torch.device) -> Any:
    """The model from seed 0, every block wrapped for ``ac`` and sharded with ``impl``'s
    ``fully_shard`` (``"ours"``, ``"torch"``, or ``"torch_block"``: torch's, each block
    compiled first), then the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # The policy of ``traceable-hsdp train --ac selective``: the benchmark measures it.
    from traceable_hsdp.demo._train import _save_matmuls

    if impl == "ours":
        from traceable_hsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if model == "demo":
        from traceable_hsdp.demo.models import Llama

        net = Llama(shape.model_config())
        blocks = net.layers
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        net = LlamaForCausalLM(LlamaConfig(
            vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=4 * shape.dim,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
            num_key_value_heads=shape.heads, max_position_embeddings=shape.seq,
            tie_word_embeddings=False, attn_implementation="sdpa",
        ))
        blocks = net.model.layers
    net = net.to(device)
    for i, block in enumerate(blocks):
        if ac != "none":
            kw = {}
            if ac == "selective":
                kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            block = checkpoint_wrapper(block, **kw)
            blocks[i] = block
        if impl == "torch_block":  # torchtitan's order: AC, compile, then fully_shard
            block = torch.compile(block, fullgraph=True)
            blocks[i] = block
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


class _SavedBytes:
    """Wraps Inductor's partitioner: per forward graph, the bytes of the activations it
    saves for the backward (placeholders, i.e. parameters and inputs, not counted)."""

    def __init__(self) -> None:
        self.by_variant: dict[str, list[int]] = {}
        self.variant = "?"
        self._orig: Any = None

    def __enter__(self) -> "_SavedBytes":
        import torch._inductor.compile_fx as cfx

        self._orig = cfx.min_cut_rematerialization_partition
        orig = self._orig

        def recording(joint: Any, inputs: Any, **kw: Any) -> Any:
            fw, bw = orig(joint, inputs, **kw)
            out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
            n = sum(
                v.numel() * v.element_size()
                for node in out[kw["num_fwd_outputs"]:]
                if isinstance(node, torch.fx.Node) and node.op != "placeholder"
                and isinstance(v := node.meta.get("val"), torch.Tensor)
            )
            self.by_variant.setdefault(self.variant, []).append(int(n))
            return fw, bw

        cfx.min_cut_rematerialization_partition = recording
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch._inductor.compile_fx as cfx

        cfx.min_cut_rematerialization_partition = self._orig


# ------------------------------------------------------------------- per rank


def _rank(rank: int, placement: Any, model: str, shape_name: str, steps: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import _harness as H
    import traceable_hsdp

    shape = H.SHAPES[shape_name]
    world = placement.world
    device = placement.rank_device(rank)
    mesh = init_device_mesh(device.type, (world,))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    variants = [
        (f"{impl}_{mode}_{ac}", impl, mode, ac)
        for ac in AC_KINDS
        for impl, mode in (("torch", "eager"), ("torch_block", "compiled"), ("ours", "eager"),
                           ("ours", "compiled"))
    ]
    runs: dict[str, dict[str, Any]] = {}
    saved = _SavedBytes()
    with saved:
        for name, impl, mode, ac in variants:
            net = _build(model, shape, ac, impl, mesh, device)
            whole = impl == "ours" and mode == "compiled"
            runs[name] = dict(net=net, fwd=torch.compile(net) if whole else net, compiled=whole,
                              first_compiles=mode == "compiled",
                              opt=torch.optim.AdamW(net.parameters(), lr=1e-3),
                              times=[], peaks=[], losses=[], step=0, first=None)

        def step(name: str, timed: bool = False) -> float:
            r = runs[name]
            x, y = batch(r["step"])
            gc.collect()
            dist.barrier()
            H.reset_peak_memory(device)
            start = H.allocated_mib(device, pooled=r["compiled"])  # ours compiled whole
            t0 = time.perf_counter()
            if r["compiled"]:
                traceable_hsdp.enable_compiled_autograd()
            try:
                saved.variant = name
                logits = _logits(r["fwd"](x))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss.backward()
            finally:
                traceable_hsdp.disable_compiled_autograd()
            r["opt"].step()
            r["opt"].zero_grad()
            sync()
            dt = torch.tensor(time.perf_counter() - t0)
            if timed and start is not None:
                r["peaks"].append(H.peak_memory_mib(device) - start)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step
            r["losses"].append(loss.item())
            r["step"] += 1
            return float(dt)

        for name in runs:  # the first step: compiles the compiled variants
            runs[name]["first"] = step(name)
        for _ in range(rounds):
            for name in runs:
                step(name)  # warm-up
                runs[name]["times"].extend(step(name, timed=True) for _ in range(steps))
    return {
        name: dict(first=r["first"], times=r["times"], losses=r["losses"],
                   first_compiles=r["first_compiles"],
                   peak_above_start_mib=max(r["peaks"]) if r["peaks"] else None,
                   saved_bytes=sum(saved.by_variant.get(name, [])) if r["compiled"] else None)
        for name, r in runs.items()
    }


# ---------------------------------------------------------------------- report


def report(res: dict[str, Any], a: argparse.Namespace, device: str) -> str:
    med = {n: statistics.median(r["times"]) for n, r in res.items()}
    mem = "GPU max allocated" if a.placement.device_type == "cuda" else "heap"
    lines = [
        f"# Activation checkpointing cost: {a.model} model, {a.shape} shape",
        "",
        f"torch {torch.__version__}, {device}, {a.placement.world} ranks; "
        f"{a.rounds} rounds x {a.steps} timed steps per variant, round-robin; "
        "median of the slowest rank's step. Memory: rank 0's peak above each timed "
        f"step's start ({mem}), the largest over its timed steps.",
        "",
        "| variant | median step (s) | vs the same system without AC | first step (s) "
        "| step's memory peak (MiB) | vs without AC "
        "| forward's saved activations (KiB) | vs without AC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in res.items():
        base = n.rsplit("_", 1)[0] + "_none"
        sb, sb0 = r["saved_bytes"], res[base]["saved_bytes"]
        pk, pk0 = r["peak_above_start_mib"], res[base]["peak_above_start_mib"]
        first = f"{r['first']:.1f}" if r["first_compiles"] else "(eager)"
        lines.append(
            f"| {n} | {med[n]:.4f} | {med[n] / med[base]:.2f}x | {first} | "
            + (f"{pk:.1f} | {pk / pk0:.2f}x | " if pk is not None and pk0 else "– | | ")
            + (f"{sb / 1024:.0f} | {sb / sb0:.2f}x |" if sb is not None and sb0
               else "not counted: not ours compiled whole | |")
        )
    lines += ["", "Losses of the last step (every variant trains the same model on the "
              "same batches):", ""]
    lines += [f"- {n}: {r['losses'][-1]:.6f}" for n, r in res.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import _harness as H
    import _report as R

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ac_cost_inductor_"))
    with contextlib.ExitStack() as stack:
        if a.placement.device_type == "cpu":
            import _heap

            stack.enter_context(_heap.counting_children())  # the ranks are spawned
        res = H.run_spawned_fn(_rank, a.placement, model=a.model, shape_name=a.shape,
                               steps=a.steps, rounds=a.rounds)[0]
    device = f"{platform.processor() or platform.machine()} CPU" if a.placement.device_type == "cpu" \
        else torch.cuda.get_device_name(0)

    text = report(res, a, device) + "\n\n" + R.code_line(R.code_state()) + "."
    print(text)
    if a.out:
        R.write_report(a.out, f"ac_cost_{a.model}_{a.shape}", text, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
