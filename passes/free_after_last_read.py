"""Move each free of an unsharded placeholder to just after the graph's last read of it.

[Note: Frees after the last read]
A unit's backward frees its placeholders in the post-accumulate-grad hook that
finishes it. In a compiled graph that position is wrong both ways:

- **Too early.** Compiled autograd moves every ``AccumulateGrad`` and its hooks as
  early as it can, and in the inlined graph a linear's two gradients are two
  matmuls: when the weight's gradient comes first, the free lands before the input
  gradient's read of the weight (``nn.MultiheadAttention``'s ``in_proj_weight``
  under Inductor). A correctness fix.
- **Too late.** A unit that stays gathered after its forward (the root, by default)
  is freed only when its backward ends, after its reduce-scatter allocated its
  buffers, although its parameters were last read much earlier: an LM head at the
  start of the backward, an embedding in the forward. Eagerly torch's FSDP2 frees
  them just before that reduce-scatter; the graph can free each at its last read.

So this pass, the first on every post-grad graph, moves each free of a placeholder to
just after the last node that reads or writes it (or a view of it) since its previous
grow, or since the graph's start, and before its next grow or the graph's end. A free
with no such node moves to the graph's start when the placeholder arrives gathered
(no grow before it). Nothing reads the placeholder between the new and the old
position, so no value changes. The ``output`` node is not a read. A free moves
earlier only when no other graph input shares the placeholder's storage (compiled
autograd can pass a saved view of it as an input of its own, read through that
input). Not switched by :class:`PassConfig`: one half is a correctness fix.
``aot_eager`` runs no post-grad pass (docs/passes.md). ``tests/test_passes_unit.py``
checks both moves on a built graph; ``benchmarks/memory.py`` measures the root's.
"""

from __future__ import annotations

from torch import fx

from ._graph import is_grow, is_resize, resize_nbytes
from ._rewrite import alias_closure, node_order, storage_sharers

__all__ = ["free_after_last_read"]


def free_after_last_read(gm: fx.GraphModule) -> int:
    """Moves each free of a placeholder to just after its last read or write between
    its previous and its next grow. See [Note: Frees after the last read].

    Returns:
        How many frees were moved.
    """
    graph = gm.graph
    frees = [n for n in graph.nodes if is_resize(n) and resize_nbytes(n) == 0]
    sharers = storage_sharers(graph)
    moved = 0
    order = node_order(graph)
    for free in frees:
        placeholder = free.args[0]
        if not isinstance(placeholder, fx.Node):
            continue
        at = order[free]
        grows = [order[n] for n in placeholder.users if is_grow(n, placeholder)]
        start = max((g for g in grows if g < at), default=-1)
        end = min((g for g in grows if g > at), default=len(order))
        last = None
        for alias in alias_closure(placeholder):
            for user in alias.users:
                if user is free or user.op == "output" or (is_resize(user) and user.args[0] is placeholder):
                    continue
                if start < order[user] < end and (last is None or order[user] > order[last]):
                    last = user
        if last is None:
            if start >= 0 or placeholder.op != "placeholder" or placeholder in sharers:
                continue
            # Arrives gathered and nothing here reads it: free it first.
            last = max(graph.find_nodes(op="placeholder"), key=order.__getitem__)
        if order[last] < at and placeholder in sharers:
            continue
        if last.next is free:
            continue
        last.append(free)
        moved += 1
        order = node_order(graph)  # the move shifted positions
    return moved
