"""FX node predicates and small graph helpers shared by every pass.

Written once here so that all passes agree on what an all-gather, a wait, an
``fsdp.copy_`` or a storage resize is. Everything takes ``torch.fx.Node``s of a
post-grad (ATen-level, functionalized) graph, where each op is an ``OpOverload``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed.fsdp  # noqa: F401  registers torch.ops.fsdp.copy_
from torch import fx

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten

ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
WAIT = _c10d.wait_tensor.default
FSDP_COPY = torch.ops.fsdp.copy_.default
RESIZE = torch.ops.inductor.resize_storage_bytes_.default

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _is_call(node: fx.Node, target: Any) -> bool:
    return node.op == "call_function" and node.target is target


def is_all_gather(node: fx.Node) -> bool:
    """``_c10d_functional.all_gather_into_tensor(input, group_size, group_name)``."""
    return _is_call(node, ALL_GATHER)


def is_reduce_scatter(node: fx.Node) -> bool:
    """``_c10d_functional.reduce_scatter_tensor(input, op, group_size, group_name)``."""
    return _is_call(node, REDUCE_SCATTER)


def is_all_reduce(node: fx.Node) -> bool:
    """``_c10d_functional.all_reduce(input, op, group_name)``."""
    return _is_call(node, ALL_REDUCE)


def is_wait(node: fx.Node) -> bool:
    """``_c10d_functional.wait_tensor(t)``."""
    return _is_call(node, WAIT)


def is_fsdp_copy(node: fx.Node) -> bool:
    """``fsdp.copy_(dst, src)``: fills the unsharded placeholder ``dst``."""
    return _is_call(node, FSDP_COPY)


def is_resize(node: fx.Node) -> bool:
    """``inductor.resize_storage_bytes_(t, nbytes)``."""
    return _is_call(node, RESIZE)


def is_collective(node: fx.Node) -> bool:
    """Any functional c10d op that issues communication (every one but the wait)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target.namespace in _COLLECTIVE_NAMESPACES and node.target is not WAIT


def collective_group_name(node: fx.Node) -> str | None:
    """The ``group_name`` argument of any functional collective (all-gather,
    reduce-scatter, all-reduce, ...), or ``None`` when it is not a constant string or
    ``node`` is not a collective."""
    if not is_collective(node):
        return None
    assert isinstance(node.target, torch._ops.OpOverload)
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "group_name":
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, str) else None
    return None


def resize_nbytes(node: fx.Node) -> int | None:
    """The byte count of a resize node, or ``None`` if it is not a plain int."""
    n = node.args[1] if len(node.args) > 1 else node.kwargs.get("new_size")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def single_wait(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` consuming ``collective``, or ``None`` if the collective
    has any other user (or none)."""
    users = list(collective.users)
    if len(users) == 1 and is_wait(users[0]) and users[0].args[0] is collective:
        return users[0]
    return None


def collective_group(node: fx.Node) -> tuple[int, str] | None:
    """``(group_size, group_name)`` of an all-gather or reduce-scatter, or ``None``
    when the group is not a constant (e.g. a node in compile-on-one-rank graphs)."""
    if is_all_gather(node):
        size, name = node.args[1], node.args[2]
    elif is_reduce_scatter(node):
        size, name = node.args[2], node.args[3]
    else:
        return None
    if not isinstance(size, int) or not isinstance(name, str):
        return None
    return size, name


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


def is_view(node: fx.Node) -> bool:
    """An op whose output may alias its first input (view, reshape, slice, t, ...)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and bool(node.target.is_view)
    )


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


def has_side_effects(node: fx.Node) -> bool:
    """Nodes a pass must not move across or drop: mutations, resizes, collectives and
    waits, and whatever FX itself considers impure."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op != "call_function":
        return False
    if is_resize(node) or is_fsdp_copy(node) or is_collective(node) or is_wait(node):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return True
    return node.is_impure()


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
