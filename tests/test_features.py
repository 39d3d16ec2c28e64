"""fully_shard features against torch's own fully_shard with the same settings.

One fat run per mode checks together: MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32), frozen parameters mixed with trainable ones inside units,
explicit forward/backward prefetch (set_modules_to_*_prefetch), gradient
accumulation over 2 micro-batches with set_requires_gradient_sync(False) on the
first, shard_placement_fn (the MLP down projections and the output head on dim 1),
ignored_params (the token embedding) and CPUOffloadPolicy on the blocks. Eager also
keeps the units gathered between micro-batches (set_reshard_after_backward / set_is_last_backward False on the
first); ``compiled_keep`` does that compiled, on the 2x2 mesh only (its checks there
are the 1-D ones plus the replicas' all-reduce, so a 1-D run would repeat its compile
and add no check). The comparison is bitwise (atol=rtol=0): both libraries cast,
gather, compute and reduce in the same dtypes and orders, so any drift means a
semantic difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor, Shard

import traceable_hsdp as th
from _dist import run_ranks
from _workers import (
    CFG,
    GraphRecorder,
    _data,
    _loss,
    _mean_over_ranks,
    _placeholder_bytes,
    dp_mesh,
    full_state,
)
from traceable_hsdp.demo.models import Llama

# Managed parameters: every parameter but the token embedding (ignored_params).
N_PARAMS = 2 + 9 * CFG.n_layers + 1 - 1
N_FROZEN = CFG.n_layers + 1  # attn_norm of every block + layers[0].attn.wq


MICRO = 2  # micro-batches per optimizer step
STEPS = 3


def _freeze(model: Llama) -> None:
    # Frozen and trainable parameters mixed inside units: the norms and the first
    # block's query projection.
    for layer in model.layers:
        layer.attn_norm.weight.requires_grad_(False)
    model.layers[0].attn.wq.weight.requires_grad_(False)


def _build(lib: str, mesh: Any, mp: Any) -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG)
    _freeze(model)
    fs = th.fully_shard if lib == "ours" else torch_fsdp.fully_shard
    # shard_placement_fn: the MLP's down projections and the output head on dim 1.
    dim1 = {id(layer.ffn.w2.weight) for layer in model.layers} | {id(model.output.weight)}

    def placement(p: torch.nn.Parameter) -> Shard | None:
        return Shard(1) if id(p) in dim1 else None

    # CPUOffloadPolicy on the blocks (on this CPU mesh the copies are same-device,
    # so the numbers must not change; the test checks where the tensors live).
    offload = (th if lib == "ours" else torch_fsdp).CPUOffloadPolicy(pin_memory=False)
    for layer in model.layers:
        fs(layer, mesh=mesh, mp_policy=mp, shard_placement_fn=placement, offload_policy=offload)
    # ignored_params: the token embedding stays a plain fp32 tensor, not gathered,
    # its gradient not reduced: each rank steps it with its own gradient, in both
    # (its fp32 output is cast to bf16 by the first block's cast_forward_inputs).
    fs(model, mesh=mesh, mp_policy=mp, shard_placement_fn=placement,
       ignored_params={model.tok_embeddings.weight})
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return model


def _train(
    model: Llama, rank: int, world: int, step_fn: Any, keep_gathered: bool
) -> tuple[list[float], list[Any], list[int]]:
    """``keep_gathered``: on the no-sync micro-batch also set_reshard_after_backward
    (False) and set_is_last_backward(False), as torch's docs suggest for gradient
    accumulation; the last micro-batch sets both back to True."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads_after_nosync, kept_bytes = [], [], []
    for x, y in _data(world * MICRO, STEPS):
        # This rank's share of the global batch, split into MICRO micro-batches.
        xs, ys = x.chunk(world)[rank].chunk(MICRO), y.chunk(world)[rank].chunk(MICRO)
        total = 0.0
        for i in range(MICRO):
            last = i == MICRO - 1
            model.set_requires_gradient_sync(last)
            if keep_gathered:
                model.set_reshard_after_backward(last)
                model.set_is_last_backward(last)
            total += step_fn(xs[i], ys[i]) / MICRO
            if not last:
                # The managed (sharded) ones; an ignored parameter has its own.
                grads_after_nosync.append(
                    [p.grad is None for p in model.parameters()
                     if p.requires_grad and isinstance(p, DTensor)]
                )
                if keep_gathered and hasattr(model, "_traceable_hsdp_state"):
                    kept_bytes.append(_placeholder_bytes(model))
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(torch.tensor(total), world))
    return losses, grads_after_nosync, kept_bytes


def features_vs_torch(rank: int, world: int, mesh_shape: tuple[int, ...], mode: str) -> dict[str, Any]:
    mesh = dp_mesh(mesh_shape)
    mp = th.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tmp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def eager_step(model: Llama):
        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = _loss(model(x).float(), y) / MICRO
            loss.backward()
            return loss.item() * MICRO
        return step

    # torch's fully_shard first: compiled autograd must be off for it.
    ref = _build("torch", mesh, tmp)
    keep = mode in ("eager", "compiled_keep")
    ref_losses, _, _ = _train(ref, rank, world, eager_step(ref), keep)
    ref_params = full_state(ref)

    ours = _build("ours", mesh, mp)
    rec = GraphRecorder()
    if mode.startswith("compiled"):
        th.enable_compiled_autograd(backend=rec)
        compiled = torch.compile(ours, backend=rec, fullgraph=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = _loss(compiled(x).float(), y) / MICRO
            loss.backward()
            return loss.item() * MICRO
    else:
        step = eager_step(ours)
    losses, nosync, kept_bytes = _train(ours, rank, world, step, keep)
    if mode.startswith("compiled"):
        th.disable_compiled_autograd()
    return dict(
        losses=losses,
        ref_losses=ref_losses,
        params=full_state(ours),
        ref_params=ref_params,
        nosync_grads_none=nosync,
        bytes_after=_placeholder_bytes(ours),
        kept_bytes=kept_bytes,
        fwd_counts=rec.forward,
        bwd_counts=rec.backward,
        dtypes={str(p.dtype) for p in ours.parameters()},
        placements={k: str(v.placements) if isinstance(v, DTensor) else type(v).__name__
                    for k, v in ours.state_dict().items()},
        devices={str(p.device) for p in ours.parameters()}
        | {str(p.grad.device) for p in ours.parameters() if p.grad is not None},
    )


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
