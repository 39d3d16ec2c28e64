"""Tier 1: the graph passes on small hand-built FX graphs (no processes, no model
compile). Each test pins the exact rewrite by counting nodes before and after.

Values are checked by running the graphs, before and after a pass, in a small SPMD
simulator (``_run_spmd``): it runs one graph for every rank in lock step and
computes each functional collective from all ranks' inputs, so the rank-major
un-interleaving of a bucketed all-gather (and the chunking of a bucketed
reduce-scatter) is checked for 2 and 3 ranks without a process group. All value
checks are bitwise: the passes only move data (a bucketed reduce-scatter sums the
same elements in the same rank order).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import traceable_hsdp as th
import traceable_hsdp.passes as passes
from _workers import AtenOps, FunctionalCollectiveOps
from traceable_hsdp.debug._recorder import PostGradRecorder
from traceable_hsdp.debug._table import family_counts, graph_counts
from traceable_hsdp.passes import (
    PassConfig,
    bucket_all_gathers,
    bucket_reduce_scatters,
    free_after_last_read,
    overlap,
    remove_resize_copy,
)
from traceable_hsdp.passes._graph import (
    ALL_GATHER,
    ALL_REDUCE,
    FSDP_COPY,
    REDUCE_SCATTER,
    RESIZE,
    WAIT,
    UnitPassOptions,
    annotation_of,
    annotation_value,
    is_all_gather,
    is_all_reduce,
    is_collective,
    is_fsdp_copy,
    is_reduce_scatter,
    is_resize,
    is_wait,
    set_annotation,
)
from traceable_hsdp.passes._ops import PACK_TWICE, SPLIT_COLUMNS
from traceable_hsdp.passes._rewrite import alias_closure, set_fake_val, tensor_val

aten = torch.ops.aten
F32 = torch.float32
BROADCAST = torch.ops._c10d_functional.broadcast.default


# --------------------------------------------------------------------- helpers
class _Builder:
    """Builds a graph of real ops by hand, with fake values on every tensor node."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()

    def input(self, name: str, *shape: int, dtype: torch.dtype = F32) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        if target not in (RESIZE, FSDP_COPY):  # side effects only: no value
            set_fake_val(node)
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


_KINDS = (
    ("all_gather", is_all_gather),
    ("reduce_scatter", is_reduce_scatter),
    ("all_reduce", is_all_reduce),
    ("wait", is_wait),
    ("copy", is_fsdp_copy),
    ("resize", is_resize),
)


def _counts(gm: fx.GraphModule) -> Counter[str]:
    c: Counter[str] = Counter()
    for n in gm.graph.nodes:
        c["nodes"] += 1
        for name, pred in _KINDS:
            if pred(n):
                c[name] += 1
    return c


def _run_spmd(gm: fx.GraphModule, per_rank_inputs: list[list[torch.Tensor]]) -> list[list[Any]]:
    """Runs ``gm`` on every rank's inputs in lock step; collectives see all ranks."""
    world = len(per_rank_inputs)
    envs: list[dict[fx.Node, Any]] = [{} for _ in range(world)]
    outputs: list[list[Any]] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for r in range(world):
        envs[r].update(zip(placeholders, per_rank_inputs[r]))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            for r in range(world):
                outputs.append(list(fx.node.map_arg(node.args[0], envs[r].__getitem__)))
            break
        if is_all_gather(node) or is_reduce_scatter(node) or is_all_reduce(node):
            xs = [envs[r][node.args[0]] for r in range(world)]
            if is_all_gather(node):
                assert node.args[1] == world
                results = [torch.cat(xs).clone() for _ in range(world)]
            else:
                op = node.args[1]
                total = xs[0].clone()
                for x in xs[1:]:
                    total = total + x
                if op == "avg":
                    total = total / world
                if is_all_reduce(node):
                    results = [total.clone() for _ in range(world)]
                else:
                    results = [c.clone() for c in total.chunk(world)]
            for r in range(world):
                envs[r][node] = results[r]
            continue
        for r in range(world):
            if is_wait(node):
                envs[r][node] = envs[r][node.args[0]]
                continue
            args = fx.node.map_arg(node.args, envs[r].__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, envs[r].__getitem__)
            envs[r][node] = node.target(*args, **kwargs)
    return outputs


def _placeholder(*shape: int) -> torch.Tensor:
    """An unsharded placeholder as the runtime makes it: full shape, 0 bytes."""
    p = torch.empty(shape)
    p.untyped_storage().resize_(0)
    return p


def _same(a: list[list[Any]], b: list[list[Any]]) -> None:
    assert len(a) == len(b)
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert torch.equal(x, y), (x, y)


def _graph_text(gm: fx.GraphModule) -> str:
    return str(gm.graph)


