"""Issue every CPU all-gather of a compiled graph into a buffer allocated beforehand.

[Note: CPU all-gathers into buffers]
On torch 2.13 with gloo, the allocating functional all-gather
(``_c10d_functional.all_gather_into_tensor``, which reaches gloo through
``allgather_into_tensor_coalesced``) corrupts the heap or hangs when another
collective is in flight at the same time; the ``_out`` form
(``all_gather_into_tensor_out``, gloo's ``_allgather_base``) does not, alone or with
a reduce-scatter or an all-reduce in flight (crashes: ``malloc(): unaligned tcache
chunk detected``, ``free(): invalid pointer`` or SIGSEGV at an allocation on the main
thread; hangs: a gloo worker spinning in ``~UnboundBuffer``).
``benchmarks/gloo_in_flight.py`` reproduces it; docs/passes.md has the table. The
overlap pass (``overlap.py``) keeps one all-gather in flight, but a reduce-scatter may
be in flight when it is issued (late waits), which is that pattern. So this pass,
the last one on every post-grad graph, rewrites each all-gather of CPU tensors::

    ag  = all_gather_into_tensor(shard, 2, "0")
    r   = wait_tensor(ag)

into::

    buf = empty([2 * n], dtype=..., device=cpu)
    ag  = all_gather_into_tensor_out(shard, 2, "0", out=buf)
    r   = wait_tensor(ag)

Inductor lowers the ``_out`` op (``comm_lowering.py``) as a collective that writes
``buf`` in place; the wait and every use read the same values as before. GPU
all-gathers (NCCL) are left alone. It is a correctness fix, not an optimisation, so
:class:`PassConfig` does not switch it (``TRACEABLE_HSDP_PASSES=none`` keeps it),
and it runs on every graph the installed pass sees, a user's own all-gathers
included: on gloo they are exposed the same way. An all-gather whose output shape
is symbolic (dynamic shapes), or that is not read by exactly one ``wait_tensor``,
is left allocating, with a log line: a parameter's all-gather is static and waited
for once. Over two gloo ranks ``all_gather_by_exchange`` (``exchange.py``), which runs
before this pass, has already issued each all-gather as an exchange, so this pass
finds the all-gathers of larger groups, and every one where that pass is off.

[Note: The input lives until the wait]
gloo reads an all-gather's input on its worker thread, any time before the wait.
For an allocating collective Inductor keeps the input alive and unreused until the
wait (``_WaitKernel.get_volatile_reads``), but not for an ``_out`` one, whose wait
names only the buffer it writes: the generated code deleted the input right after
the issue, and Inductor's buffer reuse could hand that memory to a later kernel while
gloo still reads it. So the pass adds a second ``wait_tensor``, on the input, right
after the buffer's wait::

    r   = wait_tensor(ag)
    _   = wait_tensor(shard)    # no collective produced shard: a no-op at run time

Inductor then treats the input as read at that point, as it did before the rewrite
(``tests/test_passes_e2e.py`` checks the generated code: no input is deleted or
reused between its all-gather and the wait).

Invariant: each rewritten node computes the same tensor as the node it replaces,
with the same inputs, group and position in the graph, so collective order and
values are unchanged. The eager runtime issues ``_out`` all-gathers already (see
[Note: In-flight all-gathers on gloo] in ``traceable_hsdp/_collectives.py``).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from .._graph import ALL_GATHER, ALL_GATHER_OUT, WAIT, bound_args, single_wait
from .._rewrite import tensor_val

__all__ = ["gather_into_buffers"]

log = logging.getLogger(__name__)


def gather_into_buffers(gm: fx.GraphModule) -> int:
    """Rewrites each allocating all-gather of CPU tensors in ``gm`` into an ``empty``
    buffer and ``all_gather_into_tensor_out`` into it. See [Note: CPU all-gathers
    into buffers].

    Args:
        gm: a post-grad graph module (``OpOverload`` targets), changed in place.

    Returns:
        How many all-gathers were rewritten.
    """
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ALL_GATHER:
            continue
        val = tensor_val(node)
        if val is None or val.device.type != "cpu":
            continue
        shape = list(val.shape)
        if not all(isinstance(s, int) for s in shape):
            log.info("gather_into_buffers: %s left allocating: symbolic shape %s", node.name, shape)
            continue
        args = bound_args(node)
        wait, inp = single_wait(node), args.get("input")
        if wait is None or not isinstance(inp, fx.Node):
            # Without its one wait the input could not be kept alive as long: see
            # [Note: The input lives until the wait].
            log.info("gather_into_buffers: %s left allocating: not one wait_tensor", node.name)
            continue
        with graph.inserting_before(node):
            buf = graph.call_function(
                torch.ops.aten.empty.memory_format,
                (shape,),
                {"dtype": val.dtype, "device": val.device, "pin_memory": False},
            )
            out = graph.call_function(
                ALL_GATHER_OUT,
                (inp, args["group_size"], args["group_name"]),
                {"out": buf},
            )
        fake_mode = torch._guards.detect_fake_mode([val])
        if fake_mode is not None:
            with fake_mode:
                buf.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        else:
            buf.meta["val"] = torch.empty(shape, dtype=val.dtype, device="meta")
        # The annotation, stack trace and the rest carry over; the value is the buffer.
        out.meta.update({**node.meta, "val": buf.meta["val"]})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        # See [Note: The input lives until the wait].
        with graph.inserting_after(wait):
            keep = graph.call_function(WAIT, (inp,))
        keep.meta["val"] = inp.meta.get("val")
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done
