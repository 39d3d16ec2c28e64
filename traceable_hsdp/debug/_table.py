"""The collective table of a graph and its node counts: what ``dump_graphs``, the
benchmarks and the tests read from a traced graph.

:func:`collective_table` lists each collective in graph order with its group, dtype,
bytes and the unit and parameters it serves (from [Note: Collective annotations] in
``passes/_graph.py``); :func:`graph_counts` and :func:`collective_totals` count
collectives, waits, ``fsdp.copy_`` and storage resizes. Tested in
``tests/test_dump.py`` and ``tests/test_passes_unit.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from ..passes._graph import (
    EXCHANGED,
    PARAMS,
    UNIT,
    _FAMILIES,
    Family,
    _EXCHANGE_COUNTS,
    _c10d_like,
    _group_name,
    _group_size,
    _input,
    _nbytes,
    _shape,
    _tensors,
    _value,
    annotation_of,
    bound_args,
    collective_family,
    is_collective,
    is_fsdp_copy,
    is_resize,
    op_name,
    resize_nbytes,
)


@dataclass(frozen=True)
class CollectiveRow:
    """One collective of a graph.

    Args:
        index: position among the graph's collectives (graph order).
        node: the FX node's name.
        op: the op without namespace and overload, e.g. ``all_gather_into_tensor``.
        reduce_op: ``"sum"``, ``"avg"``, ... for reductions, else ``None``.
        group_name: the process group's name (baked into the graph).
        group_size: ranks in the group; ``None`` where the graph does not say and
            no process group of that name is known here.
        dtype: of the input, e.g. ``"float32"``.
        in_shape: the input's shape (``None`` if unknown or symbolic).
        out_shape: the result's shape.
        in_bytes: bytes of the input (``None`` if unknown or symbolic).
        out_bytes: bytes of the result.
        unit: the fully_shard unit it serves (from the node's annotation), or
            ``None``.
        params: the parameters it serves (FQNs relative to the unit).
        issued_at: its position in the final schedule (:func:`with_schedule`), or
            ``None``.
        waited_at: the position of its wait there, or ``None``.
        kernels_before_wait: the overlap distance in kernels, or ``None``.
        family: what it does (:func:`collective_family`; an exchange counts as what
            it replaces); see :attr:`label`.
    """

    index: int
    node: str
    op: str
    reduce_op: str | None
    group_name: str | None
    group_size: int | None
    dtype: str | None
    in_shape: list[int] | None
    out_shape: list[int] | None
    in_bytes: int | None
    out_bytes: int | None
    unit: str | None
    params: tuple[str, ...]
    issued_at: int | None = None
    waited_at: int | None = None
    kernels_before_wait: int | None = None
    family: Family | None = None

    @property
    def label(self) -> str:
        """The op, and for an exchange what it stands for: ``all_to_all_single as
        all_gather``."""
        if self.family is None or _name_family(self.op) == self.family:
            return self.op
        return f"{self.op} as {self.family}"


def _graph_of(graph: fx.Graph | fx.GraphModule) -> fx.Graph:
    return graph.graph if isinstance(graph, fx.GraphModule) else graph


def collective_table(graph: fx.Graph | fx.GraphModule) -> list[CollectiveRow]:
    """Every collective of ``graph`` in graph order (either op form). Sizes come from
    the fake values on the nodes (``val`` or ``example_value``); unit and parameters
    from the node's annotation (see [Note: Collective annotations]).

    Args:
        graph: an FX graph or graph module; not changed.
    """
    rows: list[CollectiveRow] = []
    for node in _graph_of(graph).nodes:
        if not is_collective(node):
            continue
        q = op_name(node)
        assert q is not None
        args = bound_args(node)
        in_val, out_val = _value(_input(node)), _value(node)
        name = _group_name(args.get("group_name"))
        size = args.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool):
            size = _group_size(name)
        reduce_op = args.get("reduce_op")
        in_ts = _tensors(in_val)
        ann = annotation_of(node)
        rows.append(
            CollectiveRow(
                index=len(rows),
                node=node.name,
                op=q[1],
                reduce_op=reduce_op if isinstance(reduce_op, str) else None,
                group_name=name,
                group_size=size,
                dtype=str(in_ts[0].dtype).removeprefix("torch.") if in_ts else None,
                in_shape=_shape(in_val),
                out_shape=_shape(out_val),
                in_bytes=_nbytes(in_val),
                out_bytes=_nbytes(out_val),
                unit=None if ann is None else ann[UNIT],
                params=() if ann is None else ann[PARAMS],
                family=collective_family(node),
            )
        )
    return rows


def graph_counts(graph: fx.Graph | fx.GraphModule) -> dict[str, int]:
    """Counts of each functional c10d op by name (exchanges as
    :data:`EXCHANGE_COUNT`), ``fsdp.copy_``, ``resize_to_0`` and ``resize_to_full``.
    Zero counts are left out."""
    c: Counter[str] = Counter()
    for node in _graph_of(graph).nodes:
        q = op_name(node)
        if q is None:
            continue
        if _c10d_like(q):
            c[_EXCHANGE_COUNTS.get(node.meta.get(EXCHANGED), q[1])] += 1
        elif is_fsdp_copy(node):
            c["fsdp.copy_"] += 1
        elif is_resize(node):
            c["resize_to_0" if resize_nbytes(node) == 0 else "resize_to_full"] += 1
    return dict(sorted(c.items()))


def family_counts(counts: Mapping[str, int]) -> dict[Family, int]:
    """The collectives of :func:`graph_counts` summed by family: an all-gather counts
    as ``"all_gather"`` in either form (the allocating op, or ``_out`` as CPU graphs
    issue it; see [Note: CPU all-gathers into buffers] in ``passes/gloo/gather_into_buffers.py``).
    Families with no collective are left out."""
    out: dict[Family, int] = {}
    for name, n in counts.items():
        family = _name_family(name)
        if family is not None:
            out[family] = out.get(family, 0) + n
    return out


def collective_totals(graph: fx.Graph | fx.GraphModule) -> dict[Family, dict[str, int]]:
    """``{family: {"count": n, "bytes": b}}`` over the graph's collectives (waits
    excluded; see :func:`collective_family`). An all-gather is sized by its output
    (the gathered buffer), a reduce-scatter by its input (the full gradient), an
    all-reduce by its tensor; from the nodes' fake values (``val``)."""
    out: dict[Family, dict[str, int]] = {}
    for node in _graph_of(graph).nodes:
        family = collective_family(node)
        if family is None:
            continue
        if family == "reduce_scatter":
            val = _value(_input(node))
        else:
            val = node.meta.get("val")
        slot = out.setdefault(family, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += _nbytes(val) or 0
    return out


def _name_family(name: str) -> Family | None:
    for prefix, family in _FAMILIES:
        if name.startswith(prefix):
            return family
    return None
