"""``fully_shard(mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(...))``, torch's
SPMD-mesh form: every parameter is already a ``DTensor`` on the full mesh,
``Replicate()`` on the data-parallel dims, and the model computes with DTensors on
that mesh. See [Note: The SPMD-mesh form] in traceable_hsdp/_param.py.

The model: blocks of two linears, tensor-parallel over a ``tp`` dim where the mesh has
one (column-wise then row-wise, laid out by ``distribute_module``), and a replicated
head of 5 rows (uneven over every data-parallel size here). Inputs are DTensors
replicated on every dim (each data-parallel rank its own batch, the ranks of a TP
group the same one), as in torch's tests of this form.

Checks and tolerances:
- the refusals, against torch's ``fully_shard`` on the same inputs: the same exception
  type, torch's message matching ours (one process);
- eager, every layout (FSDP, DDP, HSDP, two flattened shard or replicate dims, FSDP x
  TP, HSDP x TP): torch's placements and meshes; a global batch sharded over the
  data-parallel dims against a one-process model, losses rtol 1e-5, parameters atol
  1e-5 after 3 AdamW steps (the reductions sum in another order); against torch's
  ``fully_shard`` bitwise on torch's input idiom where the gradients stay
  ``Replicate()`` on the data-parallel dims (the same collectives on the same local
  tensors); with TP, torch's gradients are ours divided by the data-parallel size
  (see [Note: The SPMD-mesh form] in traceable_hsdp/_param.py), checked rtol 1e-5;
- compiled whole (compiled autograd, ``fullgraph=True``), HSDP under aot_eager:
  bitwise equal to our eager run, one forward and one backward graph, no graph break,
  the collectives counted per mesh dim from dynamo's graphs; FSDP x TP in this form,
  compiled, refused;
- under Inductor, on a (2, 1) (dp, tp) mesh: losses rtol 1e-5, parameters atol 1e-5
  against eager (fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import GroupRecorder

DIM, HEAD, STEPS, LR = 8, 5, 3, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM)
        self.out_proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``distribute_module``'s partition function: Replicate() on every dim but
    ``tp``, where the blocks' linears are column-wise (``in_proj``) then row-wise
    (``out_proj``)."""
    names = mesh.mesh_dim_names
    assert names is not None
    for pname, p in list(module.named_parameters(recurse=False)):
        tp: Any = Replicate()
        if "in_proj" in name:
            tp = Shard(0)
        elif "out_proj" in name and pname == "weight":
            tp = Shard(1)
        placements = [tp if n == "tp" else Replicate() for n in names]
        module.register_parameter(
            pname, nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        )


def build(
    mesh: DeviceMesh, dims: DataParallelMeshDims, fully_shard_fn: Callable[..., Any], **kwargs: Any
) -> Net:
    """The model distributed over ``mesh``, then ``fully_shard`` on each block and the
    root with ``dp_mesh_dims=dims``."""
    torch.manual_seed(0)
    model = Net()
    distribute_module(model, mesh, _partition)
    for block in model.blocks:
        fully_shard_fn(block, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    fully_shard_fn(model, mesh=mesh, dp_mesh_dims=dims, **kwargs)
    return model


def _dp_index(mesh: DeviceMesh, dims: DataParallelMeshDims) -> int:
    """This rank's index among the data-parallel ranks (its batch's seed)."""
    names = mesh.mesh_dim_names
    assert names is not None
    coord = mesh.get_coordinate()
    assert coord is not None
    index = 0
    for i, n in enumerate(names):
        if n in _dp_names(dims):
            index = index * mesh.size(i) + coord[i]
    return index


def _batches(mesh: DeviceMesh, dims: DataParallelMeshDims, idiom: str) -> list[torch.Tensor]:
    """The inputs of ``STEPS`` steps on this rank, as DTensors on ``mesh``.

    ``"global"``: a global batch of 8 rows, ``Shard(0)`` over the data-parallel dims
    (the reference trains on it whole). ``"per_rank"`` (torch's tests): each
    data-parallel rank its own batch of 4 rows, labelled ``Replicate()`` on every dim.
    """
    dp = [mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names or ()) if n in _dp_names(dims)]
    if idiom == "per_rank":
        g = torch.Generator().manual_seed(_dp_index(mesh, dims) + 1)
        return [
            DTensor.from_local(torch.randn(4, DIM, generator=g), mesh, [Replicate()] * mesh.ndim)
            for _ in range(STEPS)
        ]
    placements = [Shard(0) if n in _dp_names(dims) else Replicate() for n in mesh.mesh_dim_names or ()]
    n_dp = 1
    for size in dp:
        n_dp *= size
    return [
        DTensor.from_local(x.chunk(n_dp)[_dp_index(mesh, dims)], mesh, placements)
        for x in global_batches()
    ]


