"""state_dict / load_state_dict, torch.distributed.checkpoint round trips, and
parameters shared across modules (tied embedding and output head).

Bitwise or tolerant:
- Loading and resuming are compared bitwise (==, atol=rtol=0). A loaded model holds
  exactly the saved shards, a loaded AdamW exactly the saved moments, step and lr,
  and the steps after it run the same ops with the same collectives in the same
  order on the same data as the run that saved, so every number must repeat.
- Tied-weight parity against a single process is tolerant (losses rtol 1e-5, final
  parameters atol 2e-5), for test_runtime.py's reason: the sharded run averages
  gradients with reduce-scatter, another summation order than one process's
  backward, and AdamW turns ~1e-7 gradient differences into ~1e-6 parameter
  differences over a few steps. The tied gradient of the first step is compared
  with atol 1e-6 (one backward, no optimizer in between). Seen: gradient 3e-8,
  losses 9e-8 relative, parameters 4e-7 after 6 steps.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import traceable_hsdp as th
from _ckpt_workers import (
    N_PARAMS,
    N_RESUME,
    N_SAVE,
    TIED_CFG,
    dcp_worker,
    load_rules_worker,
    tied_reference,
    tied_worker,
)
from _dist import full_tensor, run_ranks
from _workers import CFG, reference_run
from traceable_hsdp.demo.models import Llama


def test_load_state_dict_rules_2_ranks() -> None:
    """Keys are the original FQNs; strict=True catches a missing and an extra key;
    DTensors, plain full tensors (sharded on load) and assign=True all load, before
    the first forward, and that forward uses the loaded values (its loss equals, bitwise,
    the loss of a model sharded from those values); loading while units hold gathered
    data (unshard(), async unshard, reshard_after_backward=False) drops the stale copy."""
    results = run_ranks(load_rules_worker, 2)
    ref_losses, _ = reference_run(2, steps=2)
    for r in results:
        assert r["keys"] == r["plain_keys"]
        # The first loss of the loaded model equals the single-process loss of the
        # same weights on the same global batch (mean of 2 half-batch means: tolerant).
        torch.testing.assert_close(r["src_loss"], ref_losses[0], rtol=1e-6, atol=0)
        # Two training steps after load_state_dict(assign=True) follow the reference.
        torch.testing.assert_close(r["assign_losses"], ref_losses, rtol=1e-5, atol=0)
    assert results[0]["src_loss"] == results[1]["src_loss"]


def _check_resume(results: list[dict]) -> None:
    for r in results:
        # The fresh model (other init) holds exactly the saved values after loading.
        assert r["loaded"].keys() == r["saved"].keys()
        for k, v in r["saved"].items():
            assert torch.equal(r["loaded"][k], v), k
        # Resumed and reloaded-again runs repeat the uninterrupted run bitwise.
        assert r["resumed"] == r["continued"], (r["resumed"], r["continued"])
        assert r["again"] == r["continued"], (r["again"], r["continued"])
        assert len(r["first"]) == N_SAVE and len(r["continued"]) == N_RESUME
    assert all(r["continued"] == results[0]["continued"] for r in results)


def test_dcp_round_trip_fsdp_eager() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(dcp_worker, 2, (2,), "eager", path)
    _check_resume(results)
    # The losses before and after the checkpoint are the reference's (training works).
    ref_losses, _ = reference_run(2, steps=N_SAVE + N_RESUME)
    losses = results[0]["first"] + results[0]["continued"]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for r in results:  # plain dcp.save/load of model.state_dict()
        for k, v in r["plain_saved"].items():
            assert torch.equal(r["plain_loaded"][k], v), k


def test_dcp_round_trip_hsdp_2x2_eager() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(dcp_worker, 4, (2, 2), "eager", path)
    _check_resume(results)
    ref_losses, _ = reference_run(4, steps=N_SAVE + N_RESUME)
    losses = results[0]["first"] + results[0]["continued"]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_dcp_round_trip_and_tied_weights_fsdp_compiled() -> None:
    """aot_eager with compiled autograd, on the Llama with tied embedding and head:
    resumes bitwise after a DCP round trip; one forward and one backward graph per
    model (compiled in its first step), none after the save or the loads; the tied
    weight is gathered once per forward and reduced once per backward; the run that
    saved matches the single-process tied reference."""
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(dcp_worker, 2, (2,), "compiled", path, True)
    _check_resume(results)
    for r in results:
        assert r["graphs_at_save"] == r["graphs_a"] == (1, 1), r
        assert r["graphs_b"] == r["graphs_b_again"] == (1, 1), r
        assert r["fwd_counts"][0]["all_gather_into_tensor"] == N_PARAMS - 1
        assert r["bwd_counts"][0]["reduce_scatter_tensor"] == N_PARAMS - 1
    _check_tied(
        [
            dict(losses=r["first"] + r["continued"], params=r["params_a"], grad0=r["grad0"],
                 bytes_after=r["bytes_after"])
            for r in results
        ]
    )


# -------------------------------------------------------------------- tied weights
def _check_tied(results: list[dict]) -> None:
    ref = tied_reference(2)
    # The tied gradient is the sum of both uses: the untied twin's two gradients add
    # up to the tied one bitwise (autograd adds the same two gradients once; IEEE
    # addition commutes).
    torch.testing.assert_close(ref["grad0"], ref["twin_sum"], rtol=0, atol=0)
    for r in results:
        torch.testing.assert_close(r["grad0"], ref["grad0"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=0)
        assert r["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(r["params"][k], v, rtol=0, atol=2e-5, msg=k)
        assert torch.equal(r["params"]["output.weight"], r["params"]["tok_embeddings.weight"])
        assert r["bytes_after"] == 0


def test_tied_embeddings_parity_eager() -> None:
    """The tied weight is managed once, by the unit that holds both its modules (the
    root; or a list unit of embedding and head, fully_shard([emb, head])), and trains
    like one process."""
    results = run_ranks(tied_worker, 2)
    _check_tied([r[layout] for r in results for layout in ("root", "list_unit")])


# ---------------------------------------------------- a parameter split across units


def test_error_tied_weight_split_across_units(one_rank) -> None:
    """A nested unit on the head would shard the tied weight alone; the root would
    then shard the embedding's original again (silently untied): refused at the first
    forward, as torch's fully_shard refuses it ("already managed by another")."""
    torch.manual_seed(0)
    model = Llama(TIED_CFG)
    th.fully_shard(model.output, mesh=one_rank)
    for layer in model.layers:
        th.fully_shard(layer, mesh=one_rank)
    th.fully_shard(model, mesh=one_rank)
    with pytest.raises(
        ValueError,
        match=r"'tok_embeddings.weight' of Llama is already managed by another fully_shard "
        r"unit: it is shared with 'weight' of the fully_shard unit Linear.*one fully_shard "
        r"unit only.*fully_shard\(\[module_a, module_b\]\)",
    ):
        model(torch.zeros(1, 4, dtype=torch.long))
    # Two sibling units sharing a weight: the second one's forward raises (also when
    # called on its own, not through a root).
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    th.fully_shard(a, mesh=one_rank)
    th.fully_shard(b, mesh=one_rank)
    with pytest.raises(ValueError, match=r"'weight' of Linear is already managed by another"):
        b(torch.randn(1, 4))


