"""hsdp(): the HSDP systems' entry point on the fully_shard runtime.

Parity against the single-process reference of tests/_workers.py (AdamW, same global
batch), with the tolerance of test_runtime.py (losses rtol 1e-5, params atol 2e-5:
reductions in another order, amplified by AdamW; replicated parameters are
all-reduced instead of reduce-scattered, which is one more order).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import traceable_hsdp as th
from _dist import run_ranks
from _hsdp_workers import STEPS, hsdp_worker, reduce_op_worker
from _workers import CFG, reference_run

N_PARAMS = 2 + 9 * CFG.n_layers + 1
# threshold=1 KiB keeps every RMSNorm weight (dim 32 fp32 = 128 B) whole: 2 per block
# and the final norm; replicate_params keeps the output head whole.
N_REPLICATED = 2 * CFG.n_layers + 1 + 1


def _check(results: list[dict], world: int, levels: list[str]) -> None:
    ref_losses, ref_params = reference_run(world, STEPS)
    for r in results:
        for level in levels:
            got = r[level]
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-5, atol=0, msg=level)
            for k, v in ref_params.items():
                torch.testing.assert_close(got["params"][k], v, rtol=0, atol=2e-5, msg=f"{level} {k}")
            pl = got["placements"]
            assert "Shard" not in pl["norm.weight"] and "Shard" not in pl["output.weight"], pl
            assert "Shard(dim=0)" in pl["layers.0.attn.wq.weight"], pl
            replicated = sum("Shard" not in v for v in pl.values())
            assert replicated == N_REPLICATED, pl
            if level == "level1":
                # Parameters stay whole across the step: storage is never freed.
                assert all(b > 0 for b in got["bytes_after_bwd"]), got["bytes_after_bwd"]
            else:
                assert got["bytes_after_bwd"] == [0] * STEPS, (level, got["bytes_after_bwd"])


@pytest.mark.slow
def test_hsdp_levels_2x2_eager() -> None:
    """shard_size=2 on 4 ranks: a 2-D (replicate, shard) mesh; all three levels.

    Compiled: level3 (the default) on this model and mesh is test_clip.py's
    test_clip_grad_hsdp_2x2 (the plain loop, aot_eager; against the one-process
    reference of the same steps with clipping, and bitwise against its eager run; the
    collectives of each graph counted). Level2 and
    level1 are compiled under Inductor on this mesh in test_inductor_features.py, with
    every graph's collectives counted (no re-gather of either in the backward, level2's
    storage freed there and level1's kept), losses and parameters against the eager
    run."""
    levels = ["level3", "level2", "level1"]
    results = run_ranks(hsdp_worker, 4, 2, levels)
    _check(results, 4, levels)
    assert "Replicate(), Shard(dim=0)" in results[0]["level3"]["placements"]["tok_embeddings.weight"]


def test_hsdp_reduce_op_and_divide_factor() -> None:
    for ratios in run_ranks(reduce_op_worker, 2):
        for k, (d_sum, d_div) in ratios.items():
            assert d_sum < 1e-5 and d_div < 1e-5, (k, d_sum, d_div)




@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(shard_size=3), ValueError, r"shard_size=3\) must be -1 or a positive divisor"),
        (dict(shard_size=0), ValueError, "positive divisor"),
        (dict(shard_size=1.5), TypeError, "shard_size=...\\) must be an int"),
        (dict(threshold=-1), ValueError, "threshold=...\\) must be >= 0"),
        (dict(optimizer_level="level4"), ValueError, "level1, level2, level3"),
        (dict(reduce_dtype="bf16"), TypeError, "reduce_dtype must be a torch.dtype"),
        (dict(reduce_dtype=torch.int32), ValueError, "floating-point"),
        (dict(comm_fusion=1), TypeError, "comm_fusion"),
        (dict(bucket_size=0), ValueError, "bucket_size"),
        (dict(reduce_op="max"), ValueError, "'mean' or 'sum'"),
        (dict(gradient_divide_factor=-2.0), ValueError, "must be > 0"),
        (dict(reduce_op="sum", gradient_divide_factor=2.0), ValueError, "not both"),
        (dict(replicate_params=[torch.ones(2)]), TypeError, "not an nn.Parameter"),
    ],
)
def test_hsdp_errors(one_rank, kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        th.hsdp(nn.Linear(2, 2), **kwargs)


def test_hsdp_comm_fusion_travels_with_the_unit(one_rank) -> None:
    """comm_fusion/bucket_size become the unit's own pass options (carried in its
    collectives' annotations), never the process-wide PassConfig. The bucketing they
    cause is checked from post-grad graphs in test_passes_e2e.py."""
    from traceable_hsdp import passes
    from traceable_hsdp._state import state_of as _get_state

    before = passes.get_config()
    fused = th.hsdp(nn.Linear(2, 2), comm_fusion=True, bucket_size=8)
    opts = _get_state(fused).param_group.pass_options
    assert opts == passes.UnitPassOptions(bucket=True, bucket_cap_mb=8.0)
    assert passes.get_config() == before
    plain = th.hsdp(nn.Linear(2, 2))
    assert _get_state(plain).param_group.pass_options == passes.UnitPassOptions(bucket=False)
    assert passes.get_config() == before
    # The FX graph cache key does not see annotations: the units' options enter our
    # uuid() (test_passes_unit.py checks how).
    key = passes._install._unit_options_key()
    assert "=UnitPassOptions(bucket=True, bucket_cap_mb=8.0)" in key, key


def test_fsdp_module_comm_options_2x2_eager() -> None:
    """set_force_sum_reduction_for_comms, set_reduce_scatter_divide_factor (the
    deprecated name), set_requires_all_reduce, set_unshard_in_backward. Tolerance
    1e-6: sums in another order than the averaging collectives."""
    from _hsdp_workers import comm_options_worker

    for r in run_ranks(comm_options_worker, 4, "eager"):
        assert r["force_sum"] < 1e-6, r
        assert r["rs_divide_warned"] and r["rs_divide"] < 1e-6, r
        assert r["all_reduce_later"] < 1e-6, r
        assert r["no_all_reduce"] > 1e-4, r
        assert r["embedding_no_unshard"] < 1e-6, r
        assert r["linear_error"] and "storage of size 0" in r["linear_error"], r


@pytest.mark.slow
def test_fsdp_module_comm_options_2x2_compiled() -> None:
    """The same options compiled (aot_eager, compiled autograd), against the plain
    eager run, tolerance 1e-6; the collectives each option leaves in the graphs."""
    from _hsdp_workers import COMM_CFG, comm_options_worker

    n = 2 + 9 * COMM_CFG.n_layers + 1
    for r in run_ranks(comm_options_worker, 4, "compiled"):
        assert r["force_sum_all_reduce_later"] < 1e-6, r
        assert r["embedding_no_unshard"] < 1e-6, r
        assert r["linear_error"] and "storage of size 0" in r["linear_error"], r
        g = r["graphs"]
        fwd, bwd, ops = g["force_sum_all_reduce_later"]
        assert len(fwd) == 1 and fwd[0]["all_gather_into_tensor"] == n, fwd
        # Two backward graphs (compiled autograd also specializes on the gradient
        # the first leaves): set_requires_all_reduce(False) has no all-reduce in the
        # first, the second all-reduces every parameter. The blocks re-gather; the
        # root's 3 parameters stay gathered (the default reshard_after_forward).
        assert len(bwd) == 2, bwd
        assert "all_reduce" not in bwd[0] and bwd[0]["reduce_scatter_tensor"] == n, bwd
        assert _sub({"all_gather_into_tensor": n - 3, "reduce_scatter_tensor": n, "all_reduce": n}, bwd[1]), bwd
        # Forced sums: no averaging collective in the graphs (the default run's are
        # "avg", see below); the division is a separate op.
        assert ops == ["sum"], ops
        # set_unshard_in_backward(False) on the embedding unit: the backward re-gathers
        # only the root's two Linear parameters (reshard_after_forward=True on it),
        # and reduces all three, averaging.
        fwd, bwd, ops = g["embedding_no_unshard"]
        assert fwd == [_with_copies({"all_gather_into_tensor": 3})], fwd
        assert bwd == [_with_copies({"all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
                                     "all_reduce": 3})], bwd
        assert ops == ["avg"], ops


def _sub(want: dict[str, int], got: dict[str, int]) -> bool:
    return all(got.get(k) == v for k, v in want.items())


def _with_copies(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` plus the placeholder fill of each all-gather: one fsdp.copy_ and two
    storage resizes (to full, back to 0)."""
    ag = counts.get("all_gather_into_tensor", 0)
    return {**counts, "fsdp.copy_": ag, "resize_storage_bytes_": 2 * ag}


def test_ignored_params_match_torch_fully_shard() -> None:
    """Bitwise: the same ops in the same order as torch's fully_shard (eager)."""
    from _hsdp_workers import ignored_params_worker

    for r in run_ranks(ignored_params_worker, 2):
        ours, ref = r["ours"], r["torch"]
        assert ours["norm_type"] == "Parameter" and ref["norm_type"] == "Parameter"
        assert ours["losses"] == ref["losses"]
        for k, v in ref["params"].items():
            torch.testing.assert_close(ours["params"][k], v, rtol=0, atol=0, msg=k)
