"""Graph helpers the passes share to plan and make a rewrite: fake values, alias and
write analysis, inserting and erasing nodes.

What a node *is* (an all-gather, a wait, an ``fsdp.copy_``, a resize, a view) is
asked of ``_graph.py``, the graph vocabulary. Everything here takes ``torch.fx.Node``s
of a post-grad (ATen-level, functionalized) graph, where each op is an ``OpOverload``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ._graph import is_resize, is_view


def tensor_val(node: Any) -> torch.Tensor | None:
    """The fake (or meta) tensor recorded in ``node.meta["val"]``, if any."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def static_numel(t: torch.Tensor) -> int | None:
    """``t.numel()`` as an int, or ``None`` for a symbolic size."""
    n = t.numel()
    return n if isinstance(n, int) else None


def writes_to(node: fx.Node, tensor: fx.Node) -> bool:
    """Whether ``node`` may mutate ``tensor`` (passed directly as an argument).

    Uses the op schema's alias annotations (``Tensor(a!)``). A call to anything that
    is not an ``OpOverload`` (a Python function, a higher-order op) counts as a
    possible mutation unless it is ``operator.getitem``.
    """
    if node.op != "call_function":
        return node.op == "call_module"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        positional = list(node.args)
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = positional[i] if i < len(positional) else node.kwargs.get(arg.name)
            if _mentions(value, tensor):
                return True
        return False
    return target is not operator.getitem


def _mentions(value: Any, node: fx.Node) -> bool:
    if value is node:
        return True
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, node) for v in value)
    return False


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Position of every node in the graph's current order."""
    return {n: i for i, n in enumerate(graph.nodes)}


def alias_closure(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that may alias it through chains of view ops."""
    out, stack, seen = [], [node], {node}
    while stack:
        n = stack.pop()
        out.append(n)
        for u in n.users:
            if is_view(u) and u.args and u.args[0] is n and u not in seen:
                seen.add(u)
                stack.append(u)
    return out


def storage_sharers(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Each graph input that shares its storage with other graph inputs, mapped to
    those (by their fake values, which keep the real inputs' aliasing)."""
    by_storage: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in graph.find_nodes(op="placeholder"):
        val = tensor_val(node)
        if val is not None:
            by_storage.setdefault(StorageWeakRef(val.untyped_storage()), []).append(node)
    return {
        n: [m for m in group if m is not n]
        for group in by_storage.values()
        if len(group) > 1
        for n in group
    }


def alias_base(node: fx.Node) -> fx.Node:
    """The node ``node`` is a view of, through chains of view ops (``node`` itself if
    it is not a view)."""
    base = node
    while is_view(base) and base.args and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    return base


def writes_between(
    tensor: object, a: fx.Node, b: fx.Node, order: dict[fx.Node, int]
) -> list[fx.Node]:
    """The nodes strictly between ``a`` and ``b`` (either order), in graph order, that
    write to or resize ``tensor``, a view of it, or its base or another view of that:
    a read of ``tensor`` may move from one end to the other only if this is empty.
    (``resize_storage_bytes_`` declares no mutation in its schema: checked by name.)"""
    if not isinstance(tensor, fx.Node):
        return []
    lo, hi = sorted((order[a], order[b]))
    found = set()
    for alias in alias_closure(alias_base(tensor)):
        for u in alias.users:
            if lo < order[u] < hi and (
                writes_to(u, alias) or (is_resize(u) and u.args[0] is alias)
            ):
                found.add(u)
    return sorted(found, key=order.__getitem__)


def set_fake_val(node: fx.Node) -> None:
    """Fills ``node.meta["val"]`` by running its op on its inputs' recorded values.

    Works with fake tensors (under their mode) and meta tensors; does nothing if an
    input has no recorded value.
    """
    missing = False

    def value(a: fx.Node) -> Any:
        nonlocal missing
        if "val" not in a.meta:
            missing = True
            return None
        return a.meta["val"]

    args = fx.node.map_arg(node.args, value)
    kwargs = fx.node.map_arg(node.kwargs, value)
    if missing:
        return
    fake_mode = torch._guards.detect_fake_mode(
        [a.meta["val"] for a in node.all_input_nodes]
    )
    assert callable(node.target)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
    else:
        node.meta["val"] = node.target(*args, **kwargs)


def insert_call(
    graph: fx.Graph,
    target: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    like: fx.Node | None = None,
) -> fx.Node:
    """``graph.call_function`` at the current insertion point, with its fake value set
    and the stack trace of ``like`` (for readable graph dumps)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    set_fake_val(node)
    return node


def erase_all(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erases ``nodes`` (users before producers)."""
    for n in sorted(set(nodes), key=node_order(graph).__getitem__, reverse=True):
        graph.erase_node(n)