# ----------------------------------------------------- remove_resize_copy
def _forward_like(world: int = 2) -> tuple[fx.GraphModule, list[list[torch.Tensor]]]:
    """One unit, two parameters: w0 (8, 8) even, w1 (5,) padded to 3 rows a rank.
    Gathers first, then each parameter's fill as the runtime traces it (the padded
    one's slice, grow, copy), compute, frees; p0 is also returned (as AOTAutograd
    returns a placeholder it saves for backward)."""
    b = _Builder()
    w0, w1 = b.input("w0", 8 // world, 8), b.input("w1", 3)
    p0, p1 = b.input("p0", 8, 8), b.input("p1", 5)
    x = b.input("x", 2, 8)
    r0 = b(WAIT, b(ALL_GATHER, w0, world, "0"))
    r1 = b(WAIT, b(ALL_GATHER, w1, world, "0"))
    b(RESIZE, p0, 8 * 8 * 4)
    b(FSDP_COPY, p0, r0)
    full1 = b(aten.slice.Tensor, r1, 0, 0, 5)
    b(RESIZE, p1, 5 * 4)
    b(FSDP_COPY, p1, full1)
    y = b(aten.mm.default, x, b(aten.permute.default, p0, [1, 0]))
    out = b(aten.add.Tensor, y, b(aten.sum.default, p1))
    b(RESIZE, p0, 0)
    b(RESIZE, p1, 0)
    gm = b.done(out, p0)
    g = torch.Generator().manual_seed(0)
    inputs = [
        [
            torch.randn(8 // world, 8, generator=g),
            torch.randn(3, generator=g),
            _placeholder(8, 8),
            _placeholder(5),
            torch.randn(2, 8, generator=g),
        ]
        for _ in range(world)
    ]
    return gm, inputs


def _values(out: list[list[Any]]) -> list[list[Any]]:
    """The data outputs (the returned placeholder has no data: compare its size)."""
    return [[o[0], torch.tensor(o[1].untyped_storage().nbytes())] for o in out]


def test_free_after_last_read_moves_a_free_past_its_readers() -> None:
    """[Note: Frees after the last read]: a free between a placeholder's fill and a
    read of it (through a view) moves to just after that read; a free far after its
    last read moves up to just after it; the output node (the forward returns freed
    placeholders) is not a read; a read after the next grow is the refilled value's
    and is not waited for."""
    b = _Builder()
    p, q, x = b.input("p", 4, 4), b.input("q", 4, 4), b.input("x", 2, 4)
    full = b.input("full", 4, 4)
    b(RESIZE, p, 64)
    b(FSDP_COPY, p, full)
    b(RESIZE, q, 64)
    b(FSDP_COPY, q, full)
    view = b(aten.permute.default, p, [1, 0])
    y = b(aten.mm.default, x, q)
    free_p = b(RESIZE, p, 0)  # before the mm that reads p's view
    z = b(aten.mm.default, x, view)
    free_q = b(RESIZE, q, 0)  # after q's last read: stays
    b(RESIZE, p, 64)
    b(FSDP_COPY, p, full)
    w = b(aten.mm.default, x, p)  # reads the refill
    gm = b.done(b(aten.add.Tensor, b(aten.add.Tensor, y, z), w), p)
    assert free_after_last_read(gm) == 2
    order = [n for n in gm.graph.nodes]
    assert order.index(z) + 1 == order.index(free_p), gm.graph
    assert order.index(y) + 1 == order.index(free_q), gm.graph  # q's last read
    assert free_after_last_read(gm) == 0  # nothing left to move


def test_free_after_last_read_frees_a_gathered_input_early() -> None:
    """[Note: Frees after the last read]: a placeholder that arrives gathered (no
    grow in the graph) is freed just after its last read, or first when nothing reads
    it; one whose storage another input shares keeps its free where it was."""
    b = _Builder()
    head, embed, x = b.input("head", 4, 4), b.input("embed", 4, 4), b.input("x", 2, 4)
    shared = b.input("shared", 4, 4)
    alias = b.graph.placeholder("alias")  # a saved view of ``shared``: its storage
    alias.meta["val"] = shared.meta["val"].view(16)
    y = b(aten.mm.default, x, head)
    z = b(aten.mm.default, x, shared)
    w = b(aten.add.Tensor, y, z)
    free_embed = b(RESIZE, embed, 0)
    free_head = b(RESIZE, head, 0)
    free_shared = b(RESIZE, shared, 0)
    gm = b.done(b(aten.add.Tensor, w, b(aten.sum.default, alias)))
    assert free_after_last_read(gm) == 2
    order = list(gm.graph.nodes)
    assert order.index(free_embed) == order.index(alias) + 1, gm.graph  # first
    assert order.index(free_head) == order.index(y) + 1, gm.graph
    assert order.index(free_shared) == order.index(free_head) + 3, gm.graph  # stays
    assert free_after_last_read(gm) == 0


def test_remove_resize_copy_rewrites_forward_regions() -> None:
    gm, inputs = _forward_like()
    before = _counts(gm)
    ref = _values(_run_spmd(gm, inputs))
    assert remove_resize_copy(gm) == 2
    after = _counts(gm)
    assert (before["copy"], before["resize"], before["all_gather"]) == (2, 4, 2)
    assert (after["copy"], after["resize"], after["all_gather"]) == (0, 0, 2)
    assert after["nodes"] == before["nodes"] - 6  # nothing added: shapes already match
    by_target = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    assert by_target[aten.permute.default].args[0].target is WAIT  # reads the gathered p0
    assert by_target[aten.sum.default].args[0].target is aten.slice.Tensor  # p1's rows
    _same(_values(_run_spmd(gm, inputs)), ref)


def test_remove_resize_copy_no_match_is_unchanged() -> None:
    b = _Builder()
    x, w = b.input("x", 2, 4), b.input("w", 4, 4)
    gm = b.done(b(aten.mm.default, x, w))
    text = _graph_text(gm)
    assert remove_resize_copy(gm) == 0
    assert _graph_text(gm) == text


def _one_param(
    free: bool = True,
    grow_bytes: int = 64,
    use_before_copy: bool = False,
    use_after_free: bool = False,
    mutate: bool = False,
    return_view: bool = False,
    shared_input: bool = False,
) -> fx.GraphModule:
    """One placeholder p (4, 4) filled from a gather, with one defect switched on.
    ``shared_input``: another graph input, ``saved``, shares p's storage and is read
    after the copy (as compiled autograd passes an eager forward's saved placeholder
    beside the one its re-gather hook fills)."""
    b = _Builder()
    w, p, x = b.input("w", 2, 4), b.input("p", 4, 4), b.input("x", 4, 4)
    saved = None
    if shared_input:
        saved = b.graph.placeholder("saved")
        saved.meta["val"] = p.meta["val"].view(4, 4)  # the same fake storage
    r = b(WAIT, b(ALL_GATHER, w, 2, "0"))
    b(RESIZE, p, grow_bytes)
    if use_before_copy:
        b(aten.sum.default, p)
    b(FSDP_COPY, p, r)
    y = b(aten.mm.default, x, p if saved is None else saved)
    if mutate:
        b(aten.add_.Tensor, p, 1.0)
    t = b(aten.t.default, p)
    if free:
        b(RESIZE, p, 0)
    outs = [y]
    if use_after_free:
        outs.append(b(aten.mm.default, x, p))
    if return_view:
        outs.append(t)
    return b.done(*outs)


@pytest.mark.parametrize(
    ("defect", "reason"),
    [
        ({"free": False}, "never freed (incomplete)"),
        ({"grow_bytes": 32}, "resizes it to 32 bytes"),
        ({"use_before_copy": True}, "outside a grow -> copy -> free region"),
        ({"use_after_free": True}, "outside a grow -> copy -> free region"),
        ({"mutate": True}, "writes to it"),
        ({"return_view": True}, "is a graph output"),
        ({"shared_input": True}, "graph inputs saved share its storage"),
    ],
)
def test_remove_resize_copy_skips_incomplete_or_mutated(
    defect: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    gm = _one_param(**defect)
    text = _graph_text(gm)
    with caplog.at_level(logging.INFO, logger="traceable_hsdp.passes.remove_resize_copy"):
        assert remove_resize_copy(gm) == 0
    assert _graph_text(gm) == text
    assert "leaving p alone: " in caplog.text and reason in caplog.text, caplog.text


def test_remove_resize_copy_control_case_of_the_defects() -> None:
    gm = _one_param()
    before = _counts(gm)
    assert remove_resize_copy(gm) == 1
    after = _counts(gm)
    assert (after["copy"], after["resize"]) == (0, 0)
    assert after["nodes"] == before["nodes"] - 3


def test_remove_resize_copy_multi_region() -> None:
    """p is grown, filled and freed twice (forward, then the backward's re-gather);
    the second fill copies from a transposed (non-contiguous) source: a contiguous
    clone is inserted, so the uses see p's strides."""
    b = _Builder()
    w, p, x = b.input("w", 2, 4), b.input("p", 4, 4), b.input("x", 4, 4)
    r = b(WAIT, b(ALL_GATHER, w, 2, "0"))
    b(RESIZE, p, 64)
    b(FSDP_COPY, p, r)
    y = b(aten.mm.default, x, p)
    b(RESIZE, p, 0)
    r2 = b(WAIT, b(ALL_GATHER, w, 2, "0"))
    b(RESIZE, p, 64)
    b(FSDP_COPY, p, b(aten.t.default, r2))
    z = b(aten.mm.default, y, b(aten.view.default, p, [4, 4]))
    b(RESIZE, p, 0)
    gm = b.done(z)
    before = _counts(gm)
    g = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(2, 4, generator=g), _placeholder(4, 4), torch.randn(4, 4, generator=g)] for _ in range(2)]
    ref = _run_spmd(gm, inputs)
    assert remove_resize_copy(gm) == 2
    after = _counts(gm)
    assert (before["copy"], before["resize"]) == (2, 4)
    assert (after["copy"], after["resize"]) == (0, 0)
    assert after["nodes"] == before["nodes"] - 6 + 1  # one clone
    _same(_run_spmd(gm, inputs), ref)


def test_remove_resize_copy_broadcast_copy_of_as_many_elements() -> None:
    """fsdp.copy_ of a (16,) source into a (1, 16) placeholder: a view restores the
    placeholder's shape."""
    b = _Builder()
    w, p = b.input("w", 8), b.input("p", 1, 16)
    r = b(WAIT, b(ALL_GATHER, w, 2, "0"))
    b(RESIZE, p, 64)
    b(FSDP_COPY, p, r)
    y = b(aten.sum.dim_IntList, p, [0])
    b(RESIZE, p, 0)
    gm = b.done(y)
    inputs = [[torch.randn(8), _placeholder(1, 16)] for _ in range(2)]
    ref = _run_spmd(gm, inputs)
    n = _counts(gm)["nodes"]
    assert remove_resize_copy(gm) == 1
    assert _counts(gm)["nodes"] == n - 3 + 1
    _same(_run_spmd(gm, inputs), ref)


def test_remove_resize_copy_leaves_other_params_alone_when_one_is_bad(
    caplog: pytest.LogCaptureFixture,
) -> None:
    b = _Builder()
    w, p, q, x = b.input("w", 2, 4), b.input("p", 4, 4), b.input("q", 4, 4), b.input("x", 4, 4)
    r = b(WAIT, b(ALL_GATHER, w, 2, "0"))
    for t in (p, q):
        b(RESIZE, t, 64)
        b(FSDP_COPY, t, r)
    y = b(aten.mm.default, b(aten.mm.default, x, p), q)
    b(RESIZE, p, 0)  # q is never freed
    gm = b.done(y)
    with caplog.at_level(logging.INFO, logger="traceable_hsdp.passes.remove_resize_copy"):
        assert remove_resize_copy(gm) == 1
    c = _counts(gm)
    assert (c["copy"], c["resize"]) == (1, 1)
    assert "leaving q alone" in caplog.text


# --------------------------------------------------------- bucket_all_gathers
_SHAPES = [(4, 8), (3,), (2, 3, 2)]  # per-rank shard shapes, 3 parameters


def _gathers(world: int, dtypes: tuple[torch.dtype, ...] = (F32, F32, F32), units: int = 1):
    """``units`` units of 3 gathers each; each unit's results are read (summed) before
    the next unit gathers."""
    b = _Builder()
    shards = [
        [b.input(f"u{u}w{i}", *s, dtype=d) for i, (s, d) in enumerate(zip(_SHAPES, dtypes))]
        for u in range(units)
    ]
    acc = b.input("acc", 1)
    for u in range(units):
        results = [b(WAIT, b(ALL_GATHER, s, world, "0")) for s in shards[u]]
        for r in results:
            acc = b(aten.add.Tensor, acc, b(aten.sum.default, r))
    outs = [acc, *results]  # the last unit's gathered tensors themselves too
    gm = b.done(*outs)
    g = torch.Generator().manual_seed(2)
    inputs = [
        [torch.randn(s, generator=g).to(d) for _ in range(units) for s, d in zip(_SHAPES, dtypes)]
        + [torch.zeros(1)]
        for _ in range(world)
    ]
    return gm, inputs


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_all_gathers_three_into_one(world: int) -> None:
    gm, inputs = _gathers(world)
    before = _counts(gm)
    ref = _run_spmd(gm, inputs)
    assert bucket_all_gathers(gm) == 1
    after = _counts(gm)
    assert (before["all_gather"], before["wait"]) == (3, 3)
    assert (after["all_gather"], after["wait"]) == (1, 1)
    # 3 flattens + cat + gather + wait + view + split_columns + 3 x (getitem, view)
    # - 6 old nodes: one copy-out for the bucket, not a clone per parameter
    assert after["nodes"] == before["nodes"] + 3 + 4 + 1 + 6 - 6
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(SPLIT_COLUMNS) == 1 and aten.clone.default not in targets, targets
    out = _run_spmd(gm, inputs)
    _same(out, ref)  # bitwise: the gathered tensors come back in cat-over-ranks order
    for o, s in zip(out[0][1:], _SHAPES):
        assert o.shape == (world * s[0], *s[1:]) and o.is_contiguous()


def test_bucket_all_gathers_copies_a_kept_unit_straight_into_its_placeholders() -> None:
    """[Note: A bucket copied straight into its placeholders]: when every gathered
    parameter of a bucket is read only by ``fsdp.copy_`` into its placeholder (through
    views; the padded one through a slice), each is a reshape of the grid's column
    slice, with no ``split_columns``; the values are bitwise the same. Each
    placeholder grows just before its fill, after the bucket's wait: none holds its
    bytes while the bucket is gathered. A bucket with another reader keeps
    ``split_columns`` (the test above)."""
    gm, inputs = _forward_like()
    ref = _values(_run_spmd(gm, inputs))
    assert bucket_all_gathers(gm) == 1
    targets = [n.target for n in gm.graph.nodes]
    assert SPLIT_COLUMNS not in targets, gm.graph
    assert targets.count(aten.reshape.default) == 2 + 2, gm.graph  # 2 flattens, 2 blocks
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    wait = next(n for n in gm.graph.nodes if n.target is WAIT)
    grows = [n for n in gm.graph.nodes if n.target is RESIZE and n.args[1] != 0]
    assert len(grows) == 2, gm.graph
    for grow in grows:
        assert order[grow] > order[wait] and grow.next.target is FSDP_COPY, gm.graph
    _same(_values(_run_spmd(gm, inputs)), ref)


def test_bucket_all_gathers_one_bucket_per_unit_and_cap() -> None:
    gm, inputs = _gathers(2, units=2)
    ref = _run_spmd(gm, inputs)
    assert bucket_all_gathers(gm) == 2
    assert _counts(gm)["all_gather"] == 2
    _same(_run_spmd(gm, inputs), ref)

    # A cap that fits both units merges them (the second unit's gather goes early).
    unit_bytes = 2 * sum(torch.Size(s).numel() for s in _SHAPES) * 4
    gm, _ = _gathers(2, units=2)
    assert bucket_all_gathers(gm, bucket_cap_mb=2 * unit_bytes / 2**20) == 1
    assert _counts(gm)["all_gather"] == 1
    _same(_run_spmd(gm, inputs), ref)

    # A cap below two units keeps one bucket per unit (a unit is never split).
    gm, _ = _gathers(2, units=2)
    assert bucket_all_gathers(gm, bucket_cap_mb=1.5 * unit_bytes / 2**20) == 2
    gm, _ = _gathers(2, units=2)
    assert bucket_all_gathers(gm, bucket_cap_mb=0.0) == 2


def test_bucket_all_gathers_same_dtype_and_group_only() -> None:
    gm, inputs = _gathers(2, dtypes=(F32, torch.bfloat16, torch.bfloat16))
    ref = _run_spmd(gm, inputs)
    assert bucket_all_gathers(gm) == 1  # the two bf16 gathers; the f32 one stays
    assert _counts(gm)["all_gather"] == 2
    _same(_run_spmd(gm, inputs), ref)

    b = _Builder()
    a, c = b.input("a", 2, 2), b.input("c", 2, 2)
    ra = b(WAIT, b(ALL_GATHER, a, 2, "0"))
    rc = b(WAIT, b(ALL_GATHER, c, 2, "1"))  # another group
    gm = b.done(ra, rc)
    text = _graph_text(gm)
    assert bucket_all_gathers(gm) == 0
    assert _graph_text(gm) == text


def test_bucket_all_gathers_stops_at_a_read() -> None:
    """A read of the first result between two gathers makes two units of one:
    nothing to merge."""
    b = _Builder()
    a, c = b.input("a", 2, 2), b.input("c", 2, 2)
    ra = b(WAIT, b(ALL_GATHER, a, 2, "0"))
    s = b(aten.sum.default, ra)
    rc = b(WAIT, b(ALL_GATHER, c, 2, "0"))
    gm = b.done(s, rc)
    text = _graph_text(gm)
    assert bucket_all_gathers(gm) == 0
    assert _graph_text(gm) == text


def _annotate_units(gm: fx.GraphModule, options: list[UnitPassOptions | None]) -> None:
    """Annotates unit ``u``'s collectives (``u{u}...`` inputs; reduce-scatters in
    order, three per unit) as the runtime would, with ``options[u]``."""
    rs_seen = 0
    for n in gm.graph.nodes:
        if is_all_gather(n) and n.args[0].name.startswith("u"):
            u = int(n.args[0].name[1])
        elif is_reduce_scatter(n):
            u = rs_seen // 3
            rs_seen += 1
        else:
            continue
        set_annotation(n, annotation_value(f"unit{u}", [n.name], options[u]))


def test_bucketing_follows_each_units_own_options() -> None:
    """[Note: Per-unit pass options]: a unit's annotation decides over the pass's
    ``enabled``/cap (the process-wide PassConfig); units of different options never
    share a bucket; values stay bitwise."""
    off, on = UnitPassOptions(bucket=False), UnitPassOptions(bucket=True)
    gm, inputs = _gathers(2, units=2)
    ref = _run_spmd(gm, inputs)
    _annotate_units(gm, [off, None])  # unit 0 opts out; unit 1 follows `enabled`
    assert bucket_all_gathers(gm) == 1
    assert _counts(gm)["all_gather"] == 3 + 1
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _gathers(2, units=2)
    _annotate_units(gm, [on, None])  # unit 0 opts in although bucketing is off
    assert bucket_all_gathers(gm, enabled=False) == 1
    assert _counts(gm)["all_gather"] == 1 + 3
    assert annotation_of(next(n for n in gm.graph.nodes if is_all_gather(n)))["bucket"] is True
    # A cap carried by the units merges them; a unit with other options stays apart.
    unit_bytes = 2 * sum(torch.Size(s).numel() for s in _SHAPES) * 4
    capped = UnitPassOptions(bucket=True, bucket_cap_mb=2 * unit_bytes / 2**20)
    gm, _ = _gathers(2, units=2)
    _annotate_units(gm, [capped, capped])
    assert bucket_all_gathers(gm, enabled=False) == 1 and _counts(gm)["all_gather"] == 1
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _gathers(2, units=2)
    _annotate_units(gm, [capped, on])
    assert bucket_all_gathers(gm, bucket_cap_mb=1e3) == 2
    # Reduce-scatters alike.
    gm, inputs = _scatters(2, units=2)
    ref = _run_spmd(gm, inputs)
    _annotate_units(gm, [off, None])
    assert bucket_reduce_scatters(gm) == 1 and _counts(gm)["reduce_scatter"] == 3 + 1
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _scatters(2, units=2)
    _annotate_units(gm, [off, off])
    assert bucket_reduce_scatters(gm, bucket_cap_mb=1.0) == 0
    # run_passes with bucketing off in the configuration still honours an opt-in.
    gm, _ = _gathers(2, units=2)
    _annotate_units(gm, [on, None])
    cfg = PassConfig(remove_resize_copy=False, bucket_all_gathers=False, overlap=False)
    assert passes.run_passes(gm, cfg)["bucket_all_gathers"] == 1
    with pytest.raises(TypeError, match="bucket must be a bool"):
        UnitPassOptions(bucket=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        UnitPassOptions(bucket=True, bucket_cap_mb=-1.0)


# ----------------------------------------------------- bucket_reduce_scatters
def _scatters(world: int, hsdp: bool = False, units: int = 1):
    """Backward-like: per unit a re-gather, then 3 gradients each computed and
    reduce-scattered in turn (HSDP: all-reduced right after)."""
    shapes = [(world * 2, 3), (world * 3,), (world, 2, 2)]
    b = _Builder()
    w = b.input("w", 2, 2)
    grads_in = [[b.input(f"u{u}g{i}", *s) for i, s in enumerate(shapes)] for u in range(units)]
    outs = []
    for u in range(units):
        outs.append(b(WAIT, b(ALL_GATHER, w, world, "0")))
        for g in grads_in[u]:
            grad = b(aten.mul.Tensor, g, 2.0)  # "compute"
            r = b(WAIT, b(REDUCE_SCATTER, grad, "avg", world, "0"))
            if hsdp:
                r = b(WAIT, b(ALL_REDUCE, r, "avg", "1"))
            outs.append(r)
    gm = b.done(*outs)
    gen = torch.Generator().manual_seed(3)
    inputs = [
        [torch.randn(2, 2, generator=gen)]
        + [torch.randn(s, generator=gen) for _ in range(units) for s in shapes]
        for _ in range(world)
    ]
    return gm, inputs


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_reduce_scatters_three_into_one(world: int) -> None:
    gm, inputs = _scatters(world)
    before = _counts(gm)
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm) == 1
    after = _counts(gm)
    assert (before["reduce_scatter"], after["reduce_scatter"]) == (3, 1)
    # 3 reshapes + cat + view + rs + wait + 3 x (slice, view) - 6 old nodes
    assert after["nodes"] == before["nodes"] + 3 + 4 + 6 - 6
    _same(_run_spmd(gm, inputs), ref)


def test_bucket_reduce_scatters_hsdp_all_reduce_moves_after() -> None:
    gm, inputs = _scatters(2, hsdp=True)
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm) == 1
    c = _counts(gm)
    assert (c["reduce_scatter"], c["all_reduce"]) == (1, 3)
    _same(_run_spmd(gm, inputs), ref)
    order = [n for n in gm.graph.nodes if is_reduce_scatter(n) or is_all_reduce(n)]
    assert order[0].target is REDUCE_SCATTER  # every all-reduce reads the bucket


