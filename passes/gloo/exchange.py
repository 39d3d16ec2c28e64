"""Reduce-scatters and all-gathers over two gloo ranks as exchanges (``all_to_all_single``).

[Note: gloo reduce-scatters as an exchange]
gloo has no reduce-scatter: ``ProcessGroupGloo`` copies the whole input, all-reduces
it, and copies this rank's chunk out in ``wait()``, so every rank moves the whole
tensor. An all-to-all moves exactly what a reduce-scatter needs (rank ``r`` sends chunk
``j`` to rank ``j``), then the rank adds what it received (bare-op comparison in
docs/benchmarks.md). So this pass rewrites each reduce-scatter of CPU tensors over a
gloo group of two ranks, read by one wait, on rank ``r`` of the group::

    rs = reduce_scatter_tensor(g, "avg", 2, "0")    # g: (2k, ...)
    r  = wait_tensor(rs)

into::

    ex = all_to_all_single(g[(1-r)k:(2-r)k], s, s, "0")  # where rs was; s: [0, k] on
    w  = wait_tensor(ex)                            #   rank 0, [k, 0] on rank 1
    r  = div_(add_(w, g[rk:(r+1)k]), 2)             # "sum": add_(w, g[rk:(r+1)k])

Each rank sends only the peer's half and receives the peer's half of its own chunk
(``k`` rows, not ``2k``), and the sum is written into the received buffer, which is
the result: the input and one half are alive at once, where gloo's reduce-scatter
holds its input, its copy and its output. The addition is in place in the graph
because Inductor does not reuse a collective's output for a kernel's result: an
out-of-place ``add`` put a third buffer of the result's size beside the input and
the received half (the root's bucket: the backward's tensor peak; docs/benchmarks.md,
"Memory"). A pooled received buffer is then held by the gradients that view the
result, and the pool hands it out again only once nothing else references it ([Note:
Exchange outputs from a pool] in ``_pool.py``). The graph depends on the rank, so the
passes' ``uuid()`` holds it ([Note: Per-unit options and the FX graph cache] in
``_install.py``).

Bitwise equal: over two ranks each element is one commutative addition
(``tests/test_passes_unit.py`` checks both ops against gloo's). Eagerly
(``traceable_hsdp/_collectives.py``) the runtime does the same, the sum made in place.
Compiled, only float32 and float64 are rewritten ([Note: Low-precision sums and
fusion]). Left alone: more than two ranks (gloo's ring has its own order of
additions), ``max``/``min``/``product``, GPU tensors, symbolic shapes, and
reduce-scatters not read by exactly one wait.

The exchange is issued and waited for where the reduce-scatter was, so ``overlap``'s
schedule holds; Inductor keeps its input alive until the addition. It is safe in
flight with a later ``_out`` all-gather on gloo ([Note: CPU all-gathers into buffers]
in ``gather_into_buffers.py``). The node keeps the annotation and is marked
(:data:`EXCHANGED`), so it still counts as a reduce-scatter. ``PassConfig(
reduce_scatter_by_exchange=False)`` turns both the pass and the eager exchange off.

[Note: gloo all-gathers as an exchange]
gloo's all-gather into a tensor gathers into a buffer it allocates on every call, then
copies that into the output. An all-to-all writes the output directly, and over two
ranks it is an all-gather when the input is the shard twice. The price is writing the
shard twice while packing the bucket, in one extern call ([Note: The doubled
all-gather input, packed by one extern call] in ``_ops.py``); a training step is a
little faster with it (docs/benchmarks.md). So :func:`all_gather_by_exchange`
rewrites each all-gather of CPU tensors over a gloo group of two ranks, read by one
wait::

    buf = cat([f0, f1])                             # the bucket: this rank's shards
    ag  = all_gather_into_tensor(buf, 2, "0")       # buf: (n,)
    r   = wait_tensor(ag)

into::

    two = pack_twice([f0, f1])                      # the shard, once per rank
    ex  = all_to_all_single(two, [n, n], [n, n], "0")   # where ag was
    w   = wait_tensor(ex)                           # where r was
    r   = view(w, <ag's shape>)

Bitwise equal in every dtype (nothing is computed). It runs after ``overlap`` and
before :func:`gather_into_buffers`. Left alone: more than two ranks, GPU tensors,
symbolic shapes, and all-gathers not read by exactly one wait. The node is marked
(:data:`EXCHANGED`, ``"all_gather"``) and counted under
:data:`~passes._graph.AG_EXCHANGE_COUNT`. Eagerly the runtime keeps gloo's ``_out``
all-gather. ``PassConfig(all_gather_by_exchange=False)`` turns it off.

Invariant: the rewritten graph computes the same tensors as before, with its
collectives issued and waited for at the same positions and over the same groups.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from .._graph import (
    ALL_GATHER,
    ALL_TO_ALL,
    EXCHANGED,
    REDUCE_SCATTER,
    WAIT,
    bound_args,
    group_backend,
    resolve_group,
    single_wait,
)
from .._ops import PACK_TWICE
from .._rewrite import insert_call, static_numel, tensor_val
from ._pool import POOLED_ALL_TO_ALL, pooled_all_to_all_lowering

__all__ = ["all_gather_by_exchange", "is_gloo_group", "reduce_scatter_by_exchange"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten

# [Note: Low-precision sums and fusion]
# Inductor computes a bfloat16/float16 kernel in float32 and rounds only what it
# stores, so the addition fused with the reduce-scatter's readers skips the rounding
# gloo's result had (last-bit differences). Only float32 and float64 are rewritten in
# compiled graphs; eagerly each op rounds, so every dtype matches gloo
# (``tests/test_passes_unit.py`` checks both).
_SAME_PRECISION = (torch.float32, torch.float64)


def is_gloo_group(group_name: str) -> bool:
    """Whether the process group named ``group_name`` reaches CPU tensors through
    gloo (``False`` for an unknown name, a group with no CPU backend, or another
    backend; see :func:`~traceable_hsdp.passes._graph.group_backend`)."""
    import torch.distributed as dist

    return isinstance(group_backend(group_name, torch.device("cpu")), dist.ProcessGroupGloo)


def _candidates(
    graph: fx.Graph, target: torch._ops.OpOverload
) -> Iterator[tuple[fx.Node, dict[str, Any], torch.Tensor, str]]:
    """Each ``target`` collective of CPU tensors over a group of two ranks, with its
    bound arguments, input fake value and group name."""
    for node in list(graph.find_nodes(op="call_function", target=target)):
        args = bound_args(node)
        val, name = tensor_val(args.get("input")), args.get("group_name")
        if (
            val is not None
            and val.device.type == "cpu"
            and args.get("group_size") == 2
            and isinstance(name, str)
        ):
            yield node, args, val, name


def _one_wait(node: fx.Node, name: str, pass_name: str) -> fx.Node | None:
    """The one ``wait_tensor`` that reads ``node``, if its group is gloo's; else
    ``None`` (logged when the wait is what is missing)."""
    wait = single_wait(node)
    if wait is None:
        log.info("%s: %s left alone: not one wait_tensor", pass_name, node.name)
        return None
    return wait if is_gloo_group(name) else None


def _all_to_all(pooled: bool) -> torch._ops.OpOverload:
    """The all-to-all an exchange issues: the pooled one where asked, else torch's.
    See [Note: Exchange outputs from a pool] in ``_pool.py``."""
    return POOLED_ALL_TO_ALL if pooled and pooled_all_to_all_lowering() else ALL_TO_ALL


def _group_rank(group_name: str) -> int:
    """This process's rank in the process group named ``group_name``, which
    :func:`is_gloo_group` found."""
    group = resolve_group(group_name)
    if group is None:
        raise RuntimeError(
            f"reduce_scatter_by_exchange: the process group {group_name!r} is no longer "
            "known to this process; compile after the groups exist and while they do."
        )
    return int(group.rank())


def _exchange(
    graph: fx.Graph, node: fx.Node, wait: fx.Node, inp: fx.Node, splits: list[int],
    name: str, family: str, finish: Callable[[fx.Node], fx.Node],
    op: torch._ops.OpOverload,
) -> None:
    """Puts ``op(inp, splits, splits, name)`` where ``node`` was and its wait where
    ``wait`` was; ``finish(got)`` builds what the old wait's readers read. The
    exchange keeps ``node``'s meta and is marked as ``family``."""
    with graph.inserting_before(node):
        ex = graph.call_function(op, (inp, splits, splits, name))
    with graph.inserting_after(wait):
        got = graph.call_function(WAIT, (ex,))
    sent = tensor_val(inp)
    assert sent is not None
    # The splits sum to the input's rows both ways: the output has the input's shape.
    ex.meta.update({**node.meta, "val": sent.new_empty(sent.shape), EXCHANGED: family})
    got.meta["val"] = ex.meta["val"]
    with graph.inserting_before(got.next):  # each new node after the last
        out = finish(got)
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    graph.erase_node(node)


