"""HF accelerate's FSDP2 preparation as a real client (tests/_accelerate_workers.py):
accelerate's own ``fsdp2_prepare_model`` (and ``fsdp2_apply_ac``) on HF GPT-2 and
Llama, with traceable_hsdp switched in by patching ``torch.distributed.fsdp.fully_shard``
(the name accelerate imports), against the same preparation with torch's
``fully_shard``.

Tolerances: eager and aot_eager bitwise (atol=rtol=0: the same ops on the same data
in the same order). Inductor: losses rtol 1e-5, parameters atol 1e-4. Inductor fuses
and reorders float arithmetic, and AdamW (lr 1e-2) turns that into parameter steps:
the same GPT-2 unsharded on one process, compiled against eager with the same three
steps, moves 2.3e-5; ours compiled against torch's eager 2.6e-5.
"""

from __future__ import annotations

import pytest
import torch

from _accelerate_workers import (
    EAGER_CASES,
    accelerate_compiled,
    accelerate_eager,
    accelerate_regional,
)
from _conformance_workers import assert_same_run
from _dist import run_ranks

# accelerate's layout of a 2-layer model: the root, a unit per decoder layer, and the
# tail unit [final norm, (input embedding,) head] kept gathered after forward; Llama's
# untied input embedding is a unit of its own. Listed by module: the tail's members
# each show as a unit.
GPT2_UNITS = ["", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
              "lm_head"]
LLAMA_UNITS = ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
               "lm_head"]


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
