"""Conformance with torch's fully_shard: what users of torch's FSDP2 do after
``fully_shard`` and around it, eager, against torch's own ``fully_shard`` on the
same model and data, bitwise (atol=rtol=0): both gather, compute and reduce the
same tensors in the same order, so any drift is a semantic difference.

One spawned 2-rank group runs every scenario (see tests/_conformance_workers.py):
- a unit called three times in one forward (weight reuse), resharding after
  forward or not: every use's backward must find the parameters gathered;
- dataclass activations (a frozen dataclass) passed between units (the
  pre-backward hooks must find the tensors inside them, and the inputs' gradient
  trigger must rebuild them); in ``_Mixed`` below, one of its tensors both units
  pass through unchanged, as T5's blocks pass the position bias (its gradient
  completes after the units' backward, whose hooks must then not gather them
  again: the compiled tests count the backward's all-gathers and check every
  placeholder freed);
- prefix tuning: frozen units given a learnable prefix (a leaf of the root) every
  step; their backward must not end before the ops that read their frozen weights
  (it ended early from step 2 on, when each step added a hook to the prefix);
- the three above in one model (``_Mixed``), the model the compiled tests compile;
  two of its units return views, and with ``inplace`` the root scales one such
  output in place, which drops the hook that re-gathers that unit for its backward
  (torch's fully_shard then fails; ours hooks the view's base too): ours in place
  against torch's on the same model with the op out of place ("mixed_inplace");
- ``model.to(torch.float64)`` after fully_shard: training follows the new dtype;
- parameters frozen after fully_shard (before the first forward);
- activation checkpointing: checkpoint_wrapper then fully_shard (torchtitan's
  order), fully_shard then checkpoint_wrapper, and selective AC saving matmuls;
- the meta-device flow (build on meta, fully_shard, to_empty, load a full state
  dict): the shards equal those of the model built on the CPU and sharded, no op
  allocates a parameter's full size, and training matches torch's same flow; a
  seeded random init of the shards matches torch's same flow;
- freezing and unfreezing between steps after the first forward: against a
  one-process model (tolerance below);
- torch's rank-0 broadcast flow (HF accelerate's FSDP2 loading): build on meta,
  fully_shard, load_state_dict of DTensors with assign=True;
- a frozen float8 parameter in a unit with fp32 ones (gloo's all-gather has no
  float8 type: the bytes are gathered);
- torch's ``replicate()`` (DDP) on the root over fully_shard blocks (it must leave
  our sharded parameters as they are);
- optimizer in backward (torchtitan's): an SGD per parameter, stepped by a
  post-accumulate-grad hook registered on the sharded parameter;
- HF accelerate's mixed precision: ``model.forward`` replaced, before fully_shard,
  by an instance method running it under ``torch.autocast(bfloat16)`` (that
  attribute must not hide the unit's forward wrapper);
- the root called twice before one backward (two batches, one summed loss);
- fp16 with ``torch.amp.GradScaler``, gradients unscaled and clipped, steps skipped
  on overflow (HF accelerate's fp16 with FSDP2).
"""

from __future__ import annotations

import pytest
import torch

from _conformance_workers import (
    MOE_LAYERS,
    assert_same_run,
    compiled_without_ca,
    conformance_2x2,
    conformance_compiled,
    conformance_eager,
    conformance_hf,
    hf_families_compiled,
)
from _dist import run_ranks

BITWISE = ["reuse_raf_True", "reuse_raf_False", "dataclass", "prefix", "mixed", "mixed_inplace", "cast_float64", "freeze_after_shard",
           "ac_wrap_then_shard", "ac_shard_then_wrap", "ac_selective", "meta_assign", "float8_frozen",
           "replicate_root", "optim_in_backward", "autocast", "root_twice"]