def test_bucket_reduce_scatters_per_unit_and_cap() -> None:
    gm, inputs = _scatters(2, units=2)
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm) == 2
    assert _counts(gm)["reduce_scatter"] == 2
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _scatters(2, units=2)
    assert bucket_reduce_scatters(gm, bucket_cap_mb=1.0) == 1
    assert _counts(gm)["reduce_scatter"] == 1
    _same(_run_spmd(gm, inputs), ref)


def _head_and_norms(head_rows: int, units: int = 1, first: tuple[int, ...] = (4, 3)):
    """Backward-like, 2 ranks: per unit a re-gather, then a ``first`` gradient, a
    (head_rows, 1024) one (a language model's head) and a (6,) one, each
    reduce-scattered in turn."""
    shapes = [first, (head_rows, 1024), (6,)]
    b = _Builder()
    w = b.input("w", 2, 2)
    grads = [[b.input(f"u{u}g{i}", *s) for i, s in enumerate(shapes)] for u in range(units)]
    outs = []
    for u in range(units):
        outs.append(b(WAIT, b(ALL_GATHER, w, 2, "0")))
        for g in grads[u]:
            outs.append(b(WAIT, b(REDUCE_SCATTER, b(aten.mul.Tensor, g, 2.0), "avg", 2, "0")))
    gen = torch.Generator().manual_seed(5)
    inputs = [
        [torch.randn(2, 2, generator=gen)]
        + [torch.randn(s, generator=gen) for _ in range(units) for s in shapes]
        for _ in range(2)
    ]
    return b.done(*outs), inputs


def _scatter_inputs(gm: fx.GraphModule) -> list[list[int]]:
    """Each reduce-scatter's input shape, in graph order."""
    return [list(tensor_val(n.args[0]).shape) for n in gm.graph.nodes if is_reduce_scatter(n)]


def test_dominant_gradient_reduced_alone() -> None:
    """[Note: A dominant gradient is reduced alone]: a 4.7 MiB gradient beside two of a
    few bytes is reduce-scattered from its own tensor (no copy into a bucket) and the
    two small ones are bucketed, with bitwise the results of unbucketed reduce-scatters;
    under a cap above its size, or when it is not larger than the rest, it is bucketed
    as before. Two such units give two lone ones and two buckets."""
    gm, inputs = _head_and_norms(1200)
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm) == 1
    assert _scatter_inputs(gm) == [[1200, 1024], [18]]  # alone (its own tensor), bucket
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _head_and_norms(1200)
    assert bucket_reduce_scatters(gm, bucket_cap_mb=8.0) == 1
    assert _scatter_inputs(gm) == [[1228818]]  # below the cap: one bucket
    gm, _ = _head_and_norms(2)  # 8 KiB: below the default cap
    assert bucket_reduce_scatters(gm) == 1 and len(_scatter_inputs(gm)) == 1
    gm, _ = _head_and_norms(1200, first=(1200, 1024))  # not larger than the rest
    assert bucket_reduce_scatters(gm) == 1 and len(_scatter_inputs(gm)) == 1
    gm, inputs = _head_and_norms(1200, units=2)
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm) == 2
    assert _scatter_inputs(gm) == [[1200, 1024], [18], [1200, 1024], [18]]
    _same(_run_spmd(gm, inputs), ref)


def test_bucket_reduce_scatters_split_by_side_effecting_read() -> None:
    """A read of the first result that cannot move (it writes to a graph input)
    keeps the first reduce-scatter out of the bucket."""
    b = _Builder()
    g0, g1, g2, buf = b.input("g0", 4), b.input("g1", 4), b.input("g2", 4), b.input("buf", 2)
    r0 = b(WAIT, b(REDUCE_SCATTER, g0, "avg", 2, "0"))
    b(aten.copy_.default, buf, r0)
    r1 = b(WAIT, b(REDUCE_SCATTER, g1, "avg", 2, "0"))
    r2 = b(WAIT, b(REDUCE_SCATTER, g2, "avg", 2, "0"))
    gm = b.done(r1, r2)
    assert bucket_reduce_scatters(gm) == 1
    assert _counts(gm)["reduce_scatter"] == 2


def test_bucket_reduce_scatters_never_merges_a_dependent_one() -> None:
    """A reduce-scatter whose input is computed from an earlier one's result (tensor
    parallelism's sequence-parallel reduce-scatters in the forward: the next layer
    reads the last one's output) is never merged with it, under any cap. Merging put
    the bucket before its own input (a graph that fails lint)."""
    b = _Builder()
    g0 = b.input("g0", 4)
    r0 = b(WAIT, b(REDUCE_SCATTER, g0, "sum", 2, "0"))
    h = b(aten.mul.Tensor, b(aten.cat.default, [r0, r0]), 2.0)  # the next layer
    r1 = b(WAIT, b(REDUCE_SCATTER, h, "sum", 2, "0"))
    gm = b.done(r1)
    inputs = [[torch.arange(4.0) + k] for k in range(2)]
    ref = _run_spmd(gm, inputs)
    assert bucket_reduce_scatters(gm, bucket_cap_mb=1e3) == 0
    assert _counts(gm)["reduce_scatter"] == 2
    _same(_run_spmd(gm, inputs), ref)


# ------------------------------------------------------------- all together
def test_all_passes_on_a_forward_like_graph() -> None:
    gm, inputs = _forward_like()
    ref = _values(_run_spmd(gm, inputs))
    done = passes.run_passes(gm, PassConfig())
    assert done == {
        "remove_resize_copy": 2,
        "bucket_all_gathers": 1,
        "bucket_reduce_scatters": 0,
        "overlap": 0,  # one unit: nothing to prefetch
        "reduce_scatter_by_exchange": 0,  # no reduce-scatter (and no gloo group here)
        "all_gather_by_exchange": 0,  # no gloo group here
    }
    c = _counts(gm)
    assert (c["all_gather"], c["copy"], c["resize"]) == (1, 0, 0)
    _same(_values(_run_spmd(gm, inputs)), ref)


