"""Per-rank bodies of tests/test_accelerate.py: HF accelerate's FSDP2 preparation as a
real client (importable by spawned ranks).

accelerate's ``Accelerator.prepare`` shards a model for ``fsdp_version=2`` with
``accelerate.utils.fsdp_utils.fsdp2_prepare_model``, which imports the public name
``torch.distributed.fsdp.fully_shard`` each time it runs. A user switches it to
traceable_hsdp by patching that name around ``prepare`` (docs/real_jobs.md, "HF
accelerate"). ``Accelerator`` runs FSDP on accelerators only (GPUs, XPUs, ...), not on
the CPU, so these workers call accelerate's own preparation functions directly, with
the attributes of an ``Accelerator`` they read; everything else is accelerate's code:
its auto-wrap policy, its layout (a unit per decoder layer, the input embedding its
own unit when untied, ``[final norm, (embedding,) head]`` one unit kept gathered after
forward, the root), its rank-0 broadcast load on meta (``cpu_ram_efficient_loading``)
and its activation checkpointing (``fsdp2_apply_ac``).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any
from unittest import mock

import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import traceable_hsdp as th
from _conformance_workers import STEPS, _full, _hf_config
from _workers import CFG, LR, GraphRecorder, _data, _managed, _placeholder_bytes

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
        cfg = _hf_config(layers)  # the conformance tests' HF Llama, untied
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
    return losses, _full(model)


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
