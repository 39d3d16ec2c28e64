"""FSDP x TP (2-D): parallelize_module over world_mesh["tp"], then fully_shard over
world_mesh["dp"], on a (2, 2) gloo mesh (4 ranks); HSDP x TP (3-D): fully_shard over
the (dp_replicate, dp_shard) slice of a (2, 2, 2) mesh (8 ranks). See [Note: FSDP x
TP] in traceable_hsdp/_param.py.

The model is the project's Llama with torchtitan's tensor-parallel plan with sequence
parallelism (:func:`tp_plan`): attention q/k/v and the MLP's w1/w3 column-wise, wo and
w2 row-wise (outputs sharded on the sequence), the token embedding row-wise, the
output head column-wise with a replicated output, the RMSNorms sequence-parallel
(their weights replicated DTensors). The world mesh is ``(dp, tp)`` (rank = dp_index
* tp + tp_index); the ranks of one TP group see the same batch. The vocabulary (65)
is uneven over both TP and FSDP.

Checks and tolerances:
- ours against torch's fully_shard with the same TP plan: bitwise (losses, gradient
  norms of clip_grad_norm_, final parameters; fp32 and bf16 mixed precision): the
  same collectives on the same TP-local tensors in the same order;
- ours against a one-process model on the global batch: losses and norms rtol 1e-5,
  parameters atol 2e-5 after 3 AdamW steps (TP and the dp reduction sum in another
  order; AdamW amplifies the difference);
- compiled whole (compiled autograd) against eager: aot_eager bitwise (the same ops,
  run one by one; on the 3-D mesh); Inductor losses and norms rtol 1e-5, parameters
  atol 1e-5 (fused kernels; on the 2-D mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP, fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import traceable_hsdp as th
import traceable_hsdp.passes._graph as G
from _dist import full_tensor, run_ranks
from _workers import CFG, LR, GroupRecorder, _data, _loss, _managed, _placeholder_bytes, full_state
from traceable_hsdp._api import REDUCE_IN_GRAD_DTYPE
from traceable_hsdp.debug._recorder import current_compile
from traceable_hsdp.demo.models import Llama, LlamaConfig


def _assert_params(got: dict, want: dict, atol: float, msg: str) -> None:
    assert got.keys() == want.keys(), msg
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=atol, msg=f"{msg} {k}")


def _assert_equal_params(got: dict, want: dict, msg: str) -> None:
    assert got.keys() == want.keys(), msg
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{msg} {k}: max diff {(got[k] - v).abs().max().item()}"


TP_STEPS = 3


CLIP = 1.0  # below the gradient norms seen (about 1.1): clipping is active


def tp_plan(model: Llama) -> dict[str, Any]:
    """torchtitan's Llama plan with sequence parallelism. Every parameter becomes a
    DTensor on the TP mesh, so every sharded parameter lives on the (dp, tp) mesh,
    which torch's ``clip_grad_norm_`` needs (it cannot stack norms of two meshes)."""
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan[p + "attn_norm"] = SequenceParallel()
        plan[p + "attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan[p + "ffn_norm"] = SequenceParallel()
        plan[p + "ffn"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        for name in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3"):
            plan[p + name] = ColwiseParallel()
        for name in ("attn.wo", "ffn.w2"):
            plan[p + name] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def build_2d(
    world_mesh: DeviceMesh,
    fully_shard_fn: Any,
    dp_mesh: DeviceMesh | None = None,
    cfg: LlamaConfig = CFG,
    **kwargs: Any,
) -> Llama:
    """The torchtitan order: parallelize_module over world_mesh["tp"], then
    fully_shard each block and the root over ``dp_mesh`` (default world_mesh["dp"]; a
    2-D (replicate, shard) slice for HSDP x TP)."""
    torch.manual_seed(0)
    model = Llama(cfg)
    tp_mesh = world_mesh["tp"]
    dp_mesh = world_mesh["dp"] if dp_mesh is None else dp_mesh
    parallelize_module(model, tp_mesh, tp_plan(model))
    for layer in model.layers:
        layer.attn.n_heads //= tp_mesh.size()  # each TP rank computes its heads
    for layer in model.layers:
        fully_shard_fn(layer, mesh=dp_mesh, **kwargs)
    fully_shard_fn(model, mesh=dp_mesh, **kwargs)
    return model


def reference(steps: int, clip: float | None) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, the global batch of the dp ranks (2): losses, final parameters and
    the gradient norms before clipping."""
    torch.manual_seed(0)
    model = Llama(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for x, y in _data(2, steps):
        loss = _loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(
    model: nn.Module, fwd: Any, world_mesh: DeviceMesh, steps: int, clip: float | None = CLIP
) -> dict[str, Any]:
    """AdamW steps on this dp rank's slice of the global batch; the losses are
    averaged over the dp ranks (every TP rank of a group computes the same loss)."""
    dp = world_mesh["dp"].size()
    dp_rank = world_mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, bytes_after = [], [], []
    for x, y in _data(dp, steps):
        loss = _loss(fwd(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank])
        loss.backward()
        bytes_after.append(_placeholder_bytes(model) if isinstance(model, th.FSDPModule) else None)
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        if clip is not None:
            norms.append(full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)).item())
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t, group=world_mesh["dp"].get_group())
        losses.append(t.item() / dp)
    return dict(losses=losses, norms=norms, bytes_after=bytes_after, params=full_state(model))


def _refusal(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def tp_eager_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Eager FSDP x TP on a (2, 2) mesh, ours against torch's fully_shard: training
    with clipping, mixed precision, init layout, full and DCP state dicts across the
    two implementations, collective groups, refusals."""
    world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}

    ours = build_2d(world_mesh, th.fully_shard)
    out["init"] = full_state(ours)
    out["placements"] = {k: tuple(v.placements) for k, v in ours.state_dict().items()}
    out["meshes"] = {
        k: v.device_mesh.mesh_dim_names for k, v in ours.state_dict().items()
    }
    dp_group = world_mesh["dp"].get_group().group_name
    out["gather_groups_are_dp"] = all(
        fp.mesh_info.shard_group_name == dp_group for fp in _managed(ours)
    )
    # What the modules hold during forward: a DTensor on the TP mesh.
    seen: dict[str, Any] = {}
    wq = ours.layers[0].attn.wq

    def peek(module: nn.Module, args: Any) -> None:
        w = module.weight
        seen["type"] = type(w).__name__
        seen["mesh"] = w.device_mesh.mesh_dim_names
        seen["placements"] = tuple(w.placements)
        seen["local_shape"] = tuple(w.to_local().shape)

    handle = wq.register_forward_pre_hook(peek)
    out["ours"] = train(ours, ours, world_mesh, TP_STEPS)
    handle.remove()
    out["seen"] = seen
    ref_torch = build_2d(world_mesh, torch_fully_shard)
    out["torch"] = train(ref_torch, ref_torch, world_mesh, TP_STEPS)

    # Mixed precision (bf16 compute, fp32 reduction), two steps, both implementations.
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = build_2d(world_mesh, th.fully_shard, mp_policy=th.MixedPrecisionPolicy(**mp))
    out["mp_ours"] = train(m, m, world_mesh, 2, clip=None)
    m = build_2d(world_mesh, torch_fully_shard, mp_policy=TorchMP(**mp))
    out["mp_torch"] = train(m, m, world_mesh, 2, clip=None)

    # Parameters kept gathered from forward to backward.
    m = build_2d(world_mesh, th.fully_shard, reshard_after_forward=False)
    out["keep_ours"] = train(m, m, world_mesh, 2, clip=None)
    m = build_2d(world_mesh, torch_fully_shard, reshard_after_forward=False)
    out["keep_torch"] = train(m, m, world_mesh, 2, clip=None)

    # DCP: save ours, load into a fresh model of each implementation.
    dcp.save(ours.state_dict(), checkpoint_id=ckpt_dir)
    for name, fn in (("ours", th.fully_shard), ("torch", torch_fully_shard)):
        fresh = build_2d(world_mesh, fn)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=ckpt_dir)
        fresh.load_state_dict(sd)
        out[f"dcp_into_{name}"] = full_state(fresh)
    # A full (plain tensor) state dict, as from a one-process checkpoint.
    fresh = build_2d(world_mesh, th.fully_shard)
    fresh.load_state_dict(out["ours"]["params"])
    out["full_load"] = full_state(fresh)

    # shard_placement_fn returning torch's ShardPlacementResult: the second linear
    # sharded over another mesh (tp) than the unit's (dp), as experts are in torch's
    # expert-parallel recipes. Two SGD steps, each rank its own batch.
    out["placement_result"] = {}
    for name, fn in (("ours", th.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
        other = set(seq[2].parameters())
        tp_info = FSDPMeshInfo(mesh=world_mesh["tp"], shard_mesh_dim=0)

        def place(p: nn.Parameter) -> Any:
            return ShardPlacementResult(placement=Shard(0), mesh_info=tp_info) if p in other else None

        fn(seq, mesh=world_mesh["dp"], shard_placement_fn=place)
        opt = torch.optim.SGD(seq.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(2):
            loss = seq(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["placement_result"][name] = dict(
            losses=losses,
            params=full_state(seq),
            meshes={k: v.device_mesh.mesh_dim_names for k, v in seq.state_dict().items()},
        )

    # Refusals.
    def same_dim() -> None:  # TP and FSDP over the same mesh dim
        lin = nn.Linear(8, 8)
        parallelize_module(lin, world_mesh["dp"], ColwiseParallel())
        th.fully_shard(lin, mesh=world_mesh["dp"])

    def hsdp_tp() -> None:  # hsdp() keeping a TP parameter whole over dp
        lin = nn.Linear(8, 8)
        parallelize_module(lin, world_mesh["tp"], ColwiseParallel())
        th.hsdp(lin, mesh=world_mesh["dp"], replicate_params=[lin.weight])

    def partial() -> None:
        lin = nn.Linear(8, 8)
        lin.weight = nn.Parameter(DTensor.from_local(torch.zeros(8, 8), world_mesh["tp"], [Partial()]))
        th.fully_shard(lin, mesh=world_mesh["dp"])

    out["refusals"] = {
        "same_dim": _refusal(same_dim),
        "hsdp_tp": _refusal(hsdp_tp),
        "partial": _refusal(partial),
    }
    return out


@pytest.mark.slow
def test_fsdp_tp_eager(tmp_path) -> None:
    """Eager 2-D training against torch's fully_shard (bitwise) and a one-process
    model; placements and meshes; what the modules hold in forward; all-gathers over
    dp only; clip_grad_norm_; bf16 mixed precision; reshard_after_forward=False; state_dict, full-state-dict load
    and DCP save/load across the two implementations; a parameter sharded over
    another mesh by shard_placement_fn's ShardPlacementResult; refusals."""
    results = run_ranks(tp_eager_worker, 4, str(tmp_path / "ckpt"))
    ref_losses, ref_params, ref_norms = reference(TP_STEPS, CLIP)
    torch.manual_seed(0)
    init = {k: v.detach() for k, v in Llama(CFG).state_dict().items()}
    r0 = results[0]
    for rank, r in enumerate(results):
        msg = f"rank {rank}"
        # Layout: torch's, on the (dp, tp) mesh.
        assert set(r["meshes"].values()) == {("dp", "tp")}, r["meshes"]
        pl = {k: tuple(repr(p) for p in v) for k, v in r["placements"].items()}
        # TP shards dim 0 (colwise, embedding rowwise): FSDP shards each TP shard.
        assert pl["layers.0.attn.wq.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), pl
        assert pl["output.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), pl
        assert pl["tok_embeddings.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), pl
        assert pl["layers.0.attn.wo.weight"] == ("Shard(dim=0)", "Shard(dim=1)"), pl
        assert pl["norm.weight"] == ("Shard(dim=0)", "Replicate()"), pl
        assert r["gather_groups_are_dp"]
        # In forward the TP module holds a DTensor on the TP mesh, TP-local data.
        assert r["seen"] == {
            "type": "DTensor",
            "mesh": ("tp",),
            "placements": (torch.distributed.tensor.Shard(0),),
            "local_shape": (CFG.dim // 2, CFG.dim),
        }, r["seen"]
        # full_tensor() of the sharded init is the one-process model.
        _assert_equal_params(r["init"], init, f"{msg} init")
        # Bitwise equal to torch's fully_shard with the same plan.
        assert r["ours"]["losses"] == r["torch"]["losses"], msg
        assert r["ours"]["norms"] == r["torch"]["norms"], msg
        _assert_equal_params(r["ours"]["params"], r["torch"]["params"], f"{msg} vs torch")
        assert r["mp_ours"]["losses"] == r["mp_torch"]["losses"], msg
        _assert_equal_params(r["mp_ours"]["params"], r["mp_torch"]["params"], f"{msg} bf16 vs torch")
        assert r["keep_ours"]["losses"] == r["keep_torch"]["losses"], msg
        _assert_equal_params(r["keep_ours"]["params"], r["keep_torch"]["params"], f"{msg} raf=False")
        assert r["keep_ours"]["bytes_after"] == [0, 0], r["keep_ours"]["bytes_after"]
        # Against the one-process model (clipping active: norms above CLIP).
        torch.testing.assert_close(r["ours"]["losses"], ref_losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(r["ours"]["norms"], ref_norms, rtol=1e-5, atol=0)
        assert min(ref_norms) > CLIP, ref_norms
        _assert_params(r["ours"]["params"], ref_params, 2e-5, f"{msg} vs reference")
        assert r["ours"]["bytes_after"] == [0] * TP_STEPS, r["ours"]["bytes_after"]
        # Checkpoints in torch's format: ours saved, loaded by either implementation.
        _assert_equal_params(r["dcp_into_ours"], r0["ours"]["params"], f"{msg} DCP -> ours")
        _assert_equal_params(r["dcp_into_torch"], r0["ours"]["params"], f"{msg} DCP -> torch")
        _assert_equal_params(r["full_load"], r0["ours"]["params"], f"{msg} full state dict")
        # A parameter sharded over another mesh than its unit's (ShardPlacementResult).
        pr = r["placement_result"]
        assert pr["ours"]["meshes"] == {
            "0.weight": ("dp",), "0.bias": ("dp",), "2.weight": ("tp",), "2.bias": ("tp",)
        }, pr["ours"]["meshes"]
        assert pr["ours"]["meshes"] == pr["torch"]["meshes"]
        assert pr["ours"]["losses"] == pr["torch"]["losses"], msg
        _assert_equal_params(pr["ours"]["params"], pr["torch"]["params"], f"{msg} ShardPlacementResult")
        ref_msgs = r["refusals"]
        assert ref_msgs["same_dim"].startswith("ValueError") and "overlapping" in ref_msgs["same_dim"], ref_msgs
        assert "world_mesh['dp']" in ref_msgs["same_dim"], ref_msgs
        assert ref_msgs["hsdp_tp"].startswith("NotImplementedError") and "'weight'" in ref_msgs["hsdp_tp"], ref_msgs
        assert ref_msgs["partial"].startswith("ValueError") and "Partial" in ref_msgs["partial"], ref_msgs


# The compiled tests' model: one block (every block costs compile time, on 4 and 8
# ranks sharing 2 cores); the eager ones use CFG's two.
ONE_BLOCK_CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=1, n_heads=2, max_seq_len=16)


def _train_compiled(model: nn.Module, world_mesh: Any, rec: GroupRecorder, out: dict[str, Any],
                    key: str, **train_kwargs: Any) -> None:
    """Trains ``model`` compiled whole (compiled autograd, ``fullgraph=True``, backend
    ``rec``) into ``out[key]``, with ``rec``'s collectives per graph and dynamo's graph
    breaks."""
    torch._dynamo.reset()
    counters.clear()
    th.enable_compiled_autograd(backend=rec)
    try:
        compiled = torch.compile(model, backend=rec, fullgraph=True)
        out[key] = train(model, compiled, world_mesh, TP_STEPS, **train_kwargs)
    finally:
        th.disable_compiled_autograd()
    out["fwd"], out["bwd"] = rec.forward, rec.backward
    out["graph_breaks"] = sum(counters["graph_break"].values())


def tp_compiled_worker(rank: int, world: int) -> dict[str, Any]:
    """The FSDP x TP model with one block eager, then compiled whole (compiled autograd,
    ``torch.compile(model, fullgraph=True)``) with Inductor, the collectives of dynamo's
    graphs counted by group on the way in."""
    from torch._inductor.compile_fx import compile_fx

    world_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    model = build_2d(world_mesh, th.fully_shard, cfg=ONE_BLOCK_CFG)
    out["n_params"] = len(list(model.parameters()))
    out["eager"] = train(model, model, world_mesh, TP_STEPS)

    groups = {
        world_mesh["dp"].get_group().group_name: "dp",
        world_mesh["tp"].get_group().group_name: "tp",
    }
    model = build_2d(world_mesh, th.fully_shard, cfg=ONE_BLOCK_CFG)
    _train_compiled(model, world_mesh, GroupRecorder(groups, compile_fx), out, "inductor")

    # bf16 with an fp32 reduce_dtype: eager, then compiled whole with aot_eager.
    mp = th.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_2d(world_mesh, th.fully_shard, cfg=ONE_BLOCK_CFG, mp_policy=mp)
    out["bf16_eager"] = train(model, model, world_mesh, TP_STEPS, clip=None)
    model = build_2d(world_mesh, th.fully_shard, cfg=ONE_BLOCK_CFG, mp_policy=mp)
    rec, bf16 = GroupRecorder(groups), {}
    _train_compiled(model, world_mesh, rec, bf16, "run", clip=None)
    out["bf16_compiled"] = bf16["run"]
    out["bf16_all_reduce_dtypes"] = rec.all_reduce_dtypes
    return out


@pytest.mark.slow
def test_fsdp_tp_compiled() -> None:
    """The whole model (one block) compiled (compiled autograd, fullgraph=True) with
    Inductor, every pass on: within tolerance of eager, with the collectives counted
    per process group from dynamo's graphs (FSDP's over dp only, TP's over tp only,
    one forward and one backward graph, no graph break). Bitwise equality of the
    compiled graphs with eager (aot_eager) is checked on the 3-D mesh below, which
    composes the same FSDP x TP with a replicate dim (a second compile here would
    add time and no check)."""
    results = run_ranks(tp_compiled_worker, 4)
    for rank, r in enumerate(results):
        n = r["n_params"]
        eager = r["eager"]
        assert r["graph_breaks"] == 0
        assert len(r["fwd"]) == 1 and len(r["bwd"]) == 1, (r["fwd"], r["bwd"])
        # Forward (dynamo's graph; TP's collectives are inside DTensor ops there): one
        # all-gather over dp per parameter.
        assert r["fwd"][0] == {"all_gather_into_tensor@dp": n, "fsdp.copy_": n}, r["fwd"]
        # Backward (compiled autograd's graph, TP's collectives explicit): FSDP's
        # re-gathers over dp (the block's: the root, 3 parameters, stays gathered,
        # the default reshard_after_forward) and reduce-scatters over dp; sequence
        # parallelism's over tp (one
        # block: 3 sequence all-gathers and their reduce-scatters, the 3 RMSNorm
        # weight gradients, the block's two and the final one, all-reduced from
        # Partial).
        assert r["bwd"][0] == {
            "all_gather_into_tensor@dp": n - 3,
            "reduce_scatter_tensor@dp": n,
            "all_gather_into_tensor@tp": 3,
            "reduce_scatter_tensor@tp": 3,
            "all_reduce@tp": 3,
            "fsdp.copy_": n - 3,
        }, r["bwd"]
        ind = r["inductor"]
        torch.testing.assert_close(ind["losses"], eager["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(ind["norms"], eager["norms"], rtol=1e-5, atol=0)
        _assert_params(ind["params"], eager["params"], 1e-5, f"rank {rank} inductor")
        assert ind["bytes_after"] == [0] * TP_STEPS
        # bf16, fp32 reduce_dtype, aot_eager: bitwise equal to eager (which
        # test_fsdp_tp_eager checks bitwise against torch's fully_shard). The 3 RMSNorm
        # gradients' TP all-reduces run in reduce_dtype where the installed torch's
        # fully_shard runs them so (2.15), in param_dtype before.
        assert r["bf16_compiled"]["losses"] == r["bf16_eager"]["losses"]
        _assert_params(r["bf16_compiled"]["params"], r["bf16_eager"]["params"], 0, f"rank {rank} bf16")
        tp_dtype = torch.float32 if REDUCE_IN_GRAD_DTYPE else torch.bfloat16
        assert r["bf16_all_reduce_dtypes"] == [tp_dtype] * 3, r["bf16_all_reduce_dtypes"]


# A clipping threshold below the gradient norms of ONE_BLOCK_CFG's model (about 0.8
# on this data).
HSDP_TP_CLIP = 0.5


def hsdp_tp_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """HSDP x TP on a (2, 2, 2) mesh (dp_replicate, dp_shard, tp), torchtitan's order
    with fully_shard over the 2-D (dp_replicate, dp_shard) slice: ours eager against
    torch's fully_shard eager (training with clipping, layouts), then ours compiled
    whole (compiled autograd, fullgraph=True) with aot_eager, its collectives counted
    per process group; a DCP checkpoint of ours loaded into torch's.
    ``world_mesh["dp"]`` (the two dp dims flattened, as torchtitan does) is what
    ``train`` splits the batch and averages the losses over."""
    world_mesh = init_device_mesh(
        "cpu", (2, 2, world // 4), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    world_mesh["dp_replicate", "dp_shard"]._flatten("dp")
    dp = world_mesh["dp_replicate", "dp_shard"]
    out: dict[str, Any] = {}
    for name, fn in (("torch", torch_fully_shard), ("ours", th.fully_shard)):
        model = build_2d(world_mesh, fn, dp_mesh=dp, cfg=ONE_BLOCK_CFG)
        out[f"{name}_placements"] = {k: tuple(v.placements) for k, v in model.state_dict().items()}
        out[name] = train(model, model, world_mesh, TP_STEPS, clip=HSDP_TP_CLIP)
    out["n_params"] = len(list(model.parameters()))
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)  # ours, trained
    fresh = build_2d(world_mesh, torch_fully_shard, dp_mesh=dp, cfg=ONE_BLOCK_CFG)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(sd)
    out["dcp_into_torch"] = full_state(fresh)

    groups = {world_mesh[d].get_group().group_name: d for d in ("dp_replicate", "dp_shard", "tp")}
    model = build_2d(world_mesh, th.fully_shard, dp_mesh=dp, cfg=ONE_BLOCK_CFG)
    _train_compiled(model, world_mesh, GroupRecorder(groups), out, "aot_eager", clip=HSDP_TP_CLIP)
    return out


@pytest.mark.slow
def test_hsdp_tp_3d(tmp_path) -> None:
    """HSDP x TP on 8 ranks, a 1-block Llama. Eager: bitwise equal to torch's
    fully_shard (losses, clip_grad_norm_ norms, final parameters), torch's placements,
    and our DCP checkpoint loads into torch's model. Compiled whole with aot_eager:
    bitwise equal to eager, one forward and one backward graph, no graph break,
    FSDP's collectives over dp_shard, the replicas' all-reduce over dp_replicate and
    TP's over tp, counted from the graphs. Inductor is not run here (8 ranks
    compiling on 2 cores): the 2-D test above runs FSDP x TP under Inductor, and
    HSDP runs under Inductor in test_inductor_features.py."""
    results = run_ranks(hsdp_tp_worker, 8, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        ours, ref = r["ours"], r["torch"]
        assert ours["losses"] == ref["losses"], (rank, ours["losses"], ref["losses"])
        assert ours["norms"] == ref["norms"], (rank, ours["norms"], ref["norms"])
        assert all(n > HSDP_TP_CLIP for n in ours["norms"]), ours["norms"]  # clipping acts
        _assert_equal_params(ours["params"], ref["params"], f"rank {rank} eager vs torch")
        assert r["ours_placements"] == r["torch_placements"], rank
        # Our DCP checkpoint, loaded into torch's fully_shard model.
        _assert_equal_params(r["dcp_into_torch"], ours["params"], f"rank {rank} DCP into torch")
        assert ours["bytes_after"] == [0] * TP_STEPS
        aot = r["aot_eager"]
        assert aot["losses"] == ours["losses"] and aot["norms"] == ours["norms"], rank
        _assert_equal_params(aot["params"], ours["params"], f"rank {rank} aot_eager")
        assert aot["bytes_after"] == [0] * TP_STEPS
        assert r["graph_breaks"] == 0
        assert len(r["fwd"]) == 1 and len(r["bwd"]) == 1, (r["fwd"], r["bwd"])
        n = r["n_params"]
        assert r["fwd"][0] == {"all_gather_into_tensor@dp_shard": n, "fsdp.copy_": n}, r["fwd"]
        assert r["bwd"][0] == {  # the block re-gathers; the root stays gathered
            "all_gather_into_tensor@dp_shard": n - 3,
            "reduce_scatter_tensor@dp_shard": n,
            "all_reduce@dp_replicate": n,
            # One block: its two RMSNorms and the final one (sequence parallelism).
            "all_gather_into_tensor@tp": 3,
            "reduce_scatter_tensor@tp": 3,
            "all_reduce@tp": 3,
            "fsdp.copy_": n - 3,
        }, r["bwd"]
    pl = results[0]["ours_placements"]
    assert str(pl["layers.0.attn.wq.weight"]) == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))", pl
    assert str(pl["layers.0.attn.wo.weight"]) == "(Replicate(), Shard(dim=0), Shard(dim=1))", pl
