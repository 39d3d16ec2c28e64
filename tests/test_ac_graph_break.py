"""Activation checkpointing inside a unit (``checkpoint_wrapper`` on each block, then
``fully_shard`` on each block and the root: torchtitan's order) whose checkpointed
region breaks the graph, compiled whole (``enable_compiled_autograd()`` and
``torch.compile(model)``) with no dynamo setting changed. Dynamo then runs each
checkpoint eagerly, and its recompute runs eagerly inside the compiled-autograd
backward; the unit's modules hold the gathered parameters for it ([Note: A checkpoint
inside a unit, run eagerly by compiled autograd] in traceable_hsdp/_compile_checks.py).

Two models, 2 gloo ranks, 3 AdamW steps each: our demo Llama with a graph break at
the end of each block's attention (``break_after``), and HF ``LlamaForCausalLM``
(transformers 5.25 breaks the graph in every decoder layer's attention: the
``kernels`` package sets a context variable). Each is trained with torch's
``fully_shard`` eagerly, with ours eagerly and with ours compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import CFG1, LR, GraphRecorder, _data, _loss, _mean_over_ranks, break_after
from _workers import _placeholder_bytes, graph_break_reasons
from traceable_hsdp.demo.models import Llama

STEPS = 3
HF_LAYERS = 1  # every layer costs compile time
# Parameters per block: our Llama's 4 attention and 3 feed-forward projections and 2
# norms; HF Llama's decoder layer the same. The root's: embedding, final norm, head.
BLOCK_PARAMS, ROOT_PARAMS = 9, 3
Run = tuple[list[float], dict[str, torch.Tensor]]


def _llama(fs: Callable[..., Any]) -> nn.Module:
    """Our Llama (1 block: each saved tensor of an eager checkpoint costs a compile),
    its block's attention ending with a graph break, the block checkpoint_wrapped,
    then sharded, then the root."""
    model = Llama(CFG1)
    for i, block in enumerate(model.layers):
        break_after(block.attn)
        model.layers[i] = checkpoint_wrapper(block)
        fs(model.layers[i])
    fs(model)
    return model


def _hf_llama(fs: Callable[..., Any]) -> nn.Module:
    """HF ``LlamaForCausalLM`` (``HF_LAYERS`` decoder layers, no KV cache), each layer
    checkpoint_wrapped, then sharded, then the root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=CFG1.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=HF_LAYERS, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=32, tie_word_embeddings=False, use_cache=False,
    ))
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
        fs(layers[i])
    fs(model)
    return model.train()


CASES: dict[str, tuple[Callable[[Callable[..., Any]], nn.Module], bool]] = {
    "llama": (_llama, False),
    "hf_llama": (_hf_llama, True),
}


