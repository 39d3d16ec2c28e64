"""hsdp(): the HSDP systems' entry point on the fully_shard runtime.

Parity against the single-process reference of tests/_workers.py (AdamW, same global
batch), with the tolerance of test_runtime.py (losses rtol 1e-5, params atol 2e-5:
reductions in another order, amplified by AdamW; replicated parameters are
all-reduced instead of reduce-scattered, which is one more order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import (
    CFG,
    CFG1,
    LR,
    GraphRecorder,
    _data,
    _loss,
    _mean_over_ranks,
    _placeholder_bytes,
    dp_mesh,
    reference_run,
)
from traceable_hsdp.demo.models import Llama, shard_llama

N_PARAMS = 2 + 9 * CFG.n_layers + 1
# threshold=1 KiB keeps every RMSNorm weight (dim 32 fp32 = 128 B) whole: 2 per block
# and the final norm; replicate_params keeps the output head whole.
N_REPLICATED = 2 * CFG.n_layers + 1 + 1


STEPS = 3


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


def hsdp_worker(rank: int, world: int, shard_size: int, levels: list[str]) -> dict[str, Any]:
    """Trains one model per optimizer level with hsdp(threshold=1 KiB: the RMSNorm
    weights stay replicated; replicate_params: the output head), eager, and reports
    losses, final parameters, placements and storage. (Compiled, level3 on this model
    is test_clip.py's hsdp run.)"""
    out: dict[str, Any] = {}
    for level in levels:
        torch.manual_seed(0)
        model = Llama(CFG)
        keep = [model.output.weight]
        shard_llama(model, th.hsdp, shard_size=shard_size, threshold=1, optimizer_level=level,
                    replicate_params=keep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, bytes_after_bwd = [], []
        for x, y in _data(world, STEPS):
            loss = _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            bytes_after_bwd.append(_placeholder_bytes(model))
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(loss, world))
        out[level] = dict(
            losses=losses,
            params={k: full_tensor(v) for k, v in model.state_dict().items()},
            placements={k: str(v.placements) for k, v in model.state_dict().items()},
            bytes_after_bwd=bytes_after_bwd,
        )
    return out


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


def reduce_op_worker(rank: int, world: int) -> dict[str, float]:
    """One backward with reduce_op="mean", "sum" and gradient_divide_factor=4: the
    sharded gradients must be in ratio 1 : world : world/4."""
    grads = {}
    for name, kwargs in (("mean", {}), ("sum", {"reduce_op": "sum"}),
                         ("div4", {"gradient_divide_factor": 4.0})):
        torch.manual_seed(0)
        model = Llama(CFG)
        shard_llama(model, th.hsdp, threshold=0, **kwargs)
        x, y = _data(world, 1)[0]
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        grads[name] = {k: full_tensor(p.grad) for k, p in model.named_parameters()}
    ratios = {}
    for k, g in grads["mean"].items():
        ratios[k] = (
            (grads["sum"][k] - world * g).abs().max().item(),
            (grads["div4"][k] - world / 4 * g).abs().max().item(),
        )
    return ratios


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


# comm_options_worker's Llama: one block (the options apply per unit; a second block
# adds compile time and no path).
COMM_CFG = CFG1


def comm_options_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    """FSDPModule's communication options on a 2x2 HSDP mesh, eager or compiled
    (aot_eager, compiled autograd): each run is compared with a plain eager run of the
    same model (``COMM_CFG``) and data (gradients after two backwards). Compiled, it
    also reports the collectives of every graph each run compiled."""
    from torch import nn

    compiled = mode == "compiled"
    mesh = dp_mesh((2, 2))
    data = _data(world * 2, 1)[0]
    xs, ys = data[0].chunk(world)[rank].chunk(2), data[1].chunk(world)[rank].chunk(2)
    graphs: dict[str, tuple[list, list]] = {}

    def run(name: str, model: nn.Module, backwards: Any) -> None:
        """``backwards(fwd)`` runs the backwards, with ``fwd`` the (compiled) model."""
        if not compiled:
            backwards(model)
            return
        rec = GraphRecorder()
        torch._dynamo.reset()
        th.enable_compiled_autograd(backend=rec)
        try:
            backwards(torch.compile(model, backend=rec, fullgraph=True))
        finally:
            th.disable_compiled_autograd()
        graphs[name] = (rec.forward, rec.backward, sorted(rec.reduce_ops))

    def grads(
        name: str, setup: Any, per_backward: Any = None, eager: bool = False
    ) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Llama(COMM_CFG)
        shard_llama(model, th.fully_shard, mesh=mesh)
        setup(model)

        def backwards(fwd: Any) -> None:
            for i in range(2):
                if per_backward is not None:
                    per_backward(model, i)
                _loss(fwd(xs[i]), ys[i]).backward()

        if eager:
            backwards(model)
        else:
            run(name, model, backwards)
        return {k: full_tensor(p.grad) for k, p in model.named_parameters()}

    def _on_units(model: Any, setter: str, value: Any) -> None:
        # These setters apply to one unit, as torch's: set them on every unit.
        for unit in (*model.layers, model):
            getattr(unit, setter)(value)

    def diff(a: dict, b: dict, scale: float = 1.0) -> float:
        return max((a[k] - scale * b[k]).abs().max().item() for k in a)

    # The plain run, eager in both modes (compiled and eager agree to 1e-6, and a
    # compiled base would add a compile without a new graph: force_sum's graphs have
    # the same collectives).
    base = grads("base", lambda m: None, eager=True)
    out: dict[str, Any] = {}
    if compiled:
        # One compiled run for both (compiles are the cost): summed collectives, and
        # no all-reduce on the first backward, all-reduce on the second.
        out["force_sum_all_reduce_later"] = diff(
            grads("force_sum_all_reduce_later", lambda m: _on_units(m, "set_force_sum_reduction_for_comms", True),
                  lambda m, i: m.set_requires_all_reduce(i == 1)),
            base)
    else:
        out["force_sum"] = diff(
            grads("force_sum", lambda m: _on_units(m, "set_force_sum_reduction_for_comms", True)), base)
        # No all-reduce on the first backward, all-reduce on the second: the same sum.
        out["all_reduce_later"] = diff(
            grads("all_reduce_later", lambda m: None, lambda m, i: m.set_requires_all_reduce(i == 1)),
            base)
        # Compiled, these add compile time and nothing new: the deprecated name sets
        # the same divide factor as force_sum's path, and the no-all-reduce graph is
        # all_reduce_later's first backward graph.
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rs = grads("rs_divide", lambda m: _on_units(m, "set_reduce_scatter_divide_factor", 2.0))
        out["rs_divide_warned"] = any(issubclass(w.category, FutureWarning) for w in caught)
        out["rs_divide"] = diff(rs, base, world / 2.0)
        # Without any all-reduce the replicas' gradients differ (so the check above
        # can fail): the first replica group and the second see other data.
        no_ar = grads("no_all_reduce", lambda m: m.set_requires_all_reduce(False))
        out["no_all_reduce"] = diff(no_ar, base)
    # The embedding unit need not re-gather for backward: its weight gradient reads
    # only indices and the output gradient.
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Embedding(CFG.vocab_size, 8), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Embedding(CFG.vocab_size, 8), nn.Linear(8, 3))
    ref.load_state_dict(emb.state_dict())
    th.fully_shard(emb[0], mesh=mesh)
    # The root reshards too, so its re-gather shows beside the embedding's absence.
    th.fully_shard(emb, mesh=mesh, reshard_after_forward=True)
    emb[0].set_unshard_in_backward(False)
    run("embedding_no_unshard", emb, lambda fwd: fwd(xs[0]).sum().backward())
    ref(xs[0]).sum().backward()
    for p in ref.parameters():  # the reference's grads averaged over the 4 ranks
        torch.distributed.all_reduce(p.grad)
        p.grad /= world
    out["embedding_no_unshard"] = max(
        (full_tensor(a.grad) - b.grad).abs().max().item()
        for a, b in zip(emb.parameters(), ref.parameters())
    )
    # A unit that reads its weight in backward fails loudly when not re-gathered.
    lin = th.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=True)
    lin.set_unshard_in_backward(False)
    try:
        run("linear_error", lin, lambda fwd: fwd(torch.randn(2, 4, requires_grad=True)).sum().backward())
        out["linear_error"] = None
    except RuntimeError as e:
        out["linear_error"] = str(e)
    out["graphs"] = graphs
    return out


