"""Issue every CPU all-gather of a compiled graph into a buffer allocated beforehand.

[Note: CPU all-gathers into buffers]
With gloo, the allocating ``all_gather_into_tensor`` corrupts the heap or hangs when
another collective is in flight; the ``_out`` form (gloo's ``_allgather_base``) does
not (``benchmarks/gloo_in_flight.py`` reproduces it; docs/passes.md has the table).
After ``overlap``, a reduce-scatter may be in flight when an all-gather is issued. So
this pass, the last on every post-grad graph, rewrites each all-gather of CPU tensors::

    ag  = all_gather_into_tensor(shard, 2, "0")
    r   = wait_tensor(ag)

into::

    buf = empty([2 * n], dtype=..., device=cpu)
    ag  = all_gather_into_tensor_out(shard, 2, "0", out=buf)
    r   = wait_tensor(ag)

GPU all-gathers are left alone. A correctness fix, so :class:`PassConfig` does not
switch it, and it covers a user's own all-gathers too. A symbolic output shape, or an
all-gather not read by exactly one wait, is left allocating, with a log line. Over two
gloo ranks ``all_gather_by_exchange`` has already replaced the all-gathers.

[Note: The input lives until the wait]
gloo reads an all-gather's input any time before the wait. Inductor keeps an
allocating collective's input alive until its wait, but not an ``_out`` one's, whose
wait names only the buffer; the memory could be reused while gloo reads it. So the
pass adds a second ``wait_tensor``, on the input, right after the buffer's wait::

    r   = wait_tensor(ag)
    _   = wait_tensor(shard)    # no collective produced shard: a no-op at run time

``tests/test_passes_e2e.py`` checks the generated code: no input is deleted or reused
between its all-gather and the wait.

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