@pytest.mark.slow
def test_conformance_eager_vs_torch_fully_shard() -> None:
    results = run_ranks(conformance_eager, 2)
    for r in results:
        for name in BITWISE:
            assert_same_run(r[name]["ours"], r[name]["torch"], name)
            assert r[name]["bytes_after"] == 0, name  # every placeholder freed
        assert r["cast_dtypes"] == {"torch.float64"}
        # fp16 with GradScaler: bitwise, with the same scales as torch's; some steps
        # overflowed (the scale halved) and some were taken (it stayed).
        g = r["fp16_grad_scaler"]
        assert_same_run(g["ours"], g["torch"], "fp16_grad_scaler")
        scales = g["ours_scales"]
        assert scales == g["torch_scales"], (scales, g["torch_scales"])
        assert scales[0] < 2.0**20 and any(a == b for a, b in zip(scales, scales[1:])), scales
        # Meta flow: same shards as the CPU-built model, bitwise; no rank holds a
        # whole parameter: after to_empty every storage the model keeps is at most a
        # shard, no op wrote more than a shard, and the only full-size allocations
        # are the placeholders' (empty, released at once: see
        # FSDPParam._empty_placeholder); training as torch's.
        for lib in ("torch", "ours"):
            assert r[f"meta_{lib}"]["same_shards"], lib
        m = r["meta_ours"]
        assert m["largest_live"] <= m["largest_shard"] < m["largest_param"], m
        assert m["largest_written"] <= m["largest_shard"], m
        assert m["full_size_allocs"] <= {"aten.empty.memory_format"}, m["full_size_allocs"]
        assert_same_run(r["meta_ours"]["run"], r["meta_torch"]["run"], "meta")
        assert_same_run(r["meta_random_ours"], r["meta_random_torch"], "meta_random")
        # Freezing between steps: the frozen parameters did not move, got no
        # gradient, and the run matches a one-process model on the global batch
        # (sharded reductions sum in another order: atol 2e-5, as the parity tests).
        f = r["freeze_midway"]
        ours, ref = f["ours"][1], f["reference"][1]
        for k, v in ref.items():
            torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=2e-5, msg=k)
        for k in ("layers.1.attn.wq.weight", "layers.1.ffn.w2.weight", "output.weight"):
            assert torch.equal(ours[k], f["ours_frozen_at_1"][k]), k
        # norm.weight, frozen before fully_shard, trains once unfrozen.
        assert not torch.equal(ours["norm.weight"], f["ours_frozen_at_1"]["norm.weight"])
        # 21 managed parameters; block 1 (9) and the output head frozen at the end.
        assert f["trainable_placeholders"] == 21 - 9 - 1


@pytest.mark.slow
def test_conformance_hf_llama_vs_torch_fully_shard() -> None:
    """HF transformers' LlamaForCausalLM as a client: activation checkpointing inside
    each decoder layer (gradient_checkpointing_enable, non-reentrant), and the
    meta-device flow loading a full state dict; and T5ForConditionalGeneration, whose
    encoder output every decoder block reads (its gradient is summed over the units
    in the order of their nodes: equal only with torch's node per unit, see [Note:
    When a unit's backward is done] in traceable_hsdp/_param_group.py), and whose
    blocks pass the position bias through (its all-gathers counted for one eager
    step). Bitwise against torch's fully_shard."""
    for r in run_ranks(conformance_hf, 2):
        assert_same_run(r["t5"]["ours"], r["t5"]["torch"], "t5")
        assert r["t5"]["bytes_after"] == 0
        # One flat all-gather per unit forward (4 blocks and the root) and one per
        # block backward; the position bias each block passes through gathered no
        # block again after its backward.
        assert r["t5_units"] == 5, r["t5_units"]
        assert r["t5_all_gathers"] == 5 + 4, r["t5_all_gathers"]
        assert_same_run(r["hf_ac"]["ours"], r["hf_ac"]["torch"], "hf_ac")
        assert r["hf_ac"]["bytes_after"] == 0
        assert_same_run(r["hf_meta_ours"], r["hf_meta_torch"], "hf_meta")