def test_error_module_in_nested_unit_and_parent(one_rank) -> None:
    """A module inside a nested unit that the parent also reaches directly would run
    on the nested unit's sharded DTensor in the parent's forward: refused."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.head = self.block[0]  # the same module, outside the block's unit

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(x))

    net = Net()
    th.fully_shard(net.block, mesh=one_rank)
    with pytest.raises(
        ValueError, match=r"'head.weight' of Net is '0.weight' of the fully_shard unit Sequential"
    ):
        th.fully_shard(net, mesh=one_rank)


def test_llama_config_tie_embeddings() -> None:
    untied = Llama(CFG)
    assert not CFG.tie_embeddings and untied.output.weight is not untied.tok_embeddings.weight
    m = Llama(TIED_CFG)
    assert m.output.weight is m.tok_embeddings.weight
    assert len(list(m.parameters())) == N_PARAMS - 1
    with pytest.raises(TypeError, match="tie_embeddings must be a bool"):
        type(CFG)(tie_embeddings=1)  # type: ignore[arg-type]


def test_list_unit_built_on_meta_loads_with_assign(one_rank) -> None:
    """A list unit whose modules load one after the other: torch's rank-0 broadcast
    flow (HF accelerate's cpu_ram_efficient_loading) builds on meta, shards, and loads
    DTensors with load_state_dict(assign=True). The unit's hook after its first
    module's load once refused the others as still on meta, though the same load
    was about to reach them. Now each one is adopted as it loads, and a shard still
    on meta at the forward is refused there. Values are compared bitwise with the
    state dict loaded."""
    from torch.distributed.tensor import distribute_tensor

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))

    torch.manual_seed(0)
    full = build().state_dict()
    with torch.device("meta"):
        model = build()
    th.fully_shard([model[0], model[3]], mesh=one_rank)  # first and last: not adjacent
    th.fully_shard(model, mesh=one_rank)
    meta_sd = model.state_dict()
    sharded = {
        k: distribute_tensor(full[k], v.device_mesh, v.placements) for k, v in meta_sd.items()
    }
    # All but the list unit's last module: that one stays on meta until the forward.
    partial = {k: v for k, v in sharded.items() if not k.startswith("3.")}
    model.load_state_dict(partial, assign=True, strict=False)
    with pytest.raises(
        RuntimeError, match=r"still on meta device: \['3.weight', '3.bias'\].*to_empty"
    ):
        model(torch.randn(2, 4))
    model.load_state_dict(sharded, assign=True)
    for k, v in model.state_dict().items():
        assert torch.equal(full_tensor(v), full[k]), k
    x = torch.randn(2, 4)
    ref = build()
    ref.load_state_dict(full)
    out = model(x)
    assert torch.equal(out, ref(x))
    out.sum().backward()
    assert all(p.grad is not None and not p.is_meta for p in model.parameters())
