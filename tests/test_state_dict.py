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
  with atol 1e-6 (one backward, no optimizer in between).

The rank workers make the checks that raise (``pytest.raises``) in the rank and
return the numbers the tests compare.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import (
    CFG,
    LR,
    GraphRecorder,
    _data,
    _loss,
    _placeholder_bytes,
    dp_mesh,
    full_state,
    reference_run,
)
from traceable_hsdp.demo.models import Llama, LlamaConfig, shard_llama


def _sharded(cfg: LlamaConfig, seed: int, mesh: DeviceMesh) -> Llama:
    torch.manual_seed(seed)
    return shard_llama(Llama(cfg), th.fully_shard, mesh=mesh)


def _mean_over_ranks(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _first_batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the first global batch (the first step's data)."""
    x, y = _data(world, 1)[0]
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _eval_loss(model: torch.nn.Module, rank: int, world: int) -> float:
    """Mean loss of the first batch over the ranks, no gradient."""
    x, y = _first_batch(rank, world)
    with torch.no_grad():
        return _mean_over_ranks(_loss(model(x), y))


def _train(
    fwd: Any,
    opt: torch.optim.Optimizer,
    batches: list[Any],
    rank: int,
    world: int,
    first_grad_of: torch.nn.Parameter | None = None,
) -> tuple[list[float], torch.Tensor | None]:
    """Trains on this rank's share of ``batches``; returns the mean losses and the full
    gradient of ``first_grad_of`` after the first backward."""
    losses, first_grad = [], None
    for x, y in batches:
        loss = _loss(fwd(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        if first_grad_of is not None and first_grad is None:
            first_grad = full_tensor(first_grad_of.grad)
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss))
    return losses, first_grad


# ------------------------------------------------------------ load_state_dict rules
def load_rules_worker(rank: int, world: int) -> dict[str, Any]:
    """Eager, 1-D mesh: keys, strictness, the three value kinds (DTensor, plain full
    tensor, assign=True), loading before the first forward, and loading while units
    hold gathered data. Returns what the test compares with a reference."""
    mesh = dp_mesh((world,))
    torch.manual_seed(0)
    plain = Llama(CFG)  # the values every load below brings in
    plain_sd = plain.state_dict()
    src = _sharded(CFG, 0, mesh)  # the same values, sharded
    src_loss = _eval_loss(src, rank, world)
    src_sd = src.state_dict()
    out: dict[str, Any] = {"src_loss": src_loss}

    # Keys: the original FQNs in the original order; values: Shard(0) DTensors whose
    # local part is this rank's torch.chunk row block (vocab 65 over 2: 33 and 32 rows).
    out["keys"] = list(src_sd)
    out["plain_keys"] = list(plain_sd)
    assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in src_sd.values())
    emb = src_sd["tok_embeddings.weight"].to_local()
    rows = plain_sd["tok_embeddings.weight"].chunk(world)[rank]
    assert torch.equal(emb, rows), (emb.shape, rows.shape)

    def fresh() -> Llama:
        return _sharded(CFG, 1, mesh)  # other values than src

    def loaded_ok(model: Llama) -> None:
        for k, v in full_state(model).items():
            assert torch.equal(v, plain_sd[k]), k
        # Loaded before the first forward, the values are the ones it uses: the same
        # loss as src, bitwise (same sharded values, same ops).
        assert _eval_loss(model, rank, world) == src_loss
        # That forward ran without grad: the root resharded too, so an optimizer
        # built now gets the sharded parameters ([Note: The default keeps the root
        # gathered for backward]; torch's keeps the root's gathered copies registered,
        # and an optimizer built from them never updates the model).
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert _placeholder_bytes(model) == 0

    # strict=True: a missing and an unexpected key raise as torch does.
    # strict=False reports them and loads the rest.
    m = fresh()
    missing = {k: v for k, v in src_sd.items() if k != "norm.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "norm.weight"'):
        m.load_state_dict(missing)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra.weight"'):
        m.load_state_dict({**src_sd, "extra.weight": src_sd["norm.weight"]})
    res = m.load_state_dict({**missing, "extra.weight": src_sd["norm.weight"]}, strict=False)
    assert res.missing_keys == ["norm.weight"] and res.unexpected_keys == ["extra.weight"]
    assert torch.equal(full_tensor(m.output.weight), plain_sd["output.weight"])

    # DTensors (another sharded model's state_dict()), before the first forward.
    m = fresh()
    m.load_state_dict(src_sd)
    loaded_ok(m)

    # Plain full tensors: each rank keeps its own shard of them.
    m = fresh()
    m.load_state_dict(plain_sd)
    assert isinstance(m.tok_embeddings.weight, DTensor)
    loaded_ok(m)
    # A wrong full shape is torch's size-mismatch error, with the key.
    bad = {**plain_sd, "norm.weight": torch.ones(CFG.dim + 1)}
    with pytest.raises(RuntimeError, match=r"size mismatch for norm.weight"):
        fresh().load_state_dict(bad)
    # Full state dicts through torch's distributed state-dict API: gathered full on
    # save; on load either every rank passes the full values, or rank 0 alone does
    # and they are broadcast.
    full = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True))
    assert full.keys() == plain_sd.keys()
    assert all(torch.equal(full[k], v) for k, v in plain_sd.items())
    m = fresh()
    # (set_model_state_dict replaces the values of the dict it is given: pass a copy.)
    set_model_state_dict(m, dict(plain_sd), options=StateDictOptions(full_state_dict=True))
    loaded_ok(m)
    m = fresh()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(m, dict(plain_sd) if rank == 0 else {}, options=opts)
    loaded_ok(m)
    # A DTensor with other placements is redistributed by DTensor.copy_.
    m = fresh()
    replicated = {k: v.redistribute(mesh, (Replicate(),)) for k, v in src_sd.items()}
    m.load_state_dict(replicated)
    loaded_ok(m)

    # assign=True: the loaded DTensors become the parameters, and training uses them
    # (gathers read them, gradients land on them): the test compares two steps with
    # the single-process reference.
    for sd in (src_sd, plain_sd):
        m = fresh()
        m.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        new = m.layers[0].attn.wq.weight
        assert isinstance(new, torch.nn.Parameter) and isinstance(new, DTensor)
        state = m.layers[0]._traceable_hsdp_state
        assert state.param_group.fsdp_params[1].sharded_param is new
        # A parameter made from a plain full tensor keeps only its shard's storage
        # (distribute_tensor copies the shard out of the full tensor).
        local = m.tok_embeddings.weight.to_local()
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
        loaded_ok(m)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    out["assign_losses"], _ = _train(m, opt, _data(world, 2), rank, world)
    # assign=True refuses what cannot replace a parameter, before assigning anything:
    # one bad value, on the last module load_state_dict visits, leaves every
    # parameter as it was.
    m = fresh()
    before = list(m.parameters())
    bad_dtype = {**src_sd, "output.weight": src_sd["output.weight"].to(torch.bfloat16)}
    with pytest.raises(ValueError, match=r"'output.weight' has dtype torch.bfloat16"):
        m.load_state_dict(bad_dtype, assign=True)
    bad_placement = {**src_sd, "output.weight": replicated["output.weight"]}
    placements_msg = r"'output.weight' is a DTensor with placements \(Replicate\(\),\)"
    with pytest.raises(ValueError, match=placements_msg):
        m.load_state_dict(bad_placement, assign=True)
    assert all(p is q for p, q in zip(m.parameters(), before))
    # Loaded on a module inside a unit (no unit's module above it), a plain full
    # tensor is still sharded.
    m.layers[0].attn.wq.load_state_dict({"weight": plain_sd["layers.0.attn.wq.weight"]})
    wq = m.layers[0].attn.wq.weight
    assert isinstance(wq, DTensor)
    assert torch.equal(full_tensor(wq), plain_sd["layers.0.attn.wq.weight"])

    # Other layouts load the same way: parameters sharded on dim 1
    # (shard_placement_fn) and kept on the CPU (CPUOffloadPolicy), copied or assigned.
    for assign in (False, True):
        torch.manual_seed(1)
        m = shard_llama(
            Llama(CFG), th.fully_shard, mesh=mesh, offload_policy=th.CPUOffloadPolicy(),
            shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        )
        m.load_state_dict(plain_sd, assign=assign)
        assert m.layers[0].attn.wq.weight.placements == (Shard(1),)
        loaded_ok(m)

    # state_dict() and load_state_dict() while units hold gathered data.
    m = fresh()
    m.unshard()  # root unit: embedding, norm, output
    m.layers[0].unshard()
    assert not isinstance(m.layers[0].attn.wq.weight, DTensor)  # holds the placeholder
    sd = m.state_dict()
    assert list(sd) == out["keys"] and all(isinstance(v, DTensor) for v in sd.values())
    m.layers[1].unshard(async_op=True)  # an all-gather in flight, of the old values
    m.load_state_dict(src_sd)
    assert all(isinstance(p, DTensor) for p in m.parameters())
    assert _placeholder_bytes(m) == 0  # the stale gathered copies were freed
    m.reshard()  # a no-op now
    m.layers[0].reshard()
    loaded_ok(m)
    # Left gathered by a backward with reshard_after_backward=False: the load drops
    # the stale copy and the next forward gathers the loaded values.
    m = fresh()
    m.set_reshard_after_backward(False)
    x, y = _first_batch(rank, world)
    _loss(m(x), y).backward()
    assert _placeholder_bytes(m) > 0
    m.zero_grad()
    m.load_state_dict(plain_sd)
    assert _placeholder_bytes(m) == 0
    m.set_reshard_after_backward(True)
    loaded_ok(m)
    return out


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


