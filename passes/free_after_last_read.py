"""Move each free of an unsharded placeholder after the graph's last read of it.

[Note: Frees after the last read]
A unit's backward frees its placeholders in the post-accumulate-grad hook that
finishes it. Compiled autograd moves every ``AccumulateGrad`` and its hooks as early
as it can, and in the inlined graph a linear's two gradients are two matmuls: when the
weight's gradient comes first, the free lands before the input gradient's read of the
weight (``nn.MultiheadAttention``'s ``in_proj_weight`` under Inductor).

So this pass, the first on every post-grad graph, moves each free of a placeholder to
just after the last node that reads it (or a view of it) before its next grow or the
end of the graph. Nothing writes the placeholder between free and grow, so no value
changes; the memory is freed a little later. The ``output`` node is not a read. A
correctness fix, so :class:`PassConfig` does not switch it. ``aot_eager`` runs no
post-grad pass (docs/passes.md).
"""

from __future__ import annotations

from torch import fx

from ._graph import is_placeholder_op, is_resize, resize_nbytes
from ._rewrite import alias_closure, node_order

__all__ = ["free_after_last_read"]


def _is_grow(node: fx.Node, placeholder: fx.Node) -> bool:
    return is_resize(node) and node.args[0] is placeholder and resize_nbytes(node) != 0


def free_after_last_read(gm: fx.GraphModule) -> int:
    """Moves each free of a placeholder after its last read before its next grow.
    See [Note: Frees after the last read].

    Returns:
        How many frees were moved.
    """
    graph = gm.graph
    frees = [n for n in graph.nodes if is_resize(n) and resize_nbytes(n) == 0]
    moved = 0
    order = node_order(graph)
    for free in frees:
        placeholder = free.args[0]
        if not isinstance(placeholder, fx.Node):
            continue
        at = order[free]
        grows = [order[n] for n in placeholder.users if _is_grow(n, placeholder) and order[n] > at]
        end = min(grows, default=len(order))
        last = None
        for alias in alias_closure(placeholder):
            for reader in alias.users:
                if reader.op == "output" or is_placeholder_op(reader):
                    continue
                if at < order[reader] < end and (last is None or order[reader] > order[last]):
                    last = reader
        if last is not None:
            last.append(free)
            moved += 1
            order = node_order(graph)  # the move shifted positions
    return moved
