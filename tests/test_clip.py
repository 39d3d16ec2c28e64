"""Gradient clipping on the sharded DTensor gradients:
torch.nn.utils.clip_grad_norm_ and clip_grad_value_, called after the backward and
outside any compiled region (as users do), after an eager backward, the plain
compiled loop (enable_compiled_autograd + torch.compile(model)) and a whole compiled
step (torch._dynamo.config.compiled_autograd; on the 1-D mesh); aot_eager
underneath. Every step clips the norm to MAX_NORM, then the values to CLIP_VALUE,
then steps AdamW; both clip (the tests assert it). One process group per mesh runs
its cases in turn (:func:`clip_worker`).

Checks and tolerances:
- traceable_hsdp.fully_shard against torch's fully_shard on the same mesh, data and
  clipping: bitwise (norms, losses, final parameters), eager and compiled. Both hold
  Shard(0) DTensor gradients reduced by the same collectives in the same dtypes, and
  clip_grad_norm_ runs the same DTensor ops on the same local shards; aot_eager runs
  the same aten ops as eager.
- hsdp() with replicated parameters (the RMSNorm weights under threshold=1 KiB, the
  output head by replicate_params) against torch's fully_shard (which shards them):
  norms and losses rtol 1e-5, parameters atol 2e-5. The replicated gradients are
  all-reduced instead of reduce-scattered and their norms are taken whole instead of
  from shards: another order of the same sums. Its compiled loop against its eager
  run: bitwise, as above.
- Every run against the one-process reference (plain tensors, the global batch, the
  same clipping): norms and losses rtol 1e-5, parameters atol 1e-4 (REF_PARAM_ATOL,
  1% of the learning rate). The reduce-scatter averages in another order than one
  backward, and AdamW divides each update by the root of its second moment, so an
  element whose gradient is near zero turns that rounding into a visible step (torch's
  fully_shard and ours alike; they stay bitwise equal). A run trained without
  clipping ends more than 1e-3 away, so the comparison still sees the clipping.

The model has one block (``CLIP_CFG``): the root and one unit, so every path below
(a block re-gathered for backward, the root kept gathered) runs once per step.
- The compiled runs are also the runtime's compiled checks for this model on these
  meshes (the clipping runs outside the graphs, so the graphs are those of a plain
  step): the collectives of each graph, counted from the graphs dynamo captured;
  no recompile after step 1; the graph breaks; every placeholder freed after the
  forward and the backward; the model freed once dropped with its compiled wrapper.
  See :func:`_check_compiled_graphs` and :func:`_check_hsdp_compiled_graphs`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from _workers import (
    CFG1,
    LR,
    ROOT_BYTES,
    ROOT_PARAMS,
    GraphRecorder,
    _data,
    _loss,
    _mean_over_ranks,
    _placeholder_bytes,
    count_alive,
    dp_mesh,
    graph_break_reasons,
    model_refs,
    reference_run,
)
from traceable_hsdp.demo.models import Llama, shard_llama

# The model: one block (the root and one unit; a second block adds compile time and
# nothing the clipping sees: every gradient is a DTensor either way).
CLIP_CFG = CFG1
STEPS = 3
N_PARAMS = 2 + 9 * CLIP_CFG.n_layers + 1  # embedding, final norm, output head + 9 per block
# hsdp(threshold=1 KiB) keeps the RMSNorm weights whole (2 per block and the final
# one, 128 B each), and replicate_params the output head.
N_REPLICATED = 2 * CLIP_CFG.n_layers + 1 + 1
# Below every step's gradient norm on these data, so every step clips (the tests
# assert it).
MAX_NORM = 0.1
# Below the largest gradient entry left after norm clipping, so value clipping clips
# too (asserted).
CLIP_VALUE = 2e-3
# The largest gradient entry after clip_grad_value_ is exactly the float32 bound.
CLIP_VALUE_F32 = torch.tensor(CLIP_VALUE).item()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_clipped(run: dict[str, Any], key: str) -> None:
    """Every step clipped the norm (and the norm reached .grad) and the values."""
    for c in run["clips"]:
        assert c["norm"] > MAX_NORM, (key, c)
        torch.testing.assert_close(c["clipped_norm"], MAX_NORM, rtol=1e-5, atol=0, msg=key)
        assert c["max_before_value"] > CLIP_VALUE_F32, (key, c)
        assert c["max_after_value"] == CLIP_VALUE_F32, (key, c)


# Parameters against the one-process reference (see the module docstring).
REF_PARAM_ATOL = 1e-4


def _assert_same(run: dict[str, Any], base: dict[str, Any], key: str, bitwise: bool,
                 param_atol: float = 2e-5) -> None:
    """Norms, losses and final parameters of ``run`` against ``base``."""
    norms, base_norms = [c["norm"] for c in run["clips"]], [c["norm"] for c in base["clips"]]
    if bitwise:
        assert norms == base_norms, (key, norms, base_norms)
        assert run["losses"] == base["losses"], (key, run["losses"], base["losses"])
        assert _max_diff(run["params"], base["params"]) == 0.0, key
        return
    torch.testing.assert_close(norms, base_norms, rtol=1e-5, atol=0, msg=key)
    torch.testing.assert_close(run["losses"], base["losses"], rtol=1e-5, atol=0, msg=key)
    for k, v in base["params"].items():
        diff = (run["params"][k] - v).abs().max().item()
        torch.testing.assert_close(run["params"][k], v, rtol=0, atol=param_atol,
                                   msg=f"{key} {k}: max diff {diff:.3g}")


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _clip(model: torch.nn.Module) -> dict[str, Any]:
    """Clips ``model``'s gradients, norm then value; reports the gradients' types and
    placements, the norm clip_grad_norm_ returned (value, type, placements), the total
    norm after it, and the largest gradient entry before and after clip_grad_value_."""
    params = [p for p in model.parameters() if p.grad is not None]
    grad_types = {type(p.grad).__name__ for p in params}
    grad_placements: dict[str, int] = {}  # placements -> how many gradients have them
    for p in params:
        if isinstance(p.grad, DTensor):
            key = str(p.grad.placements)
            grad_placements[key] = grad_placements.get(key, 0) + 1
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in params])
    before = max(full_tensor(p.grad).abs().max().item() for p in params)
    torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    after = max(full_tensor(p.grad).abs().max().item() for p in params)
    return dict(
        n_grads=len(params),
        grad_types=grad_types,
        grad_placements=grad_placements,
        norm=norm.item(),  # a DTensor's item() is its replicated value
        norm_type=type(norm).__name__,
        norm_placements=str(norm.placements) if isinstance(norm, DTensor) else None,
        clipped_norm=clipped.item(),
        max_before_value=before,
        max_after_value=after,
    )


def _train(
    model: torch.nn.Module, step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]],
    rec: GraphRecorder | None = None,
) -> dict[str, Any]:
    """One ``step(x, y) -> loss`` (it runs the backward), the clipping and AdamW per
    batch. Reports the losses (averaged over the ranks, if any), each step's clip
    results, and the final parameters whole; with ``rec`` (a compiled run), also each
    step's graph counts and the placeholders' storage bytes after its backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    losses, clips, graphs, bytes_after_bwd = [], [], [], []
    for x, y in batches:
        loss = step(x, y)
        if rec is not None:
            bytes_after_bwd.append(_placeholder_bytes(model))
        clips.append(_clip(model))
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss, world) if world > 1 else loss.item())
        if rec is not None:
            graphs.append((len(rec.forward), len(rec.backward)))
    return dict(
        losses=losses,
        clips=clips,
        graphs=graphs,
        bytes_after_bwd=bytes_after_bwd,
        params={k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()},
    )


