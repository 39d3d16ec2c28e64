"""torch FSDP2's all-gather extensions (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the local shard): [Note: All-gather extensions] in
traceable_hsdp/_extension.py.

The extension here is ``_Bf16Gather``, a wrapper subclass whose weights all-gather in
bfloat16 and are cast back to the parameter dtype after the gather (the shape of
torchao's float8 all-gather, with a cast instead of a scaled quantization). On 2 gloo
ranks, 3 training steps of a small MLP whose weights are ``_Bf16Gather`` (biases
plain):

- eager against torch's ``fully_shard``: losses and local shards bitwise equal (both
  cast, gather and reduce the same way);
- compiled (compiled autograd, ``fullgraph=True``, aot_eager) against the eager run:
  bitwise; the dynamo graphs hold the hooks' casts next to the all-gathers (counted);
- a post-all-gather hook returning a subclass: eager bitwise equal to torch's
  (the ``out=`` refill from the second step on); a compiled step refuses it;
- Inductor (slow): within tolerance of eager, the all-gathers and the placeholder
  copies counted in the final post-grad graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from _dist import run_ranks

STEPS = 3
DIM = 8


class _Bf16Gather(torch.Tensor):
    """A weight gathered in bfloat16 and cast back after the gather. With
    ``subclass_result``, the post-all-gather hook returns a ``_Bf16Gather``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, subclass_result: bool = False) -> Any:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, subclass_result: bool = False) -> None:
        self._data = data
        self._subclass_result = subclass_result

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        rows = -(-outer_size[0] // mesh.size())  # the padded shard's rows
        data = self._data.to(torch.bfloat16)
        if data.size(0) != rows:
            data = torch.cat([data, data.new_zeros((rows - data.size(0), *data.shape[1:]))])
        return (data,), None

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
        *, out: torch.Tensor | None = None,
    ) -> Any:
        (gathered,) = outputs
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])
            return None
        up = gathered.to(param_dtype)
        if self._subclass_result:
            return _Bf16Gather(up, True), (gathered, up)
        return up, (gathered, up)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flags = [t._subclass_result for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)]
        unwrap = lambda t: t._data  # noqa: E731
        out = func(*pytree.tree_map_only(cls, unwrap, args), **pytree.tree_map_only(cls, unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, flags[0]), out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], self._subclass_result

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], flag: Any, size: Any, stride: Any) -> Any:
        return _Bf16Gather(inner["_data"], flag)

    def __repr__(self) -> str:
        return f"_Bf16Gather({self._data})"


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    while isinstance(t, _Bf16Gather):
        t = t._data
    return t.clone()


def _model(subclass_result: bool) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(2)]
    model = nn.Sequential(*blocks, nn.Linear(DIM, 3))  # the head: 3 rows, uneven shards
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(_Bf16Gather(m.weight.detach().clone(), subclass_result))
    return model


