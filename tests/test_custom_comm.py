"""torch FSDP2's custom collectives on our units ([Note: Custom collectives] in
traceable_hsdp/_custom_comm.py): a comm object's all-gather and reduce-scatter, and
the process group's allocator.

Reference: the same model trained with the default collectives in the same ranks;
bitwise equal (over two ranks every element of a reduction is one addition, in any
order the same bits). The comms' calls are counted: one all-gather per unit per
gather, one reduce-scatter per unit per backward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import traceable_hsdp as th
from _dist import run_ranks
from _workers import dp_mesh

STEPS = 3


class _Recording:
    """A comm that allocates with ``torch.empty`` and issues torch's c10d op,
    counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RecordingAllGather(_Recording):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(_Recording):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
        self.calls += 1
        assert op == dist.ReduceOp.SUM
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _model(mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    th.fully_shard(m[0], mesh=mesh)
    th.fully_shard(m[2], mesh=mesh)
    return th.fully_shard(m, mesh=mesh)


def _train(m: nn.Module, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(STEPS):
        loss = m(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.to_local().clone() for k, v in m.state_dict().items()}


def custom_comm_worker(rank: int, world: int) -> None:
    mesh = dp_mesh((world,))
    ref = _train(_model(mesh), rank)

    m = _model(mesh)
    units = [m[0], m[2], m]
    ags = [RecordingAllGather() for _ in units]
    rss = [RecordingReduceScatter() for _ in units]
    for unit, ag, rs in zip(units, ags, rss):
        unit.set_custom_all_gather(ag)
        unit.set_custom_reduce_scatter(rs)
    _assert_same(_train(m, rank), ref)
    # The blocks gather in forward and again in backward; the root (kept gathered
    # for its backward, torch's default) once. One reduce-scatter per unit per step.
    assert [ag.calls for ag in ags] == [2 * STEPS, 2 * STEPS, STEPS], [ag.calls for ag in ags]
    assert [rs.calls for rs in rss] == [STEPS] * 3, [rs.calls for rs in rss]
    # torch's order rule: the process group's allocator after a custom comm.
    with pytest.raises(AssertionError, match="when all gather comm is custom: RecordingAllGather"):
        m.set_allocate_memory_from_process_group_for_comm(True)

    # The process group's allocator (gloo has none: torch.empty), same numbers.
    m = _model(mesh)
    for unit in (m[0], m[2], m):
        unit.set_allocate_memory_from_process_group_for_comm(True)
    _assert_same(_train(m, rank), ref)
    m.set_allocate_memory_from_process_group_for_comm(False)

    # A compiled step refuses a custom comm, naming the fix.
    m = _model(mesh)
    m[0].set_custom_all_gather(RecordingAllGather())
    th.enable_compiled_autograd(backend="aot_eager")
    try:
        with pytest.raises(Exception, match="custom collective .* Fix: run the unit eagerly"):
            torch.compile(m, backend="aot_eager", fullgraph=True)(torch.randn(4, 8)).sum().backward()
    finally:
        th.disable_compiled_autograd()


def _assert_same(got: Any, ref: Any) -> None:
    assert got[0] == ref[0], (got[0], ref[0])
    for k, v in ref[1].items():
        assert torch.equal(got[1][k], v), k


def test_custom_comms_train_as_the_default_ones() -> None:
    run_ranks(custom_comm_worker, 2)


def test_custom_comm_checks(one_rank) -> None:
    m = _model(one_rank)
    with pytest.raises(TypeError, match="expects a comm object with allocate"):
        m.set_custom_all_gather(lambda *a: None)
    with pytest.raises(TypeError, match="enable must be a bool"):
        m.set_allocate_memory_from_process_group_for_comm(1)
