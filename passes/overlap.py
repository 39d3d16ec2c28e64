"""Overlap communication with compute: prefetch all-gathers, wait late for reductions.

[Note: Overlap]
The traced runtime waits for every collective where it issues it ([Note: In-flight
all-gathers on gloo] in ``traceable_hsdp/_collectives.py``), so nothing overlaps. This
pass moves two kinds of nodes.

**Prefetch.** The graph's all-gathers form one chain. Each but the first, with the
nodes computing its input from graph inputs alone (copy-in, padding, casts), is issued
right after the previous all-gather's wait, before the previous unit's compute; its
own wait stays before its first use. Forward (after bucketing), before::

    ag1  = all_gather_into_tensor(buf1, 2, "0")
    r1   = wait_tensor(ag1)
    p1   = view(split_columns(view(r1, [2, n1]), [k1, ..])[0], [..])  # unit 1's params
    y1   = mm(x, p1)                                               # unit 1's compute
    buf2 = cat([reshape(w2a, [-1]), reshape(w2b, [-1])])
    ag2  = all_gather_into_tensor(buf2, 2, "0")
    r2   = wait_tensor(ag2)
    p2   = ...r2...
    y2   = mm(y1, p2)

After::

    ag1  = all_gather_into_tensor(buf1, 2, "0")
    r1   = wait_tensor(ag1)
    buf2 = cat([reshape(w2a, [-1]), reshape(w2b, [-1])])
    ag2  = all_gather_into_tensor(buf2, 2, "0")    # in flight during unit 1's compute
    p1   = ...r1...
    y1   = mm(x, p1)
    r2   = wait_tensor(ag2)                         # unchanged: before its first use
    p2   = ...r2...
    y2   = mm(y1, p2)

The backward is the same chain: unit k-1's re-gather is issued right after unit k's is
waited for.

**The first all-gather stays.** In a backward it is the last unit's re-gather; issued
earlier it would hold that unit's parameters through the head's backward (often the
memory peak) with no idle core to hide it behind on gloo.

At most one all-gather is in flight (gloo needs it), and all-gather waits never move.
The new place is pushed later, past any node it must follow: a node computing its input
that is not pure copy-in work (a side effect, or compute on activations); a write to a
tensor it or a moved node reads (``writes_between`` in ``_rewrite.py``); any collective
but a reduce-scatter or all-reduce.

**Collective order.** All-gathers keep their order. A prefetched all-gather may pass
reduce-scatters it does not read. The pass is a deterministic function of the graph's
structure, the same on every rank, so every rank issues the same collectives in the
same new order.

**Late waits.** The wait of each reduce-scatter and all-reduce, with the views of its
result, moves down to just before the first of: the next collective (but an
all-gather) on the same group, another use of the result, a write to its input.
Before::

    rs1 = reduce_scatter_tensor(g1, "avg", 2, "0")
    s1  = wait_tensor(rs1)
    o1  = view(slice(s1, 0, 0, 32), [4, 8])     # a graph output
    ... unit 0's backward ...
    rs0 = reduce_scatter_tensor(g0, "avg", 2, "0")

After::

    rs1 = reduce_scatter_tensor(g1, "avg", 2, "0")
    ... unit 0's backward ...                    # overlaps rs1
    s1  = wait_tensor(rs1)
    o1  = view(slice(s1, 0, 0, 32), [4, 8])
    rs0 = reduce_scatter_tensor(g0, "avg", 2, "0")

Runs after ``remove_resize_copy`` and the bucketing passes.

[Note: Overlap memory bound]
Relative to the graph before the pass, the extra memory alive at any point is at most
one all-gather bucket's output and input (two units' gathered parameters where there
was one: the prefetch windows do not overlap), and, per group, one reduce-scatter
bucket's input kept until its wait (at most one in flight per group). Measured in
docs/benchmarks.md.

Invariant: every node computes the same value as before (only the order changes;
no read moves across a write to what it reads), every node still follows its inputs,
and the all-gathers keep their order. Checked bitwise in ``tests/test_passes_unit.py``.

[Note: Overlap and Inductor's scheduler]
Inductor's scheduler then orders the kernels, bound only by data dependencies. With
``reorder_for_peak_memory`` on (the default) it puts every wait back right after its
issue, so nothing overlaps; with it off the generated code keeps this pass's order
(``tests/test_passes_e2e.py`` checks the wrapper code), as torchtitan's SimpleFSDP
does. :func:`traceable_hsdp.passes.install` turns it off when the overlap pass is on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import fx

from ._graph import (
    collective_group_name,
    has_side_effects,
    is_all_gather,
    is_all_reduce,
    is_collective,
    is_reduce_scatter,
    is_wait,
    single_wait,
)
from ._rewrite import alias_closure, node_order, writes_between

__all__ = [
    "LateWait",
    "Prefetch",
    "overlap",
    "plan_prefetches",
    "plan_late_waits",
    "prefetch_all_gathers",
    "sink_reduction_waits",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefetch:
    """Issue ``gather`` (after ``hoist``: the copy-in nodes computing its input, in
    graph order) right after ``after``."""

    gather: fx.Node
    after: fx.Node
    hoist: tuple[fx.Node, ...]
    crossed: int  # nodes that were before the gather and now follow it


@dataclass(frozen=True)
class LateWait:
    """Move ``nodes`` (a wait, then the views of its result, in graph order) to just
    before ``before``."""

    nodes: tuple[fx.Node, ...]
    before: fx.Node
    crossed: int  # nodes that were after the wait and now precede it


def overlap(gm: fx.GraphModule) -> int:
    """Issues each all-gather one unit early and waits for each reduce-scatter and
    all-reduce as late as its group allows. See [Note: Overlap] and [Note: Overlap
    memory bound].

    Args:
        gm: a post-grad graph module, changed in place.

    Returns:
        The number of nodes moved (prefetched all-gathers plus late waits; 0: the
        graph is unchanged).
    """
    return prefetch_all_gathers(gm) + sink_reduction_waits(gm)


# -------------------------------------------------------------------- prefetch
def prefetch_all_gathers(gm: fx.GraphModule) -> int:
    """The prefetch half of :func:`overlap`.

    Returns:
        The number of all-gathers issued earlier (0: the graph is unchanged).
    """
    plans = plan_prefetches(gm.graph)
    if not plans:
        return 0
    for p in plans:
        cursor = p.after
        for n in (*p.hoist, p.gather):
            cursor.append(n)
            cursor = n
        log.debug(
            "overlap: %s (with %d input nodes) issued after %s, before %d nodes",
            p.gather.name,
            len(p.hoist),
            p.after.name,
            p.crossed,
        )
    log.info(
        "overlap: issued %d all-gathers early: %s",
        len(plans),
        ", ".join(f"{p.gather.name} (+{p.crossed} nodes)" for p in plans),
    )
    gm.graph.lint()
    gm.recompile()
    return len(plans)


def plan_prefetches(graph: fx.Graph) -> list[Prefetch]:
    """Where each all-gather but the first can be issued (see [Note: Overlap]); the
    graph is not changed. All-gathers that would not move are left out."""
    order = node_order(graph)
    gathers = [n for n in graph.nodes if is_all_gather(n)]
    if len(gathers) < 2:
        return []
    from_inputs = _from_inputs(graph)
    plans: list[Prefetch] = []
    for prev, gather in zip(gathers, gathers[1:]):
        prev_wait = single_wait(prev)
        if prev_wait is None:
            log.info(
                "overlap: %s stays: the previous all-gather %s has no single wait",
                gather.name,
                prev.name,
            )
            continue
        if order[prev_wait] > order[gather]:
            continue  # already issued before the previous one is waited for
        plan = _plan_prefetch(gather, prev_wait, order, from_inputs)
        if plan is not None:
            plans.append(plan)
    return plans


def _from_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Graph inputs, constants and the pure nodes computed from them and from no
    collective's result: the copy-in work a prefetch may take along."""
    found: set[fx.Node] = set()

    def source(i: fx.Node) -> bool:
        return i in found or (
            i.op == "call_function"
            and has_side_effects(i)
            and not (is_collective(i) or is_wait(i))
        )

    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr") or (
            n.op == "call_function"
            and not has_side_effects(n)
            and all(source(i) for i in n.all_input_nodes)
        ):
            found.add(n)
    return found