def reduce_scatter_by_exchange(gm: fx.GraphModule, pooled: bool = True) -> int:
    """Rewrites each reduce-scatter (``"sum"`` or ``"avg"``) of CPU tensors over a
    gloo group of two ranks in ``gm`` (a post-grad graph module, changed in place)
    into an all-to-all and an addition, and returns how many. See [Note: gloo
    reduce-scatters as an exchange]. ``pooled``: the all-to-all's output comes from
    the pool ([Note: Exchange outputs from a pool] in ``_pool.py``)."""
    graph = gm.graph
    done = 0
    for node, args, val, name in _candidates(graph, REDUCE_SCATTER):
        op = args.get("reduce_op")
        if op not in ("sum", "avg"):
            continue
        if val.dtype not in _SAME_PRECISION:
            # See [Note: Low-precision sums and fusion].
            log.info("reduce_scatter_by_exchange: %s left alone: %s", node.name, val.dtype)
            continue
        shape = list(val.shape)
        if not all(isinstance(s, int) for s in shape) or shape[0] % 2:
            log.info("reduce_scatter_by_exchange: %s left alone: shape %s", node.name, shape)
            continue
        wait = _one_wait(node, name, "reduce_scatter_by_exchange")
        if wait is None:
            continue
        k, rank, inp = shape[0] // 2, _group_rank(name), args["input"]
        a2a = _all_to_all(pooled)
        with graph.inserting_before(node):
            peers = insert_call(graph, _aten.slice.Tensor, (inp, 0, (1 - rank) * k, (2 - rank) * k),
                                like=node)

        def add_own(got: fx.Node, node: fx.Node = node, inp: fx.Node = inp, k: int = k,
                    rank: int = rank, op: str = op) -> fx.Node:
            own = insert_call(graph, _aten.slice.Tensor, (inp, 0, rank * k, (rank + 1) * k),
                              like=node)
            out = insert_call(graph, _aten.add_.Tensor, (got, own), like=node)
            if op == "avg":
                out = insert_call(graph, _aten.div_.Tensor, (out, 2), like=node)
            return out

        splits = [0, k] if rank == 0 else [k, 0]
        _exchange(graph, node, wait, peers, splits, name, "reduce_scatter", add_own, a2a)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def all_gather_by_exchange(gm: fx.GraphModule, pooled: bool = True) -> int:
    """Rewrites each all-gather of CPU tensors over a gloo group of two ranks in
    ``gm`` (a post-grad graph module, changed in place) into an all-to-all of its
    input sent to both ranks, and returns how many. See [Note: gloo all-gathers as
    an exchange]. ``pooled``: as for :func:`reduce_scatter_by_exchange`."""
    graph = gm.graph
    done = 0
    for node, args, val, name in _candidates(graph, ALL_GATHER):
        inp, out_val = args["input"], tensor_val(node)
        n = static_numel(val)
        if n is None or out_val is None or not all(isinstance(s, int) for s in out_val.shape):
            log.info("all_gather_by_exchange: %s left alone: shape %s", node.name, val.shape)
            continue
        wait = _one_wait(node, name, "all_gather_by_exchange")
        if wait is None:
            continue
        a2a = _all_to_all(pooled)
        with graph.inserting_before(node):
            pieces = _flat_pieces(graph, inp, node)
            both = insert_call(graph, PACK_TWICE, (pieces,), like=node)
        shape = list(out_val.shape)

        def as_gathered(got: fx.Node, node: fx.Node = node, shape: list[int] = shape) -> fx.Node:
            return insert_call(graph, _aten.view.default, (got, shape), like=node)

        _exchange(graph, node, wait, both, [n, n], name, "all_gather", as_gathered, a2a)
        if not inp.users and inp.op == "call_function":
            graph.erase_node(inp)  # a bucket's cat, now read through its pieces
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _flat_pieces(graph: fx.Graph, inp: fx.Node, like: fx.Node) -> list[fx.Node]:
    """The all-gather input's flat pieces: a bucket's ``cat`` read only by it gives
    its pieces (the doubled input is packed from them); anything else is one piece."""
    if (
        inp.target is _aten.cat.default
        and len(inp.users) == 1
        and isinstance(inp.args[0], (list, tuple))
        and all(
            isinstance(a, fx.Node) and (v := tensor_val(a)) is not None and v.dim() == 1
            for a in inp.args[0]
        )
        and (len(inp.args) < 2 or inp.args[1] in (0, -1))
    ):
        return list(inp.args[0])
    return [insert_call(graph, _aten.reshape.default, (inp, [-1]), like=like)]