N_SAVE, N_RESUME = 3, 3  # DCP test: steps before the checkpoint, steps after it


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


TIED_CFG = dataclasses.replace(CFG, tie_embeddings=True)


# ------------------------------------------------------------------- DCP round trip
DOC = Path(__file__).resolve().parent.parent / "docs" / "state_dict.md"
DOC_MARKER = "<!-- tested: tests/test_state_dict.py executes the next python block -->"


def _doc_example() -> dict[str, Any]:
    """Executes the DCP example of docs/state_dict.md (the python block after
    DOC_MARKER) and returns what it defines: the DCP tests save and load with it, so
    the documented code is the tested code."""
    text = DOC.read_text()
    if DOC_MARKER not in text:
        raise AssertionError(f"{DOC} lost its marker {DOC_MARKER!r}")
    block = text.split(DOC_MARKER, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def dcp_worker(
    rank: int, world: int, mesh_shape: tuple[int, ...], mode: str, path: str, tied: bool = False
) -> dict[str, Any]:
    """Trains N_SAVE steps, saves model + AdamW state with DCP, trains N_RESUME more;
    then a fresh model (other init seed) and optimizer (other lr) load the checkpoint
    and train the same N_RESUME steps; then they load it again, warm, and repeat.
    ``mode`` is "eager" or "compiled" (aot_eager, compiled autograd); ``tied`` uses
    the Llama with tied embedding and output head."""
    mesh = dp_mesh(mesh_shape)
    cfg = TIED_CFG if tied else CFG
    doc = _doc_example()
    save, load = doc["save_checkpoint"], doc["load_checkpoint"]
    batches = _data(world, N_SAVE + N_RESUME)
    compiled = mode == "compiled"

    def compile_(model: Llama) -> tuple[Any, GraphRecorder]:
        rec = GraphRecorder()
        if not compiled:
            return model, rec
        th.enable_compiled_autograd(backend=rec)
        return torch.compile(model, backend=rec, fullgraph=True), rec

    a = _sharded(cfg, 0, mesh)
    opt_a = torch.optim.AdamW(a.parameters(), lr=LR)
    fwd_a, rec_a = compile_(a)
    first, grad0 = _train(fwd_a, opt_a, batches[:N_SAVE], rank, world, a.tok_embeddings.weight)
    saved = full_state(a)
    save(a, opt_a, f"{path}/dsd")
    graphs_at_save = (len(rec_a.forward), len(rec_a.backward))
    continued, _ = _train(fwd_a, opt_a, batches[N_SAVE:], rank, world)
    graphs_a = (len(rec_a.forward), len(rec_a.backward))
    if compiled:
        # A fresh start, as a new process would have: no cached graphs.
        th.disable_compiled_autograd()
        torch._dynamo.reset()

    b = _sharded(cfg, 1, mesh)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR * 10)  # the checkpoint's lr wins
    load(b, opt_b, f"{path}/dsd")
    loaded = full_state(b)
    assert opt_b.param_groups[0]["lr"] == LR
    fwd_b, rec_b = compile_(b)
    resumed, _ = _train(fwd_b, opt_b, batches[N_SAVE:], rank, world)
    graphs_b = (len(rec_b.forward), len(rec_b.backward))
    # Load again into the warm (compiled, stepped) model and optimizer: the same
    # steps again, and no recompile.
    load(b, opt_b, f"{path}/dsd")
    again, _ = _train(fwd_b, opt_b, batches[N_SAVE:], rank, world)
    graphs_b_again = (len(rec_b.forward), len(rec_b.backward))
    if compiled:
        th.disable_compiled_autograd()
    if tied:
        assert b.output.weight is b.tok_embeddings.weight

    out = dict(
        first=first, continued=continued, resumed=resumed, again=again, grad0=grad0,
        saved=saved, loaded=loaded, params_a=full_state(a), graphs_at_save=graphs_at_save,
        graphs_a=graphs_a, graphs_b=graphs_b, graphs_b_again=graphs_b_again,
        fwd_counts=rec_b.forward, bwd_counts=rec_b.backward, bytes_after=_placeholder_bytes(b),
    )
    if mode == "eager" and len(mesh_shape) == 1:
        # The plain path of torch's FSDP2 docs: dcp.save/load of model.state_dict(),
        # then load_state_dict.
        dcp.save({"model": a.state_dict()}, checkpoint_id=f"{path}/plain")
        c = _sharded(CFG, 2, mesh)
        state = {"model": c.state_dict()}
        dcp.load(state, checkpoint_id=f"{path}/plain")
        c.load_state_dict(state["model"])
        out["plain_loaded"], out["plain_saved"] = full_state(c), full_state(a)
    return out


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