@pytest.mark.slow
def test_hf_families_compiled_vs_torch_fully_shard() -> None:
    """HF transformers Gemma 2, GPT-NeoX and BERT (masked LM) as clients, the whole
    step compiled (aot_eager, fullgraph, compiled autograd), each layer and the root
    a unit: bitwise equal to torch's fully_shard eager over 3 AdamW steps, in one
    forward and one backward graph, with the tied heads still tied. Inductor runs
    the same graphs for HF Llama, GPT-2 and Mixtral in the other tests."""
    for r in run_ranks(hf_families_compiled, 2):
        for name in ("gemma2", "gpt_neox", "bert"):
            assert_same_run(r[name], r[f"{name}_torch"], name)
            assert r[f"{name}_graphs"] == 2, (name, r[f"{name}_graphs"])
        assert r["gemma2_tied"] and r["bert_tied"] and not r["gpt_neox_tied"], r


# _Mixed: the root's parameters (embedding, prefix, head weight and bias), and the
# calls of its reused unit per forward.
MIXED_ROOT, MIXED_CALLS = 4, 3


@pytest.mark.slow
def test_conformance_compiled_aot_eager() -> None:
    """Compiled with compiled autograd (aot_eager: the same ops as eager, so bitwise
    equal to the eager run): weight reuse, dataclass activations and prefix tuning in
    one model (``_Mixed``, with its in-place op on a unit's output that is a view,
    whose eager run is bitwise equal to torch's fully_shard in the eager test; one
    unit's parameters stepped in the backward by hooks on them, which the compiled
    backward must run),
    frozen in part after the first compiled step (fullgraph=True
    holds: the change is applied before dynamo traces), HF Mixtral (mixture of experts) in fp32 and in bf16 mixed precision,
    whose eager runs are also bitwise equal to torch's fully_shard, and HF Llama with
    its own gradient checkpointing (the checkpoint around each unit's whole call;
    dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint on) and its forward under
    ``torch.autocast(bfloat16)``, as HF accelerate runs it. Collectives counted
    from the captured graphs, which hold no version-counter op. And the model or its
    blocks compiled before fully_shard (``compiled_before_shard``): torchtitan's two
    per-block forms and HF accelerate's compiled root, against torch's fully_shard."""
    for r in run_ranks(conformance_compiled, 2, "aot_eager"):
        for name in ("mixed", "moe", "moe_bf16", "hf_ac"):
            assert_same_run(r[f"{name}_compiled"], r[f"{name}_eager"], name)
            assert r[f"{name}_compiled_bytes_after"] == 0, name
        # No version-counter op in any graph dynamo captured: [Note: Version counters
        # in a traced step] (traceable_hsdp/_param.py).
        for name in ("mixed", "moe", "moe_bf16", "hf_ac"):
            fwd, bwd = r[f"{name}_graphs"]
            assert fwd and bwd and not any("version_counter" in g for g in fwd + bwd), name
        assert_same_run(r["moe_eager"], r["moe_torch"], "moe vs torch's fully_shard")
        # bf16 mixed precision: the saved views of the expert weights are recomputed
        # in the backward (they failed on the freed placeholder before).
        assert_same_run(r["moe_bf16_eager"], r["moe_bf16_torch"], "moe bf16 vs torch's fully_shard")
        assert [len(g) for g in r["moe_bf16_graphs"]] == [1, 1], r["moe_bf16_graphs"]
        # Mixtral: 9 parameters per layer (4 attention projections, 2 norms, the
        # router, the two 3-D expert weights) and 3 on the root; one forward and one
        # backward graph, every parameter gathered and reduced in them, the layers'
        # re-gathered (the root stays gathered for backward: the default
        # reshard_after_forward, None, as torch's).
        fwd, bwd = r["moe_graphs"]
        assert len(fwd) == len(bwd) == 1, (fwd, bwd)
        n_moe = MOE_LAYERS * 9 + 3
        assert fwd[0]["all_gather_into_tensor"] == n_moe, fwd
        assert bwd[0]["all_gather_into_tensor"] == n_moe - 3, bwd
        assert bwd[0]["reduce_scatter_tensor"] == n_moe, bwd
        # HF Llama (1 decoder layer), checkpointed around the layer's call: one graph
        # each way (fullgraph=True, no break), and the backward's recompute of the
        # layer adds no collective: the layer's 9 parameters re-gathered once, and
        # each parameter reduced once (9 in the layer, 3 on the root, which stays
        # gathered). The forward's layer gathers sit inside the
        # checkpoint subgraph, which these dynamo-level counts do not open.
        fwd, bwd = r["hf_ac_graphs"]
        assert len(fwd) == len(bwd) == 1, (fwd, bwd)
        assert bwd[0]["all_gather_into_tensor"] == 9, bwd
        assert bwd[0]["reduce_scatter_tensor"] == 9 + 3, bwd
        # _Mixed: units pre (4 parameters, frozen), blocks.0 and blocks.1 (4 each), sub
        # (2, called three times); the root holds 4 (embedding, prefix, head weight
        # and bias). Forward: every call gathers (each unit but the root resharded
        # after it). Backward: each unit but the root (kept gathered) re-gathered
        # once, the frozen pre too (for its input's
        # gradient, the embedding's), and kept until its first use's backward; every
        # trainable parameter reduced once. Freezing blocks.0 and the head's weight
        # after step 1 recompiles once (dynamo's guards on requires_grad), and the
        # backward after it reduces 5 fewer.
        fwd, bwd = r["mixed_graphs"]
        assert len(fwd) == len(bwd) == 2, (fwd, bwd)
        for f in fwd:
            assert f["all_gather_into_tensor"] == MIXED_ROOT + 4 + 2 * 4 + MIXED_CALLS * 2, fwd
        for b in bwd:
            assert b["all_gather_into_tensor"] == 4 + 2 * 4 + 2, bwd
        assert bwd[0]["reduce_scatter_tensor"] == MIXED_ROOT + 2 * 4 + 2, bwd
        assert bwd[1]["reduce_scatter_tensor"] == MIXED_ROOT + 2 * 4 + 2 - 4 - 1, bwd
        # Compiled before fully_shard (torchtitan's per-block forms, HF accelerate's
        # compiled root): bitwise equal to torch's fully_shard eager. torchtitan's
        # block.compile(fullgraph=True) without compiled autograd, before or after
        # fully_shard, compiles the block's forward alone: one graph for the three
        # blocks, as with torch's fully_shard. With compiled autograd on, one graph
        # for the blocks (their gathers in it) and one for the backward, with or
        # without a unit nested in each block.
        b = r["before_shard"]
        forms = ("wrap", "inplace", "inplace_after", "inplace_ca", "inplace_ca_nested", "root",
                 "root_ca")
        for form in forms:
            assert_same_run(b[form], b["torch"], form)
            assert b[f"{form}_bytes_after"] == 0, form
        assert b["inplace_graphs"] == b["inplace_after_graphs"] == 1, b
        assert b["inplace_ca_graphs"] == b["inplace_ca_nested_graphs"] == 2, b
        assert "fullgraph=True while compiled autograd is off" in b["root_fullgraph"], b["root_fullgraph"]


