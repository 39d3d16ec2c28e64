"""The final schedule: the order Inductor's generated code runs collectives, waits and
kernels, read from that code (:func:`read_schedule`), and each collective's overlap
distance (:func:`with_schedule`). Tested in ``tests/test_dump.py``.

[Note: The final schedule]
Inductor's scheduler reorders and fuses the post-grad graph; the generated code's
``call`` runs the kernels in the final order. :func:`read_schedule` reads that code
with ``ast``: a functional collective is an issue, ``wait_tensor`` a wait (matched
through buffer aliases), any other kernel but a resize is compute. A collective's
overlap distance (:func:`with_schedule`) is the number of kernels between its issue
and its wait (0: nothing hides it), counted in kernels because torch's per-kernel
estimates are 0 on the CPU. Inductor keeps collectives in graph order, so the k-th
scheduled collective is row k of :func:`collective_table`.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from ..passes._graph import (
    _RESIZE_NAME,
    _WAIT_NAME,
    _c10d_like,
)
from ._table import CollectiveRow, _name_family

ScheduleKind = Literal["collective", "wait", "kernel"]


@dataclass(frozen=True)
class ScheduledOp:
    """One call in the order Inductor's generated code runs them (see [Note: The
    final schedule]).

    Args:
        position: index in the schedule (collectives, waits and kernels counted).
        kind: ``"collective"``, ``"wait"``, or ``"kernel"`` (any other op).
        name: the call as the code writes it: ``torch.ops._c10d_functional.
            all_gather_into_tensor.default``, ``cpp_fused_add_0``, ...
        line: its line in the output code (1-based).
        collective: a collective's index among the schedule's collectives, or the
            one a wait waits for; else ``None``.
        group_name: a collective's process group (a literal in the code), or
            ``None``.
    """

    position: int
    kind: ScheduleKind
    name: str
    line: int
    collective: int | None = None
    group_name: str | None = None


def _dotted(expr: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def _code_op(dotted: str) -> tuple[str, str, str] | None:
    """``(namespace, name, overload)`` of ``torch.ops.NS.NAME.OVERLOAD`` (or the
    wrapper's ``aten.NAME.OVERLOAD``) as generated code calls it."""
    parts = dotted.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) in (4, 5):
        return parts[2], parts[3], parts[4] if len(parts) == 5 else "default"
    if parts[0] == "aten" and len(parts) in (2, 3):
        return "aten", parts[1], parts[2] if len(parts) == 3 else "default"
    return None


def _code_schema(op: tuple[str, str, str]) -> torch._C.FunctionSchema | None:
    try:
        return getattr(getattr(getattr(torch.ops, op[0]), op[1]), op[2])._schema
    except (AttributeError, RuntimeError):
        return None


def _code_args(op: tuple[str, str, str], call: ast.Call) -> dict[str, ast.expr]:
    """A call's argument expressions in generated code, by the op schema's names
    (generated code calls ops positionally, with literals; ``out=`` by keyword)."""
    schema = _code_schema(op)
    if schema is None:
        return {}
    out = {a.name: e for a, e in zip(schema.arguments, call.args)}
    out.update((kw.arg, kw.value) for kw in call.keywords if kw.arg is not None)
    return out


def _mutated_names(op: tuple[str, str, str], call: ast.Call) -> list[str]:
    """The buffers a call writes into: its mutable arguments (the ``_out``
    variants' ``out=``, the in-place ``all_reduce_``'s tensor)."""
    schema = _code_schema(op)
    if schema is None:
        return []
    args = _code_args(op, call)
    names: list[str] = []
    for a in schema.arguments:
        expr = args.get(a.name)
        if a.alias_info is None or not a.alias_info.is_write or expr is None:
            continue
        elts = expr.elts if isinstance(expr, (ast.List, ast.Tuple)) else [expr]
        names.extend(e.id for e in elts if isinstance(e, ast.Name))
    return names


def _code_group_name(op: tuple[str, str, str], call: ast.Call) -> str | None:
    """The ``group_name`` literal of a collective call in generated code."""
    expr = _code_args(op, call).get("group_name")
    value = expr.value if isinstance(expr, ast.Constant) else None
    return value if isinstance(value, str) else None