N_PARAMS = 2 + 9 * CFG.n_layers + 1  # embedding, norm, output + 9 per block


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


# ------------------------------------------------------------------- tied weights
TIED_STEPS = N_SAVE + N_RESUME  # the compiled DCP run doubles as tied parity


def tied_reference(world: int) -> dict[str, Any]:
    """Single-process tied Llama on the global batches, and the tied gradient of the
    first step computed two ways: tied, and as the sum of an untied twin's two."""
    torch.manual_seed(0)
    model = Llama(TIED_CFG)
    twin = Llama(CFG)  # untied, the same values
    twin.load_state_dict(model.state_dict())
    assert twin.output.weight is not twin.tok_embeddings.weight
    x, y = _data(world, 1)[0]
    _loss(twin(x), y).backward()
    twin_sum = twin.tok_embeddings.weight.grad + twin.output.weight.grad
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad0 = [], None
    for x, y in _data(world, TIED_STEPS):
        loss = _loss(model(x), y)
        loss.backward()
        if grad0 is None:
            grad0 = model.tok_embeddings.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(
        losses=losses, params={k: v.detach().clone() for k, v in model.state_dict().items()},
        grad0=grad0, twin_sum=twin_sum,
    )


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


def tied_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Runs :func:`tied_run` for both layouts, in one process group."""
    return {layout: tied_run(rank, world, layout) for layout in ("root", "list_unit")}


def tied_run(rank: int, world: int, layout: str) -> dict[str, Any]:
    """Tied Llama, eager: fully_shard per block then the root (``layout`` "root"), or
    with embedding and head as one list unit first ("list_unit")."""
    mesh = dp_mesh((world,))
    torch.manual_seed(0)
    model = Llama(TIED_CFG)
    init_sd = {k: v.clone() for k, v in model.state_dict().items()}
    if layout == "list_unit":
        th.fully_shard([model.tok_embeddings, model.output], mesh=mesh)
    shard_llama(model, th.fully_shard, mesh=mesh)
    owner = model.tok_embeddings if layout == "list_unit" else model
    unit = owner._traceable_hsdp_state
    tied = [
        fp for s in model._traceable_hsdp_state.states if s.param_group is not None
        for fp in s.param_group.fsdp_params if fp.sharded_param is model.tok_embeddings.weight
    ]
    # Managed once, by one unit, registered on both modules.
    assert len(tied) == 1 and len(tied[0].module_infos) == 2, tied
    assert tied[0] in unit.param_group.fsdp_params
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == N_PARAMS - 1  # listed once

    # Both keys in the state dict, the same sharded values; a full plain state dict
    # with both keys loads, and the weight stays tied.
    sd = model.state_dict()
    assert "output.weight" in sd and "tok_embeddings.weight" in sd
    local_ptr = sd["tok_embeddings.weight"].to_local().data_ptr()
    assert sd["output.weight"].to_local().data_ptr() == local_ptr
    model.load_state_dict(init_sd)
    assert model.output.weight is model.tok_embeddings.weight
    # assign=True: the two keys bring two tensors; the weight is tied again, to the
    # first key's, and the unit manages that one.
    model.load_state_dict(init_sd, assign=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert tied[0].sharded_param is model.tok_embeddings.weight
    assert len(list(model.parameters())) == N_PARAMS - 1

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _data(world, TIED_STEPS)
    losses, grad0 = _train(model, opt, batches, rank, world, model.tok_embeddings.weight)
    return dict(
        losses=losses, params=full_state(model), grad0=grad0, bytes_after=_placeholder_bytes(model)
    )


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
