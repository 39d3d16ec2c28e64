"""Move each free of an unsharded placeholder after the graph's last read of it.

[Note: Frees after the last read]
A unit's backward frees its placeholders (``resize_storage_bytes_(p, 0)``) in the
post-accumulate-grad hook that finishes it, traced into the compiled-autograd
graph. Compiled autograd inlines the forward graph's AOTAutograd backward into that
graph and then moves every ``AccumulateGrad`` and its hooks as early as it can, to
mimic eager (``reorder_accumulate_grad_nodes`` and
``reorder_post_acc_grad_hook_nodes`` in ``torch/_dynamo/compiled_autograd.py``).
Eagerly, a linear's two gradients come from one autograd node, so a weight's
gradient is never accumulated before its last read. In the inlined graph they are
two matmuls, and when the weight's gradient comes first the free lands between
them: a ``nn.TransformerEncoderLayer`` unit (``nn.MultiheadAttention``'s packed
``in_proj_weight``) compiled with Inductor read its freed placeholder in the
matmul of its input's gradient and failed ("The tensor has a non-zero number of
elements, but its data is not allocated yet"). With aot_eager the decomposition
emits the other order.

So this pass, the first on every post-grad graph, moves each free of a placeholder
to just after the last node that reads it, or a view of it, before its next grow
(a resize to a non-zero size) or the end of the graph. A read after the free can
only be of the values the fill wrote (nothing else writes the placeholder between
the free and its next grow), so the move changes no value; it frees the memory a
little later. The graph's ``output`` node is not a read: the forward returns freed
placeholders that its backward fills again. It is a correctness fix, not an
optimisation, so :class:`PassConfig` does not switch it. A graph compiled with
``aot_eager`` runs no post-grad pass; there the order is torch's (see
docs/passes.md).
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