def test_all_passes_overlap_the_buckets() -> None:
    """Per-parameter gathers of 3 units: bucketed one per unit, then each unit's
    bucket issued before the previous unit's reads (its copy-in moved with it)."""
    gm, inputs = _gathers(2, units=3)
    ref = _run_spmd(gm, inputs)
    done = passes.run_passes(gm, PassConfig(bucket_cap_mb=None))
    assert (done["bucket_all_gathers"], done["overlap"]) == (3, 2)
    ags = _of(gm, ALL_GATHER)
    assert all(a.args[0].target is aten.cat.default for a in ags)
    p = _pos(gm)
    sums = _of(gm, aten.sum.default)  # 3 reads per unit
    for u in (1, 2):
        assert p[next(iter(ags[u - 1].users)).name] < p[ags[u].name] < p[sums[3 * (u - 1)].name]
    assert _in_flight(gm, ALL_GATHER) == 1
    _same(_run_spmd(gm, inputs), ref)
    gm, _ = _gathers(2, units=3)
    assert "overlap" not in passes.run_passes(gm, PassConfig(overlap=False))
    # The default cap (4 MiB) merges the three small units into one bucket: nothing
    # is left to overlap.
    gm, _ = _gathers(2, units=3)
    done = passes.run_passes(gm, PassConfig())
    assert (done["bucket_all_gathers"], done["overlap"]) == (1, 0)
    assert len(_of(gm, ALL_GATHER)) == 1
    _same(_run_spmd(gm, inputs), ref)


def test_bucketing_without_remove_keeps_copies_after_the_bucket() -> None:
    gm, inputs = _forward_like()
    ref = _values(_run_spmd(gm, inputs))
    assert bucket_all_gathers(gm) == 1
    c = _counts(gm)
    assert (c["all_gather"], c["copy"], c["resize"]) == (1, 2, 4)
    _same(_values(_run_spmd(gm, inputs)), ref)


