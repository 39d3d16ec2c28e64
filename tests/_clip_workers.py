"""Per-rank bodies of the gradient-clipping tests (importable by spawned ranks).

Every step of every run: forward, loss and backward (eager, the compiled loop, or the
whole step compiled), then, outside any compiled region as users do,
``torch.nn.utils.clip_grad_norm_(params, MAX_NORM)`` and
``torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)``, then AdamW. The one-process
reference (:func:`reference_clip_run`) runs the same loop on plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor
from _workers import (
    CFG1,
    LR,
    GraphRecorder,
    _data,
    _loss,
    _mean_over_ranks,
    _placeholder_bytes,
    count_alive,
    dp_mesh,
    graph_break_reasons,
    model_refs,
)
from traceable_hsdp.demo.models import Llama, shard_llama

STEPS = 3
# The model: one block (the root and one unit; a second block adds compile time and
# nothing the clipping sees: every gradient is a DTensor either way).
CLIP_CFG = CFG1
# Below every step's gradient norm on these data, so every step clips (the tests
# assert it).
MAX_NORM = 0.1
# Below the largest gradient entry left after norm clipping, so value clipping clips
# too (asserted).
CLIP_VALUE = 2e-3

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
