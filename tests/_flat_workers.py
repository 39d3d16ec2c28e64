"""Per-rank bodies of the eager flat-collective tests (importable by spawned ranks).

Each scenario trains the same model with torch's ``fully_shard`` and with ours,
eagerly, on the same data, and records every collective our run issues (op, the
unit and parameters its annotation names) step by step. See
[Note: One collective per unit, eagerly] in traceable_hsdp/_param_group.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
from _dist import full_tensor
from _workers import CFG, _data, _loss, _placeholder_bytes, dp_mesh
from traceable_hsdp._annotate import ANNOTATION_KEY
from traceable_hsdp.demo.models import Llama

STEPS = 3
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


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v) if isinstance(v, DTensor) else v.detach().clone()
            for k, v in model.state_dict().items()}


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
    return dict(losses=losses, params=_full(model), calls=per_step)


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
