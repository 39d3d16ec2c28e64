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

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import traceable_hsdp as th
from _dist import run_ranks
from _pp_workers import pipelined_fsdp


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
