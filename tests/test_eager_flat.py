"""Eagerly a unit issues one flat all-gather and one flat reduce-scatter (and, for
HSDP, one all-reduce) per step, as torch's fully_shard does, with the numbers of
torch's fully_shard, bitwise (atol=rtol=0). See [Note: One collective per unit,
eagerly] in traceable_hsdp/_param_group.py.

The collectives are counted as they are dispatched (a TorchDispatchMode over our
steps, :class:`CollectiveLog` below), each with the unit and parameters its annotation
names. The model has uneven dim-0 shards (vocab 65), Shard(1) parameters, bf16
parameters with fp32 reduction and a frozen parameter (gathered, not reduced).
2 ranks: a 1-D mesh. 4 ranks: HSDP on a 2x2 mesh; ``reshard_after_forward=2`` on a
1-D mesh of 4 (backward re-gathers over pairs of ranks; fp32, even shards, dim 0:
what torch's fully_shard supports there); ``hsdp()`` with the
norms replicated (their gradients in one all-reduce per mesh dim), fp32, against
torch's fully_shard on the same 2x2 mesh.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
from _dist import run_ranks
from _workers import CFG, _data, _loss, _placeholder_bytes, dp_mesh, full_state
from traceable_hsdp._annotate import ANNOTATION_KEY
from traceable_hsdp.demo.models import Llama


def _same_as_torch(run: dict[str, Any], what: str) -> None:
    ours, ref = run["ours"], run["torch"]
    assert ours["losses"] == ref["losses"], (what, ours["losses"], ref["losses"])
    assert ours["params"].keys() == ref["params"].keys(), what
    for k, v in ref["params"].items():
        torch.testing.assert_close(ours["params"][k], v, rtol=0, atol=0, msg=f"{what}: {k}")
    assert ours["bytes_after"] == 0, what


STEPS = 3


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


LR = 1e-2
COLLECTIVES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    # over two gloo ranks a reduce-scatter is an exchange: see [Note: gloo
    # reduce-scatters as an exchange] in passes/gloo/exchange.py
    "all_to_all_single": "reduce_scatter",
    "all_reduce": "all_reduce",
}


class CollectiveLog(TorchDispatchMode):
    """Records every functional collective dispatched while active, as
    ``(kind, unit, params, group size)`` from its collective annotation (see
    [Note: Collective annotations] in traceable_hsdp/_annotate.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str | None, tuple[str, ...], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func.namespace == "_c10d_functional" and packet.__name__ in COLLECTIVES:
            meta = torch.fx.traceback.current_meta.get("custom", {}).get(ANNOTATION_KEY, {})
            group = args[-1] if packet.__name__ != "all_gather_into_tensor_out" else args[2]
            size = torch.distributed.distributed_c10d._resolve_process_group(group).size()
            params = tuple(meta.get("params", ()))
            self.calls.append((COLLECTIVES[packet.__name__], meta.get("unit"), params, size))
        return func(*args, **kwargs)


def _build(
    lib: str,
    mesh: Any,
    mp: bool = True,
    dim1: bool = True,
    vocab: int = CFG.vocab_size,
    **kw: Any,
) -> Llama:
    """Our test Llama (vocab 65: uneven dim-0 shards of the embedding) with a frozen
    norm in block 0; fully_shard per block and root. ``dim1``: every block's MLP
    down projection and the output head on Shard(1); ``mp``: bf16 parameters and
    fp32 reduction."""
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CFG, vocab_size=vocab))
    model.layers[0].attn_norm.weight.requires_grad_(False)
    api = th if lib == "ours" else torch_fsdp
    if dim1:
        on_1 = {id(layer.ffn.w2.weight) for layer in model.layers} | {id(model.output.weight)}
        kw["shard_placement_fn"] = lambda p: Shard(1) if id(p) in on_1 else None
    if mp:
        kw["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, **kw)
    api.fully_shard(model, mesh=mesh, **kw)
    return model


def _train(
    model: torch.nn.Module, rank: int, dp: int, dp_rank: int, log: CollectiveLog | None
) -> dict[str, Any]:
    """``STEPS`` AdamW steps on this data-parallel rank's share of the global batch;
    ``log`` records each step's collectives (reset between steps)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, per_step = [], []
    for x, y in _data(dp, STEPS):
        if log is not None:
            log.calls = []
            with log:
                loss = _loss(model(x.chunk(dp)[dp_rank]).float(), y.chunk(dp)[dp_rank])
                loss.backward()
            per_step.append(log.calls)
        else:
            loss = _loss(model(x.chunk(dp)[dp_rank]).float(), y.chunk(dp)[dp_rank])
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, params=full_state(model), calls=per_step)


def _units(model: torch.nn.Module) -> dict[str, dict[str, list[str]]]:
    """Each unit's label -> its parameters' FQNs (all, and those that require grad)."""
    out = {}
    for state in model._traceable_hsdp_state.states:
        pg = state.param_group
        if pg is not None:
            out[pg.label] = {
                "all": [fp.fqn for fp in pg.fsdp_params],
                "trainable": [fp.fqn for fp in pg.trainable],
                "replicated": [fp.fqn for fp in pg.fsdp_params if fp.replicate],
            }
    return out


def _both(
    rank: int, mesh: Any, dp: int, dp_rank: int, ours_build: Any = None, **kw: Any
) -> dict[str, Any]:
    """Torch's run and ours (``_build`` with ``kw``, or ``ours_build()``)."""
    ref = _train(_build("torch", mesh, **kw), rank, dp, dp_rank, None)
    ours_model = _build("ours", mesh, **kw) if ours_build is None else ours_build()
    ours = _train(ours_model, rank, dp, dp_rank, CollectiveLog())
    ours["bytes_after"] = _placeholder_bytes(ours_model)
    ours["units"] = _units(ours_model)
    return dict(ours=ours, torch=ref)


def _comm_debug_counts(lib: str, mesh: Any, rank: int) -> tuple[int, int]:
    """The collectives torch's CommDebugMode counts in one forward and in its
    backward, with the default reshard_after_forward (the root stays gathered)."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = _build(lib, mesh)
    x, y = _data(2, 1)[0]
    with CommDebugMode() as fwd:
        loss = _loss(model(x.chunk(2)[rank]).float(), y.chunk(2)[rank])
    with CommDebugMode() as bwd:
        loss.backward()
    return fwd.get_total_counts(), bwd.get_total_counts()


def flat_2_ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out = {"fsdp": _both(rank, mesh, world, rank)}
    out["comm_debug"] = {lib: _comm_debug_counts(lib, mesh, rank) for lib in ("torch", "ours")}
    return out


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


def flat_4_ranks(rank: int, world: int) -> dict[str, Any]:
    """HSDP on a 2x2 (replicate, shard) mesh; reshard_after_forward=2 on a 1-D mesh
    of 4 (the backward re-gathers over pairs of ranks; vocab 68); hsdp() keeping the small
    parameters replicated (one flat all-reduce per group for them), against torch's
    fully_shard on the 2x2 mesh."""
    out = {}
    mesh2 = dp_mesh((2, 2))
    out["hsdp"] = _both(rank, mesh2, world, rank)
    mesh1 = init_device_mesh("cpu", (world,))
    # Vocab 68 (even over 4 ranks) and no Shard(1): torch 2.13's fully_shard fails
    # to reshard to a smaller world with either (uneven: its as_strided of the
    # post-forward shard is out of bounds; Shard(1): an IndexError in its copy-out).
    out["raf2"] = _both(rank, mesh1, world, rank, dim1=False, vocab=68, reshard_after_forward=2)

    def build_hsdp() -> Llama:
        # hsdp() per block and on the root, keeping the norms (32 fp32 values, 0.125
        # KiB) replicated; fp32 throughout, as the torch run it is compared with.
        torch.manual_seed(0)
        model = Llama(CFG)
        model.layers[0].attn_norm.weight.requires_grad_(False)
        for layer in model.layers:
            th.hsdp(layer, threshold=1, mesh=mesh2)
        th.hsdp(model, threshold=1, mesh=mesh2)
        return model

    out["hsdp_api"] = _both(rank, mesh2, world, rank, ours_build=build_hsdp, mp=False, dim1=False)
    return out


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