def test_fsdp_module_comm_options_2x2_eager() -> None:
    """set_force_sum_reduction_for_comms, set_reduce_scatter_divide_factor (the
    deprecated name), set_requires_all_reduce, set_unshard_in_backward. Tolerance
    1e-6: sums in another order than the averaging collectives."""

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


def ignored_params_worker(rank: int, world: int) -> dict[str, Any]:
    """ignored_params against torch's fully_shard with the same setting, eagerly, 2
    steps of AdamW: the ignored parameter (the final norm) stays a plain tensor that
    each rank steps with its own, unreduced gradient, in both libraries."""
    import torch.distributed.fsdp as torch_fsdp

    out = {}
    for lib, fs in (("ours", th.fully_shard), ("torch", torch_fsdp.fully_shard)):
        torch.manual_seed(0)
        model = Llama(CFG)
        for layer in model.layers:
            fs(layer)
        fs(model, ignored_params={model.norm.weight})
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for xs, ys in _data(world, 2):
            loss = _loss(model(xs.chunk(world)[rank]), ys.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[lib] = dict(
            losses=losses,
            params={k: full_tensor(v) if isinstance(v, DTensor) else v.detach().clone()
                    for k, v in model.state_dict().items()},
            norm_type=type(model.norm.weight).__name__,
        )
    return out


def test_ignored_params_match_torch_fully_shard() -> None:
    """Bitwise: the same ops in the same order as torch's fully_shard (eager)."""

    for r in run_ranks(ignored_params_worker, 2):
        ours, ref = r["ours"], r["torch"]
        assert ours["norm_type"] == "Parameter" and ref["norm_type"] == "Parameter"
        assert ours["losses"] == ref["losses"]
        for k, v in ref["params"].items():
            torch.testing.assert_close(ours["params"][k], v, rtol=0, atol=0, msg=k)
