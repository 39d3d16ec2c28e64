"""Eagerly a unit issues one flat all-gather and one flat reduce-scatter (and, for
HSDP, one all-reduce) per step, as torch's fully_shard does, with the numbers of
torch's fully_shard, bitwise (atol=rtol=0). See [Note: One collective per unit,
eagerly] in traceable_hsdp/_param_group.py.

The collectives are counted as they are dispatched (a TorchDispatchMode over our
steps, tests/_flat_workers.py), each with the unit and parameters its annotation
names. The model has uneven dim-0 shards (vocab 65), Shard(1) parameters, bf16
parameters with fp32 reduction and a frozen parameter (gathered, not reduced).
2 ranks: a 1-D mesh. 4 ranks: HSDP on a 2x2 mesh; ``reshard_after_forward=2`` on a
1-D mesh of 4 (backward re-gathers over pairs of ranks; fp32, even shards, dim 0:
what torch's fully_shard supports there); ``hsdp()`` with the
norms replicated (their gradients in one all-reduce per mesh dim), fp32, against
torch's fully_shard on the same 2x2 mesh.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from _dist import run_ranks
from _flat_workers import STEPS, flat_2_ranks, flat_4_ranks


def _same_as_torch(run: dict[str, Any], what: str) -> None:
    ours, ref = run["ours"], run["torch"]
    assert ours["losses"] == ref["losses"], (what, ours["losses"], ref["losses"])
    assert ours["params"].keys() == ref["params"].keys(), what
    for k, v in ref["params"].items():
        torch.testing.assert_close(ours["params"][k], v, rtol=0, atol=0, msg=f"{what}: {k}")
    assert ours["bytes_after"] == 0, what


def _check_calls(
    run: dict[str, Any],
    what: str,
    regathered: set[str],
    gather_sizes: tuple[int, int],
    shard: int,
    replicate: int,
) -> None:
    """Every step: each unit's all-gather once in forward and once more in backward
    when ``regathered``, each over all of its sharded parameters (in forward over
    ``gather_sizes[0]`` ranks, in backward over ``gather_sizes[1]``); one
    reduce-scatter over its trainable sharded parameters (``shard`` ranks); for
    HSDP (``replicate`` > 1) one all-reduce of those over the replicas; one
    all-reduce per mesh dim over its trainable replicated parameters, if any.
    Nothing else."""
    units = run["ours"]["units"]
    assert len(run["ours"]["calls"]) == STEPS
    for step, calls in enumerate(run["ours"]["calls"]):
        expected: Counter = Counter()
        for label, u in units.items():
            sharded = tuple(p for p in u["all"] if p not in u["replicated"])
            trainable = tuple(p for p in u["trainable"] if p not in u["replicated"])
            kept = tuple(p for p in u["trainable"] if p in u["replicated"])
            expected[("all_gather", label, sharded, gather_sizes[0])] += 1
            if label in regathered:
                expected[("all_gather", label, sharded, gather_sizes[1])] += 1
            expected[("reduce_scatter", label, trainable, shard)] += 1
            if replicate > 1:
                expected[("all_reduce", label, trainable, replicate)] += 1
            if kept:
                expected[("all_reduce", label, kept, shard)] += 1
                expected[("all_reduce", label, kept, replicate)] += 1
        got = Counter(calls)
        assert got == expected, (what, step, got - expected, expected - got)


BLOCKS = {"layers.0", "layers.1"}
UNITS = BLOCKS | {"Llama"}


@pytest.mark.slow
def test_one_collective_per_unit_2_ranks() -> None:
    for r in run_ranks(flat_2_ranks, 2):
        _same_as_torch(r["fsdp"], "fsdp")
        # The default reshard_after_forward (None, as torch's): the root stays
        # gathered, the blocks re-gather in backward.
        _check_calls(r["fsdp"], "fsdp", BLOCKS, (2, 2), shard=2, replicate=1)
        # Units: 2 blocks and the root; the frozen norm is gathered, not reduced.
        units = r["fsdp"]["ours"]["units"]
        assert set(units) == UNITS
        assert "attn_norm.weight" in units["layers.0"]["all"]
        assert "attn_norm.weight" not in units["layers.0"]["trainable"]
        # torch's CommDebugMode counts ours as torch's: 3 all-gathers in forward; 2
        # re-gathers (the blocks) and 3 reduce-scatters in backward (our eager
        # all-gathers use the _out op, which it must count too).
        assert r["comm_debug"]["ours"] == r["comm_debug"]["torch"] == (3, 5), r["comm_debug"]


@pytest.mark.slow
def test_one_collective_per_unit_4_ranks() -> None:
    for r in run_ranks(flat_4_ranks, 4):
        _same_as_torch(r["hsdp"], "hsdp 2x2")
        _check_calls(r["hsdp"], "hsdp 2x2", BLOCKS, (2, 2), shard=2, replicate=2)
        _same_as_torch(r["raf2"], "reshard_after_forward=2")
        # Gathered over 4 ranks in forward, re-gathered over pairs in backward (an
        # int applies to the root too, as torch's). hsdp() reshards every unit.
        _check_calls(r["raf2"], "raf2", UNITS, (4, 2), shard=4, replicate=1)
        _same_as_torch(r["hsdp_api"], "hsdp()")
        _check_calls(r["hsdp_api"], "hsdp()", UNITS, (2, 2), shard=2, replicate=2)
        units = r["hsdp_api"]["ours"]["units"]
        assert units["Llama"]["replicated"] == ["norm.weight"], units["Llama"]
        assert set(units["layers.1"]["replicated"]) == {"attn_norm.weight", "ffn_norm.weight"}
