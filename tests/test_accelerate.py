"""HF accelerate's FSDP2 preparation as a real client: accelerate's own
``fsdp2_prepare_model`` (and ``fsdp2_apply_ac``) on HF GPT-2 and Llama, with
traceable_hsdp switched in by patching ``torch.distributed.fsdp.fully_shard`` (the
name accelerate imports), against the same preparation with torch's ``fully_shard``.

accelerate's ``Accelerator.prepare`` shards a model for ``fsdp_version=2`` with
``accelerate.utils.fsdp_utils.fsdp2_prepare_model``, which imports the public name
``torch.distributed.fsdp.fully_shard`` each time it runs. A user switches it to
traceable_hsdp by patching that name around ``prepare`` (docs/real_jobs.md, "HF
accelerate"). ``Accelerator`` runs FSDP on accelerators only (GPUs, XPUs, ...), not on
the CPU, so the rank workers call accelerate's own preparation functions directly,
with the attributes of an ``Accelerator`` they read; everything else is accelerate's
code: its auto-wrap policy, its layout (a unit per decoder layer, the input embedding
its own unit when untied, ``[final norm, (embedding,) head]`` one unit kept gathered
after forward, the root), its rank-0 broadcast load on meta
(``cpu_ram_efficient_loading``) and its activation checkpointing (``fsdp2_apply_ac``).

Tolerances: eager and aot_eager bitwise (atol=rtol=0: the same ops on the same data
in the same order). Inductor: losses rtol 1e-5, parameters atol 1e-4. Inductor fuses
and reorders float arithmetic, and AdamW (lr 1e-2) turns that into parameter steps of
a few 1e-5, as the same GPT-2 unsharded on one process, compiled against eager, also
shows.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import traceable_hsdp as th
from _dist import run_ranks
from _workers import (
    CFG,
    LR,
    GraphRecorder,
    _data,
    _managed,
    _placeholder_bytes,
    assert_same_run,
    full_state,
    hf_llama_config,
)

# accelerate's layout of a 2-layer model: the root, a unit per decoder layer, and the
# tail unit [final norm, (input embedding,) head] kept gathered after forward; Llama's
# untied input embedding is a unit of its own. Listed by module: the tail's members
# each show as a unit.
GPT2_UNITS = ["", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
              "lm_head"]
LLAMA_UNITS = ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
               "lm_head"]


STEPS = 3

# (model, cpu_ram_efficient_loading, accelerate's mixed_precision): GPT-2 ties its
# embedding and head (accelerate puts both in the tail unit with the final norm), Llama
# does not (the embedding is a unit of its own). With "bf16" accelerate keeps fp32
# parameters and passes torch's MixedPrecisionPolicy(param_dtype=bfloat16,
# reduce_dtype=bfloat16).
EAGER_CASES = [("gpt2", False, "no"), ("gpt2", True, "no"), ("llama", False, "no"),
               ("llama", True, "no"), ("llama", True, "bf16")]


def hf_model(kind: str, layers: int = 2) -> nn.Module:
    """A small HF causal LM, no weights, dropout off (Inductor draws its own random
    numbers, so a compiled dropout could not equal the eager one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind == "gpt2":
        cfg = AutoConfig.for_model(
            "gpt2", n_embd=32, n_head=2, n_layer=layers, n_positions=32,
            vocab_size=CFG.vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        )
    else:
        cfg = hf_llama_config(layers)  # the conformance tests' HF Llama, untied
    model = AutoModelForCausalLM.from_config(cfg)
    # GPT-2's class name names no loss, so HF warns at each loss (a logger call, which
    # fullgraph=True cannot trace) unless the model names it.
    model.loss_type = "ForCausalLM"
    return model


def prepare(
    model: nn.Module, lib: str, rank: int, efficient: bool, ac: bool = False,
    mixed_precision: str = "no",
) -> nn.Module:
    """``model`` sharded by accelerate's FSDP2 preparation with torch's ``fully_shard``
    or, patched into torch's public name, ours."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        cpu_ram_efficient_loading=efficient, reshard_after_forward=True,
    )
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)  # as accelerate's state does
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
        is_main_process=rank == 0, mixed_precision=mixed_precision, device=torch.device("cpu"),
    )
    plugin.set_auto_wrap_policy(model)  # as Accelerator.prepare does first
    if ac:
        model = fsdp2_apply_ac(accelerator, model)
    switch = (
        mock.patch("torch.distributed.fsdp.fully_shard", th.fully_shard)
        if lib == "ours" else contextlib.nullcontext()
    )
    with switch:
        return fsdp2_prepare_model(accelerator, model)


def units(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch_fsdp.FSDPModule)]


def train(model: nn.Module, rank: int, world: int, fwd: Any = None) -> tuple[list[float], dict]:
    """``STEPS`` AdamW steps with HF's own loss (``labels=``) and accelerate's gradient
    clipping on the sharded gradients."""
    fwd = model if fwd is None else fwd
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, _ in _data(world, STEPS):
        ids = x.chunk(world)[rank]
        loss = fwd(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state(model)


def accelerate_eager(rank: int, world: int) -> dict[str, Any]:
    """Each of ``EAGER_CASES`` prepared by accelerate with torch's ``fully_shard`` and
    with ours, trained alike."""
    out: dict[str, Any] = {}
    for kind, efficient, mixed_precision in EAGER_CASES:
        case: dict[str, Any] = {}
        for lib in ("torch", "ours"):
            torch.manual_seed(0)
            model = prepare(hf_model(kind), lib, rank, efficient, mixed_precision=mixed_precision)
            case[f"units_{lib}"] = units(model)
            case[lib] = train(model, rank, world)
            if lib == "ours":
                case["bytes_after"] = _placeholder_bytes(model)
                case["compute_dtypes"] = {fp.unsharded_param.dtype for fp in _managed(model)}
        out[f"{kind}_{efficient}_{mixed_precision}"] = case
    return out


def test_accelerate_fsdp2_prepare_eager() -> None:
    """GPT-2 (tied: accelerate puts the embedding, the final norm and the head in one
    list unit whose members run at the forward's two ends) and Llama (untied), each
    with accelerate's plain preparation and with its rank-0 broadcast load
    (``cpu_ram_efficient_loading``: every rank's model moved to meta and sharded
    there, rank 0's weights broadcast and loaded with ``load_state_dict(assign=True)``).
    Llama also with accelerate's bf16 mixed precision (its policy, torch's class).
    Same units as torch's, bitwise equal to torch's over 3 AdamW steps with HF's loss
    and accelerate's clipping: under torch's patched name (which accelerate reads
    ``__wrapped__`` of), and in the broadcast load (where the tail unit's head is
    loaded after its norm)."""
    for r in run_ranks(accelerate_eager, 2):
        for kind, efficient, mixed_precision in EAGER_CASES:
            what = f"{kind} efficient={efficient} mixed_precision={mixed_precision}"
            case = r[f"{kind}_{efficient}_{mixed_precision}"]
            expected = GPT2_UNITS if kind == "gpt2" else LLAMA_UNITS
            assert case["units_torch"] == expected, case["units_torch"]
            assert case["units_ours"] == expected, case["units_ours"]
            assert_same_run(case["ours"], case["torch"], what)
            assert case["bytes_after"] == 0, what
            dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
            assert case["compute_dtypes"] == {dtype}, (what, case["compute_dtypes"])


def accelerate_compiled(rank: int, world: int) -> dict[str, Any]:
    """GPT-2 (tied) prepared by accelerate with its activation checkpointing and its
    rank-0 broadcast load, then ``torch.compile(model, fullgraph=True)`` with compiled
    autograd: eager (ours and torch's), aot_eager (collectives counted in the captured
    graphs) and Inductor with every pass."""
    out: dict[str, Any] = {}
    for mode in ("torch", "eager", "aot_eager", "inductor"):
        torch.manual_seed(0)
        model = prepare(hf_model("gpt2"), "torch" if mode == "torch" else "ours", rank,
                        efficient=True, ac=True)
        fwd, rec = model, None
        if mode in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            rec = GraphRecorder() if mode == "aot_eager" else None
            backend = rec or mode
            th.enable_compiled_autograd(backend=backend)
            fwd = torch.compile(model, backend=backend, fullgraph=True)
        try:
            out[mode] = train(model, rank, world, fwd)
        finally:
            if rec is not None or mode == "inductor":
                th.disable_compiled_autograd()
        out[f"{mode}_units"] = units(model)
        out[f"{mode}_checkpointed"] = sum(
            hasattr(m, "_checkpoint_wrapped_module") for m in model.modules()
        )
        if mode != "torch":
            out[f"{mode}_bytes_after"] = _placeholder_bytes(model)
        if rec is not None:
            out["graphs"] = (rec.forward, rec.backward)
    return out


@pytest.mark.slow
def test_accelerate_fsdp2_prepare_compiled() -> None:
    """GPT-2 prepared by accelerate with its activation checkpointing (its
    ``checkpoint_wrapper`` on each block, the wrapper sharded) and its rank-0 broadcast
    load, then ``torch.compile(model, fullgraph=True)`` with compiled autograd.
    aot_eager: bitwise equal to ours eager, which is bitwise equal to torch's eager;
    one graph each way, with the collectives counted in them. Inductor (every pass):
    within the tolerances above."""
    for r in run_ranks(accelerate_compiled, 2, spawn=True):
        for mode in ("torch", "eager", "aot_eager", "inductor"):
            assert r[f"{mode}_units"] == GPT2_UNITS, (mode, r[f"{mode}_units"])
            assert r[f"{mode}_checkpointed"] == 2, mode  # both blocks wrapped
        for mode in ("eager", "aot_eager", "inductor"):
            assert r[f"{mode}_bytes_after"] == 0, mode
        assert_same_run(r["eager"], r["torch"], "ours eager vs torch's")
        assert_same_run(r["aot_eager"], r["eager"], "aot_eager vs eager")
        torch.testing.assert_close(r["inductor"][0], r["eager"][0], rtol=1e-5, atol=0)
        for k, v in r["eager"][1].items():
            torch.testing.assert_close(r["inductor"][1][k], v, rtol=0, atol=1e-4, msg=k)
        # 12 parameters a block, 3 in the tail (final norm's two, the tied embedding),
        # 1 on the root (the position embedding). Forward: every unit gathers. Backward:
        # only the blocks are re-gathered (the tail, reshard_after_forward=False, and
        # the root stay gathered); every parameter reduced once. The checkpointed
        # blocks' recompute adds no collective.
        fwd, bwd = r["graphs"]
        assert len(fwd) == len(bwd) == 1, (fwd, bwd)
        assert fwd[0]["all_gather_into_tensor"] == 2 * 12 + 3 + 1, fwd
        assert bwd[0]["all_gather_into_tensor"] == 2 * 12, bwd
        assert bwd[0]["reduce_scatter_tensor"] == 2 * 12 + 3 + 1, bwd


def accelerate_regional(rank: int, world: int) -> dict[str, Any]:
    """HF Llama compiled by accelerate's regional compilation for FSDP2
    (``compile_regions_fsdp2``: ``.compile()`` in place on each decoder layer and each
    other leaf module, aot_eager, with the two dynamo settings accelerate sets for it),
    then prepared by accelerate, with torch's ``fully_shard`` and with ours, 2 and 10
    layers. No compiled autograd (accelerate's way): the root runs eagerly. Per case:
    the losses and parameters, and dynamo's frame and graph counts."""
    from accelerate.utils.other import compile_regions_fsdp2
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    with torch._dynamo.config.patch(
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    ):
        for layers in (2, 10):
            for lib in ("torch", "ours"):
                torch._dynamo.reset()
                counters.clear()
                torch.manual_seed(0)
                model = compile_regions_fsdp2(hf_model("llama", layers), backend="aot_eager")
                model = prepare(model, lib, rank, efficient=False)
                out[f"{lib}_{layers}"] = train(model, rank, world)
                out[f"{lib}_{layers}_frames"] = counters["frames"]["total"]
                out[f"{lib}_{layers}_graphs"] = counters["stats"]["unique_graphs"]
    return out


@pytest.mark.slow
def test_accelerate_regional_compilation() -> None:
    """accelerate's regional compilation for FSDP2 (``.compile()`` in place on each
    layer and leaf, then its preparation; no compiled autograd): bitwise equal to
    torch's same flow, and dynamo's work does not grow with depth: each unit's pre-
    and post-forward run eagerly around its compiled forward, and the units of one
    class share their class, so 10 layers compile what 2 do."""
    for r in run_ranks(accelerate_regional, 2):
        for layers in (2, 10):
            assert_same_run(r[f"ours_{layers}"], r[f"torch_{layers}"], f"{layers} layers")
        for lib in ("torch", "ours"):
            assert r[f"{lib}_10_frames"] == r[f"{lib}_2_frames"], (lib, r)
            assert r[f"{lib}_10_graphs"] == r[f"{lib}_2_graphs"], (lib, r)
        # Each layer compiled in place runs its unit's pre- and post-forward eagerly
        # and compiles the layer's own forward, and a unit whose forward is torch's
        # own (the embedding, the head) runs eagerly, as dynamo skips it under torch's
        # fully_shard ([Note: A unit compiled in place] in
        # traceable_hsdp/_compiled_call.py): the graphs are torch's. Dynamo looks at
        # fewer frames than with torch's: torch's compiled ``_call_impl`` of the
        # embedding and the head (and, on newer torch, its own hooks) are frames it
        # skips, where ours calls those units' forwards without it. How many such
        # frames torch's runs through depends on the torch version.
        assert r["ours_10_graphs"] == r["torch_10_graphs"], r
        assert r["ours_10_frames"] <= r["torch_10_frames"], r