# ------------------------------------------------------- config and install
def test_config_from_env() -> None:
    f = PassConfig.from_env
    assert f({}) == PassConfig()
    assert f({"TRACEABLE_HSDP_PASSES": ""}) == PassConfig()
    off = dict(
        remove_resize_copy=False,
        bucket_all_gathers=False,
        bucket_reduce_scatters=False,
        overlap=False,
        reduce_scatter_by_exchange=False,
        all_gather_by_exchange=False,
    )
    assert f({"TRACEABLE_HSDP_PASSES": "none"}) == PassConfig(**off)
    assert f({"TRACEABLE_HSDP_PASSES": "all"}) == PassConfig()
    assert f({"TRACEABLE_HSDP_PASSES": "remove_resize_copy"}) == PassConfig(
        **{**off, "remove_resize_copy": True}
    )
    assert f({"TRACEABLE_HSDP_PASSES": " Remove_Resize_Copy , bucket , OVERLAP"}) == PassConfig(
        reduce_scatter_by_exchange=False, all_gather_by_exchange=False
    )
    assert f({"TRACEABLE_HSDP_PASSES": "remove_resize_copy,bucket,reduce_scatter_by_exchange"}) == (
        PassConfig(overlap=False, all_gather_by_exchange=False)
    )
    assert f({"TRACEABLE_HSDP_PASSES": "all_gather_by_exchange"}) == PassConfig(
        **{**off, "all_gather_by_exchange": True}
    )
    assert f({"TRACEABLE_HSDP_PASSES": "reduce_scatter_by_exchange"}) == PassConfig(
        **{**off, "reduce_scatter_by_exchange": True}
    )
    assert f({"TRACEABLE_HSDP_PASSES": "bucket_reduce_scatters"}) == PassConfig(
        **{**off, "bucket_reduce_scatters": True}
    )
    assert f({"TRACEABLE_HSDP_PASSES": "overlap"}) == PassConfig(**{**off, "overlap": True})
    assert f({"TRACEABLE_HSDP_BUCKET_CAP_MB": "25"}).bucket_cap_mb == 25.0
    assert f({"TRACEABLE_HSDP_BUCKET_CAP_MB": "none"}).bucket_cap_mb is None
    assert f({}).bucket_cap_mb == f({"TRACEABLE_HSDP_BUCKET_CAP_MB": ""}).bucket_cap_mb == 4.0
    assert PassConfig().bucket_cap_mb == passes.DEFAULT_BUCKET_CAP_MB == 4.0
    assert f({"TRACEABLE_HSDP_BUCKET_CAP_MB": "0.5"}).bucket_cap_mb == 0.5
    with pytest.raises(ValueError, match="unknown pass 'bucketing'"):
        f({"TRACEABLE_HSDP_PASSES": "bucketing"})
    with pytest.raises(ValueError, match="mixes 'none'"):
        f({"TRACEABLE_HSDP_PASSES": "none,bucket"})
    for bad in ("-1", "abc", "nan", "inf"):
        with pytest.raises(ValueError, match="TRACEABLE_HSDP_BUCKET_CAP_MB"):
            f({"TRACEABLE_HSDP_BUCKET_CAP_MB": bad})
    with pytest.raises(TypeError, match="must be a bool"):
        PassConfig(remove_resize_copy=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PassConfig.overlap must be a bool"):
        PassConfig(overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        PassConfig(bucket_cap_mb="25")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        PassConfig(bucket_cap_mb=-1.0)
    with pytest.raises(TypeError, match="pool_exchange_outputs must be a bool, or None"):
        PassConfig(pool_exchange_outputs=1)  # type: ignore[arg-type]


def test_pool_where_placeholders_fill() -> None:
    """[Note: Where the exchanges pool]: by default (``None``) a graph pools its
    exchanges' outputs only if it fills placeholders (an ``fsdp.copy_`` or a resize),
    as every graph of a step compiled whole does and no graph of ``compile_block``'s
    does (``tests/test_per_block.py`` counts neither op there); ``True`` and ``False``
    apply to every graph, and the rest of the configuration is kept."""
    from traceable_hsdp.passes._install import _pool_decided

    def graph(op: Any) -> fx.GraphModule:
        g = fx.Graph()
        full, shard = g.placeholder("full"), g.placeholder("shard")
        if op is torch.ops.fsdp.copy_.default:
            g.call_function(op, (full, shard))
        elif op is not None:
            g.call_function(op, (full, 0))
        g.output(shard)
        return fx.GraphModule(torch.nn.Module(), g)

    fills = [graph(torch.ops.fsdp.copy_.default),
             graph(torch.ops.inductor.resize_storage_bytes_.default)]
    plain = graph(None)
    default = PassConfig(overlap=False)
    assert default.pool_exchange_outputs is None
    for gm in fills:
        assert _pool_decided(gm, default) == PassConfig(overlap=False, pool_exchange_outputs=True)
    assert _pool_decided(plain, default) == PassConfig(overlap=False, pool_exchange_outputs=False)
    for fixed in (True, False):
        cfg = PassConfig(pool_exchange_outputs=fixed)
        assert all(_pool_decided(gm, cfg) is cfg for gm in (*fills, plain))


@pytest.fixture
def restore_passes():
    import torch._inductor.config as ic

    saved_pass, saved_cfg = ic.post_grad_custom_pre_pass, passes.get_config()
    yield ic
    ic.post_grad_custom_pre_pass = saved_pass
    passes.set_config(saved_cfg)


class _UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, uid: bytes | None = b"user-1") -> None:
        self.calls: list[int] = []
        self.uid = uid

    def __call__(self, graph: fx.Graph) -> None:
        # Sees the graph after ours: count the copies left.
        self.calls.append(sum(1 for n in graph.nodes if is_fsdp_copy(n)))

    def uuid(self) -> bytes | None:
        return self.uid


def test_uuid_follows_config_and_user_pass(restore_passes) -> None:
    p = passes.TraceableHSDPPass()
    base = p.uuid()
    assert isinstance(base, bytes) and base == passes.TraceableHSDPPass().uuid()
    passes.set_config(PassConfig(bucket_cap_mb=25.0))
    capped = p.uuid()
    assert capped != base
    passes.set_config(PassConfig(remove_resize_copy=False, bucket_cap_mb=25.0))
    assert p.uuid() not in (base, capped)
    passes.set_config(PassConfig(overlap=False))
    assert p.uuid() not in (base, capped)
    passes.set_config(PassConfig())
    assert p.uuid() == base
    assert passes.TraceableHSDPPass(_UserPass(b"a")).uuid() != passes.TraceableHSDPPass(_UserPass(b"b")).uuid()
    assert passes.TraceableHSDPPass(_UserPass(b"a")).uuid() != base
    # A user pass that cannot be hashed turns the cache off, as it would alone.
    assert passes.TraceableHSDPPass(_UserPass(None)).uuid() is None
    assert passes.TraceableHSDPPass(lambda g: None).uuid() is None


def test_install_is_idempotent_and_composes(restore_passes) -> None:
    ic = restore_passes
    user = _UserPass()
    ic.post_grad_custom_pre_pass = user
    passes.install()
    installed = ic.post_grad_custom_pre_pass
    assert isinstance(installed, passes.TraceableHSDPPass) and installed.user_pass is user
    passes.install()
    assert ic.post_grad_custom_pre_pass is installed  # idempotent
    gm, _ = _forward_like()
    installed(gm.graph, is_inference=False)
    assert user.calls == [0]  # ours ran first (no copies left), then theirs
    # One bucketed all-gather, issued into a buffer (CPU values): gather_into_buffers
    # runs after the configured passes.
    from traceable_hsdp.passes._graph import ALL_GATHER_OUT

    assert [n.target for n in gm.graph.nodes if n.target in (ALL_GATHER, ALL_GATHER_OUT)] == [
        ALL_GATHER_OUT
    ], gm.graph
    passes.uninstall()
    assert ic.post_grad_custom_pre_pass is user
    passes.install(PassConfig(remove_resize_copy=False))
    assert passes.config == PassConfig(remove_resize_copy=False)
    gm, _ = _forward_like()
    ic.post_grad_custom_pre_pass(gm.graph)
    assert user.calls == [0, 2]
    with pytest.raises(TypeError, match="PassConfig"):
        passes.set_config({"remove_resize_copy": True})  # type: ignore[arg-type]




def test_uninstall_restores_torchs_configuration(restore_passes) -> None:
    """[Note: Global switches]: install() changes five settings of torch's compile
    configuration; uninstall() puts every one back. The fifth, Inductor's layout
    decision, answers False for a graph holding a placeholder's resize or
    fsdp.copy_ and torch's answer for any other ([Note: Layout optimization and the
    placeholders])."""
    import torch._functorch.config as fc
    from torch._inductor.graph import GraphLowering
    from torch.fx.experimental.proxy_tensor import make_fx

    ic = restore_passes
    user = _UserPass()
    names = [(ic, "post_grad_custom_pre_pass"), (ic, "reorder_for_peak_memory"),
             (fc, "joint_custom_pass"), (fc, "recompute_views"),
             (GraphLowering, "decide_layout_opt")]
    conv = make_fx(torch.nn.functional.conv2d)(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    placeholder_ops, _ = _forward_like()
    saved = {(m, name): getattr(m, name) for m, name in names}
    try:
        passes.uninstall()  # what earlier tests (and fully_shard calls) installed
        ic.post_grad_custom_pre_pass = user
        fc.joint_custom_pass = lambda gm, inputs: gm
        ic.reorder_for_peak_memory, fc.recompute_views = True, False
        before = {(m, name): getattr(m, name) for m, name in names}
        passes.install(PassConfig())
        passes.install()  # idempotent: the values before the first change are kept
        assert isinstance(ic.post_grad_custom_pre_pass, passes.TraceableHSDPPass)
        assert isinstance(fc.joint_custom_pass, passes.TraceableHSDPJointPass)
        assert ic.reorder_for_peak_memory is False and fc.recompute_views is True
        torchs = before[(GraphLowering, "decide_layout_opt")]
        decide = GraphLowering.decide_layout_opt
        assert decide is not torchs
        assert decide(placeholder_ops, is_inference=False) is False
        assert decide(conv, is_inference=False) == torchs(conv, is_inference=False)
        passes.uninstall()
        assert {(m, name): getattr(m, name) for m, name in names} == before
        passes.uninstall()  # nothing installed: nothing changes
        assert {(m, name): getattr(m, name) for m, name in names} == before
        # Without overlap, Inductor's scheduler setting is left alone.
        passes.install(PassConfig(overlap=False))
        assert ic.reorder_for_peak_memory is True
        passes.uninstall()
        assert {(m, name): getattr(m, name) for m, name in names} == before
    finally:
        passes.uninstall()
        for m, name in names:
            value = saved[(m, name)]
            if m is GraphLowering and not isinstance(value, passes._install._LayoutOptDecision):
                value = staticmethod(value)  # torch's: a static method of the class
            setattr(m, name, value)


def test_units_with_own_options_enter_the_fx_cache_key(restore_passes) -> None:
    """[Note: Per-unit options and the FX graph cache]: the key does not see
    annotations, so the live units' own options (with their labels) enter our uuid():
    the same units and options give the same key, any change gives another, and the
    key comes back when the units are gone."""
    import gc

    class Unit:
        def __init__(self, label: str, bucket: bool) -> None:
            self.label, self.options = label, passes.UnitPassOptions(bucket=bucket)

        def pass_options_key(self) -> str:
            return f"{self.label}={self.options!r}"

    base = passes.TraceableHSDPPass().uuid()
    assert base is not None
    unit = Unit("layers.0", False)
    passes.track_unit_options(unit)
    with_unit = passes.TraceableHSDPPass().uuid()
    assert with_unit is not None and with_unit != base
    unit.label = "layers.1"  # the same options on another unit: another key
    assert passes.TraceableHSDPPass().uuid() not in (base, with_unit)
    unit.label, unit.options = "layers.0", passes.UnitPassOptions(bucket=True)
    assert passes.TraceableHSDPPass().uuid() not in (base, with_unit)
    unit.options = passes.UnitPassOptions(bucket=False)
    assert passes.TraceableHSDPPass().uuid() == with_unit  # deterministic
    del unit
    gc.collect()
    assert passes.TraceableHSDPPass().uuid() == base
    with pytest.raises(TypeError, match="pass_options_key"):
        passes.track_unit_options(object())


def test_fully_shard_installs_the_passes(restore_passes, one_rank_group) -> None:
    ic = restore_passes
    user = _UserPass()
    ic.post_grad_custom_pre_pass = user
    th.fully_shard(torch.nn.Linear(2, 2))
    installed = ic.post_grad_custom_pre_pass
    assert isinstance(installed, passes.TraceableHSDPPass) and installed.user_pass is user
    th.fully_shard(torch.nn.Linear(2, 2))
    assert ic.post_grad_custom_pre_pass is installed


def test_bucketed_graphs_run_with_real_collectives(one_rank_group) -> None:
    """The rewritten graphs execute with the real functional collectives (1 rank)."""
    b = _Builder()
    a, c, g0, g1 = b.input("a", 2, 3), b.input("c", 4), b.input("g0", 2, 3), b.input("g1", 4)
    ra = b(WAIT, b(ALL_GATHER, a, 1, one_rank_group))
    rc = b(WAIT, b(ALL_GATHER, c, 1, one_rank_group))
    s0 = b(WAIT, b(REDUCE_SCATTER, g0, "avg", 1, one_rank_group))
    s1 = b(WAIT, b(REDUCE_SCATTER, g1, "avg", 1, one_rank_group))
    gm = b.done(ra, rc, s0, s1)
    inputs = [torch.randn(2, 3), torch.randn(4), torch.randn(2, 3), torch.randn(4)]
    ref = gm(*inputs)
    assert bucket_all_gathers(gm) == 1 and bucket_reduce_scatters(gm) == 1
    assert (_counts(gm)["all_gather"], _counts(gm)["reduce_scatter"]) == (1, 1)
    for x, y in zip(gm(*inputs), ref):
        assert torch.equal(x, y)


def test_fx_graph_cache_stays_on(restore_passes, monkeypatch, tmp_path) -> None:
    """With our pass installed Inductor still caches (no bypass), and a changed
    configuration misses the cache. Compiles one tiny function, not a model."""
    import weakref

    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # A process whose units carry no pass options of their own (units an earlier
    # test made with hsdp() may still be alive; see [Note: Per-unit options and the
    # FX graph cache]).
    monkeypatch.setattr(passes._install, "_units_with_options", weakref.WeakSet())
    restore_passes.post_grad_custom_pre_pass = None
    passes.install(PassConfig())

    def f(x: torch.Tensor) -> torch.Tensor:
        return x @ x.t()  # an extern mm only: no C++ kernel to build

    def compile_once() -> dict[str, int]:
        counters.clear()
        torch._dynamo.reset()
        torch.compile(f)(torch.randn(8, 8))
        return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}

    try:
        assert compile_once() == {"fxgraph_cache_miss": 1}
        assert compile_once() == {"fxgraph_cache_hit": 1}
        passes.set_config(PassConfig(bucket_cap_mb=25.0))
        assert compile_once() == {"fxgraph_cache_miss": 1}
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------- overlap
def _pos(gm: fx.GraphModule) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def _of(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target]


def _copies(inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Fresh inputs for each run (a graph may write to its inputs)."""
    return [[t.clone() for t in rank] for rank in inputs]


def _in_flight(gm: fx.GraphModule, target: Any) -> int:
    """The most collectives of ``target`` issued and not yet waited for at once."""
    most, now = 0, set()
    for n in gm.graph.nodes:
        if n.target is target:
            now.add(n)
            most = max(most, len(now))
        elif is_wait(n):
            now.discard(n.args[0])
    return most


def _live_gathered(gm: fx.GraphModule) -> int:
    """The most all-gather outputs alive at once: from the all-gather to the last read
    of its wait or a view of it."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    spans = []
    for ag in _of(gm, ALL_GATHER):
        (wait,) = ag.users
        readers = [u for a in alias_closure(wait) for u in a.users]
        spans.append((pos[ag], max(pos[u] for u in readers)))
    return max(sum(1 for a, b in spans if a <= i <= b) for i in range(len(pos)))


def _chain(world: int, units: int = 3, *, between: Any = None, group: str = "0"):
    """A forward: per unit, the copy-in (flatten the shard), its all-gather and wait,
    the unpack (views), then its compute (mm, relu). ``between(b, shards)`` may add
    nodes after unit 1's mm. Returns the graph and per-rank inputs."""
    b = _Builder()
    rows = 4 // world if 4 % world == 0 else 2  # the gathered weight has >= 4 rows
    shards = [b.input(f"w{u}", rows, 4) for u in range(units)]
    x = b.input("x", 2, 4)
    h = x
    for u in range(units):
        flat = b(aten.reshape.default, shards[u], [-1])
        r = b(WAIT, b(ALL_GATHER, flat, world, group))
        weight = b(aten.view.default, r, [world * rows, 4])
        h = b(aten.mm.default, h, b(aten.narrow.default, weight, 0, 0, 4))
        if between is not None and u == 1:
            between(b, shards)
        h = b(aten.relu.default, h)
    gm = b.done(h)
    g = torch.Generator().manual_seed(5)
    inputs = [
        [torch.randn(rows, 4, generator=g) for _ in range(units)] + [torch.randn(2, 4, generator=g)]
        for _ in range(world)
    ]
    return gm, inputs


@pytest.mark.parametrize("world", [2, 3])
def test_overlap_prefetches_the_next_unit(world: int) -> None:
    gm, inputs = _chain(world)
    before = _counts(gm)
    ref = _run_spmd(gm, _copies(inputs))
    ags, waits, mms = _of(gm, ALL_GATHER), _of(gm, WAIT), _of(gm, aten.mm.default)
    p = _pos(gm)
    assert all(p[ags[u].name] > p[mms[u - 1].name] for u in (1, 2))  # no overlap yet
    assert _live_gathered(gm) == 1
    assert overlap(gm) == 2
    p = _pos(gm)
    for u in (1, 2):
        # Issued right after the previous unit's wait (with its flatten), so before
        # that unit's compute; at most one ahead: not before the previous wait.
        assert p[waits[u - 1].name] < p[ags[u].name] < p[mms[u - 1].name]
        assert p[ags[u].name] == p[waits[u - 1].name] + 2
        assert ags[u].args[0].target is aten.reshape.default
        # Its own wait stays where it was: after the previous unit's compute, before
        # its unpack (the view) and its compute.
        assert p[mms[u - 1].name] < p[waits[u].name] < p[mms[u].name]
        assert next(iter(waits[u].users)).target is aten.view.default
    assert [n.name for n in _of(gm, ALL_GATHER)] == [n.name for n in ags]  # same order
    assert _counts(gm) == before  # only moved
    assert _in_flight(gm, ALL_GATHER) == 1  # gloo: never two all-gathers in flight
    assert _live_gathered(gm) == 2  # the memory bound: one unit more than before
    _same(_run_spmd(gm, _copies(inputs)), ref)


def test_overlap_no_match_is_unchanged() -> None:
    b = _Builder()
    x, w = b.input("x", 2, 4), b.input("w", 4, 4)
    gm = b.done(b(aten.mm.default, x, w))
    text = _graph_text(gm)
    assert overlap(gm) == 0
    assert _graph_text(gm) == text
    gm, _ = _chain(2, units=1)  # one all-gather: the first never moves
    text = _graph_text(gm)
    assert overlap(gm) == 0
    assert _graph_text(gm) == text
    gm, _ = _chain(2)
    assert overlap(gm) == 2
    text = _graph_text(gm)
    assert overlap(gm) == 0  # already overlapped: nothing left to move
    assert _graph_text(gm) == text


def test_overlap_stays_after_a_write_to_its_input() -> None:
    """Unit 1's compute writes to unit 2's shard: unit 2's copy-in must read it after
    that write, so the all-gather is issued only after it."""

    def bump(b: _Builder, shards: list[fx.Node]) -> None:
        b(aten.add_.Tensor, shards[2], 1.0)

    gm, inputs = _chain(2, between=bump)
    ref = _run_spmd(gm, _copies(inputs))
    assert overlap(gm) == 2
    p = _pos(gm)
    ag1, ag2 = _of(gm, ALL_GATHER)[1:]
    (write,) = _of(gm, aten.add_.Tensor)
    mm0, mm1 = _of(gm, aten.mm.default)[:2]
    assert p[ag1.name] < p[mm0.name]
    # After the write (with its flatten), so after unit 1's mm that precedes it.
    assert p[mm1.name] < p[write.name] < p[ag2.name] == p[write.name] + 2
    _same(_run_spmd(gm, _copies(inputs)), ref)


def test_overlap_stays_after_a_side_effect_its_input_needs() -> None:
    """Unit 2's shard is first copied into a buffer (a side effect in unit 1's
    compute): the copy-in and the all-gather move up only to just after it."""
    b = _Builder()
    w0, w1, w2, buf = b.input("w0", 2, 4), b.input("w1", 2, 4), b.input("w2", 2, 4), b.input("buf", 2, 4)
    x = b.input("x", 2, 4)
    h = x
    for u, w in enumerate((w0, w1, w2)):
        if u == 2:
            w = b(aten.copy_.default, buf, w)  # the shard now lives in buf
        r = b(WAIT, b(ALL_GATHER, b(aten.reshape.default, w, [-1]), 2, "0"))
        h = b(aten.mm.default, h, b(aten.view.default, r, [4, 4]))
        if u == 1:
            h = b(aten.relu.default, h)
    gm = b.done(h)
    # Move the copy_ between unit 1's mm and relu (it is not in the copy-in's place).
    mm1, relu = _of(gm, aten.mm.default)[1], _of(gm, aten.relu.default)[0]
    copy = _of(gm, aten.copy_.default)[0]
    mm1.append(copy)
    gm.graph.lint()
    assert overlap(gm) == 2
    p = _pos(gm)
    ag2 = _of(gm, ALL_GATHER)[2]
    assert p[mm1.name] < p[copy.name] < p[ag2.name] < p[relu.name]
    assert p[ag2.name] == p[copy.name] + 2  # its flatten, then it


def test_overlap_never_moves_compute_an_all_gather_reads() -> None:
    """An all-gather of an activation (unit 1's output) is not a prefetch: its input
    is compute, not copy-in from graph inputs, so it stays after that compute."""
    b = _Builder()
    w0, w1, x = b.input("w0", 2, 4), b.input("w1", 2, 4), b.input("x", 2, 4)
    h = x
    for w in (w0, w1):
        r = b(WAIT, b(ALL_GATHER, w, 2, "0"))
        h = b(aten.relu.default, b(aten.mm.default, h, b(aten.view.default, r, [4, 4])))
    act = b(WAIT, b(ALL_GATHER, b(aten.reshape.default, h, [-1]), 2, "0"))
    gm = b.done(b(aten.sum.default, act))
    last = _of(gm, ALL_GATHER)[2]
    assert overlap(gm) == 1  # w1's all-gather only
    p = _pos(gm)
    assert p[last.name] == p[_of(gm, aten.relu.default)[1].name] + 2  # relu, reshape, it


def test_overlap_keeps_the_order_of_collectives() -> None:
    """Another collective (a broadcast) in unit 1's compute is not crossed (issued
    after it, it may pass its wait); an all-gather on another group is part of the
    chain and keeps its place in it."""

    def broadcast(b: _Builder, shards: list[fx.Node]) -> None:
        b(WAIT, b(torch.ops._c10d_functional.broadcast.default, shards[0], 0, "0"))

    gm, _ = _chain(2, between=broadcast)
    collectives = [n.name for n in gm.graph.nodes if is_collective(n)]
    assert overlap(gm) == 2
    p = _pos(gm)
    (bc,) = _of(gm, BROADCAST)
    mm1, ag2 = _of(gm, aten.mm.default)[1], _of(gm, ALL_GATHER)[2]
    assert p[mm1.name] < p[bc.name] < p[ag2.name] == p[bc.name] + 2  # bc, flatten, ag2
    assert [n.name for n in gm.graph.nodes if is_collective(n)] == collectives

    b = _Builder()
    w0, w1, w2, x = b.input("w0", 2, 4), b.input("w1", 2, 4), b.input("w2", 2, 4), b.input("x", 2, 4)
    h = x
    for w, group in ((w0, "0"), (w1, "1"), (w2, "0")):
        r = b(WAIT, b(ALL_GATHER, w, 2, group))
        h = b(aten.relu.default, b(aten.mm.default, h, b(aten.view.default, r, [4, 4])))
    gm = b.done(h)
    names = [n.name for n in _of(gm, ALL_GATHER)]
    assert overlap(gm) == 2
    assert [n.name for n in _of(gm, ALL_GATHER)] == names
    assert _in_flight(gm, ALL_GATHER) == 1


def _backward_chain(world: int, units: int = 3, hsdp: bool = False, group: str = "0"):
    """A backward: per unit (last first), the re-gather, the weight's use for the
    input gradient and the weight gradient, its reduce-scatter (HSDP: then an
    all-reduce on group "1"), the result viewed as the sharded grad (an output)."""
    b = _Builder()
    shards = [b.input(f"w{u}", 4 // world, 4) for u in range(units)]
    acts = [b.input(f"a{u}", 2, 4) for u in range(units)]
    dy = b.input("dy", 2, 4)
    grads = []
    for u in reversed(range(units)):
        r = b(WAIT, b(ALL_GATHER, b(aten.reshape.default, shards[u], [-1]), world, group))
        weight = b(aten.view.default, r, [4, 4])
        dx = b(aten.mm.default, dy, b(aten.t.default, weight))
        dw = b(aten.mm.default, b(aten.t.default, dy), acts[u])
        s = b(WAIT, b(REDUCE_SCATTER, dw, "avg", world, group))
        if hsdp:
            s = b(WAIT, b(ALL_REDUCE, s, "avg", "1"))
        grads.append(b(aten.view.default, b(aten.slice.Tensor, s, 0, 0, 4 // world), [4 // world, 4]))
        dy = b(aten.relu.default, dx)
    gm = b.done(dy, *grads)
    g = torch.Generator().manual_seed(6)
    inputs = [
        [torch.randn(4 // world, 4, generator=g) for _ in range(units)]
        + [torch.randn(2, 4, generator=g) for _ in range(units + 1)]
        for _ in range(world)
    ]
    return gm, inputs


@pytest.mark.parametrize("hsdp", [False, True])
def test_overlap_backward_prefetch_and_late_reduce_scatter_waits(hsdp: bool) -> None:
    gm, inputs = _backward_chain(2, hsdp=hsdp)
    before = _counts(gm)
    ref = _run_spmd(gm, _copies(inputs))
    ags, rss, ars = _of(gm, ALL_GATHER), _of(gm, REDUCE_SCATTER), _of(gm, ALL_REDUCE)
    rs_waits = [next(iter(rs.users)) for rs in rss]
    ar_waits = [next(iter(ar.users)) for ar in ars]
    mms = _of(gm, aten.mm.default)
    first_mm = mms[0::2]  # each unit's input-gradient mm
    assert overlap(gm) == 2 + 3  # two re-gathers early, every reduction waited late
    p = _pos(gm)
    for k in (1, 2):
        # The next re-gather is issued before the previous unit's compute, and so
        # before its reduce-scatter (all ranks move it alike; see [Note: Overlap]).
        assert p[ags[k].name] < p[first_mm[k - 1].name] < p[rss[k - 1].name]
    late = ar_waits if hsdp else rs_waits
    issues = ars if hsdp else rss
    for k in (0, 1):
        # Waited after the next unit's compute, just before the next issue.
        assert p[first_mm[k + 1].name] < p[late[k].name] < p[issues[k + 1].name]
        assert p[late[k].name] + 3 == p[issues[k + 1].name]  # wait, slice, view
    output = next(iter(reversed(gm.graph.nodes)))
    assert p[late[2].name] + 3 == p[output.name]  # the last: past the last compute
    if hsdp:  # the all-reduce reads the reduce-scatter's result: that wait stays
        assert all(p[rs.name] + 1 == p[w.name] for rs, w in zip(rss, rs_waits))
        assert _in_flight(gm, ALL_REDUCE) == 1
    assert _in_flight(gm, REDUCE_SCATTER) == 1  # the memory bound: one bucket per group
    assert _in_flight(gm, ALL_GATHER) == 1
    assert _counts(gm) == before
    _same(_run_spmd(gm, _copies(inputs)), ref)


def test_overlap_late_wait_bounds() -> None:
    """A reduce-scatter's wait stops before the first use of its result and before a
    write to its input; a view of the result used late stays where it is."""
    b = _Builder()
    g0, g1, x = b.input("g0", 4, 2), b.input("g1", 4, 2), b.input("x", 2, 2)
    s0 = b(WAIT, b(REDUCE_SCATTER, g0, "sum", 2, "0"))
    y = b(aten.relu.default, x)
    y = b(aten.mul.Tensor, y, s0)  # first use
    s1 = b(WAIT, b(REDUCE_SCATTER, g1, "sum", 2, "0"))
    y = b(aten.relu.default, y)
    b(aten.add_.Tensor, g1, 1.0)  # writes to the input of the second
    y = b(aten.relu.default, y)
    gm = b.done(y, s1)
    assert overlap(gm) == 2
    p = _pos(gm)
    (mul,), (write,) = _of(gm, aten.mul.Tensor), _of(gm, aten.add_.Tensor)
    assert p[s0.name] + 1 == p[mul.name] and p[s0.name] > p[_of(gm, aten.relu.default)[0].name]
    assert p[s1.name] + 1 == p[write.name]


def test_overlapped_graphs_run_with_real_collectives(one_rank_group) -> None:
    """Overlapped graphs execute with the real functional collectives (1 rank) and
    give bitwise the same results."""
    for build in (_chain, _backward_chain):
        gm, inputs = build(1, group=one_rank_group)
        ref = gm(*inputs[0])
        assert overlap(gm) >= 2
        for x, y in zip(gm(*inputs[0]), ref):
            assert torch.equal(x, y)


# ---------------------------------------------------------- gather_into_buffers
def test_gather_into_buffers_rewrites_cpu_all_gathers(one_rank_group) -> None:
    """Each CPU all-gather becomes ``empty`` + ``all_gather_into_tensor_out`` in the
    same place, with its annotation, and the graph gives bitwise the same results
    with the real collectives (1 rank); a GPU all-gather (fake CUDA values), one with
    no wait, and the other collectives are left alone, and a second run changes
    nothing. See [Note: CPU all-gathers into buffers] in
    passes/gloo/gather_into_buffers.py."""
    from traceable_hsdp.passes import gather_into_buffers
    from traceable_hsdp.passes._graph import ALL_GATHER_OUT, collective_family

    b = _Builder()
    a, c, g = b.input("a", 2, 3), b.input("c", 4), b.input("g", 2, 3)
    ag_a = b(ALL_GATHER, a, 1, one_rank_group)
    set_annotation(ag_a, annotation_value("Block", ["w"]))
    ra = b(WAIT, ag_a)
    rc = b(WAIT, b(ALL_GATHER, c, 1, one_rank_group))
    rs = b(WAIT, b(REDUCE_SCATTER, g, "avg", 1, one_rank_group))
    gm = b.done(b(aten.add.Tensor, ra, 1.0), rc, rs)
    inputs = [torch.randn(2, 3), torch.randn(4), torch.randn(2, 3)]
    ref = gm(*inputs)

    assert gather_into_buffers(gm) == 2
    outs = [n for n in gm.graph.nodes if n.target is ALL_GATHER_OUT]
    assert len(outs) == 2 and not any(n.target is ALL_GATHER for n in gm.graph.nodes)
    for n, inp in zip(outs, (a, c)):
        buf = n.kwargs["out"]
        assert buf.target is aten.empty.memory_format and buf.next is n, gm.graph
        assert list(buf.args[0]) == list(n.meta["val"].shape)
        assert [u.target for u in n.users] == [WAIT] and collective_family(n) == "all_gather"
        # A second wait, on the input, right after the first: Inductor keeps the
        # input alive until then ([Note: The input lives until the wait]).
        (wait,) = n.users
        assert wait.next.target is WAIT and wait.next.args == (inp,), gm.graph
    assert annotation_of(outs[0]) == annotation_of(ag_a) is not None
    assert _counts(gm)["reduce_scatter"] == 1
    for x, y in zip(gm(*inputs), ref):
        assert torch.equal(x, y)
    assert gather_into_buffers(gm) == 0

    # Not read by exactly one wait: left allocating (its input could not be kept alive).
    lone = _Builder()
    x = lone.input("x", 4)
    lone_gm = lone.done(lone(ALL_GATHER, x, 2, "0"))
    assert gather_into_buffers(lone_gm) == 0

    gpu = _Builder()
    with gpu.mode:
        w = gpu.graph.placeholder("w")
        w.meta["val"] = torch.empty(4, device="cuda")
    gpu_gm = gpu.done(gpu(WAIT, gpu(ALL_GATHER, w, 2, "0")))
    assert gather_into_buffers(gpu_gm) == 0
    assert [n.target for n in gpu_gm.graph.nodes if n.op == "call_function"] == [ALL_GATHER, WAIT]


def _inputs_on_a_fake_gpu(gm: torch.fx.GraphModule) -> None:
    """Records every input of ``gm`` as a fake GPU tensor of its shape and dtype: the
    same graph, as the passes would see it on CUDA, for the cases they leave alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta["val"]
                n.meta["val"] = torch.empty(v.shape, dtype=v.dtype, device="cuda")


def _gather_times_3(world: int, group: str) -> Any:
    c10d = torch.ops._c10d_functional

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        bucket = torch.cat([a.reshape(-1), b])  # a bucket of two shards, as the passes make
        return c10d.wait_tensor(c10d.all_gather_into_tensor(bucket, world, group)) * 3

    return fn


def gather_exchange_worker(rank: int, world: int) -> dict[str, Any]:
    """The all-gather-as-exchange rewrite on 2 gloo ranks (see [Note: gloo all-gathers
    as an exchange] in passes/gloo/exchange.py): for float32 and
    bfloat16, a traced graph of one all-gather of a bucket (a ``cat`` of a 2-D and a
    1-D shard) and of one of a 2-D shard gives the same bits before and after the
    pass; the float32 bucket compiled by Inductor (the pass installed, a reader
    fused after it) gives the bits of the uncompiled op. Records the rewritten
    graph's op counts, what the exchange reads, and the cases left alone (no wait, a
    fake GPU input). Returns what each check found; the test asserts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp import passes
    from traceable_hsdp.passes import all_gather_by_exchange
    from traceable_hsdp.passes._graph import AG_EXCHANGE_COUNT, ALL_GATHER
    from traceable_hsdp.passes.gloo._pool import POOLED_ALL_TO_ALL

    c10d = torch.ops._c10d_functional
    group = torch.distributed.group.WORLD.group_name
    out: dict[str, Any] = {"bitwise": {}, "counts": {}, "exchange_input": {}, "left_alone": {}}
    gen = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(3, 4, generator=gen).to(dtype)
        b = torch.randn(5, generator=gen).to(dtype)
        cases = {
            "bucket": (_gather_times_3(world, group), (a, b)),
            "2-D": (lambda t: c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group)), (a,)),
        }
        for name, (fn, args) in cases.items():
            gm = make_fx(fn, tracing_mode="fake")(*args)  # one fake mode for all values
            ref = gm(*args)
            n = all_gather_by_exchange(gm)
            got = gm(*args)
            key = f"{dtype}/{name}"
            out["bitwise"][key] = (n, torch.equal(got, ref) and got.shape == ref.shape)
            out["counts"][key] = graph_counts(gm)
            (ex,) = [x for x in gm.graph.nodes if x.target is POOLED_ALL_TO_ALL]
            cat = ex.args[0]
            out["exchange_input"][key] = (
                str(cat.target), [str(p.target) for p in cat.args[0]], list(ex.args[1:3]),
            )
    passes.install()  # as fully_shard does: the pass runs on Inductor's graphs
    compiled = PostGradRecorder()  # the graphs Inductor compiled, after the passes
    torch._inductor.config.post_grad_custom_post_pass = compiled
    a, b = torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)
    fn = _gather_times_3(world, group)
    torch._dynamo.reset()
    same = torch.equal(torch.compile(fn, fullgraph=True)(a, b), fn(a, b))
    final = compiled.graphs[-1].final_graph()
    packs = sum(n.target is PACK_TWICE for n in final.nodes)
    out["inductor"] = (same, graph_counts(final), packs)
    torch._inductor.config.post_grad_custom_post_pass = None
    x = torch.randn(8)
    gm = make_fx(lambda t: c10d.all_gather_into_tensor(t, world, group))(x)
    out["left_alone"]["no_wait"] = all_gather_by_exchange(gm)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group)))(x)
    _inputs_on_a_fake_gpu(gm)  # NCCL writes the output
    out["left_alone"]["gpu"] = all_gather_by_exchange(gm)
    out["left_alone"]["all_gathers"] = sum(n.target is ALL_GATHER for n in gm.graph.nodes)
    out["exchange_key"] = AG_EXCHANGE_COUNT
    out["pool"] = _exchange_pool_checks(world, group, gen)
    return out


def _pool_frees(key: tuple[Any, ...], n: int, timeout_s: float = 10.0) -> bool:
    """Waits until the exchange pool holds ``n`` buffers of ``key`` that nothing else
    references; whether it did within ``timeout_s``."""
    import time

    from traceable_hsdp.passes.gloo import _pool

    deadline = time.monotonic() + timeout_s
    while True:
        with _pool._pool_lock:
            free = sum(_pool._unused(st) for st in _pool._pool.get(key, []))
        if free >= n or time.monotonic() > deadline:
            return free >= n
        time.sleep(0.001)


def _exchange_pool_checks(world: int, group: str, gen: torch.Generator) -> dict[str, Any]:
    """The exchange's pooled output ([Note: Exchange outputs from a pool] in
    passes/gloo/_pool.py), on one all-gather graph run op by op: a result the caller still
    holds is never written again, a freed one is reused, the pool's bytes, what
    :func:`release_exchange_buffers` drops, and torch's op with the pool off."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp.passes import (
        all_gather_by_exchange, exchange_pool_bytes, release_exchange_buffers,
    )
    from traceable_hsdp.passes.gloo import _pool

    c10d = torch.ops._c10d_functional

    def fn(t: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t, world, group))

    key = ((2 * 6,), torch.float32, torch.device("cpu"))  # this graph's output only

    def pooled_here() -> int:
        with _pool._pool_lock:
            return sum(st.nbytes() for st in _pool._pool.get(key, []))

    x1, x2 = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    gm = make_fx(fn, tracing_mode="fake")(x1)
    all_gather_by_exchange(gm)
    total = exchange_pool_bytes()
    kept = gm(x1)  # a view of its pooled buffer, held
    before = kept.clone()
    again = gm(x2)
    res: dict[str, Any] = {
        "held_intact": torch.equal(kept, before),
        "distinct": kept.data_ptr() != again.data_ptr(),
        "values": torch.equal(again, fn(x2)),
    }
    ptr = again.data_ptr()
    del again
    # gloo's worker can still hold a finished all-to-all's work (and so its output)
    # for a moment after the wait: the pool then hands out a new buffer, as it must.
    res["freed_in_time"] = _pool_frees(key, 1)
    third = gm(x1)
    res["reused"] = third.data_ptr() == ptr and torch.equal(third, before)
    res["bytes"] = pooled_here()
    res["total_grew_by_it"] = exchange_pool_bytes() - total == res["bytes"]
    del kept, third
    res["freed_in_time"] &= _pool_frees(key, 2)
    # The earlier cases' buffers may be dropped too, so at least this shape's bytes.
    res["released_all_of_it"] = release_exchange_buffers() >= res["bytes"]
    res["after"] = pooled_here()
    gm = make_fx(fn, tracing_mode="fake")(x1)
    all_gather_by_exchange(gm, pooled=False)
    res["unpooled"] = sorted(
        str(n.target) for n in gm.graph.nodes if str(n.target).endswith("all_to_all_single.default")
    )
    return res


# ------------------------------------------------------- all_gather_by_exchange
def test_all_gather_by_exchange_moves_the_same_bytes() -> None:
    """On 2 gloo ranks, an all-gather of a bucket (a ``cat`` of a 2-D and a 1-D
    shard) and of a 2-D shard, in float32 and bfloat16, each becomes one exchange of
    the shard sent twice, and the graph gives bitwise the same result (nothing is
    computed: tolerance 0). The doubled input is one ``pack_twice`` of the bucket's
    pieces. Compiled by Inductor with the pass installed (one compile), the bucket
    gives the bits of the uncompiled op, as one exchange, no all-gather and one
    ``pack_twice`` (an extern call, not a kernel Inductor groups with others). One with
    no wait and a GPU one are left alone. The exchange's output comes from the pool:
    a result still held is never written again, a freed one is reused, and with the
    pool off the pass issues torch's op. See [Note: gloo all-gathers as an exchange]
    in passes/gloo/exchange.py and [Note: Exchange outputs from a pool] in passes/gloo/_pool.py."""
    from _dist import run_ranks

    reshape, view = str(aten.reshape.default), str(aten.view.default)
    for r in run_ranks(gather_exchange_worker, 2):
        assert len(r["bitwise"]) == 4, r
        for key, (n, same) in r["bitwise"].items():
            counts = r["counts"][key]
            assert n == 1 and same, (key, n, same)
            assert family_counts(counts) == {"all_gather": 1}, counts
            assert counts.get(r["exchange_key"]) == 1 and "all_gather_into_tensor" not in counts
            target, pieces, splits = r["exchange_input"][key]
            assert target == str(PACK_TWICE), (key, target)
            if key.endswith("bucket"):  # a's 12 elements and b's 5, packed twice
                assert splits == [[17, 17], [17, 17]], (key, splits)
                assert len(pieces) == 2 and pieces[0] in (reshape, view), pieces
            else:  # the shard flattened, packed twice
                assert splits == [[12, 12], [12, 12]], (key, splits)
                assert pieces == [reshape], pieces
        same, counts, packs = r["inductor"]
        assert same and packs == 1, r["inductor"]  # packed by the extern op
        assert counts.get(r["exchange_key"]) == 1, counts
        assert not any(k.startswith("all_gather_into_tensor") for k in counts), counts
        assert r["left_alone"] == {"no_wait": 0, "gpu": 0, "all_gathers": 1}, r["left_alone"]
        # The pooled output: 6 float32 from each of 2 ranks, 48 bytes a buffer; two
        # alive at once, so two pooled, both dropped once nothing reads them.
        assert r["pool"] == {
            "held_intact": True, "distinct": True, "values": True, "reused": True,
            "freed_in_time": True, "bytes": 96, "total_grew_by_it": True,
            "released_all_of_it": True, "after": 0,
            "unpooled": ["_c10d_functional.all_to_all_single.default"],
        }, r["pool"]


def _reduce_scatter_times_3(op: str, world: int, group: str) -> Any:
    c10d = torch.ops._c10d_functional
    return lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, op, world, group)) * 3


def exchange_worker(rank: int, world: int) -> dict[str, Any]:
    """The reduce-scatter-as-exchange rewrite on 2 gloo ranks (see [Note: gloo
    reduce-scatters as an exchange] in passes/gloo/exchange.py): for
    float32 and bfloat16, "sum" and "avg", a 1-D and a 2-D gradient, a traced graph
    of one reduce-scatter gives the same bits before and after the pass, and so does
    the eager runtime's ``reduce_scatter`` against the functional op, its result in
    the half it received; for each
    (dtype, op), one of the two shapes compiled by Inductor gives the bits of the
    uncompiled op. Cases the pass must leave alone ("max", no wait, a fake GPU input)
    are counted. Returns what each check found; the test asserts."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from traceable_hsdp import passes
    from traceable_hsdp._collectives import reduce_scatter
    from traceable_hsdp.passes import reduce_scatter_by_exchange
    from traceable_hsdp.passes._graph import EXCHANGE_COUNT, REDUCE_SCATTER, WAIT

    c10d = torch.ops._c10d_functional
    group = torch.distributed.group.WORLD.group_name
    out: dict[str, Any] = {"bitwise": {}, "inductor": {}, "eager": {}, "counts": {},
                           "left_alone": {}}
    passes.install()  # as fully_shard does: the pass runs on Inductor's graphs
    compiled = PostGradRecorder()  # the graphs Inductor compiled, after the passes
    torch._inductor.config.post_grad_custom_post_pass = compiled
    gen = torch.Generator().manual_seed(rank)
    shapes = ((10,), (6, 5))
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        for j, op in enumerate(("sum", "avg")):
            for k, shape in enumerate(shapes):
                x = torch.randn(shape, generator=gen).to(dtype)
                gm = make_fx(_reduce_scatter_times_3(op, world, group))(x)
                ref = gm(x)
                n = reduce_scatter_by_exchange(gm)
                key = f"{dtype}/{op}/{shape}"
                out["bitwise"][key] = (n, torch.equal(gm(x), ref))
                out["counts"][key] = graph_counts(gm)
                # Compiled by Inductor with a reader after it: bfloat16 is left alone
                # ([Note: Low-precision sums and fusion]), float32 gives the same bits.
                # One shape per (dtype, op), the two shapes alternating so that each
                # is compiled with each dtype and each op: the pass treats them alike
                # (both split evenly on dim 0), and a compile is the cost here.
                if k == (i + j) % len(shapes):
                    fn = _reduce_scatter_times_3(op, world, group)
                    torch._dynamo.reset()
                    same = torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))
                    graph = compiled.graphs[-1].final_graph()
                    final = graph_counts(graph)
                    # The sum is written into the received half (a wait's value).
                    sums = [
                        (n.target.__name__, n.args[0].target is WAIT)
                        for n in graph.nodes
                        if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
                    ]
                    out["inductor"][key] = (same, final.get(EXCHANGE_COUNT, 0), sums)
                with AtenOps() as ops:
                    eager = reduce_scatter(x, op, world, group, rank)
                plain = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, world, group))
                # The sum is made in the received half: no buffer of the output's size
                # is allocated beside it.
                in_place = "add_" in ops.names and "add" not in ops.names
                out["eager"][key] = (torch.equal(eager, plain) and eager.dtype == plain.dtype
                                     and in_place)
    x = torch.randn(8)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "max", world, group)))(x)
    out["left_alone"]["max"] = reduce_scatter_by_exchange(gm)
    gm = make_fx(lambda t: c10d.reduce_scatter_tensor(t, "sum", world, group))(x)
    out["left_alone"]["no_wait"] = reduce_scatter_by_exchange(gm)
    gm = make_fx(lambda t: c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "sum", world, group)))(x)
    _inputs_on_a_fake_gpu(gm)  # NCCL has a real reduce-scatter
    out["left_alone"]["gpu"] = reduce_scatter_by_exchange(gm)
    out["left_alone"]["reduce_scatters"] = sum(n.target is REDUCE_SCATTER for n in gm.graph.nodes)
    out["exchange_key"] = EXCHANGE_COUNT
    # Each rank's graph sends and adds its own halves: the FX graph cache keys the rank.
    out["uuid"] = passes.TraceableHSDPPass().uuid()

    # Eagerly the PassConfig switch turns the exchange off too.
    config = passes.get_config()
    out["eager_ops"] = {}
    for on in (True, False):
        passes.set_config(dataclasses.replace(config, reduce_scatter_by_exchange=on))
        with FunctionalCollectiveOps() as ops:
            reduce_scatter(torch.randn(8), "avg", world, group, rank)
        out["eager_ops"][on] = ops.names
    passes.set_config(config)
    torch._inductor.config.post_grad_custom_post_pass = None
    return out


