"""fully_shard features against torch's own fully_shard with the same settings.

One fat run per mode checks together: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), frozen parameters mixed with trainable ones inside units,
explicit forward/backward prefetch (set_modules_to_*_prefetch), gradient
accumulation over 2 micro-batches with set_requires_gradient_sync(False) on the
first, shard_placement_fn (the MLP down projections and the output head on dim 1),
ignored_params (the token embedding) and CPUOffloadPolicy on the blocks. Eager also keeps the units gathered between
micro-batches (set_reshard_after_backward / set_is_last_backward False on the
first); ``compiled_keep`` does that compiled, on the 2x2 mesh only (its checks there
are the 1-D ones plus the replicas' all-reduce, so a 1-D run would repeat its compile
and add no check). The comparison is bitwise
(atol=rtol=0): both libraries cast, gather,
compute and reduce in the same dtypes and orders, and so produced identical
numbers in our runs; any drift means a semantic difference.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from _feature_workers import features_vs_torch
from _workers import CFG

# Managed parameters: every parameter but the token embedding (ignored_params).
N_PARAMS = 2 + 9 * CFG.n_layers + 1 - 1
N_FROZEN = CFG.n_layers + 1  # attn_norm of every block + layers[0].attn.wq


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_features_match_torch_fully_shard(mode: str) -> None:
    results = run_ranks(features_vs_torch, 2, (2,), mode)
    for r in results:
        assert r["losses"] == r["ref_losses"], (r["losses"], r["ref_losses"])
        for k, v in r["ref_params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=0, msg=k)
        # No gradient reached the sharded parameters on the no-sync micro-batch.
        assert all(all(none) for none in r["nosync_grads_none"])
        # Sharded parameters stay fp32 under bf16 compute.
        assert r["dtypes"] == {"torch.float32"}
        assert r["bytes_after"] == 0
        assert r["placements"]["output.weight"] == "(Shard(dim=1),)"
        assert r["placements"]["layers.0.ffn.w2.weight"] == "(Shard(dim=1),)"
        assert r["placements"]["layers.0.ffn.w1.weight"] == "(Shard(dim=0),)"
        assert r["placements"]["tok_embeddings.weight"] == "Tensor"  # ignored: not a DTensor
        assert r["devices"] == {"cpu"}
    if mode == "eager":
        # set_reshard_after_backward(False) + set_is_last_backward(False) on the
        # no-sync micro-batch: the units stay gathered until the last micro-batch
        # (then every placeholder is freed: bytes_after above).
        assert all(b > 0 for b in results[0]["kept_bytes"]), results[0]["kept_bytes"]
    if mode == "compiled":
        r = results[0]
        assert len(r["fwd_counts"]) == 1, r["fwd_counts"]  # zero recompiles
        # Two backward graphs: the no-sync micro-batch (no reduce-scatter) and the
        # syncing one (one per trainable parameter); compiled once each.
        assert len(r["bwd_counts"]) == 2, r["bwd_counts"]
        nosync, sync = r["bwd_counts"]
        assert "reduce_scatter_tensor" not in nosync
        assert sync["reduce_scatter_tensor"] == N_PARAMS - N_FROZEN
        # The blocks re-gather; the root (its norm and output head; the embedding is
        # ignored) stays gathered for backward, the default reshard_after_forward.
        assert nosync["all_gather_into_tensor"] == sync["all_gather_into_tensor"] == N_PARAMS - 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compiled_keep"])
def test_features_match_torch_fully_shard_hsdp_2x2(mode: str) -> None:
    """The same features on a 2x2 (replicate, shard) mesh, 4 ranks, against torch's
    fully_shard on the same mesh: bitwise, eager and compiled (aot_eager, compiled
    autograd, units kept gathered across the no-sync micro-batch)."""
    results = run_ranks(features_vs_torch, 4, (2, 2), mode)
    for r in results:
        assert r["losses"] == r["ref_losses"], (r["losses"], r["ref_losses"])
        for k, v in r["ref_params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=0, msg=k)
        assert all(all(none) for none in r["nosync_grads_none"])
        assert r["placements"]["output.weight"] == "(Replicate(), Shard(dim=1))"
        assert r["placements"]["layers.0.ffn.w1.weight"] == "(Replicate(), Shard(dim=0))"
        assert r["bytes_after"] == 0 and all(b > 0 for b in r["kept_bytes"])
    if mode == "compiled_keep":
        # Units kept gathered into the next micro-batch: that forward has no
        # all-gather (a second forward graph); two backward graphs (no-sync, with
        # re-gathers only; syncing, with the reduce-scatters and the all-reduce across
        # replicas of every trainable parameter). All compiled in the first step: no
        # recompiles after.
        r = results[0]
        assert len(r["fwd_counts"]) == 2 and len(r["bwd_counts"]) == 2, (r["fwd_counts"], r["bwd_counts"])
        assert r["fwd_counts"][0]["all_gather_into_tensor"] == N_PARAMS, r["fwd_counts"]
        assert "all_gather_into_tensor" not in r["fwd_counts"][1], r["fwd_counts"]
        nosync, sync = r["bwd_counts"]
        assert "reduce_scatter_tensor" not in nosync and "all_reduce" not in nosync, nosync
        assert sync["reduce_scatter_tensor"] == sync["all_reduce"] == N_PARAMS - N_FROZEN, sync
