"""Reduce-scatter over two gloo ranks as one exchange and one addition.

[Note: gloo reduce-scatters as an exchange]
gloo has no reduce-scatter. torch 2.13's ``ProcessGroupGloo`` implements one
(``reduce_scatter_tensor_coalesced``) as a copy of the whole input, an all-reduce
of that copy, and, in ``wait()``, a copy of this rank's chunk out of it: every rank
sends and receives the whole tensor instead of the 1/world_size that a
reduce-scatter needs, and the caller's thread pays the last copy. An all-to-all
moves exactly what a reduce-scatter needs: rank ``r`` sends chunk ``j`` of its
input to rank ``j`` and receives chunk ``r`` from every rank, then adds them. Bare
ops on 2 gloo ranks (one thread each, float32, medians of 20 calls, the machine
otherwise idle, 2026-11-27; ``benchmarks/collective_latency.py``, whose third column
is this module's exchange as the eager runtime issues it):

=========  ==========================  =============================
input      ``reduce_scatter_tensor``   ``all_to_all_single`` + add
=========  ==========================  =============================
16 KiB     0.73 ms                     0.56 ms
256 KiB    0.67 ms                     0.51 ms
1 MiB      2.07 ms                     0.90 ms
4 MiB      6.45 ms                     2.50 ms
16 MiB     23.72 ms                    9.57 ms
=========  ==========================  =============================

In a training step (``benchmarks/step_time.py``, docs/benchmarks.md) the compiled
step of the compute shape (5 reduce-scatters, 16.5 MiB of gradients) took 0.93x the
time it took without this pass (geometric mean of both run orders), and the eager
step went from 1.01-1.12x to 0.93-0.98x of torch's eager ``fully_shard``.

So this pass rewrites each reduce-scatter of CPU tensors over a gloo group of two
ranks, read by one wait::

    rs = reduce_scatter_tensor(g, "avg", 2, "0")    # g: (2k, ...)
    r  = wait_tensor(rs)

into::

    ex = all_to_all_single(g, [k, k], [k, k], "0")  # where rs was
    w  = wait_tensor(ex)                            # where r was
    r  = div(add(w[:k], w[k:]), 2)                  # "sum": add(w[:k], w[k:])

The numbers are the same bit for bit: over two ranks each element of the result is
one addition of two values, and floating-point addition is commutative, so the
order gloo's all-reduce adds them in cannot matter; its average divides that sum by
2, as here (``tests/test_passes_unit.py`` checks both ops against gloo's own
reduce-scatter). In compiled graphs only float32 and float64 reduce-scatters are
rewritten: see [Note: Low-precision sums and fusion]. Over more ranks gloo's ring
adds the chunks in an order of its own (on 4 ranks rank ``r`` gets ``((x[r+2] + x[r+3]) + x[r+1]) +
x[r]``), which an exchange would have to copy to give the same numbers, so
reduce-scatters over more than two ranks, ``max``/``min``/``product`` ones, GPU
ones (NCCL has a real reduce-scatter), symbolic shapes, and those not read by
exactly one wait are left alone. A 2x2 HSDP mesh's shard groups have two ranks.

The exchange is issued where the reduce-scatter was and waited for where its wait
was, so ``overlap``'s schedule holds; Inductor keeps an out-of-place collective's
input alive until its wait (``_WaitKernel.get_volatile_reads``). An exchange in
flight with an ``_out`` all-gather issued after it ran clean in 3 of 3 runs of
``benchmarks/gloo_in_flight.py --pattern ex+ago`` (20,000 rounds each), where the
control, a reduce-scatter then an allocating all-gather, crashed in 2 of 2 runs the
same minutes ([Note: CPU all-gathers into buffers] in ``gather_into_buffers.py``). The rewritten node keeps the reduce-scatter's annotation
and is marked (:data:`EXCHANGED`), so the graph vocabulary still counts it as a
reduce-scatter (:func:`passes._graph.collective_family`). The eager runtime does the
same (``reduce_scatter`` in ``traceable_hsdp/_collectives.py``), and
``PassConfig(reduce_scatter_by_exchange=False)`` turns both off.

Invariant: the rewritten graph computes the same tensors as before, with its
collectives issued and waited for at the same positions and over the same groups.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from ._graph import ALL_TO_ALL, EXCHANGED, REDUCE_SCATTER, WAIT, bound_args, group_backend, single_wait
from ._rewrite import insert_call, tensor_val

__all__ = ["is_gloo_group", "reduce_scatter_by_exchange"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten

# [Note: Low-precision sums and fusion]
# Inductor computes a bfloat16 or float16 kernel in float32 and rounds only what it
# stores: the addition fused with the reduce-scatter's readers (a ``+ 1`` after it)
# then skips the rounding to bfloat16 that gloo's result had, and the numbers
# differ in the last bit (seen: 2 gloo ranks, bfloat16, ``sum`` and ``avg``, the
# reduce-scatter's result read by an addition; without a reader after it they were
# equal). float32 and float64 are computed in their own precision, so only those are
# rewritten in compiled graphs; eagerly each op rounds, and the runtime's exchange
# gives gloo's numbers in every dtype (``tests/test_passes_unit.py`` checks both).
_SAME_PRECISION = (torch.float32, torch.float64)


def is_gloo_group(group_name: str) -> bool:
    """Whether the process group named ``group_name`` reaches CPU tensors through
    gloo (``False`` for an unknown name, a group with no CPU backend, or another
    backend; see :func:`~traceable_hsdp.passes._graph.group_backend`)."""
    import torch.distributed as dist

    return isinstance(group_backend(group_name, torch.device("cpu")), dist.ProcessGroupGloo)


def reduce_scatter_by_exchange(gm: fx.GraphModule) -> int:
    """Rewrites each reduce-scatter (``"sum"`` or ``"avg"``) of CPU tensors over a
    gloo group of two ranks into an all-to-all and an addition. See [Note: gloo
    reduce-scatters as an exchange].

    Args:
        gm: a post-grad graph module (``OpOverload`` targets), changed in place.

    Returns:
        How many reduce-scatters were rewritten.
    """
    graph = gm.graph
    done = 0
    for node in list(graph.find_nodes(op="call_function", target=REDUCE_SCATTER)):
        args = bound_args(node)
        inp, op, name = args.get("input"), args.get("reduce_op"), args.get("group_name")
        val = tensor_val(inp)
        if (
            val is None
            or val.device.type != "cpu"
            or args.get("group_size") != 2
            or op not in ("sum", "avg")
            or not isinstance(name, str)
        ):
            continue
        if val.dtype not in _SAME_PRECISION:
            # See [Note: Low-precision sums and fusion].
            log.info("reduce_scatter_by_exchange: %s left alone: %s", node.name, val.dtype)
            continue
        shape = list(val.shape)
        if not all(isinstance(s, int) for s in shape) or shape[0] % 2:
            log.info("reduce_scatter_by_exchange: %s left alone: shape %s", node.name, shape)
            continue
        wait = single_wait(node)
        if wait is None:
            log.info("reduce_scatter_by_exchange: %s left alone: not one wait_tensor", node.name)
            continue
        if not is_gloo_group(name):
            continue
        k = shape[0] // 2
        with graph.inserting_before(node):
            ex = graph.call_function(ALL_TO_ALL, (inp, [k, k], [k, k], name))
        with graph.inserting_after(wait):
            got = graph.call_function(WAIT, (ex,))
        # The annotation, stack trace and the rest carry over to the exchange.
        ex.meta.update({**node.meta, "val": val.new_empty(shape), EXCHANGED: True})
        got.meta["val"] = ex.meta["val"]
        with graph.inserting_before(got.next):  # each new node after the last
            lo = insert_call(graph, _aten.slice.Tensor, (got, 0, 0, k), like=node)
            hi = insert_call(graph, _aten.slice.Tensor, (got, 0, k, 2 * k), like=node)
            out = insert_call(graph, _aten.add.Tensor, (lo, hi), like=node)
            if op == "avg":
                out = insert_call(graph, _aten.div.Tensor, (out, 2), like=node)
        wait.replace_all_uses_with(out)
        graph.erase_node(wait)
        graph.erase_node(node)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