def _train(
    model: nn.Module, forward: Any, hf: bool, rank: int, world: int,
    after_step: Callable[[], None] = lambda: None,
) -> Run:
    """``STEPS`` AdamW steps on this rank's half of the global batch: the losses
    (averaged over the ranks) and the full parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _data(world, STEPS):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = _loss(forward(input_ids=x).logits if hf else forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world))
        after_step()
    params = {k: full_tensor(v) for k, v in model.state_dict().items()}
    return losses, params


def ac_graph_break_worker(rank: int, world: int, backend: str, cases: list[str]) -> dict[str, Any]:
    """Each of ``cases`` trained eagerly with ours, compiled with ours on ``backend``
    (under "aot_eager" through :class:`GraphRecorder`, which counts the collectives
    of every graph) and, under "aot_eager", eagerly with torch's fully_shard. Also
    returned, per compiled run: the graphs compiled at each step (forward and
    backward), the graph breaks, the placeholder bytes after each step, and whether
    the modules hold only the sharded parameters after training."""
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for name in cases:
        build, hf = CASES[name]
        libs = {"ours": th.fully_shard, "torch": torch_fsdp.fully_shard}
        for mode in ("torch", "eager", "compiled"):
            if mode == "torch" and backend != "aot_eager":
                continue
            torch.manual_seed(0)
            model = build(lambda m, lib=libs["torch" if mode == "torch" else "ours"]: lib(m, mesh=mesh))
            if mode != "compiled":
                out[f"{name}_{mode}"] = _train(model, model, hf, rank, world)
                continue
            rec = GraphRecorder() if backend == "aot_eager" else None
            torch._dynamo.reset()
            counters.clear()
            th.enable_compiled_autograd(backend=rec or backend)
            steps: list[tuple[list[dict[str, int]], list[dict[str, int]]]] = []
            held: list[int] = []

            def after_step(rec: Any = rec, model: nn.Module = model) -> None:
                held.append(_placeholder_bytes(model))
                if rec is not None:
                    done = sum(len(f) for f, _ in steps), sum(len(b) for _, b in steps)
                    steps.append((rec.forward[done[0]:], rec.backward[done[1]:]))

            try:
                compiled = torch.compile(model, backend=rec or backend)
                out[f"{name}_compiled"] = _train(model, compiled, hf, rank, world, after_step)
            finally:
                th.disable_compiled_autograd()
            out[f"{name}_graphs"] = steps
            out[f"{name}_breaks"] = graph_break_reasons()
            out[f"{name}_bytes_after"] = held
            out[f"{name}_sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def _assert_same(a: Run, b: Run, what: str) -> None:
    assert a[0] == b[0], (what, a[0], b[0])
    assert a[1].keys() == b[1].keys(), what
    for k, v in b[1].items():
        torch.testing.assert_close(a[1][k], v, rtol=0, atol=0, msg=f"{what}: {k}")


@pytest.mark.slow
def test_ac_graph_break_aot_eager() -> None:
    """aot_eager: ours compiled is bitwise equal to ours eager, which is bitwise equal
    to torch's fully_shard eager, for both models. The graph breaks the test relies
    on happen. Each step's placeholders are freed after it and the modules end
    holding the sharded parameters (the recompute's swap is undone). Collectives: the
    first step's forward graphs gather the root's parameters and one block's (the
    identical blocks would share one compiled frame), its backward graphs
    (compiled autograd's graph, split where the eager recompute runs) re-gather each
    block's parameters once (the root stays gathered from its forward: the default
    reshard_after_forward) and reduce every parameter once; the recompute adds no
    collective, and the later steps compile nothing."""
    cases = list(CASES)
    for r in run_ranks(ac_graph_break_worker, 2, "aot_eager", cases):
        for name in cases:
            _assert_same(r[f"{name}_compiled"], r[f"{name}_eager"], f"{name}: compiled vs eager")
            _assert_same(r[f"{name}_eager"], r[f"{name}_torch"], f"{name}: ours vs torch's")
            assert r[f"{name}_bytes_after"] == [0] * STEPS, r[f"{name}_bytes_after"]
            assert r[f"{name}_sharded_after"], name
            breaks = r[f"{name}_breaks"]
            assert breaks, name
            if name == "hf_llama":  # the kernels context variable set in the region
                assert "HOP: Unsafe side effect" in breaks, breaks
            steps = r[f"{name}_graphs"]
            assert all(f == [] and b == [] for f, b in steps[1:]), (name, steps)
            fwd, bwd = steps[0]
            assert fwd and bwd, (name, steps[0])
            blocks = CFG1.n_layers if name == "llama" else HF_LAYERS

            def total(graphs: list[dict[str, int]], key: str) -> int:
                return sum(g.get(key, 0) for g in graphs)

            counts = {
                (where, op): total(graphs, op)
                for where, graphs in (("fwd", fwd), ("bwd", bwd))
                for op in ("all_gather_into_tensor", "reduce_scatter_tensor")
            }
            # One block in each model (dynamo compiles a unit's forward frame once, and
            # identical blocks reuse it: the forward graphs hold one block's gathers).
            assert counts == {
                ("fwd", "all_gather_into_tensor"): ROOT_PARAMS + BLOCK_PARAMS,
                ("fwd", "reduce_scatter_tensor"): 0,
                ("bwd", "all_gather_into_tensor"): blocks * BLOCK_PARAMS,
                ("bwd", "reduce_scatter_tensor"): blocks * BLOCK_PARAMS + ROOT_PARAMS,
            }, (name, counts, steps[0])


@pytest.mark.slow
def test_ac_graph_break_inductor() -> None:
    """Inductor, with the passes: ours compiled against ours eager, losses rtol 1e-5
    and parameters atol 2e-5 (Inductor fuses and reorders float arithmetic; the
    eager recompute then differs from the compiled forward in the last bits, which
    the checkpoint accepts). HF Llama only: each saved tensor's unpack in the eager
    checkpoint breaks compiled autograd's graph, and Inductor compiles every piece."""
    cases = ["hf_llama"]
    for r in run_ranks(ac_graph_break_worker, 2, "inductor", cases):
        for name in cases:
            c, e = r[f"{name}_compiled"], r[f"{name}_eager"]
            torch.testing.assert_close(c[0], e[0], rtol=1e-5, atol=0, msg=name)
            for k, v in e[1].items():
                torch.testing.assert_close(c[1][k], v, rtol=0, atol=2e-5, msg=f"{name} {k}")
            assert r[f"{name}_bytes_after"] == [0] * STEPS, r[f"{name}_bytes_after"]
            assert r[f"{name}_sharded_after"], name
