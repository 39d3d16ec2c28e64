"""torch 2.15's FSDP2 names, on every supported torch: manual backward finalization
(``set_manual_backward_finalization``, ``finalize_backward``,
``GradientReductionHandle``), ``set_keep_unsharded_storage`` and
``MixedPrecisionPolicy.param_dtype_override_fn``.

The ranks train our Llama with bf16 mixed precision, two micro-batches a step (the
first without gradient sync), ours ending each step with ``finalize_backward``, and
torch's ``fully_shard`` the same model with ``set_is_last_backward`` (the automatic
end every torch version has). Bitwise: the same ops in the same order. On torch
2.15 both also take torch's policy with ``param_dtype_override_fn`` (the token
embedding kept in fp32); on 2.13 and 2.14, whose policy lacks the field, ours takes it from our own
policy and torch's keeps the embedding in fp32 in a unit of its own. The assertions
run in the ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import CFG, _data, _loss, _managed, dp_mesh
from traceable_hsdp._api import REDUCE_IN_GRAD_DTYPE
from traceable_hsdp.demo.models import Llama

TORCH_HAS_OVERRIDE = "param_dtype_override_fn" in {
    f.name for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)
}
MICRO, STEPS = 2, 3


def _build(lib: str, mesh: Any) -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG)
    fs, api = (th.fully_shard, th) if lib == "ours" else (torch_fsdp.fully_shard, torch_fsdp)
    fp32 = model.tok_embeddings.weight  # its fp32 output: each block casts its input

    def keep_embedding_fp32(p: nn.Parameter) -> torch.dtype | None:
        return torch.float32 if p is fp32 else None

    override = {}
    if TORCH_HAS_OVERRIDE or lib == "ours":
        override = {"param_dtype_override_fn": keep_embedding_fp32}
    # On 2.15 both take torch's policy (ours converts it); before, ours its own.
    policy_api = torch_fsdp if TORCH_HAS_OVERRIDE else api
    mp = policy_api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, **override)
    if not override:
        # torch < 2.15: the embedding kept in fp32 by a unit of its own instead.
        fs(model.tok_embeddings, mesh=mesh)
    for layer in model.layers:
        fs(layer, mesh=mesh, mp_policy=mp)
    fs(model, mesh=mesh, mp_policy=mp)
    return model


def finalization_worker(rank: int, world: int) -> None:
    mesh = dp_mesh((world,))
    ours, theirs = _build("ours", mesh), _build("torch", mesh)
    for p in _managed(ours):
        want = torch.float32 if p.fqn == "tok_embeddings.weight" else torch.bfloat16
        assert p.dtype == want, (p.fqn, p.dtype)
        assert p.reduce_dtype == (torch.float32 if REDUCE_IN_GRAD_DTYPE else p.dtype), p.fqn
    ours.set_manual_backward_finalization(True)
    with pytest.raises(RuntimeError, match="root"):
        ours.layers[0].set_manual_backward_finalization(True)
    ours.set_keep_unsharded_storage(True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for step, (x, y) in enumerate(_data(world * MICRO, STEPS)):
        xs, ys = x.chunk(world)[rank].chunk(MICRO), y.chunk(world)[rank].chunk(MICRO)
        if step == STEPS - 1:
            ours.set_keep_unsharded_storage(False)
        for i in range(MICRO):
            last = i == MICRO - 1
            for m in (ours, theirs):
                m.set_requires_gradient_sync(last)
            theirs.set_is_last_backward(last)
            lo, lt = _loss(ours(xs[i]), ys[i]), _loss(theirs(xs[i]), ys[i])
            lo.backward()
            lt.backward()
            assert torch.equal(lo, lt), (step, i, lo, lt)
        handle = ours.finalize_backward(async_op=True)
        assert isinstance(handle, th.GradientReductionHandle)
        if hasattr(torch_fsdp, "GradientReductionHandle"):
            assert isinstance(handle, torch_fsdp.GradientReductionHandle)
        with pytest.raises(RuntimeError, match="waited on"):
            ours.finalize_backward()
        handle.wait()
        kept = [fp.unsharded_param.untyped_storage().nbytes() for fp in _managed(ours)]
        if step < STEPS - 1:
            assert all(b > 0 for b in kept), kept  # resharded, storage kept
        else:
            assert not any(kept), kept  # set_keep_unsharded_storage(False) frees it
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(full_tensor(a), full_tensor(b)), name
    # A handle that reset_iter_state invalidated raises; manual mode off again, the
    # automatic end returns and finalize_backward is refused.
    x, y = _data(world, 1)[0]
    _loss(ours(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    handle = ours.finalize_backward(async_op=True)
    ours.reset_iter_state()
    with pytest.raises(RuntimeError, match="invalidated"):
        handle.wait()
    ours.set_manual_backward_finalization(False)
    with pytest.raises(RuntimeError, match="set_manual_backward_finalization"):
        ours.finalize_backward()


def test_manual_finalization_keep_storage_and_dtype_override_match_torch() -> None:
    run_ranks(finalization_worker, 2)


def test_param_dtype_override_fn_answer_is_checked(one_rank) -> None:
    bad = th.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16
    )
    with pytest.raises(ValueError, match=r"param_dtype_override_fn must return None.*'weight'"):
        th.fully_shard(nn.Linear(2, 2), mesh=one_rank, mp_policy=bad)
    with pytest.raises(TypeError, match="callable"):
        th.MixedPrecisionPolicy(param_dtype_override_fn=1)


def test_torch_policy_field_ours_lacks_is_refused(one_rank) -> None:
    @dataclasses.dataclass(frozen=True)
    class Newer(torch_fsdp.MixedPrecisionPolicy):
        future_field: int = 0

    with pytest.raises(NotImplementedError, match="future_field"):
        th.fully_shard(nn.Linear(2, 2), mesh=one_rank, mp_policy=Newer())


@pytest.mark.skipif(not REDUCE_IN_GRAD_DTYPE, reason="torch < 2.15 reduces in param_dtype")
def test_grad_dtype_ours_would_ignore_is_refused(one_rank) -> None:
    m = nn.Linear(2, 2)
    m.weight.grad_dtype = torch.bfloat16
    with pytest.raises(NotImplementedError, match="grad_dtype"):
        th.fully_shard(m, mesh=one_rank)