def _plain_step(
    model: Callable[[torch.Tensor], torch.Tensor], after_forward: Callable[[], None] | None = None
) -> Step:
    """The plain loop's step; ``model`` is the module or its compiled wrapper, and
    ``after_forward`` (if given) runs between the forward and the backward."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if after_forward is not None:
            after_forward()
        loss = _loss(out, y)
        loss.backward()
        return loss.detach()
    return step


def reference_clip_run(world: int) -> dict[str, Any]:
    """One process, plain tensors, the global batch of ``world`` ranks: the ground
    truth. Runs in the test process (no process group)."""
    torch.manual_seed(0)
    model = Llama(CLIP_CFG)
    return _train(model, _plain_step(model), _data(world, STEPS))


def _check(results: list[dict[str, Any]], world: int, placements: str, sharded: str,
           bitwise_to: dict[str, str], tolerant_to: dict[str, str]) -> None:
    """``placements``: replicated on this mesh (the norm's); ``sharded``: a sharded
    gradient's. ``bitwise_to`` / ``tolerant_to``: run -> the run it must match that
    way."""
    ref = reference_clip_run(world)
    _check_clipped(ref, "reference")
    _, unclipped = reference_run(world, STEPS, CLIP_CFG)
    assert _max_diff(ref["params"], unclipped) > 1e-3  # the parameter check can fail
    for r in results:
        assert set(r) == {"torch eager"} | set(bitwise_to) | set(tolerant_to), set(r)
        for key, run in r.items():
            for c in run["clips"]:
                assert c["grad_types"] == {"DTensor"} and c["n_grads"] == N_PARAMS, (key, c)
                # Replicated over the mesh: the same total norm on every rank.
                assert c["norm_type"] == "DTensor" and c["norm_placements"] == placements, (key, c)
                want = ({placements: N_REPLICATED, sharded: N_PARAMS - N_REPLICATED}
                        if key.startswith("hsdp") else {sharded: N_PARAMS})
                assert c["grad_placements"] == want, (key, c)
            _check_clipped(run, key)
            _assert_same(run, ref, f"{key} vs reference", bitwise=False,
                         param_atol=REF_PARAM_ATOL)
            mode = key.split()[1]
            if mode != "eager":
                # The model and its parameters are freed once dropped with the compiled
                # wrapper; the state dict holds DTensors.
                assert run["alive_after_del"] == 0, (key, run["alive_after_del"])
                assert run["sd_types"] == {"DTensor"}, (key, run["sd_types"])
            if mode == "compiled":
                # One forward and one backward graph, compiled in the first step: the
                # clipping outside adds no recompiles.
                assert run["graphs"] == [(1, 1)] * STEPS, (key, run["graphs"])
            elif mode == "compiled_step":
                # The backward() call is a graph break (a second forward-side graph).
                assert run["graphs"][0][1] == 1 and run["graphs"] == [run["graphs"][0]] * STEPS, (
                    key, run["graphs"])
        for key, base in bitwise_to.items():
            _assert_same(r[key], r[base], f"{key} vs {base}", bitwise=True)
        for key, base in tolerant_to.items():
            _assert_same(r[key], r[base], f"{key} vs {base}", bitwise=False)
    # The total norm is the global one, the same on every rank.
    for key in results[0]:
        norms = {tuple(c["norm"] for c in r[key]["clips"]) for r in results}
        assert len(norms) == 1, (key, norms)


def _build(how: str, mesh: DeviceMesh) -> Llama:
    """``how``: "torch" (torch's fully_shard), "ours" (traceable_hsdp.fully_shard),
    "hsdp" (traceable_hsdp.hsdp, threshold=1 KiB: the RMSNorm weights stay whole,
    and replicate_params keeps the output head whole; the rest sharded)."""
    torch.manual_seed(0)
    model = Llama(CLIP_CFG)
    if how == "torch":
        shard_llama(model, torch_fsdp.fully_shard, mesh=mesh)
    elif how == "ours":
        shard_llama(model, th.fully_shard, mesh=mesh)
    elif how == "hsdp":
        shard_llama(model, th.hsdp, mesh=mesh, threshold=1, replicate_params=[model.output.weight])
    else:
        raise ValueError(how)
    return model


def _run(how: str, mode: str, mesh: DeviceMesh, rank: int, world: int) -> dict[str, Any]:
    """Trains a fresh model built by ``how`` in ``mode``: "eager"; "compiled" (the
    plain loop, enable_compiled_autograd + torch.compile(model, fullgraph=True));
    "compiled_step" (forward, loss and backward in one compiled function under
    torch._dynamo.config.compiled_autograd). aot_eager underneath (GraphRecorder).

    A compiled run also reports what the graphs hold: the collectives of each graph
    (``fwd_counts``, ``bwd_counts``), dynamo's graph breaks, the placeholders' bytes
    after each forward ("compiled") and backward, the state dict's types, and how many
    of the model and its parameters outlive dropping them with the compiled wrapper
    (``alive_after_del``)."""
    model = _build(how, mesh)
    batches = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in _data(world, STEPS)]
    if mode == "eager":
        return _train(model, _plain_step(model), batches)
    rec = GraphRecorder()
    torch._dynamo.reset()
    counters.clear()
    bytes_after_fwd: list[int] = []
    if mode == "compiled":
        th.enable_compiled_autograd(backend=rec)
        try:
            compiled = torch.compile(model, backend=rec, fullgraph=True)
            step = _plain_step(
                compiled, lambda m=model: bytes_after_fwd.append(_placeholder_bytes(m))
            )
            result = _train(model, step, batches, rec)
        finally:
            th.disable_compiled_autograd()
    elif mode == "compiled_step":
        with torch._dynamo.config.patch(compiled_autograd=True):
            step = torch.compile(_plain_step(model), backend=rec)
            result = _train(model, step, batches, rec)
    else:
        raise ValueError(mode)
    result.update(
        fwd_counts=rec.forward,
        bwd_counts=rec.backward,
        graph_breaks=graph_break_reasons(),
        bytes_after_fwd=bytes_after_fwd,
        sd_types={type(v).__name__ for v in model.state_dict().values()},
    )
    refs = model_refs(model)
    del model, step
    if mode == "compiled":
        del compiled
    result["alive_after_del"] = count_alive(refs)
    return result


def clip_worker(
    rank: int, world: int, mesh_shape: tuple[int, ...], runs: list[tuple[str, str]]
) -> dict[str, dict[str, Any]]:
    """Each ``(how, mode)`` of ``runs`` in turn on one mesh (see :func:`_run`); the
    results keyed ``"how mode"``."""
    mesh = dp_mesh(mesh_shape)
    return {f"{how} {mode}": _run(how, mode, mesh, rank, world) for how, mode in runs}


@pytest.mark.slow
def test_clip_grad_2_ranks() -> None:
    """1-D mesh, 2 ranks: traceable_hsdp.fully_shard eager, compiled loop and whole
    compiled step, each bitwise against torch's fully_shard (eager).

    Its two compiled runs are also the runtime's compiled checks on this mesh (the
    clipping runs outside the graphs): what each graph holds, the graph breaks, the
    freed placeholders; see :func:`_check_compiled_graphs`."""
    ours = ("ours eager", "ours compiled", "ours compiled_step")
    runs = [("torch", "eager")] + [tuple(k.split()) for k in ours]
    results = run_ranks(clip_worker, 2, (2,), runs)
    _check(results, 2, "(Replicate(),)", "(Shard(dim=0),)",
           bitwise_to={k: "torch eager" for k in ours}, tolerant_to={})
    for r in results:
        _check_compiled_graphs(r["ours compiled"], r["ours compiled_step"])


def _check_compiled_graphs(loop: dict[str, Any], step: dict[str, Any]) -> None:
    """fully_shard on every block and the root, 1-D mesh, compiled with compiled
    autograd (aot_eager), collectives counted from dynamo's graphs.

    ``loop`` (enable_compiled_autograd + torch.compile(model, fullgraph=True)): one
    forward and one backward graph, compiled in the first step (asserted in
    :func:`_check`), no graph break. Forward: one all-gather and one fsdp.copy_ per
    parameter, a resize to full per parameter and one back to 0 per block parameter
    (the root stays gathered for backward: the default ``reshard_after_forward``), no
    reduce-scatter. Backward: the blocks' re-gathers and the reduce-scatters, one per
    parameter, inside the captured graph (HSDP's all-reduces across replicas:
    test_hsdp.py). After each forward only the root's placeholders hold storage,
    after each backward none.

    ``step`` (forward, loss and backward in one compiled function under
    ``compiled_autograd = True``): the only graph break is backward() (see [Note: The
    forward reads the local shard, not the DTensor] in traceable_hsdp/_param.py for
    the two that lifting a DTensor into the backward graph would add); the
    forward+loss graph holds the gathers and the backward graph the reduce-scatters;
    every placeholder is freed after each step."""
    assert loop["graph_breaks"] == {}, loop["graph_breaks"]
    fwd, bwd = loop["fwd_counts"][0], loop["bwd_counts"][0]
    assert fwd.get("all_gather_into_tensor") == N_PARAMS, fwd
    assert fwd.get("fsdp.copy_") == N_PARAMS, fwd
    assert fwd.get("resize_storage_bytes_") == 2 * N_PARAMS - ROOT_PARAMS, fwd
    assert "reduce_scatter_tensor" not in fwd, fwd
    assert bwd.get("all_gather_into_tensor") == N_PARAMS - ROOT_PARAMS, bwd
    assert bwd.get("reduce_scatter_tensor") == N_PARAMS, bwd
    assert "all_reduce" not in bwd, bwd
    assert loop["bytes_after_fwd"] == [ROOT_BYTES] * STEPS, loop["bytes_after_fwd"]
    assert loop["bytes_after_bwd"] == [0] * STEPS, loop["bytes_after_bwd"]
    assert set(step["graph_breaks"]) == {"Unsupported Tensor.backward() call"}, step["graph_breaks"]
    assert step["fwd_counts"][0]["all_gather_into_tensor"] == N_PARAMS, step["fwd_counts"]
    assert step["bwd_counts"][0]["reduce_scatter_tensor"] == N_PARAMS, step["bwd_counts"]
    assert step["bytes_after_bwd"] == [0] * STEPS, step["bytes_after_bwd"]


@pytest.mark.slow
def test_clip_grad_hsdp_2x2() -> None:
    """2x2 (replicate, shard) mesh, 4 ranks: fully_shard eager bitwise against torch's;
    hsdp() with replicated parameters eager and in the compiled loop, tolerant against
    torch's, the compiled loop bitwise against hsdp() eager. The whole compiled step
    is checked on the 1-D mesh only: here it would add a compile and nothing the
    clipping sees (the same DTensor gradients after backward)."""
    runs = [("torch", "eager"), ("ours", "eager"), ("hsdp", "eager"), ("hsdp", "compiled")]
    results = run_ranks(clip_worker, 4, (2, 2), runs)
    _check(results, 4, "(Replicate(), Replicate())", "(Replicate(), Shard(dim=0))",
           bitwise_to={"ours eager": "torch eager", "hsdp compiled": "hsdp eager"},
           tolerant_to={"hsdp eager": "torch eager"})
    for r in results:
        _check_hsdp_compiled_graphs(r["hsdp compiled"])


def _check_hsdp_compiled_graphs(run: dict[str, Any]) -> None:
    """hsdp() level3 (its default) on the 2x2 mesh, the plain compiled loop
    (aot_eager, compiled autograd), collectives counted from dynamo's graphs: one
    forward and one backward graph (asserted in :func:`_check`). The replicated
    parameters have no all-gather and are all-reduced in the backward graph over both
    mesh dims (shard, then replicate); the sharded ones are reduce-scattered, then
    all-reduced across the replicas, and re-gathered in the backward. Every
    placeholder, replicated ones too, is grown, filled by one fsdp.copy_ and freed in
    the forward, and has no storage after the backward."""
    n_sharded = N_PARAMS - N_REPLICATED
    fwd, bwd = run["fwd_counts"][0], run["bwd_counts"][0]
    assert fwd["all_gather_into_tensor"] == n_sharded, fwd
    assert fwd["fsdp.copy_"] == N_PARAMS and fwd["resize_storage_bytes_"] == 2 * N_PARAMS, fwd
    assert bwd["all_gather_into_tensor"] == bwd["reduce_scatter_tensor"] == n_sharded, bwd
    assert bwd["all_reduce"] == n_sharded + 2 * N_REPLICATED, bwd
    assert run["bytes_after_bwd"] == [0] * STEPS, run["bytes_after_bwd"]