def global_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, DIM, generator=g) for _ in range(STEPS)]


def _dp_names(dims: DataParallelMeshDims) -> tuple[str, ...]:
    return (*dims.shard_names, *dims.replicate_names)


def train(model: nn.Module, fwd: Any, batches: list[torch.Tensor]) -> dict[str, Any]:
    """AdamW steps on ``batches``, the mean square of the outputs as the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x in batches:
        loss = fwd(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(full_tensor(loss).item())
    return dict(losses=losses, params={k: full_tensor(v) for k, v in model.state_dict().items()})


def reference() -> dict[str, Any]:
    """One process on the global batches."""
    torch.manual_seed(0)
    model = Net()
    return train(model, model, global_batches())


def _layout(model: nn.Module) -> dict[str, Any]:
    return {
        k: (str(tuple(v.placements)), v.device_mesh.mesh_dim_names, v.device_mesh.mesh.tolist())
        for k, v in model.named_parameters()
    }


# (mesh shape, dim names, dp_mesh_dims, fully_shard kwargs), on 4 ranks.
CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], DataParallelMeshDims, dict[str, Any]]] = {
    "fsdp": ((4,), ("dp",), DataParallelMeshDims(shard="dp"), {}),
    "ddp": ((4,), ("dp",), DataParallelMeshDims(replicate="dp"), {}),
    "hsdp": ((2, 2), ("rep", "shard"), DataParallelMeshDims(shard="shard", replicate="rep"), {}),
    "two_shard_dims": ((2, 2), ("dp0", "dp1"), DataParallelMeshDims(shard=("dp0", "dp1")), {}),
    "two_replicate_dims": (
        (1, 2, 2),
        ("r0", "r1", "shard"),
        DataParallelMeshDims(shard="shard", replicate=("r0", "r1")),
        {},
    ),
    "fsdp_tp": ((2, 2), ("dp", "tp"), DataParallelMeshDims(shard="dp"), {}),
    "fsdp_tp_keep": (
        (2, 2), ("dp", "tp"), DataParallelMeshDims(shard="dp"), {"reshard_after_forward": False}
    ),
    "hsdp_tp": (
        (1, 2, 2),
        ("rep", "shard", "tp"),
        DataParallelMeshDims(shard="shard", replicate="rep"),
        {},
    ),
}
# Cases whose gradients stay Replicate() on the data-parallel dims with torch's input
# idiom: there torch's fully_shard is the bitwise reference. See [Note: The SPMD-mesh
# form] for the others.
TORCH_PARITY = ("fsdp", "ddp", "hsdp", "two_shard_dims", "two_replicate_dims")


def eager_worker(rank: int, world: int) -> dict[str, Any]:
    """Every case of CASES eagerly: ours and torch's layouts; ours on the global batch
    (against the reference); ours and torch's on torch's idiom (TORCH_PARITY); for
    the TP cases, one backward of each on the global batch (the gradients)."""
    out: dict[str, Any] = {}
    # One mesh object per shape and names: DTensor's sharding cache hands a new equal
    # mesh's DTensors the first one, which fully_shard refuses (another mesh object).
    meshes: dict[tuple[Any, ...], DeviceMesh] = {}
    for case, (shape, names, dims, kwargs) in CASES.items():
        if (shape, names) not in meshes:
            meshes[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        mesh = meshes[shape, names]
        res: dict[str, Any] = {}
        for impl, fn in (("ours", th.fully_shard), ("torch", torch_fully_shard)):
            model = build(mesh, dims, fn, **kwargs)
            res[f"{impl}_layout"] = _layout(model)
            res[f"{impl}_on_mesh"] = all(p.device_mesh is mesh for p in model.parameters())
            if case in TORCH_PARITY:
                res[impl] = train(model, model, _batches(mesh, dims, "per_rank"))
            else:
                model(_batches(mesh, dims, "global")[0]).pow(2).mean().backward()
                res[f"{impl}_grads"] = {k: full_tensor(p.grad) for k, p in model.named_parameters()}
        model = build(mesh, dims, th.fully_shard, **kwargs)
        res["global"] = train(model, model, _batches(mesh, dims, "global"))
        res["dp_size"] = 2 if case in ("fsdp_tp", "fsdp_tp_keep", "hsdp_tp") else 4
        out[case] = res
    return out


def test_eager() -> None:
    """Eager training with dp_mesh_dims, every case of CASES: torch's placements and
    meshes; within tolerance of a one-process model on the global batch; bitwise
    equal to torch's fully_shard on torch's input idiom where it applies (TORCH_PARITY).
    With TP, torch's gradients are ours divided by the data-parallel size (see [Note:
    The SPMD-mesh form]); pinned here so that the docs' statement stays true."""
    results = run_ranks(eager_worker, 4)
    ref = reference()
    for rank, r in enumerate(results):
        for case, res in r.items():
            msg = f"rank {rank} {case}"
            assert res["ours_layout"] == res["torch_layout"], (msg, res["ours_layout"])
            # One shard dim: the sharded parameters stay on the mesh object passed.
            assert res["ours_on_mesh"] == res["torch_on_mesh"] == (case != "two_shard_dims"), msg
            # Against the one-process model: the reductions sum in another order, and
            # AdamW's first steps amplify it; seen: 3e-7 on parameters.
            torch.testing.assert_close(res["global"]["losses"], ref["losses"], rtol=1e-5, atol=0)
            for k, v in ref["params"].items():
                torch.testing.assert_close(res["global"]["params"][k], v, rtol=0, atol=1e-5, msg=f"{msg} {k}")
            if case in TORCH_PARITY:
                assert res["ours"]["losses"] == res["torch"]["losses"], msg
                for k, v in res["torch"]["params"].items():
                    got = res["ours"]["params"][k]
                    assert torch.equal(got, v), f"{msg} {k}: max diff {(got - v).abs().max()}"
            else:
                for k, v in res["ours_grads"].items():
                    torch.testing.assert_close(
                        res["torch_grads"][k] * res["dp_size"], v, rtol=1e-5, atol=1e-7, msg=f"{msg} {k}"
                    )
    pl = {k: v[0] for k, v in results[0]["fsdp_tp"]["ours_layout"].items()}
    # dp left of tp, both sharding dim 0: FSDP's shard is strided, as torch's.
    assert pl["blocks.0.in_proj.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", pl
    assert pl["blocks.0.out_proj.weight"] == "(Shard(dim=0), Shard(dim=1))", pl
    assert pl["head.weight"] == "(Shard(dim=0), Replicate())", pl
    assert results[0]["ddp"]["ours_layout"]["head.weight"][0] == "(Replicate(),)"
    two = results[0]["two_shard_dims"]["ours_layout"]["head.weight"]
    assert two[:2] == ("(Shard(dim=0),)", ("dp0_dp1",)), two


def _dims_of(mesh: DeviceMesh) -> dict[str, str]:
    names = mesh.mesh_dim_names
    assert names is not None
    return {mesh[n].get_group().group_name: n for n in names}


def _compiled_run(
    mesh: DeviceMesh, dims: DataParallelMeshDims, backend: Callable[..., Any]
) -> dict[str, Any]:
    """Our model compiled whole with compiled autograd, ``backend`` under a
    GroupRecorder counting each graph's collectives per mesh dim."""
    rec = GroupRecorder(_dims_of(mesh), backend)
    model = build(mesh, dims, th.fully_shard)
    torch._dynamo.reset()
    counters.clear()
    th.enable_compiled_autograd(backend=rec)
    try:
        compiled = torch.compile(model, backend=rec, fullgraph=True)
        out = train(model, compiled, _batches(mesh, dims, "global"))
    finally:
        th.disable_compiled_autograd()
    out.update(
        fwd=rec.forward,
        bwd=rec.backward,
        graph_breaks=sum(counters["graph_break"].values()),
        n_params=len(list(model.parameters())),
    )
    return out


def aot_eager_worker(rank: int, world: int) -> dict[str, Any]:
    """HSDP on a (2, 2) (rep, shard) mesh: ours eager, then compiled with aot_eager;
    FSDP x TP in this form, compiled: refused."""
    from torch._dynamo.backends.debugging import aot_eager

    shape, names, dims, _ = CASES["hsdp"]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build(mesh, dims, th.fully_shard)
    eager = train(model, model, _batches(mesh, dims, "global"))
    out = dict(eager=eager, aot=_compiled_run(mesh, dims, aot_eager))
    shape, names, dims, _ = CASES["fsdp_tp"]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build(mesh, dims, th.fully_shard)
    torch._dynamo.reset()
    th.enable_compiled_autograd(backend="aot_eager")
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(_batches(mesh, dims, "global")[0])
    except Exception as e:  # noqa: BLE001 - checked by the test
        out["tp_refusal"] = f"{type(e).__name__}: {e}"
    finally:
        th.disable_compiled_autograd()
    return out


@pytest.mark.slow
def test_compiled_aot_eager() -> None:
    """HSDP with dp_mesh_dims compiled whole under aot_eager: bitwise equal to eager,
    one forward and one backward graph, no graph break; the collectives counted per
    mesh dim from the graphs. FSDP x TP in this form, compiled, is refused (see
    [Note: The SPMD-mesh form])."""
    results = run_ranks(aot_eager_worker, 4)
    for rank, r in enumerate(results):
        eager, aot = r["eager"], r["aot"]
        assert aot["losses"] == eager["losses"], rank
        for k, v in eager["params"].items():
            assert torch.equal(aot["params"][k], v), (rank, k)
        assert aot["graph_breaks"] == 0
        assert len(aot["fwd"]) == 1 and len(aot["bwd"]) == 1, (aot["fwd"], aot["bwd"])
        n = aot["n_params"]
        # Forward: one all-gather over the shard dim per parameter.
        assert aot["fwd"][0] == {"all_gather_into_tensor@shard": n, "fsdp.copy_": n}, aot["fwd"]
        # Backward: the blocks re-gather (the root, the head's 2, stays gathered);
        # every gradient is reduce-scattered over the shard dim and all-reduced over
        # the replicas; the batch is sharded over both dims, so each gradient reaches
        # its placeholder Partial over both and is all-reduced over each first.
        assert aot["bwd"][0] == {
            "all_gather_into_tensor@shard": n - 2,
            "fsdp.copy_": n - 2,
            "all_reduce@shard": n,
            "all_reduce@rep": 2 * n,
            "reduce_scatter_tensor@shard": n,
        }, aot["bwd"]
        assert "SPMD-mesh form" in r["tp_refusal"] and "world_mesh['tp']" in r["tp_refusal"], r


def inductor_worker(rank: int, world: int) -> dict[str, Any]:
    """FSDP over dp of a (2, 1) (dp, tp) mesh (DTensors on a 2-D mesh, TP of one
    rank): ours eager, then compiled with Inductor."""
    from torch._inductor.compile_fx import compile_fx

    dims = DataParallelMeshDims(shard="dp")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    model = build(mesh, dims, th.fully_shard)
    eager = train(model, model, _batches(mesh, dims, "global"))
    return dict(eager=eager, inductor=_compiled_run(mesh, dims, compile_fx))


@pytest.mark.slow
def test_compiled_inductor() -> None:
    """dp_mesh_dims compiled whole under Inductor, every pass on: within tolerance of
    eager, one forward and one backward graph, the collectives counted."""
    results = run_ranks(inductor_worker, 2)
    for rank, r in enumerate(results):
        eager, ind = r["eager"], r["inductor"]
        torch.testing.assert_close(ind["losses"], eager["losses"], rtol=1e-5, atol=0)
        for k, v in eager["params"].items():
            torch.testing.assert_close(ind["params"][k], v, rtol=0, atol=1e-5, msg=f"{rank} {k}")
        assert ind["graph_breaks"] == 0
        assert len(ind["fwd"]) == 1 and len(ind["bwd"]) == 1, (ind["fwd"], ind["bwd"])
        n = ind["n_params"]
        assert ind["fwd"][0] == {"all_gather_into_tensor@dp": n, "fsdp.copy_": n}, ind["fwd"]
        # The batch is sharded over dp: each gradient reaches its placeholder Partial
        # over dp and is all-reduced before the reduce-scatter.
        assert ind["bwd"][0] == {
            "all_gather_into_tensor@dp": n - 2,
            "all_reduce@dp": n,
            "reduce_scatter_tensor@dp": n,
            "fsdp.copy_": n - 2,
        }, ind["bwd"]


def _raised(fn: Callable[[], Any]) -> tuple[type[BaseException], str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


def test_refusals_match_torch(one_rank: DeviceMesh) -> None:
    """What torch's fully_shard refuses with dp_mesh_dims, ours refuses with the same
    exception type, and torch's message (its first words, as a regex) matches ours.
    Ours refuses more (checked alone): a dim named twice, a Partial placement on a
    non-data-parallel dim, a ShardPlacementResult, a dp_mesh_dims of another type."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    # Named apart: DTensor's sharding cache may hand back an equal mesh object.
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    shard = DataParallelMeshDims(shard="dp")

    def dist_linear(m: DeviceMesh, placements: list[Any]) -> nn.Linear:
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), m, placements))
        lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), m, [Replicate()] * m.ndim))
        return lin

    cases: dict[str, Callable[[Callable[..., Any]], Any]] = {
        "name not in mesh": lambda f: f(
            dist_linear(mesh, [Replicate()]), mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="nonexistent"),
        ),
        "mesh without names": lambda f: f(
            nn.Linear(4, 4), mesh=one_rank, dp_mesh_dims=shard
        ),
        "plain parameter": lambda f: f(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=shard),
        "another mesh": lambda f: f(dist_linear(other, [Replicate()]), mesh=mesh, dp_mesh_dims=shard),
        "Shard on a dp dim": lambda f: f(dist_linear(mesh, [Shard(0)]), mesh=mesh, dp_mesh_dims=shard),
        "int reshard_after_forward": lambda f: f(
            dist_linear(mesh, [Replicate()]), mesh=mesh, dp_mesh_dims=shard,
            reshard_after_forward=2,
        ),
    }
    for name, case in cases.items():
        theirs = _raised(lambda: case(torch_fully_shard))
        ours = _raised(lambda: case(th.fully_shard))
        assert theirs is not None and ours is not None, (name, theirs, ours)
        assert ours[0] is theirs[0], (name, ours, theirs)
        first_words = theirs[1].split(":")[0].split(". ")[0][:40]
        assert first_words and first_words in ours[1], (name, ours[1], theirs[1])
    # DataParallelMeshDims itself refuses neither set.
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()

    with pytest.raises(ValueError, match="more than once"):
        th.fully_shard(
            dist_linear(mesh2d, [Replicate(), Replicate()]), mesh=mesh2d,
            dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="dp"),
        )
    partial = nn.Linear(4, 4)
    partial.weight = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh2d, [Replicate(), Partial()]))
    partial.bias = nn.Parameter(distribute_tensor(partial.bias.detach(), mesh2d, [Replicate(), Replicate()]))
    with pytest.raises(ValueError, match=r"Partial.* on mesh dim 'tp'"):
        th.fully_shard(partial, mesh=mesh2d, dp_mesh_dims=shard)
    with pytest.raises(TypeError, match="DataParallelMeshDims"):
        th.fully_shard(dist_linear(mesh, [Replicate()]), mesh=mesh, dp_mesh_dims="dp")
    # None, what wrappers pass along, is the submesh form.
    th.fully_shard(nn.Linear(4, 4), mesh=one_rank, dp_mesh_dims=None)
    dist.barrier()
