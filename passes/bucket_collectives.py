"""Fuse the all-gathers, and the reduce-scatters, of one fully_shard unit.

The traced runtime issues one collective per parameter; these passes merge a unit's
in the compiled graph. They use plain FX, not Inductor's private ``bucketing`` helpers
(whose signatures change between releases). Each pass plans the buckets on the
unchanged graph, then rewrites them.

[Note: All-gather buckets]
A unit's gathers are the maximal run of all-gathers (same group, size, dtype, device)
with no read of their results in between; only pure compute that reads none of them
may sit inside the run, and another collective, wait or side effect closes it.
Before (one unit, two parameters, 2 ranks)::

    ag0 = all_gather_into_tensor(w0, 2, "0")         # w0: (4, 8)  -> (8, 8)
    r0  = wait_tensor(ag0)
    ag1 = all_gather_into_tensor(w1, 2, "0")         # w1: (3,)    -> (6,)
    r1  = wait_tensor(ag1)
    ... uses of r0, r1 ...

After::

    f0  = reshape(w0, [-1]); f1 = reshape(w1, [-1])
    buf = cat([f0, f1])                              # (35,) this rank's flat input
    ag  = all_gather_into_tensor(buf, 2, "0")        # (70,) = cat(buf of rank 0, 1)
    r   = wait_tensor(ag)
    grd = view(r, [2, 35])                           # row k: rank k's flat input
    bs  = traceable_hsdp.split_columns(grd, [32, 3]) # column blocks, each copied
    r0  = view(bs[0], [8, 8])                        # rank-major rows of w0
    r1  = view(bs[1], [6])
    ... uses of r0, r1 ...

The bucket goes just before the first use of its results; the column split ([Note:
One copy-out per all-gather bucket] in ``_ops.py``) turns the rank-major output back
into each parameter's ``cat`` over ranks.

[Note: Reduce-scatter buckets]
A unit's reduce-scatters are the run of reduce-scatters (same group, size, reduce op,
dtype, device) between two all-gathers (each unit's backward starts with its
re-gather). Before::

    rs0 = reduce_scatter_tensor(g0, "avg", 2, "0")   # g0: (8, 8)  -> (4, 8)
    s0  = wait_tensor(rs0)
    ... more backward compute ...
    rs1 = reduce_scatter_tensor(g1, "avg", 2, "0")   # g1: (6,)    -> (3,)
    s1  = wait_tensor(rs1)

After (at the last reduce-scatter of the bucket)::

    c0  = reshape(g0, [2, 32]); c1 = reshape(g1, [2, 3])   # row k: rank k's chunk
    buf = view(cat([c0, c1], 1), [-1])               # (70,) rank-major chunks
    rs  = reduce_scatter_tensor(buf, "avg", 2, "0")  # (35,) this rank's chunks
    s   = wait_tensor(rs)
    s0  = view(slice(s, 0, 0, 32), [4, 8])
    s1  = view(slice(s, 0, 32, 35), [3])

Reads of a result between the reduce-scatters (HSDP's all-reduce, views) move after
the bucket; a side-effecting read splits it. With ``reshard_after_forward=False``
nothing delimits the units, so the whole backward is one bucket (every unsharded
gradient lives until it is issued).

[Note: A dominant gradient is reduced alone]
A reduce-scatter larger than the rest of its bucket together, and at least the bucket
cap (``DEFAULT_BUCKET_CAP_MB`` where there is none), is left out of the bucket and
issued from its own tensor. Packed, it is copied: the gradient and the bucket are
alive at once (a language model's head or embedding gradient, with the exchange's
received half beside the bucket: the backward's tensor peak), to save one
collective's latency, which at that size is small beside the copy. The rest of the
unit is bucketed as before; the lone one, at least the cap, never merges with another
unit under it. Checked in ``tests/test_passes_unit.py``
(``test_dominant_gradient_reduced_alone``); measured in docs/benchmarks.md
("Memory").

The merged collective carries the annotations of those it replaces ([Note: Collective
annotations] in ``_graph.py``).

Invariant of both: every replaced wait's value is bitwise the same, no collective reads
its input before it is complete or crosses a mutation, and all ranks run the same
rewrite, so they issue the same collectives in the same order.

[Note: Bucket size cap]
``bucket_cap_mb=None`` gives one bucket per unit. A number merges adjacent units
(same key) while the bucket stays within the cap (MiB of the gathered output for an
all-gather, of the reduce-scatter input for a reduce-scatter); a unit is never split.
Merging all-gathers issues the later unit's gather early (its inputs are hoisted when
they are pure); merging reduce-scatters delays the earlier unit's.

[Note: The default bucket cap]
``DEFAULT_BUCKET_CAP_MB`` sits near the size where a collective's latency equals its
bandwidth term: below it merging saves about a whole latency, above it nothing. A unit
above the cap is never merged, so only small, latency-bound units merge, and the memory
held early or late is bounded by a few times the cap. Measured in docs/benchmarks.md
(``benchmarks/collective_latency.py``, ``benchmarks/step_time.py``).

[Note: Per-unit pass options]
Whether a collective is bucketed, and under which cap, is decided by the
:class:`UnitPassOptions` its unit carries in its annotation (``hsdp()``'s
``comm_fusion`` and ``bucket_size``), else by the ``PassConfig`` (the ``enabled`` and
``bucket_cap_mb`` arguments). The options are part of the bucket key, so units with
different options never share a bucket and never change another model's graphs.
Where annotations are lost (compiled-autograd backward graphs), the ``PassConfig``
applies and ``TraceableHSDPPass`` warns once.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from ._graph import (
    ALL_GATHER,
    REDUCE_SCATTER,
    WAIT,
    UnitPassOptions,
    collective_group,
    has_side_effects,
    is_all_gather,
    is_collective,
    is_fsdp_copy,
    is_grow,
    is_reduce_scatter,
    is_view,
    is_wait,
    merge_annotations,
    set_annotation,
    single_wait,
    unit_pass_options,
)
from ._ops import SPLIT_COLUMNS
from ._rewrite import (
    alias_closure,
    erase_all,
    insert_call,
    node_order,
    static_numel,
    tensor_val,
    writes_between,
)

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "bucket_all_gathers",
    "bucket_reduce_scatters",
    "plan_all_gather_buckets",
    "plan_reduce_scatter_buckets",
]

log = logging.getLogger(__name__)
_aten = torch.ops.aten
_MIB = 1024 * 1024

# See [Note: The default bucket cap].
DEFAULT_BUCKET_CAP_MB = 4.0


@dataclass
class _Unit:
    nodes: list[fx.Node]
    key: Hashable
    nbytes: int
    cap_mb: float | None  # see [Note: Bucket size cap]


def _options(
    node: fx.Node, enabled: bool, bucket_cap_mb: float | None
) -> tuple[UnitPassOptions | None, float | None] | None:
    """``(the unit's options or None, the cap that applies)`` for a collective to
    bucket, or ``None`` when it stays alone. See [Note: Per-unit pass options]."""
    opts = unit_pass_options(node)
    if opts is None:
        return (None, bucket_cap_mb) if enabled else None
    return (opts, opts.bucket_cap_mb) if opts.bucket else None


@dataclass(frozen=True)
class _Member:
    """One collective of a bucket, with what the rewrite needs."""

    node: fx.Node  # the all-gather or reduce-scatter
    wait: fx.Node  # its only user
    input: fx.Node
    numel: int  # of the input
    out_shape: list[int]  # of the wait

    @staticmethod
    def of(node: fx.Node) -> _Member:
        # The planning keys checked all of this; see _all_gather_key and
        # _reduce_scatter_key.
        wait, inp = single_wait(node), node.args[0]
        in_val, out_val = tensor_val(inp), tensor_val(wait)
        assert wait is not None and isinstance(inp, fx.Node)
        assert in_val is not None and out_val is not None
        numel = static_numel(in_val)
        assert numel is not None
        return _Member(node, wait, inp, numel, list(out_val.shape))


def _group(node: fx.Node) -> tuple[int, str]:
    group = collective_group(node)
    assert group is not None  # checked when planning
    return group


# ------------------------------------------------------------------ all-gathers
def bucket_all_gathers(
    gm: fx.GraphModule, bucket_cap_mb: float | None = None, *, enabled: bool = True
) -> int:
    """Merges each unit's all-gathers into one. See [Note: All-gather buckets].

    Args:
        gm: a post-grad graph module, changed in place.
        bucket_cap_mb: see [Note: Bucket size cap] (default ``None``: per unit).
        enabled: whether the all-gathers of units that carry no pass options of
            their own are bucketed (default ``True``); see [Note: Per-unit pass
            options]. ``bucket_cap_mb`` applies to those units too.

    Returns:
        The number of merged all-gathers created (0: the graph is unchanged).
    """
    buckets = plan_all_gather_buckets(gm.graph, bucket_cap_mb, enabled=enabled)
    done: list[int] = []
    for bucket in buckets:
        if _merge_all_gathers(gm.graph, bucket):
            done.append(len(bucket))
    return _finish(gm, "bucket_all_gathers", "all-gathers", done)


def plan_all_gather_buckets(
    graph: fx.Graph, bucket_cap_mb: float | None = None, *, enabled: bool = True
) -> list[list[fx.Node]]:
    """The all-gather nodes to merge, one list per bucket of two or more, in graph
    order; the graph is not changed."""
    order = node_order(graph)
    units: list[_Unit] = []
    current: _Unit | None = None
    results: set[fx.Node] = set()

    def close() -> None:
        nonlocal current
        if current is not None:
            units.append(current)
        current = None
        results.clear()

    for node in graph.nodes:
        if is_all_gather(node):
            key_bytes = _all_gather_key(node)
            options = _options(node, enabled, bucket_cap_mb)
            if key_bytes is None or options is None:
                close()
                continue
            key, nbytes = (key_bytes[0], options[0]), key_bytes[1]
            if current is not None and current.key == key:
                current.nodes.append(node)
                current.nbytes += nbytes
            else:
                close()
                current = _Unit([node], key, nbytes, options[1])
            continue
        if current is None:
            continue
        if is_wait(node) and node.args[0] in current.nodes:
            results.add(node)
        elif any(i in results for i in node.all_input_nodes) or has_side_effects(node):
            close()
    close()
    return _apply_cap(units, lambda nodes: _all_gather_layout(nodes, order) is not None)


def _all_gather_key(node: fx.Node) -> tuple[Hashable, int] | None:
    group = collective_group(node)
    val = tensor_val(node.args[0])
    if group is None or val is None or single_wait(node) is None:
        return None
    numel = static_numel(val)
    if numel is None:
        return None
    size, name = group
    return (size, name, val.dtype, val.device), size * numel * val.dtype.itemsize


def _all_gather_layout(
    gathers: Sequence[fx.Node], order: dict[fx.Node, int]
) -> tuple[fx.Node, list[fx.Node]] | None:
    """Where the merged all-gather goes (before the first read of any result) and
    the pure nodes to hoist before it so that every input is ready there; ``None``
    if that cannot be done."""
    results = {w for w in (single_wait(g) for g in gathers) if w is not None}
    if len(results) != len(gathers):
        return None
    readers = [u for w in results for u in w.users]
    if readers:
        at = min(readers, key=order.__getitem__)
    else:
        at = max(results, key=order.__getitem__).next
    hoist: set[fx.Node] = set()
    for g in gathers:
        stack = [g.args[0]]
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in hoist:
                continue
            if n in results:
                return None  # the input reads a result of the bucket
            if order[n] < order[at]:
                continue
            if has_side_effects(n) or n is at:
                return None
            hoist.add(n)
            stack.extend(n.all_input_nodes)
        if writes_between(g.args[0], at, g, order):
            return None
    return at, sorted(hoist, key=order.__getitem__)


def _merge_all_gathers(graph: fx.Graph, gathers: list[fx.Node]) -> bool:
    layout = _all_gather_layout(gathers, node_order(graph))
    if layout is None:
        log.info(
            "bucket_all_gathers: cannot place the bucket of %s any more; left as is",
            [g.name for g in gathers],
        )
        return False
    at, hoist = layout
    for n in hoist:
        at.prepend(n)
    size, name = _group(gathers[0])
    members = [_Member.of(g) for g in gathers]
    total = sum(m.numel for m in members)
    first = gathers[0]
    with graph.inserting_before(at):
        flat = [
            insert_call(graph, _aten.reshape.default, (m.input, [-1]), like=m.node)
            for m in members
        ]
        buf = insert_call(graph, _aten.cat.default, (flat,), like=first)
        ag = insert_call(graph, ALL_GATHER, (buf, size, name), like=first)
        set_annotation(ag, merge_annotations(gathers))
        out = insert_call(graph, WAIT, (ag,), like=first)
        grid = insert_call(graph, _aten.view.default, (out, [size, total]), like=first)
        if all(_only_copied(m.wait) for m in members):
            # See [Note: A bucket copied straight into its placeholders].
            offset = 0
            for m in members:
                block = insert_call(
                    graph, _aten.slice.Tensor, (grid, 1, offset, offset + m.numel), like=m.node
                )
                result = insert_call(graph, _aten.reshape.default, (block, m.out_shape),
                                     like=m.node)
                m.wait.replace_all_uses_with(result)
                offset += m.numel
            _grow_at_fill(graph, buf, out)
        else:
            # See [Note: One copy-out per all-gather bucket] in _ops.py.
            blocks = insert_call(
                graph, SPLIT_COLUMNS, (grid, [m.numel for m in members]), like=first
            )
            for i, m in enumerate(members):
                dense = insert_call(graph, operator.getitem, (blocks, i), like=m.node)
                result = insert_call(graph, _aten.view.default, (dense, m.out_shape),
                                     like=m.node)
                m.wait.replace_all_uses_with(result)
    erase_all(graph, [n for m in members for n in (m.wait, m.node)])
    log.debug("bucket_all_gathers: %s -> %s", [g.name for g in gathers], ag.name)
    return True


# [Note: A bucket copied straight into its placeholders]
# A unit that stays gathered after its forward (the root, by default) keeps its
# placeholders' fills (``remove_resize_copy`` leaves a region without a free), so each
# gathered parameter is read only by views and ``fsdp.copy_`` into its placeholder.
# ``split_columns`` would copy every block out of the bucket first: a second copy of
# the whole bucket alive beside the gathered bucket and the placeholders (207 MiB for
# HF Llama's embedding and LM head at width 1024). For such a bucket each block is a
# ``reshape`` of a column slice of the grid instead, which the copy's kernel reads in
# place: Inductor lowers the reshape of a strided slice as an indexing of it, not a
# copy. Buckets with any other reader keep ``split_columns``. The bucket goes before
# the first fill, after the first placeholder's grow: that grow moves down to its
# fill (:func:`_grow_at_fill`, when nothing between reads the placeholder), so no
# placeholder holds its bytes while the bucket is packed and gathered (for that
# Llama, the embedding's 104 MiB at the step's peak).
# ``tests/test_passes_unit.py`` checks the form and the values;
# ``benchmarks/memory.py`` measures the forward's peak.
def _fills(node: fx.Node) -> list[fx.Node]:
    """The ``fsdp.copy_`` nodes that ``node``'s value reaches through views."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if is_fsdp_copy(u) and u.args[1] is n:
                out.append(u)
            elif u.op == "call_function" and is_view(u) and u.args[0] is n:
                stack.append(u)
    return out


def _grow_at_fill(graph: fx.Graph, buf: fx.Node, wait: fx.Node) -> int:
    """Moves each grow that precedes the bucket ``buf`` packs down to just before the
    ``fsdp.copy_`` that fills its placeholder from the bucket's ``wait``, when nothing
    between reads or writes the placeholder. Returns how many moved. See [Note: A
    bucket copied straight into its placeholders]."""
    order = node_order(graph)
    moved = 0
    for fill in _fills(wait):
        placeholder = fill.args[0]
        if not isinstance(placeholder, fx.Node):
            continue
        grows = [u for u in placeholder.users
                 if is_grow(u, placeholder) and order[u] < order[fill]]
        if not grows:
            continue
        grow = max(grows, key=order.__getitem__)
        if order[grow] > order[buf]:
            continue
        aliases = alias_closure(placeholder)
        between = [u for a in aliases for u in a.users
                   if u is not grow and u is not fill and order[grow] < order[u] < order[fill]]
        between += [a for a in aliases
                    if a is not placeholder and order[grow] < order[a] < order[fill]]
        if between:
            continue
        fill.prepend(grow)
        moved += 1
    return moved


def _only_copied(wait: fx.Node) -> bool:
    """Whether ``wait``'s value reaches nothing but ``fsdp.copy_`` sources, through
    views."""
    stack, seen = [wait], {wait}
    while stack:
        n = stack.pop()
        for u in n.users:
            if is_fsdp_copy(u) and u.args[1] is n and u.args[0] is not n:
                continue
            if u.op == "call_function" and is_view(u) and u.args[0] is n:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
                continue
            return False
    return True


# -------------------------------------------------------------- reduce-scatters
def bucket_reduce_scatters(
    gm: fx.GraphModule, bucket_cap_mb: float | None = None, *, enabled: bool = True
) -> int:
    """Merges each unit's reduce-scatters into one. See [Note: Reduce-scatter
    buckets].

    Args:
        gm: a post-grad graph module, changed in place.
        bucket_cap_mb: see [Note: Bucket size cap] (default ``None``: per unit).
        enabled: whether the reduce-scatters of units that carry no pass options of
            their own are bucketed (default ``True``); see [Note: Per-unit pass
            options].

    Returns:
        The number of merged reduce-scatters created (0: the graph is unchanged).
    """
    buckets = plan_reduce_scatter_buckets(gm.graph, bucket_cap_mb, enabled=enabled)
    done: list[int] = []
    for bucket in buckets:
        if _merge_reduce_scatters(gm.graph, bucket):
            done.append(len(bucket))
    return _finish(gm, "bucket_reduce_scatters", "reduce-scatters", done)


def plan_reduce_scatter_buckets(
    graph: fx.Graph, bucket_cap_mb: float | None = None, *, enabled: bool = True
) -> list[list[fx.Node]]:
    """The reduce-scatter nodes to merge, one list per bucket of two or more, in
    graph order; the graph is not changed."""
    order = node_order(graph)

    def valid(nodes: list[fx.Node]) -> bool:
        return _reduce_scatter_layout(nodes, order) is not None

    runs: list[_Unit] = []
    current: _Unit | None = None
    for node in graph.nodes:
        if is_all_gather(node):
            if current is not None:
                runs.append(current)
            current = None
        elif is_reduce_scatter(node):
            key_bytes = _reduce_scatter_key(node)
            options = _options(node, enabled, bucket_cap_mb)
            if key_bytes is None or options is None:
                if current is not None:
                    runs.append(current)
                current = None
                continue
            key, nbytes = (key_bytes[0], options[0]), key_bytes[1]
            if current is not None and current.key == key:
                current.nodes.append(node)
                current.nbytes += nbytes
            else:
                if current is not None:
                    runs.append(current)
                current = _Unit([node], key, nbytes, options[1])
    if current is not None:
        runs.append(current)
    # A run whose results are read in between in a way that cannot move splits.
    units: list[_Unit] = []
    for run in runs:
        part = _Unit([run.nodes[0]], run.key, 0, run.cap_mb)
        for node in run.nodes[1:]:
            if valid([*part.nodes, node]):
                part.nodes.append(node)
            else:
                units.append(part)
                part = _Unit([node], run.key, 0, run.cap_mb)
        units.append(part)
    for unit in units:
        unit.nbytes = sum(_nbytes(_reduce_scatter_key(n)) for n in unit.nodes)
    return _apply_cap([part for unit in units for part in _split_dominant(unit, valid)], valid)


def _split_dominant(unit: _Unit, valid: Callable[[list[fx.Node]], bool]) -> list[_Unit]:
    """``unit`` as it is, or, when one reduce-scatter dominates it, that one alone and
    the rest. See [Note: A dominant gradient is reduced alone]."""
    if len(unit.nodes) < 2:
        return [unit]
    sizes = [_nbytes(_reduce_scatter_key(n)) for n in unit.nodes]
    i = max(range(len(sizes)), key=sizes.__getitem__)
    cap_mb = DEFAULT_BUCKET_CAP_MB if unit.cap_mb is None else unit.cap_mb
    rest = [n for j, n in enumerate(unit.nodes) if j != i]
    if sizes[i] < cap_mb * _MIB or sizes[i] <= unit.nbytes - sizes[i] or not valid(rest):
        return [unit]
    log.debug(
        "bucket_reduce_scatters: %s (%d bytes) reduced alone, not copied into the bucket of %s",
        unit.nodes[i].name, sizes[i], [n.name for n in rest],
    )
    # At least the cap, it never merges with another unit under it.
    alone = _Unit([unit.nodes[i]], unit.key, sizes[i], unit.cap_mb)
    others = _Unit(rest, unit.key, unit.nbytes - sizes[i], unit.cap_mb)
    return [alone, others] if i == 0 else [others, alone]


def _nbytes(key_bytes: tuple[Hashable, int] | None) -> int:
    assert key_bytes is not None  # planned nodes all have a key
    return key_bytes[1]


def _reduce_scatter_key(node: fx.Node) -> tuple[Hashable, int] | None:
    group = collective_group(node)
    val = tensor_val(node.args[0])
    op = node.args[1]
    if group is None or val is None or single_wait(node) is None or not isinstance(op, str):
        return None
    numel = static_numel(val)
    size, name = group
    if numel is None or numel % size:
        return None
    return (size, name, op, val.dtype, val.device), numel * val.dtype.itemsize


def _movable(node: fx.Node) -> bool:
    """A reader of a reduced result that may run later: pure compute, or a functional
    collective and its wait (HSDP's all-reduce)."""
    return not has_side_effects(node) or is_collective(node) or is_wait(node)


def _reduce_scatter_layout(
    scatters: Sequence[fx.Node], order: dict[fx.Node, int]
) -> tuple[fx.Node, list[fx.Node]] | None:
    """The last reduce-scatter (the merged one goes right after it) and the readers
    of results to move after the merged one; ``None`` if that cannot be done."""
    waits = [single_wait(s) for s in scatters]
    results = {w for w in waits if w is not None}
    if len(results) != len(scatters):
        return None
    members = set(scatters)
    first = min(scatters, key=order.__getitem__)
    last = max(scatters, key=order.__getitem__)
    moved: list[fx.Node] = []
    node = first.next
    while order[node] < order[last]:
        if node in members:
            if any(i in results for i in node.all_input_nodes):
                return None
        elif node not in results and any(i in results for i in node.all_input_nodes):
            if not _movable(node):
                return None
            results.add(node)
            moved.append(node)
        node = node.next
    # A reduce-scatter reading an earlier member's result (sequence parallelism)
    # cannot join its bucket.
    if any(i in results for i in last.all_input_nodes):
        return None
    for s in scatters:
        if writes_between(s.args[0], s, last, order):
            return None
    return last, moved


def _merge_reduce_scatters(graph: fx.Graph, scatters: list[fx.Node]) -> bool:
    layout = _reduce_scatter_layout(scatters, node_order(graph))
    if layout is None:
        log.info(
            "bucket_reduce_scatters: cannot place the bucket of %s any more; left as is",
            [s.name for s in scatters],
        )
        return False
    last, moved = layout
    size, name = _group(scatters[0])
    op = scatters[0].args[1]
    members = [_Member.of(s) for s in scatters]
    after = last
    with graph.inserting_before(last.next):
        rows = [
            insert_call(graph, _aten.reshape.default, (m.input, [size, m.numel // size]), like=m.node)
            for m in members
        ]
        grid = insert_call(graph, _aten.cat.default, (rows, 1), like=last)
        buf = insert_call(graph, _aten.view.default, (grid, [-1]), like=last)
        rs = insert_call(graph, REDUCE_SCATTER, (buf, op, size, name), like=last)
        set_annotation(rs, merge_annotations(scatters))
        out = insert_call(graph, WAIT, (rs,), like=last)
        offset = 0
        for m in members:
            chunk = m.numel // size
            part = insert_call(
                graph, _aten.slice.Tensor, (out, 0, offset, offset + chunk), like=m.node
            )
            after = insert_call(graph, _aten.view.default, (part, m.out_shape), like=m.node)
            m.wait.replace_all_uses_with(after)
            offset += chunk
    for n in moved:
        after.append(n)
        after = n
    erase_all(graph, [n for m in members for n in (m.wait, m.node)])
    log.debug("bucket_reduce_scatters: %s -> %s", [s.name for s in scatters], rs.name)
    return True


# ---------------------------------------------------------------------- shared
def _apply_cap(
    units: list[_Unit], valid: Callable[[list[fx.Node]], bool]
) -> list[list[fx.Node]]:
    """Merges adjacent units of the same key within their cap (see [Note: Bucket size
    cap]; units of one key have one cap); keeps the buckets of two or more
    collectives."""
    if units:
        merged = [units[0]]
        for unit in units[1:]:
            acc = merged[-1]
            if (
                unit.key == acc.key
                and acc.cap_mb is not None
                and acc.nbytes + unit.nbytes <= acc.cap_mb * _MIB
                and valid([*acc.nodes, *unit.nodes])
            ):
                merged[-1] = _Unit(
                    [*acc.nodes, *unit.nodes], acc.key, acc.nbytes + unit.nbytes, acc.cap_mb
                )
            else:
                merged.append(unit)
        units = merged
    return [u.nodes for u in units if len(u.nodes) >= 2]


def _finish(gm: fx.GraphModule, pass_name: str, what: str, sizes: list[int]) -> int:
    if not sizes:
        return 0
    log.info(
        "%s: %d %s -> %d (bucket sizes %s)",
        pass_name,
        sum(sizes),
        what,
        len(sizes),
        sizes,
    )
    gm.graph.lint()
    gm.recompile()
    return len(sizes)