# ---------------------------------------------------- reduce_scatter_by_exchange
def test_reduce_scatter_by_exchange_gives_gloos_numbers() -> None:
    """On 2 gloo ranks, each float32 reduce-scatter ("sum" and "avg"; a 1-D and a 2-D
    gradient) becomes one exchange and an addition into the received half (compiled:
    an in-place add of the wait's value), and the graph gives bitwise the same result
    as gloo's own reduce-scatter, run op by op and compiled by Inductor
    with a reader fused after it (one shape per dtype and op, alternating: 4
    compiles); a bfloat16 one is left alone in graphs (see
    [Note: Low-precision sums and fusion]). The eager runtime's ``reduce_scatter``
    gives the same bits in both dtypes, as an exchange unless
    ``PassConfig(reduce_scatter_by_exchange=False)``. The exchange counts as a
    reduce-scatter. A "max", one with no wait and a GPU one are left alone. The two
    ranks' passes key the FX graph cache apart. See [Note: gloo reduce-scatters as an
    exchange] in passes/gloo/exchange.py."""
    from _dist import run_ranks

    results = run_ranks(exchange_worker, 2)
    assert results[0]["uuid"] != results[1]["uuid"] and None not in [r["uuid"] for r in results]
    for r in results:
        assert len(r["bitwise"]) == 8, r
        for key, (n, same) in r["bitwise"].items():
            counts = r["counts"][key]
            assert same, key
            assert family_counts(counts) == {"reduce_scatter": 1}, counts
            if key.startswith("torch.bfloat16"):  # [Note: Low-precision sums and fusion]
                assert n == 0 and "reduce_scatter_tensor" in counts, (key, counts)
                continue
            assert n == 1, (key, n)
            assert counts.get(r["exchange_key"]) == 1 and "reduce_scatter_tensor" not in counts
        # Compiled: each (dtype, op) once, with both shapes among them.
        pairs = [key.rsplit("/", 1)[0] for key in r["inductor"]]
        assert len(set(pairs)) == len(pairs) == 4, r["inductor"]
        shapes = {key.rsplit("/", 1)[1] for key in r["inductor"]}
        assert shapes == {"(10,)", "(6, 5)"}, r["inductor"]
        for key, (same, exchanges, sums) in r["inductor"].items():  # bits, and the form
            low = key.startswith("torch.bfloat16")
            assert same and exchanges == (0 if low else 1), (key, r)
            # In the received half: no third buffer of the result's size.
            assert sums == ([] if low else [("add_.Tensor", True)]), (key, sums)
        assert all(r["eager"].values()), r["eager"]
        assert r["left_alone"] == {"max": 0, "no_wait": 0, "gpu": 0, "reduce_scatters": 1}, r
        assert r["eager_ops"] == {
            True: ["all_to_all_single", "wait_tensor"],
            False: ["reduce_scatter_tensor", "wait_tensor"],
        }, r["eager_ops"]