def _shard(model: nn.Module, fully_shard: Any, mesh: Any) -> nn.Module:
    for block in list(model)[:2]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class _Recorder:
    """aot_eager, recording per dynamo graph: the all-gathers and the hooks' casts
    (``.to(bfloat16)`` before a gather, ``.to(float32)`` after one)."""

    def __init__(self) -> None:
        self.graphs: list[dict[str, int]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        counts = {"all_gather": 0, "to_bf16": 0, "to_fp32": 0}
        for n in gm.graph.nodes:
            if "all_gather_into_tensor" in str(n.target):
                counts["all_gather"] += 1
            if n.op == "call_method" and n.target == "to":
                counts["to_bf16"] += torch.bfloat16 in n.args
                counts["to_fp32"] += torch.float32 in n.args
        self.graphs.append(counts)
        return aot_eager(gm, example_inputs)


def _train(model: nn.Module, rank: int, fwd: Any = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, DIM, generator=g)
        loss = (fwd or model)(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_plain(loss).item())
    shards = {k: _plain(v.to_local()) for k, v in model.state_dict().items()}
    return losses, shards


def extension_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Trains ``_model`` with ours in ``mode`` ("eager", "aot_eager", "inductor",
    "subclass": the post-all-gather hook returning a subclass) and with torch's
    fully_shard (eager), returning both and the graphs' counts."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import traceable_hsdp as th
    from traceable_hsdp.debug._recorder import PostGradRecorder
    from traceable_hsdp.debug._table import graph_counts

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    subclass = mode == "subclass"
    ref_losses, ref_shards = _train(_shard(_model(subclass), torch_fsdp.fully_shard, mesh), rank)
    ours = _shard(_model(subclass), th.fully_shard, mesh)
    out: dict[str, Any] = dict(ref_losses=ref_losses, ref_shards=ref_shards)
    if mode in ("eager", "subclass"):
        out["losses"], out["shards"] = _train(ours, rank)
        eager_ext = [fp.extension for fp in _fsdp_params(ours) if fp.extension is not None]
        out["n_ext"] = len(eager_ext)
        out["subclass_params"] = sum(bool(e.subclass) for e in eager_ext)
        if subclass:
            # The eager steps found the subclass result: a compiled step refuses it.
            th.enable_compiled_autograd(backend="aot_eager")
            try:
                compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
                with pytest.raises(Exception, match="fsdp_post_all_gather returns a tensor subclass"):
                    compiled(torch.randn(4, DIM)).sum().backward()
            finally:
                th.disable_compiled_autograd()
        return out
    out["eager_losses"], out["eager_shards"] = _train(
        _shard(_model(False), th.fully_shard, mesh), rank
    )
    if mode == "aot_eager":
        rec = _Recorder()
        th.enable_compiled_autograd(backend=rec)
        try:
            out["losses"], out["shards"] = _train(ours, rank, torch.compile(ours, backend=rec, fullgraph=True))
        finally:
            th.disable_compiled_autograd()
        out["graphs"] = rec.graphs
        return out
    post_grad = PostGradRecorder()
    torch._inductor.config.post_grad_custom_post_pass = post_grad
    th.enable_compiled_autograd(backend="inductor")
    try:
        out["losses"], out["shards"] = _train(ours, rank, torch.compile(ours, backend="inductor", fullgraph=True))
    finally:
        th.disable_compiled_autograd()
    out["post_grad"] = [(g.kind, graph_counts(g.final_graph())) for g in post_grad.graphs]
    return out


def _fsdp_params(model: nn.Module) -> list[Any]:
    seen, out = set(), []
    for m in model.modules():
        state = m.__dict__.get("_traceable_hsdp_state")
        if state is not None and state.param_group is not None and id(state) not in seen:
            seen.add(id(state))
            out.extend(state.param_group.fsdp_params)
    return out


def _bitwise(losses: list[float], ref: list[float], shards: dict, ref_shards: dict) -> None:
    assert losses == ref, (losses, ref)
    assert shards.keys() == ref_shards.keys()
    for k, v in ref_shards.items():
        torch.testing.assert_close(shards[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("mode", ["eager", "subclass"])
def test_extension_eager_matches_torch(mode: str) -> None:
    """Eager: bitwise equal to torch's fully_shard, losses and local shards after 3
    steps (atol=rtol=0: the same casts, gathers and reductions). Every weight uses the
    extension; "subclass" keeps a ``_Bf16Gather`` as the unsharded parameter, refilled
    with ``out=``, and its compiled step is refused."""
    for r in run_ranks(extension_worker, 2, mode):
        _bitwise(r["losses"], r["ref_losses"], r["shards"], r["ref_shards"])
        assert r["n_ext"] == 5
        assert r["subclass_params"] == (5 if mode == "subclass" else 0)


@pytest.mark.slow
def test_extension_compiled_aot_eager() -> None:
    """Compiled autograd, fullgraph, aot_eager: bitwise equal to our eager run (the
    same ops, per parameter) and to torch's; one forward and one backward graph,
    compiled once. The forward gathers the 5 weights and 5 biases, each weight's
    bfloat16 cast before its gather and float32 cast after it in the same graph; the
    backward re-gathers the blocks' 4 weights and 4 biases (the root stays gathered)."""
    for r in run_ranks(extension_worker, 2, "aot_eager"):
        _bitwise(r["losses"], r["eager_losses"], r["shards"], r["eager_shards"])
        _bitwise(r["losses"], r["ref_losses"], r["shards"], r["ref_shards"])
        assert len(r["graphs"]) == 2, r["graphs"]
        fwd, bwd = r["graphs"]
        assert fwd == {"all_gather": 10, "to_bf16": 5, "to_fp32": 5}, fwd
        assert bwd == {"all_gather": 8, "to_bf16": 4, "to_fp32": 4}, bwd


@pytest.mark.slow
def test_extension_compiled_inductor() -> None:
    """Inductor: losses and shards within rtol=1e-5, atol=1e-6 of our eager run
    (Inductor may fuse and reorder float arithmetic); the final post-grad graphs gather
    the 10 parameters in forward and the blocks' 8 in backward, and the blocks'
    placeholder copies are rewritten away (the cast reads the gathered buffer)."""
    for r in run_ranks(extension_worker, 2, "inductor", spawn=True):
        assert r["losses"] == pytest.approx(r["eager_losses"], rel=1e-5, abs=1e-6)
        for k, v in r["eager_shards"].items():
            torch.testing.assert_close(r["shards"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        kinds = [k for k, _ in r["post_grad"]]
        assert kinds == ["fwd", "bwd"], kinds
        (_, fwd), (_, bwd) = r["post_grad"]
        ag = lambda c: sum(n for k, n in c.items() if k.startswith("all_gather"))  # noqa: E731
        assert ag(fwd) == 10 and ag(bwd) == 8, r["post_grad"]
        # Only the root's 2 parameters, kept gathered for the backward, are copied
        # into their placeholders; the blocks' casts read the gathered buffers.
        assert fwd.get("fsdp.copy_") == 2 and "fsdp.copy_" not in bwd, r["post_grad"]
