"""Remove the unsharded placeholder's storage round trip from a compiled graph.

[Note: Removing resize/copy regions]
Each unsharded placeholder ``p`` (see [Note: Sharded parameter and unsharded
placeholder] in ``traceable_hsdp/_param.py``) reaches a post-grad graph as a graph
input whose storage is grown, filled, read and freed::

    ag   = all_gather_into_tensor(shard, 2, "0")
    w    = wait_tensor(ag)
    full = slice(w, 0, 0, 64)                     # only when the shard was padded
    resize_storage_bytes_(p, 8192)                # grow to full
    fsdp.copy_(p, full)
    t    = permute(p, [1, 0])                     # the uses of p ...
    mm   = mm(x, t)
    resize_storage_bytes_(p, 0)                   # free

After the pass the uses read the gathered tensor itself, and the three side-effecting
nodes are gone::

    ag   = all_gather_into_tensor(shard, 2, "0")
    w    = wait_tensor(ag)
    full = slice(w, 0, 0, 64)
    t    = permute(full, [1, 0])
    mm   = mm(x, t)

Invariant: every value computed from ``p`` inside a grow -> copy -> free region is the
same before and after, and ``p``'s storage ends in the same state (0 bytes). The uses
then hang on plain data edges, which is why this pass runs before the reordering and
bucketing passes.

Every region of a placeholder is rewritten (forward and backward re-gather). A
placeholder is left alone, with the reason logged, when a region is incomplete or
holds two copies; ``p`` or a view is used outside a region; anything else writes ``p``
or the copy's source in the region; dtype, device or size differ, ``p`` is not
contiguous or a fake value is missing; a view of ``p`` is a graph output; or another
graph input shares ``p``'s storage (compiled autograd can pass a saved placeholder
as an input of its own). ``p`` itself may be a graph output when every region is
closed by a free: AOTAutograd saves it that way for the backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import fx

from ._graph import is_fsdp_copy, is_resize, is_view, resize_nbytes
from ._rewrite import (
    alias_closure,
    insert_call,
    node_order,
    static_numel,
    storage_sharers,
    tensor_val,
    writes_to,
)

__all__ = ["remove_resize_copy"]

log = logging.getLogger(__name__)
_aten = torch.ops.aten


@dataclass
class _Region:
    grow: fx.Node
    copy: fx.Node | None = None
    free: fx.Node | None = None
    uses: list[fx.Node] = field(default_factory=list)


@dataclass
class _Plan:
    placeholder: fx.Node
    regions: list[_Region]


def remove_resize_copy(gm: fx.GraphModule) -> int:
    """Rewrites every grow -> ``fsdp.copy_`` -> uses -> free region of an unsharded
    placeholder so that the uses read the copied-from tensor, and erases the copy
    and both resizes. See [Note: Removing resize/copy regions].

    Args:
        gm: a post-grad graph module, changed in place.

    Returns:
        The number of regions rewritten (0: the graph is unchanged).
    """
    graph = gm.graph
    order = node_order(graph)
    placeholders: list[fx.Node] = []
    for node in graph.nodes:
        if is_fsdp_copy(node) and isinstance(node.args[0], fx.Node):
            if node.args[0] not in placeholders:
                placeholders.append(node.args[0])
    sharers = storage_sharers(graph)
    plans: list[_Plan] = []
    for p in placeholders:
        plan = _plan(p, order) if p not in sharers else (
            f"graph inputs {', '.join(n.name for n in sharers[p])} share its storage"
        )
        if isinstance(plan, str):
            log.info("remove_resize_copy: leaving %s alone: %s", p.name, plan)
        else:
            plans.append(plan)
    if not plans:
        return 0
    for plan in plans:
        _rewrite(graph, plan)
    n_regions = sum(len(plan.regions) for plan in plans)
    log.info(
        "remove_resize_copy: removed %d grow/copy/free regions of %d placeholders (%s)",
        n_regions,
        len(plans),
        ", ".join(plan.placeholder.name for plan in plans),
    )
    graph.lint()
    gm.recompile()
    return n_regions


def _plan(p: fx.Node, order: dict[fx.Node, int]) -> _Plan | str:
    """The regions of ``p`` if all can be rewritten, else why not."""
    val = tensor_val(p)
    if val is None:
        return "no fake value recorded for it"
    numel = static_numel(val)
    if numel is None:
        return "its size is symbolic"
    if not val.is_contiguous():
        return "it is not contiguous"
    full_nbytes = numel * val.dtype.itemsize
    regions: list[_Region] = []
    current: _Region | None = None
    returned = False
    for user in sorted(p.users, key=order.__getitem__):
        if is_resize(user) and user.args[0] is p:
            nbytes = resize_nbytes(user)
            if nbytes == full_nbytes and current is None:
                current = _Region(grow=user)
            elif nbytes == 0 and current is not None and current.copy is not None:
                current.free = user
                regions.append(current)
                current = None
            else:
                state = "no region open" if current is None else "a region open"
                return f"{user.name} resizes it to {nbytes} bytes with {state}"
        elif is_fsdp_copy(user) and user.args[0] is p:
            if current is None or current.copy is not None:
                return f"{user.name} copies into it outside a grow -> copy pair"
            if user.users:
                return f"{user.name}'s result is used"
            if user.args[1] is p:
                return f"{user.name} copies it into itself"
            current.copy = user
        elif user.op == "output":
            returned = True
        else:
            if writes_to(user, p):
                return f"{user.name} ({user.target}) writes to it"
            if current is None or current.copy is None:
                return f"{user.name} uses it outside a grow -> copy -> free region"
            current.uses.append(user)
    if current is not None:
        return f"the region grown by {current.grow.name} is never freed (incomplete)"
    if not regions:
        return "no complete grow -> copy -> free region"
    for region in regions:
        reason = _check_region(p, val, region, order)
        if reason is not None:
            return reason
    if returned:
        log.debug(
            "remove_resize_copy: %s is a graph output after its last free; its storage "
            "is 0 bytes there before and after the rewrite",
            p.name,
        )
    return _Plan(p, regions)


def _check_region(
    p: fx.Node, val: torch.Tensor, region: _Region, order: dict[fx.Node, int]
) -> str | None:
    assert region.copy is not None and region.free is not None
    src = region.copy.args[1]
    src_val = tensor_val(src)
    if src_val is None:
        return f"no fake value recorded for {region.copy.name}'s source"
    if src_val.dtype != val.dtype or src_val.device != val.device:
        return (
            f"{region.copy.name} copies a {src_val.dtype} tensor on {src_val.device} "
            f"into a {val.dtype} one on {val.device}"
        )
    if static_numel(src_val) != static_numel(val):
        return (
            f"{region.copy.name} copies {tuple(src_val.shape)} into "
            f"{tuple(val.shape)} (broadcast)"
        )
    start, end = order[region.copy], order[region.free]
    assert isinstance(src, fx.Node)
    # Nothing may write to the source between the copy and the free.
    for alias in _source_aliases(src):
        for u in alias.users:
            if start < order[u] < end and writes_to(u, alias):
                return f"{u.name} writes to {region.copy.name}'s source inside the region"
    # Views of p taken in the region live only in the region.
    for use in region.uses:
        if not is_view(use):
            continue
        for alias in alias_closure(use):
            for u in alias.users:
                if u.op == "output":
                    return f"its view {alias.name} is a graph output"
                if order[u] >= end:
                    return f"its view {alias.name} is used by {u.name} after the free"
                if writes_to(u, alias):
                    return f"{u.name} writes to its view {alias.name}"
    return None


def _source_aliases(src: fx.Node) -> list[fx.Node]:
    """``src``, the bases it is a view of, and every view of those."""
    base = src
    while is_view(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    return alias_closure(base)


def _rewrite(graph: fx.Graph, plan: _Plan) -> None:
    p = plan.placeholder
    val = tensor_val(p)
    assert val is not None
    for region in plan.regions:
        assert region.copy is not None and region.free is not None
        src = region.copy.args[1]
        assert isinstance(src, fx.Node)
        replacement = _as_placeholder_layout(graph, src, val, region.copy)
        for use in region.uses:
            use.replace_input_with(p, replacement)
        for node in (region.free, region.copy, region.grow):
            graph.erase_node(node)


def _as_placeholder_layout(
    graph: fx.Graph, src: fx.Node, val: torch.Tensor, copy: fx.Node
) -> fx.Node:
    """``src`` if it already has ``p``'s shape and strides; else, inserted after
    ``copy``, a contiguous clone of it (if it is not contiguous) viewed as ``p``'s
    shape (if that differs: a broadcast copy of as many elements, e.g. (16,) into
    (1, 16)). ``p`` is contiguous, so the result has its strides."""
    src_val = tensor_val(src)
    assert src_val is not None
    if src_val.shape == val.shape and src_val.stride() == val.stride():
        return src
    with graph.inserting_before(copy.next):
        if not src_val.is_contiguous():
            src = insert_call(
                graph,
                _aten.clone.default,
                (src,),
                {"memory_format": torch.contiguous_format},
                like=copy,
            )
        if src_val.shape != val.shape:
            src = insert_call(graph, _aten.view.default, (src, list(val.shape)), like=copy)
        return src