def _statements(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements of ``body`` in order, with ``with``/``if`` blocks (device
    guards, stream contexts) flattened."""
    for stmt in body:
        if isinstance(stmt, (ast.With, ast.If)):
            yield from _statements(stmt.body)
            if isinstance(stmt, ast.If):
                yield from _statements(stmt.orelse)
        else:
            yield stmt


def _call_function(tree: ast.Module) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            return node
    return None


def read_schedule(output_code: str) -> list[ScheduledOp]:
    """The collectives, waits and kernels of Inductor's generated Python code (its
    ``call`` function), in the order they run. See [Note: The final schedule].

    Args:
        output_code: the module Inductor generated for one graph (what
            ``TORCH_LOGS=output_code`` prints).

    Raises:
        ValueError: the code is not Python (``cpp_wrapper``) or has no ``call``
            function.
    """
    try:
        tree = ast.parse(output_code)
    except SyntaxError as e:
        raise ValueError(
            f"the output code is not Python ({e.msg}); with "
            "torch._inductor.config.cpp_wrapper the schedule is not read"
        ) from e
    fn = _call_function(tree)
    if fn is None:
        raise ValueError("the output code has no `call` function")
    # Kernels the module defines: ``name = async_compile.<kind>(...)``.
    kernels = {
        t.id
        for stmt in tree.body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
        and (_dotted(stmt.value.func) or "").startswith("async_compile.")
        for t in stmt.targets
        if isinstance(t, ast.Name)
    }
    alias: dict[str, str] = {}  # buffer name -> the buffer it aliases (reuse, views)

    def root(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    handles: dict[str, int] = {}  # a collective's result buffer -> its index
    out: list[ScheduledOp] = []
    n_collectives = 0
    for stmt in _statements(fn.body):
        target = None
        value: ast.expr | None = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0].id if isinstance(stmt.targets[0], ast.Name) else None
            value = stmt.value
        elif isinstance(stmt, ast.Expr):
            value = stmt.value
        if value is None:
            continue
        # ``bufA = bufB``, ``bufA = bufB[0]``, ``bufA = reinterpret_tensor(bufB, ...)``
        source = value.value if isinstance(value, ast.Subscript) else value
        if (isinstance(source, ast.Call) and _dotted(source.func) == "reinterpret_tensor"
                and source.args):
            source = source.args[0]
        if target is not None and isinstance(source, ast.Name):
            alias[target] = source.id
            continue
        if not isinstance(value, ast.Call):
            continue
        dotted = _dotted(value.func)
        if dotted is None:
            continue
        op = _code_op(dotted)
        pos, line = len(out), stmt.lineno
        if _c10d_like(op):
            if op[1] == _WAIT_NAME:
                arg = value.args[0] if value.args else None
                waited = handles.get(root(arg.id)) if isinstance(arg, ast.Name) else None
                out.append(ScheduledOp(pos, "wait", dotted, line, waited))
                continue
            # Its result: what it returns, and what it writes into (a wait may name
            # either, or an alias of them).
            for handle in [*([target] if target else []), *_mutated_names(op, value)]:
                handles[root(handle)] = n_collectives
            out.append(ScheduledOp(
                pos, "collective", dotted, line, n_collectives, _code_group_name(op, value)
            ))
            n_collectives += 1
        elif op is not None:
            if (op[0], op[1]) != _RESIZE_NAME:  # a storage resize computes nothing
                out.append(ScheduledOp(pos, "kernel", dotted, line))
        elif dotted.startswith("extern_kernels.") or dotted.split(".")[0] in kernels:
            out.append(ScheduledOp(pos, "kernel", dotted, line))
    return out


def scheduled_collective_name(op: ScheduledOp) -> str | None:
    """The op name (``all_gather_into_tensor``, ...) of a scheduled collective or
    wait, as :attr:`CollectiveRow.op` spells it; ``None`` for a kernel."""
    if op.kind == "kernel":
        return None
    parsed = _code_op(op.name)
    return None if parsed is None else parsed[1]


def max_in_flight(
    schedule: Sequence[ScheduledOp], rows: Sequence[CollectiveRow] | None = None
) -> dict[str, int]:
    """The most collectives of each op (``all_gather_into_tensor``, ...) issued and
    not yet waited for at any point of ``schedule``. More than one all-gather in
    flight is what gloo cannot take on torch 2.13 (see [Note: In-flight all-gathers
    on gloo] in ``traceable_hsdp/_collectives.py``). With ``rows`` (the graph's
    :func:`collective_table`, in the schedule's order: :func:`with_schedule`), each
    collective is named by its row's :attr:`~CollectiveRow.label`, so an exchange
    counts as what it stands for."""
    op_of: dict[int, str] = {}
    now: Counter[str] = Counter()
    most: dict[str, int] = {}
    for op in schedule:
        if op.kind == "collective" and op.collective is not None:
            if rows is not None and op.collective < len(rows):
                name = rows[op.collective].label
            else:
                name = scheduled_collective_name(op) or op.name
            op_of[op.collective] = name
            now[name] += 1
            most[name] = max(most.get(name, 0), now[name])
        elif op.kind == "wait" and op.collective in op_of:
            name = op_of.pop(op.collective)  # a coalesced op's later waits: no-ops
            now[name] -= 1
    return most


def with_schedule(
    rows: Sequence[CollectiveRow], schedule: Sequence[ScheduledOp]
) -> list[CollectiveRow]:
    """``rows`` (the :func:`collective_table` of the graph Inductor compiled) with
    their place in the final ``schedule``: ``issued_at``, ``waited_at`` and
    ``kernels_before_wait``, the number of kernels that run between the
    collective's issue and its wait (0: nothing overlaps it). Inductor keeps the
    collectives in graph order (it chains them so every rank issues them alike),
    so the k-th collective of the schedule is row k; that is checked.

    Raises:
        ValueError: the schedule's collectives are not the rows' (count, family or
            group name differ), with the first difference.
    """
    issued = [op for op in schedule if op.kind == "collective"]
    if len(issued) != len(rows):
        raise ValueError(
            f"{len(issued)} collectives in the output code, {len(rows)} in the graph"
        )
    waits: dict[int, ScheduledOp] = {}
    for op in schedule:
        if op.kind == "wait" and op.collective is not None:
            waits.setdefault(op.collective, op)  # a coalesced one: its first wait
    out: list[CollectiveRow] = []
    for i, (row, op) in enumerate(zip(rows, issued)):
        name = scheduled_collective_name(op) or ""
        if _name_family(name) != _name_family(row.op) or (
            row.group_name is not None and op.group_name is not None
            and row.group_name != op.group_name
        ):
            raise ValueError(
                f"collective {i} differs: {name} on group {op.group_name!r} in the "
                f"output code, {row.op} on group {row.group_name!r} in the graph"
            )
        wait = waits.get(i)
        between = None
        if wait is not None:
            between = sum(
                1 for o in schedule[op.position + 1 : wait.position] if o.kind == "kernel"
            )
        out.append(replace(
            row,
            issued_at=op.position,
            waited_at=None if wait is None else wait.position,
            kernels_before_wait=between,
        ))
    return out