def _plan_prefetch(
    gather: fx.Node, anchor: fx.Node, order: dict[fx.Node, int], from_inputs: set[fx.Node]
) -> Prefetch | None:
    """``gather`` issued as early after ``anchor`` as its barriers allow."""
    while True:
        hoist = _producers_after(gather, anchor, order)
        barrier = _last_barrier(gather, hoist, anchor, order, from_inputs)
        if barrier is None:
            break
        anchor = barrier
    moving = {*hoist, gather}
    crossed = sum(1 for n in _between(anchor, gather) if n not in moving)
    if crossed == 0:
        return None
    return Prefetch(gather, anchor, tuple(sorted(hoist, key=order.__getitem__)), crossed)


def _producers_after(
    gather: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]
) -> set[fx.Node]:
    """The nodes after ``anchor`` that ``gather``'s input depends on."""
    found: set[fx.Node] = set()
    stack = list(gather.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in found or order[n] <= order[anchor]:
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _last_barrier(
    gather: fx.Node,
    hoist: set[fx.Node],
    anchor: fx.Node,
    order: dict[fx.Node, int],
    from_inputs: set[fx.Node],
) -> fx.Node | None:
    """The last node after ``anchor`` that the moved nodes must stay after, if any."""
    barriers: list[fx.Node] = [n for n in hoist if n not in from_inputs]
    for n in (*hoist, gather):
        for x in n.all_input_nodes:
            barriers.extend(w for w in writes_between(x, anchor, n, order) if w is not n)
    for n in _between(anchor, gather):
        if is_collective(n) and not (is_reduce_scatter(n) or is_all_reduce(n)):
            barriers.append(n)
    return max(barriers, key=order.__getitem__) if barriers else None


def _between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
    """The nodes strictly between ``a`` and a later ``b``."""
    out = []
    n = a.next
    while n is not b:
        out.append(n)
        n = n.next
    return out


# ------------------------------------------------------------------ late waits
def sink_reduction_waits(gm: fx.GraphModule) -> int:
    """The late-wait half of :func:`overlap`.

    Returns:
        The number of waits moved later (0: the graph is unchanged).
    """
    plans = plan_late_waits(gm.graph)
    if not plans:
        return 0
    for p in plans:
        for n in p.nodes:
            p.before.prepend(n)
        log.debug(
            "overlap: %s (with %d views) waited before %s, after %d nodes",
            p.nodes[0].name,
            len(p.nodes) - 1,
            p.before.name,
            p.crossed,
        )
    log.info(
        "overlap: waited %d reduce-scatters/all-reduces late: %s",
        len(plans),
        ", ".join(f"{p.nodes[0].name} (+{p.crossed} nodes)" for p in plans),
    )
    gm.graph.lint()
    gm.recompile()
    return len(plans)


def plan_late_waits(graph: fx.Graph) -> list[LateWait]:
    """Where the wait of each reduce-scatter and all-reduce can go (see [Note:
    Overlap]); the graph is not changed. Waits that would not move are left out."""
    order = node_order(graph)
    nodes = list(graph.nodes)
    # Issues a wait must not pass: every collective but the all-gathers.
    issues = [n for n in nodes if is_collective(n) and not is_all_gather(n)]
    plans: list[LateWait] = []
    for c in issues:
        if not (is_reduce_scatter(c) or is_all_reduce(c)):
            continue
        wait = single_wait(c)
        if wait is None:
            continue
        tail = alias_closure(wait)  # the wait and the views of its result
        tail_set = set(tail)
        bounds = [u for t in tail for u in t.users if u not in tail_set]
        group = collective_group_name(c)
        for n in issues:
            other = collective_group_name(n)
            if order[n] > order[wait] and (group is None or other is None or other == group):
                bounds.append(n)
                break
        bounds.extend(writes_between(c.args[0], wait, nodes[-1], order))
        if not bounds:
            continue  # no output node: nothing to bound by (not a real graph)
        before = min(bounds, key=order.__getitem__)
        moving = tuple(
            sorted((t for t in tail if order[t] < order[before]), key=order.__getitem__)
        )
        crossed = sum(1 for n in _between(wait, before) if n not in tail_set)
        if crossed:
            plans.append(LateWait(moving, before, crossed))
    return plans
