"""torch.distributed.pipelining over traceable_hsdp units, eager and compiled.

pipelining treats a stage module that is a torch ``FSDPModule`` (ours are: see
[Note: A subclass of torch's FSDPModule]) as FSDP: micro-batch backwards without
gradient sync, then its own gradient-reduction step through torch's
``fully_shard.state``. A 2-stage x 2-way FSDP GPipe run is compared with one process
training the whole model on the mean of the same micro-batch losses, eagerly and
with the stage modules compiled by Inductor (compiled autograd for the micro-batch
backwards), where the graphs compiled must stop growing after the second step
(counted from dynamo's counters). Tolerance: atol 1e-6 on the parameters after each
of 3 SGD steps of 4 micro-batches (the ranks reduce in another order than the one
process sums; Inductor's kernels sum in their own order too).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import traceable_hsdp as th
from _dist import full_tensor, run_ranks


DIM, ROWS, MICROBATCHES, STEPS, LR = 8, 8, 4, 3, 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)


def pipelined_fsdp(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A (pp=2, dp=2) mesh: stage ``pp`` holds half of the model, fully_shard over
    ``dp`` (the first Linear its own unit, the chunk the root), trained with
    torch.distributed.pipelining's GPipe schedule (2 micro-batches, gradients scaled
    by their count) and SGD; ``mode`` ``"inductor"`` compiles the stage module
    (``module.compile()``) with compiled autograd on, both with Inductor. The
    one-process reference trains the whole model on the mean of the same
    per-micro-batch losses over every dp rank's rows. Returns the stage's parameters
    after each step, both runs, and, after each step, dynamo's graph breaks, the
    graphs dynamo compiled and the compiled-autograd captures (counted from
    ``torch._dynamo.utils.counters``)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    full = _model()
    ref = _model()
    chunk = nn.Sequential(*list(full)[:2]) if pp == 0 else nn.Sequential(*list(full)[2:])
    ref_chunk = list(ref)[:2] if pp == 0 else list(ref)[2:]
    th.fully_shard(chunk[0], mesh=mesh["dp"])
    th.fully_shard(chunk, mesh=mesh["dp"])
    if mode == "inductor":
        torch._dynamo.reset()
        th.enable_compiled_autograd()
        chunk.compile()
    stage = PipelineStage(chunk, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, MICROBATCHES, loss_fn=_loss, scale_grads=True)
    opt = torch.optim.SGD(chunk.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    params, ref_params = [], []
    counts: list[dict[str, int]] = []
    counters = torch._dynamo.utils.counters
    for step in range(STEPS):
        x, y = _data(step)
        xs, ys = x.chunk(2)[dp], y.chunk(2)[dp]
        if pp == 0:
            schedule.step(xs)
        else:
            schedule.step(target=ys)
        opt.step()
        opt.zero_grad()
        counts.append({
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
            "captures": counters["compiled_autograd"]["captures"],
        })
        params.append([full_tensor(p).clone() for p in chunk.parameters()])
        losses = [
            _loss(ref(xm), ym)
            for r in range(2)
            for xm, ym in zip(x.chunk(2)[r].chunk(MICROBATCHES), y.chunk(2)[r].chunk(MICROBATCHES))
        ]
        (sum(losses) / len(losses)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_params.append([p.detach().clone() for m in ref_chunk for p in m.parameters()])
    th.disable_compiled_autograd()
    all_freed = all(
        fp.unsharded_param.untyped_storage().size() == 0
        for s in th.fully_shard.state(chunk).states
        if s.param_group is not None
        for fp in s.param_group.fsdp_params
    )
    return {"params": params, "ref_params": ref_params, "all_freed": all_freed, "counts": counts}


@pytest.mark.parametrize("mode", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_gpipe_two_stages_fsdp_matches_one_process(mode: str) -> None:
    for rank, r in enumerate(run_ranks(pipelined_fsdp, 4, mode)):
        for step, (got, want) in enumerate(zip(r["params"], r["ref_params"])):
            assert len(got) == len(want) > 0
            for i, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=f"rank {rank} step {step} param {i}")
        assert r["all_freed"], rank  # the schedule's last backward freed every unit
        first, second, last = r["counts"]
        if mode == "eager":
            assert last == {"graph_breaks": 0, "graphs": 0, "captures": 0}, r["counts"]
        else:
            # The micro-batch forwards compiled without a graph break and the
            # backwards ran as compiled-autograd graphs. The second step may still
            # compile the states the first did not reach (a micro-batch's backward
            # finding the unit gathered, or gradients already kept: one more graph
            # each); the third compiles and captures nothing, however many
            # micro-batches (4 here). Before [Note: When a unit's backward is
            # done] stopped counting input hooks of units that train all their
            # parameters, stage 1 compiled 4 or 5 new graphs in every step.
            assert last["graph_breaks"] == 0, r["counts"]
            assert first["graphs"] > 0 and first["captures"] > 0, r["counts"]
            assert last == second, r["counts"]


def test_torch_fully_shard_state_sees_our_unit(one_rank) -> None:
    m = th.fully_shard(nn.Linear(2, 2), mesh=one_rank)
    view = torch_fsdp.fully_shard.state(m)
    assert view is not None and [type(s).__name__ for s in view._state_ctx.all_states] == ["TorchStateView"]
    assert torch_fsdp.fully_shard.state(nn.Linear(2, 2)) is None