@pytest.mark.slow
def test_conformance_compiled_inductor() -> None:
    """The same three cases under Inductor with every pass on, and a fourth, "twice"
    (the root called twice before one backward, as DPO's chosen and rejected batches
    are; aot_eager cannot run it, docs/api.md), against the eager run:
    losses rtol 1e-5 and parameters atol 2e-5 (Inductor fuses and reorders float
    arithmetic), 1e-4 for Mixtral. AdamW divides each gradient element by its own
    running scale, so an element whose gradient is close to 0 (an expert that few
    tokens reach) turns a reordering error into a visible step: seen 2.4e-5 and
    2.1e-5 (with 2 decoder layers), on one element of each 3-D expert weight, with
    the losses equal; on "twice" torch 2.15's Inductor ends 2.5e-5 away on one element
    of a 0.2-sized weight, the losses equal. HF Llama runs under ``torch.autocast(bfloat16)``, where Inductor
    keeps bf16 intermediates in fp32 unless ``emulate_precision_casts`` is set: set
    for it, it was within 6e-8 of eager (without, the plain unsharded model moves
    0.026 from eager in 3 AdamW steps)."""
    for r in run_ranks(conformance_compiled, 2, "inductor"):
        for name in ("mixed", "moe", "hf_ac", "twice"):
            c, e = r[f"{name}_compiled"], r[f"{name}_eager"]
            torch.testing.assert_close(c[0], e[0], rtol=1e-5, atol=0, msg=name)
            atol = 1e-4 if name in ("moe", "twice") else 2e-5
            for k, v in e[1].items():
                torch.testing.assert_close(c[1][k], v, rtol=0, atol=atol, msg=f"{name} {k}")
            assert r[f"{name}_compiled_bytes_after"] == 0, name
        # torchtitan's per-block compile in its two forms (each block an
        # OptimizedModule, or block.compile(fullgraph=True) in place, then
        # fully_shard; no compiled autograd), and in place with compiled autograd and
        # the block's feed-forward a unit of its own (one graph each way), against
        # torch's fully_shard eager.
        b = r["before_shard"]
        assert b["inplace_ca_nested_graphs"] == 2, b["inplace_ca_nested_graphs"]
        for form in ("wrap", "inplace", "inplace_ca_nested"):
            torch.testing.assert_close(b[form][0], b["torch"][0], rtol=1e-5, atol=0)
            for k, v in b["torch"][1].items():
                torch.testing.assert_close(b[form][1][k], v, rtol=0, atol=2e-5, msg=f"{form} {k}")
            assert b[f"{form}_bytes_after"] == 0, form