# ------------------------------------------------------------ the C++ wrapper
def test_cpp_wrapper_refused_on_what_it_cannot_call() -> None:
    """With Inductor's ``cpp_wrapper`` on, a graph holding a placeholder's resize or
    one of our exchanges (an ``all_to_all_single`` marked as one) is refused, naming
    each op once; the same graphs pass with it off, and a user's own
    ``all_to_all_single`` (not marked) is not ours to refuse. The Inductor case is in
    test_runtime.py. See [Note: Inductor's C++ wrapper] in passes/_install.py."""
    from traceable_hsdp.passes._graph import ALL_TO_ALL, EXCHANGED
    from traceable_hsdp.passes._install import _refuse_cpp_wrapper

    def graph(marked: bool, resize: bool) -> fx.Graph:
        b = _Builder()
        x, p = b.input("x", 4), b.input("p", 4)
        if resize:
            b(RESIZE, p, 16)
        ex = b(ALL_TO_ALL, x, [2, 2], [2, 2], "0")
        if marked:
            ex.meta[EXCHANGED] = "reduce_scatter"
        return b.done(b(WAIT, ex)).graph

    with torch._inductor.config.patch(cpp_wrapper=True):
        with pytest.raises(RuntimeError, match="cpp_wrapper': False") as info:
            _refuse_cpp_wrapper(graph(marked=True, resize=True))
        message = str(info.value)
        assert message.count("_c10d_functional.all_to_all_single.default") == 1, message
        assert message.count("inductor.resize_storage_bytes_.default") == 1, message
        _refuse_cpp_wrapper(graph(marked=False, resize=False))  # a user's: not refused
    _refuse_cpp_wrapper(graph(marked=True, resize=True))  # the wrapper off