@pytest.mark.slow
def test_compiled_without_compiled_autograd_vs_torch() -> None:
    """``torch.compile(model)`` with compiled autograd off (tests/_conformance_workers.py,
    ``compiled_without_ca``), against torch's fully_shard eager on the same model and
    data: our Llama under Inductor, losses rtol 1e-5 and parameters atol 1e-4 (Inductor
    fuses and reorders float arithmetic, which AdamW turns into steps); HF Llama under
    aot_eager, bitwise (the same ops in the same order as the eager runs, which the
    eager conformance tests find bitwise equal to torch's). No collective, resize or
    ``fsdp.copy_`` in any graph dynamo compiled (the units' hooks run eagerly around
    them); every placeholder freed after the steps."""
    for r in run_ranks(compiled_without_ca, 2):
        ours, ref = r["llama_ours"], r["llama_torch"]
        torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=0)
        for k, v in ref[1].items():
            torch.testing.assert_close(ours[1][k], v, rtol=0, atol=1e-4, msg=k)
        assert_same_run(r["hf_llama_ours"], r["hf_llama_torch"], "hf_llama")
        for name in ("llama", "hf_llama"):
            graphs = r[f"{name}_graphs"]
            assert graphs and all(g == {} for g in graphs), (name, graphs)
            assert r[f"{name}_bytes_after"] == 0, name


@pytest.mark.slow
def test_conformance_hsdp_2x2() -> None:
    """On a 2x2 (replicate, shard) mesh, 4 ranks: the three AC forms, the meta flow
    and optimizer in backward bitwise against torch's fully_shard (eager); a model
    built on meta with AC on every block, compiled (aot_eager, plain loop), bitwise
    equal to the same eager."""
    for r in run_ranks(conformance_2x2, 4):
        for form in ("wrap_then_shard", "shard_then_wrap", "selective"):
            assert_same_run(r[f"ac_{form}"]["ours"], r[f"ac_{form}"]["torch"], form)
            assert r[f"ac_{form}"]["bytes_after"] == 0, form
        for lib in ("torch", "ours"):
            assert r[f"meta_{lib}"]["same_shards"], lib
        m = r["meta_ours"]
        assert m["largest_live"] <= m["largest_shard"] < m["largest_param"], m
        assert m["largest_written"] <= m["largest_shard"], m
        assert_same_run(r["meta_ours"]["run"], r["meta_torch"]["run"], "meta 2x2")
        assert_same_run(r["meta_ac_loop"], r["meta_ac_eager"], "meta + AC compiled vs eager")
        # Optimizer in backward: the hooks run once the gradient is all-reduced over
        # the replicas too.
        assert_same_run(r["optim_in_backward"]["ours"], r["optim_in_backward"]["torch"], "optim_in_backward")
        assert r["optim_in_backward"]["bytes_after"] == 0