def test_pool_keeps_within_its_budget() -> None:
    """The exchange pool keeps at most ``POOL_MAX_BYTES`` (64 MiB) a process:
    layer-sized buffers are pooled until the budget is full; a buffer past it (an
    embedding-sized bucket, or any other) is handed out unpooled. See [Note: Exchange
    outputs from a pool] in passes/gloo/_pool.py."""
    from traceable_hsdp.passes.gloo import _pool

    cpu = torch.device("cpu")
    _pool.release_exchange_buffers()
    assert _pool.exchange_pool_bytes() == 0
    assert _pool.POOL_MAX_BYTES == 64 << 20
    held = [_pool._take([2 << 20], torch.float32, cpu) for _ in range(_pool.POOL_DEPTH)]
    assert _pool.exchange_pool_bytes() == 64 << 20  # 8 buffers of 8 MiB
    big = _pool._take([32 << 20], torch.float32, cpu)  # 128 MiB: never pooled
    small = _pool._take([1 << 10], torch.float32, cpu)  # 4 KiB past the budget
    assert _pool.exchange_pool_bytes() == 64 << 20
    # Released, the buffers in use stay; unused, they go.
    assert _pool.release_exchange_buffers() == 0
    del big, small, held
    assert _pool.release_exchange_buffers() == 64 << 20
    assert _pool.exchange_pool_bytes() == 0
