"""The graph vocabulary: what a node of a traceable_hsdp graph is, written once.

Every reader of traced graphs uses this module and matches no op name by itself: the
passes, ``traceable_hsdp.dump_graphs``, the benchmarks and the tests. It owns

- the predicates: is this node a collective (and which), a wait, an ``fsdp.copy_``,
  a storage resize, a view; its arguments by schema name;
- the per-graph collective table (:func:`collective_table`) and node counts
  (:func:`graph_counts`, :func:`collective_totals`);
- the one recorder of Inductor's post-grad graphs (:class:`PostGradRecorder`);
- the reader of Inductor's final schedule and the overlap distances
  (:func:`read_schedule`, :func:`with_schedule`; see [Note: The final schedule]);
- the collective annotations' keys, and reading, merging and copying them
  (see [Note: Collective annotations]).
- resolving a collective's process group by name, and its backend for a device
  (:func:`resolve_group`, :func:`group_backend`).

It imports only torch.

[Note: Two op forms]
A graph calls an ATen-style op in one of two forms. Post-grad and AOTAutograd graphs
call the ``OpOverload`` (``torch.ops._c10d_functional.all_gather_into_tensor.default``);
the graph dynamo hands a ``torch.compile`` backend calls the ``OpOverloadPacket``
(``torch.ops._c10d_functional.all_gather_into_tensor``), sometimes with keyword
arguments. Every predicate here compares the op's qualified name (namespace and
name), so it accepts both forms; :func:`bound_args` binds either form's arguments to
the op schema's names. Functional collectives live in ``_c10d_functional`` (and the
older ``c10d_functional``); ``wait_tensor`` is the wait, everything else there
communicates.

[Note: Collective annotations]
The runtime issues each parameter's all-gather and reduce-scatter (and, for HSDP, its
all-reduce) inside ``traceable_hsdp._annotate.collective_annotation``, which is
``torch.fx.traceback.annotate`` with one key, :data:`ANNOTATION_KEY`. Every FX node
traced inside it gets::

    node.meta["custom"]["traceable_hsdp"] = {"unit": "layers.0", "params": ("attn.wq.weight",)}

``unit`` is the unit's label and ``params`` the parameter FQNs relative to the unit's
module. A unit that carries its own pass options (``hsdp(comm_fusion=...,
bucket_size=...)``, see :class:`UnitPassOptions`) adds ``"bucket"`` (bool) and
``"bucket_cap_mb"`` (MiB or ``None``); the bucketing passes read them (see [Note:
Per-unit pass options] in ``bucket_collectives.py``). Passes that merge collectives
give the merged node the concatenation (:func:`merge_annotations`), so after
bucketing one collective lists every parameter it serves.

Where it survives, on torch 2.13 (checked with the demo Llama, 2 ranks):

- dynamo's graphs (what a ``torch.compile`` backend receives): forward, and the
  graph compiled autograd hands to dynamo for the backward (the annotation is
  entered inside the backward hooks, which dynamo inlines);
- AOTAutograd's forward graph and so Inductor's post-grad forward graph;
- NOT AOTAutograd's graph of a compiled-autograd backward, nor its post-grad graph:
  that graph takes a boxed list input, so dynamo hands AOTAutograd a wrapper module
  instead of the ``GraphModule``, and AOTAutograd re-traces it without preserving
  node meta (every node's meta is lost, ``stack_trace`` included).
  ``traceable_hsdp.dump_graphs`` copies the annotations over from dynamo's graph of
  the same compile (:func:`copy_annotations`); the passes cannot (no public Inductor
  hook shows them dynamo's graph), so in those graphs the process-wide
  ``PassConfig`` decides what a unit's own options would have.

The annotation is metadata only: the graph, its code and the FX graph cache key are
the same with and without it (see [Note: Per-unit options and the FX graph cache] in
``_install.py``).

[Note: The final schedule]
The post-grad graph is not the order that runs: Inductor's scheduler sorts, fuses
and reorders its nodes (``reorder_for_peak_memory`` is on by default; the comm
passes such as ``reorder_compute_and_comm_for_overlap`` when configured), and the
generated code's ``call`` function then runs the kernels in the scheduler's final
order. torch logs that code (``TORCH_LOGS=output_code``; the ``inductor_output_code``
record of ``TORCH_TRACE``) and, for collectives alone, their final order (the
``inductor_collective_schedule`` artifact, issues and waits without the compute
between). :func:`read_schedule` reads the generated code with ``ast``: a call to a
functional collective is an issue, ``wait_tensor`` a wait (of the collective whose
result buffer, or an alias of it, it waits on), and any other kernel (a generated
kernel the module defines with ``async_compile``, an ``extern_kernels.*`` call, an
op Inductor falls back to, but not a storage resize) is compute. The overlap
distance of a collective, :func:`with_schedule`, is the number of kernels between
its issue and its wait: 0 means the wait comes right after the issue and nothing
hides the collective. Inductor keeps collectives in graph order (it chains them,
so every rank issues them alike), which ties the k-th scheduled collective to the
k-th row of the graph's :func:`collective_table` and so to its unit and
parameters. torch's runtime estimates per kernel (``config.log_tlparse``) are 0
on the CPU, so distances are counted in kernels, not time.
"""

from __future__ import annotations

import ast
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
import torch.distributed.fsdp  # noqa: F401  registers torch.ops.fsdp.copy_
from torch import fx
from torch._inductor import custom_graph_pass as _cgp

__all__ = [
    "AG_EXCHANGE_COUNT",
    "ALL_GATHER",
    "ALL_GATHER_OUT",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "ANNOTATION_KEY",
    "CollectiveRow",
    "EXCHANGED",
    "EXCHANGE_COUNT",
    "FSDP_COPY",
    "PostGradRecorder",
    "RESIZE",
    "REDUCE_SCATTER",
    "RecordedGraph",
    "ScheduledOp",
    "UnitPassOptions",
    "WAIT",
    "annotation_of",
    "bound_args",
    "collective_family",
    "collective_group",
    "collective_group_name",
    "collective_table",
    "collective_totals",
    "copy_annotations",
    "current_compile",
    "family_counts",
    "graph_counts",
    "group_backend",
    "has_side_effects",
    "is_all_gather",
    "is_all_reduce",
    "is_collective",
    "is_fsdp_copy",
    "is_placeholder_op",
    "is_reduce_scatter",
    "is_resize",
    "is_version_counter_op",
    "is_view",
    "is_wait",
    "max_in_flight",
    "merge_annotations",
    "read_schedule",
    "resolve_group",
    "scheduled_collective_name",
    "op_name",
    "resize_nbytes",
    "set_annotation",
    "single_wait",
    "unit_pass_options",
    "with_schedule",
]

log = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional

# The OpOverloads of post-grad graphs (what the passes insert, and tests build with).
ALL_GATHER = _c10d.all_gather_into_tensor.default
ALL_GATHER_OUT = _c10d.all_gather_into_tensor_out.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
ALL_TO_ALL = _c10d.all_to_all_single.default
WAIT = _c10d.wait_tensor.default
FSDP_COPY = torch.ops.fsdp.copy_.default
RESIZE = torch.ops.inductor.resize_storage_bytes_.default

COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
_WAIT_NAME = "wait_tensor"
_FSDP_COPY_NAME = ("fsdp", "copy_")
_RESIZE_NAME = ("inductor", "resize_storage_bytes_")
# ``traceable_hsdp::all_to_all_single``: torch's all-to-all with a pooled output, which
# the exchanges issue (``_ops.py``); named here, not imported, as the others are.
_POOLED_NAME = ("traceable_hsdp", "all_to_all_single")
_VERSION_COUNTER_NAMES = (("prims", "_tensor_version"), ("prims", "_unsafe_set_version_counter"))

# The meta key that marks an ``all_to_all_single`` node as a reduce-scatter or an
# all-gather issued as an exchange (see [Note: gloo reduce-scatters as an exchange]
# and [Note: gloo all-gathers as an exchange] in ``exchange.py``).
# Its value is the family the node counts in; :func:`graph_counts` counts it under
# :data:`EXCHANGE_COUNT` or :data:`AG_EXCHANGE_COUNT`.
EXCHANGED = "traceable_hsdp_exchange"
EXCHANGE_COUNT = "reduce_scatter_by_exchange"
AG_EXCHANGE_COUNT = "all_gather_by_exchange"
_EXCHANGE_COUNTS = {"reduce_scatter": EXCHANGE_COUNT, "all_gather": AG_EXCHANGE_COUNT}

Family = Literal["all_gather", "reduce_scatter", "all_reduce"]
# Op-name prefix of each collective family: the plain op and its variants
# (``_out``, ``_coalesced``, the in-place ``all_reduce_``) count alike, and so does
# a reduce-scatter or an all-gather issued as an exchange (:data:`EXCHANGE_COUNT`,
# :data:`AG_EXCHANGE_COUNT`).
_FAMILIES: tuple[tuple[str, Family], ...] = (
    ("all_gather_into_tensor", "all_gather"),
    (AG_EXCHANGE_COUNT, "all_gather"),
    ("reduce_scatter_tensor", "reduce_scatter"),
    (EXCHANGE_COUNT, "reduce_scatter"),
    ("all_reduce", "all_reduce"),
)


# ------------------------------------------------------------------ predicates
def op_name(node: fx.Node) -> tuple[str, str] | None:
    """``(namespace, name)`` of a ``call_function`` node's op, in either form (see
    [Note: Two op forms]), e.g. ``("_c10d_functional", "all_gather_into_tensor")``;
    ``None`` for anything else (a Python function, ``operator.getitem``, ...)."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if not isinstance(target, torch._ops.OpOverloadPacket):
        return None
    ns, _, name = target._qualified_op_name.partition("::")
    return ns, name


def _is_c10d(node: fx.Node, name: str) -> bool:
    q = op_name(node)
    return q is not None and q[0] in COLLECTIVE_NAMESPACES and q[1] == name


def is_all_gather(node: fx.Node) -> bool:
    """``_c10d_functional.all_gather_into_tensor(input, group_size, group_name)``."""
    return _is_c10d(node, "all_gather_into_tensor")


def is_reduce_scatter(node: fx.Node) -> bool:
    """``_c10d_functional.reduce_scatter_tensor(input, reduce_op, group_size, group_name)``."""
    return _is_c10d(node, "reduce_scatter_tensor")


def is_all_reduce(node: fx.Node) -> bool:
    """``_c10d_functional.all_reduce(input, reduce_op, group_name)``."""
    return _is_c10d(node, "all_reduce")


def is_wait(node: fx.Node) -> bool:
    """``_c10d_functional.wait_tensor(t)``."""
    return _is_c10d(node, _WAIT_NAME)


def _c10d_like(q: tuple[str, ...] | None) -> bool:
    """A functional c10d op (the wait included), or the exchanges' pooled all-to-all
    ([Note: Exchange outputs from a pool] in ``_ops.py``), from ``(namespace, name,
    ...)``."""
    return q is not None and (q[0] in COLLECTIVE_NAMESPACES or q[:2] == _POOLED_NAME)


def is_collective(node: fx.Node) -> bool:
    """Any functional c10d op that communicates (every one but the wait), or the
    exchanges' all-to-all with a pooled output."""
    q = op_name(node)
    return _c10d_like(q) and q[1] != _WAIT_NAME


def collective_family(node: fx.Node) -> Family | None:
    """``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"`` for a collective of
    that family, its variants included (``all_gather_into_tensor_out``, the
    ``_coalesced`` ops, the in-place ``all_reduce_``, a reduce-scatter issued as an
    exchange: an ``all_to_all_single`` marked :data:`EXCHANGED`); else ``None``."""
    if not is_collective(node):
        return None
    family = node.meta.get(EXCHANGED)
    if family in _EXCHANGE_COUNTS:
        return family
    q = op_name(node)
    assert q is not None
    for prefix, family in _FAMILIES:
        if q[1].startswith(prefix):
            return family
    return None


def is_fsdp_copy(node: fx.Node) -> bool:
    """``fsdp.copy_(dst, src)``: fills the unsharded placeholder ``dst``."""
    return op_name(node) == _FSDP_COPY_NAME


def is_resize(node: fx.Node) -> bool:
    """``inductor.resize_storage_bytes_(variable, new_size)``."""
    return op_name(node) == _RESIZE_NAME


def is_placeholder_op(node: fx.Node) -> bool:
    """A resize or an ``fsdp.copy_``: what grows, fills or frees an unsharded
    placeholder (its first argument)."""
    return is_resize(node) or is_fsdp_copy(node)


def is_version_counter_op(node: fx.Node) -> bool:
    """``prims._tensor_version`` or ``prims._unsafe_set_version_counter``: dynamo's
    record of ``torch.autograd._unsafe_preserve_version_counter``, which AOTAutograd
    runs on its fake tensors and leaves out of the graphs it hands on."""
    return op_name(node) in _VERSION_COUNTER_NAMES


def is_view(node: fx.Node) -> bool:
    """An op whose output may alias its first input (view, reshape, slice, t, ...)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and bool(node.target.is_view)
    )


def has_side_effects(node: fx.Node) -> bool:
    """Nodes a pass must not move across or drop: mutations, resizes, collectives and
    waits, and whatever FX itself considers impure."""
    if node.op in ("placeholder", "output", "call_module"):
        return True
    if node.op != "call_function":
        return False
    if is_placeholder_op(node) or is_collective(node) or is_wait(node):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return True
    return node.is_impure()


# ------------------------------------------------------------------ arguments
def _schema(node: fx.Node) -> torch._C.FunctionSchema | None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket):
        default = getattr(target, "default", None)
        return default._schema if default is not None else None
    return None


def bound_args(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by the op schema's names (either form; positional or
    keyword; defaults filled in), from torch's ``fx.Node.normalized_arguments``;
    ``{}`` for a node that calls no op. torch names a schema's ``self`` argument
    ``input``."""
    if op_name(node) is None:
        return {}
    try:
        pair = node.normalized_arguments(
            node.graph.owning_module, normalize_to_only_use_kwargs=True
        )
    except RuntimeError:
        # torch raises when an OpOverloadPacket's call binds to several overloads
        # and no argument types are given to choose (e.g. ``aten.add`` with two
        # nodes); bind to the packet's default overload below instead.
        pair = None
    if pair is not None:
        return dict(pair.kwargs)
    # torch's helper could not bind (it returns None when no overload's schema
    # accepts the node's arguments, e.g. a hand-built node missing an argument):
    # take what the node has, by the schema's names, without defaults.
    return _bind_by_schema(node)


def _bind_by_schema(node: fx.Node) -> dict[str, Any]:
    schema = _schema(node)
    if schema is None:
        return {}
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        name = "input" if arg.name == "self" else arg.name  # as torch's helper names it
        if i < len(node.args):
            out[name] = node.args[i]
        elif arg.name in node.kwargs:
            out[name] = node.kwargs[arg.name]
    return out


def collective_group_name(node: fx.Node) -> str | None:
    """The ``group_name`` argument of any functional collective, or ``None`` when it
    is not a constant string or ``node`` is not a collective."""
    if not is_collective(node):
        return None
    value = bound_args(node).get("group_name")
    return value if isinstance(value, str) else None


def collective_group(node: fx.Node) -> tuple[int, str] | None:
    """``(group_size, group_name)`` of an all-gather or reduce-scatter, or ``None``
    when the group is not a constant (or ``node`` is neither)."""
    if not (is_all_gather(node) or is_reduce_scatter(node)):
        return None
    args = bound_args(node)
    size, name = args.get("group_size"), args.get("group_name")
    if not isinstance(size, int) or isinstance(size, bool) or not isinstance(name, str):
        return None
    return size, name


def resize_nbytes(node: fx.Node) -> int | None:
    """The byte count of a resize node, or ``None`` if it is not a plain int."""
    n = bound_args(node).get("new_size")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def single_wait(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` consuming ``collective``, or ``None`` if the collective
    has any other user (or none)."""
    users = list(collective.users)
    if len(users) == 1 and is_wait(users[0]) and users[0].args[0] is collective:
        return users[0]
    return None


def _input(node: fx.Node) -> Any:
    args = bound_args(node)
    for key in ("input", "inputs", "tensor"):
        if key in args:
            return args[key]
    return node.args[0] if node.args else None


def _value(node: Any) -> Any:
    """The fake value recorded on a node: ``val`` (AOT and post-grad graphs) or
    ``example_value`` (dynamo graphs); a list of them for a list of nodes."""
    if isinstance(node, (list, tuple)):
        return [_value(n) for n in node]
    if not isinstance(node, fx.Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _shape(value: Any) -> list[int] | None:
    ts = _tensors(value)
    if len(ts) != 1:
        return None
    dims = list(ts[0].shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def _nbytes(value: Any) -> int | None:
    ts = _tensors(value)
    if not ts:
        return None
    total = 0
    for t in ts:
        n = t.numel()
        if not isinstance(n, int):
            return None
        total += n * t.element_size()
    return total


def resolve_group(name: str | None) -> Any | None:
    """The live process group named ``name``, or ``None``: no name, no initialized
    default group, or a name this process does not know (a graph from another
    process, a group destroyed since). Not cached: a name may be given to another
    group after its group is destroyed."""
    import torch.distributed as dist

    if name is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)
    except Exception:  # an unknown name: say nothing
        return None


def group_backend(name: str | None, device: torch.device) -> Any | None:
    """The backend that the process group named ``name`` uses for ``device``'s type
    (a ``ProcessGroupGloo``, ``ProcessGroupNCCL``, ...), or ``None`` where there is no
    such group (:func:`resolve_group`) or it has no backend for that device type
    (torch's threaded test group has none)."""
    group = resolve_group(name)
    if group is None:
        return None
    try:
        return group._get_backend(device)
    except RuntimeError:  # no backend registered for this device type
        return None


def _group_size(name: str | None) -> int | None:
    group = resolve_group(name)
    return None if group is None else group.size()


def _group_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    name = getattr(value, "group_name", None)
    return name if isinstance(name, str) else None


# ------------------------------------------------------------------ annotations
ANNOTATION_KEY = "traceable_hsdp"
UNIT, PARAMS, BUCKET, BUCKET_CAP_MB = "unit", "params", "bucket", "bucket_cap_mb"


@dataclass(frozen=True)
class UnitPassOptions:
    """Pass options one fully_shard unit carries in its collectives' annotations,
    in place of the process-wide ``PassConfig`` (see [Note: Per-unit pass options]
    in ``bucket_collectives.py``).

    Args:
        bucket: merge this unit's all-gathers, and its reduce-scatters, into one
            each (``hsdp(comm_fusion=...)``).
        bucket_cap_mb: merge adjacent units with the same options up to this many
            MiB; ``None`` keeps one bucket per unit (``hsdp(bucket_size=...)``).

    Raises:
        TypeError: ``bucket`` is not a bool, or the cap is not a number or ``None``.
        ValueError: a negative (or NaN) cap.
    """

    bucket: bool
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, bool):
            raise TypeError(
                f"UnitPassOptions.bucket must be a bool, got {type(self.bucket).__name__}."
            )
        cap = self.bucket_cap_mb
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise TypeError(
                    "UnitPassOptions.bucket_cap_mb must be a number of MiB or None, got "
                    f"{type(cap).__name__} {cap!r}."
                )
            if not cap >= 0:
                raise ValueError(f"UnitPassOptions.bucket_cap_mb must be >= 0, got {cap!r}.")

    def as_annotation(self) -> dict[str, Any]:
        """The keys this adds to a collective's annotation."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def annotation_value(
    unit: str, params: Iterable[str], options: UnitPassOptions | None = None
) -> dict[str, Any]:
    """The value stored under :data:`ANNOTATION_KEY` for a collective serving
    ``params`` of ``unit``. See [Note: Collective annotations]."""
    value: dict[str, Any] = {UNIT: unit, PARAMS: tuple(params)}
    if options is not None:
        value.update(options.as_annotation())
    return value


def annotation_of(node: fx.Node) -> dict[str, Any] | None:
    """The ``{"unit": str, "params": tuple[str, ...]}`` annotation of ``node`` (with
    ``"bucket"`` and ``"bucket_cap_mb"`` when its unit carries pass options), or
    ``None`` when it has none (or a malformed one)."""
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    value = custom.get(ANNOTATION_KEY)
    if not isinstance(value, dict) or not isinstance(value.get(UNIT), str):
        return None
    params = value.get(PARAMS)
    if not isinstance(params, (tuple, list)) or not all(isinstance(p, str) for p in params):
        return None
    out: dict[str, Any] = {UNIT: value[UNIT], PARAMS: tuple(params)}
    options = _options_in(value)
    if options is not None:
        out.update(options.as_annotation())
    return out


def _options_in(value: dict[str, Any]) -> UnitPassOptions | None:
    if BUCKET not in value:
        return None
    try:
        return UnitPassOptions(value[BUCKET], value.get(BUCKET_CAP_MB))
    except (TypeError, ValueError):
        return None  # malformed: as if the unit carried none


def unit_pass_options(node: fx.Node) -> UnitPassOptions | None:
    """The pass options ``node``'s unit carries, or ``None`` (no annotation, or one
    without options: the process-wide ``PassConfig`` decides)."""
    ann = annotation_of(node)
    return None if ann is None else _options_in(ann)


def merge_annotations(nodes: Iterable[fx.Node]) -> dict[str, Any] | None:
    """The annotation of one collective that replaces ``nodes``: the distinct units
    (joined by ``", "``, in order) and all their parameters, in order; the pass
    options when every node carries the same. ``None`` when no node is annotated."""
    units: list[str] = []
    params: list[str] = []
    options: list[UnitPassOptions | None] = []
    for n in nodes:
        a = annotation_of(n)
        options.append(None if a is None else _options_in(a))
        if a is None:
            continue
        if a[UNIT] not in units:
            units.append(a[UNIT])
        params.extend(p for p in a[PARAMS] if p not in params)
    if not units:
        return None
    same = options[0] if all(o == options[0] for o in options) else None
    return annotation_value(", ".join(units), params, same)


def set_annotation(node: fx.Node, annotation: dict[str, Any] | None) -> None:
    """Sets (or, for ``None``, leaves alone) ``node``'s annotation, keeping any other
    key of ``node.meta["custom"]``."""
    if annotation is None:
        return
    custom = node.meta.get("custom")
    custom = dict(custom) if isinstance(custom, dict) else {}
    custom[ANNOTATION_KEY] = {**annotation, PARAMS: tuple(annotation[PARAMS])}
    node.meta["custom"] = custom


def _signature(node: fx.Node) -> tuple[Any, ...]:
    args = bound_args(node)
    in_val = _value(_input(node))
    in_ts = _tensors(in_val)
    return (
        op_name(node),
        _group_name(args.get("group_name")),
        args.get("reduce_op"),
        _shape(in_val),
        in_ts[0].dtype if in_ts else None,
    )


def copy_annotations(source: fx.Graph | fx.GraphModule, target: fx.Graph | fx.GraphModule) -> str:
    """Copies the collectives' annotations from ``source`` (e.g. dynamo's graph) to
    the unannotated collectives of ``target`` (e.g. the post-grad graph of the same
    compile), matching them in graph order; only when both hold the same sequence of
    (op, group, reduce op, input shape, dtype).

    Returns:
        What happened: ``"copied N"``, ``"nothing to copy"`` (all were annotated
        already), or why nothing was copied (the graphs did not match, or ``source``
        has no annotations); then ``target`` is unchanged.
    """
    src = source.graph if isinstance(source, fx.GraphModule) else source
    dst = target.graph if isinstance(target, fx.GraphModule) else target
    src_nodes = [n for n in src.nodes if is_collective(n)]
    dst_nodes = [n for n in dst.nodes if is_collective(n)]
    if len(src_nodes) != len(dst_nodes):
        return (
            f"not copied: {len(src_nodes)} collectives in dynamo's graph, "
            f"{len(dst_nodes)} here"
        )
    for i, (s, d) in enumerate(zip(src_nodes, dst_nodes)):
        if _signature(s) != _signature(d):
            return (
                f"not copied: collective {i} differs ({s.name}: {_signature(s)} vs "
                f"{d.name}: {_signature(d)})"
            )
    if all(annotation_of(s) is None for s in src_nodes):
        return (
            "none: dynamo's graph has no annotations either (the runtime does not "
            "annotate its collectives; see [Note: Collective annotations])"
        )
    copied = 0
    for s, d in zip(src_nodes, dst_nodes):
        ann = annotation_of(s)
        if ann is not None and annotation_of(d) is None:
            set_annotation(d, ann)
            copied += 1
    return f"copied {copied}" if copied else "nothing to copy"


# ------------------------------------------------------------ tables and counts
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
        issued_at: its position in the final schedule (see :func:`with_schedule`);
            ``None`` for a graph that is not Inductor's final one.
        waited_at: the position of its wait there (``None``: not waited for in
            this graph, or no schedule).
        kernels_before_wait: kernels that run between its issue and its wait in
            the final schedule, the overlap distance (``None``: no schedule or no
            wait).
        family: what it does (:func:`collective_family`): for an exchange (an
            ``all_to_all_single`` the passes issue in place of a reduce-scatter or
            an all-gather) not its op's family; see :attr:`label`.
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
    """Counts of the nodes a fully_shard graph is judged by: each functional c10d op
    by name (``all_gather_into_tensor``, ``wait_tensor``, ...; a reduce-scatter issued
    as an exchange as :data:`EXCHANGE_COUNT`), ``fsdp.copy_``, and storage resizes
    (``resize_to_0`` and ``resize_to_full``). Zero counts are left out."""
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
    issue it; see [Note: CPU all-gathers into buffers] in ``gather_into_buffers.py``).
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


# ------------------------------------------------------------- final schedule
ScheduleKind = Literal["collective", "wait", "kernel"]


@dataclass(frozen=True)
class ScheduledOp:
    """One call in the order Inductor's generated code runs them (see [Note: The
    final schedule]).

    Args:
        position: index in the schedule (collectives, waits and kernels counted).
        kind: ``"collective"``, ``"wait"``, or ``"kernel"`` (any other op that
            computes or copies: a generated kernel, an extern kernel such as
            ``extern_kernels.mm``, an op Inductor falls back to).
        name: the call as the code writes it: ``torch.ops._c10d_functional.
            all_gather_into_tensor.default``, ``cpp_fused_add_0``, ...
        line: its line in the output code (1-based).
        collective: a collective's index among the schedule's collectives; for a
            wait, the index of the collective it waits for (``None`` when that
            collective was not issued in this graph); ``None`` for a kernel.
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


def _name_family(name: str) -> Family | None:
    for prefix, family in _FAMILIES:
        if name.startswith(prefix):
            return family
    return None


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


# ------------------------------------------------------------------ recording
Kind = Literal["fwd", "bwd", "aot_bwd"]


@dataclass
class RecordedGraph:
    """One graph a :class:`PostGradRecorder` was handed.

    Args:
        graph: the graph object (later post-grad passes may still change it).
        gm: its owning module, if any.
        compile_id: torch's compile id (``"0/0"``; ``"!0/1/0"`` for compiled
            autograd), or ``None`` outside a compile.
        kind: ``"bwd"`` (a compiled-autograd graph), ``"aot_bwd"`` (AOTAutograd's
            own backward: it takes tangents) or ``"fwd"``.
        tag: the recorder's ``tag`` when the graph came (e.g. a benchmark variant).
    """

    graph: fx.Graph
    gm: fx.GraphModule | None
    compile_id: str | None
    kind: Kind
    tag: str | None = None

    @property
    def backward(self) -> bool:
        return self.kind != "fwd"

    def final_graph(self) -> fx.Graph:
        """The graph as it is now: a later pass may have given the module a new one."""
        return self.gm.graph if self.gm is not None else self.graph


def current_compile() -> tuple[str | None, bool]:
    """``(torch's compile id, whether it is a compiled-autograd backward)`` of the
    compile running now; ``(None, False)`` outside one."""
    cid = torch._guards.CompileContext.current_compile_id()
    if cid is None:
        return None, False
    return str(cid), getattr(cid, "compiled_autograd_id", None) is not None


def _kind(graph: fx.Graph) -> tuple[str | None, Kind]:
    cid, compiled_autograd = current_compile()
    if compiled_autograd:
        return cid, "bwd"
    tangents = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    return cid, ("aot_bwd" if tangents else "fwd")


# Inductor hands ``is_inference`` to passes of this class; older torch lacks it.
InferenceAwareGraphPass: type = getattr(
    _cgp, "CustomInferenceAwareGraphPass", _cgp.CustomGraphPass
)
INFERENCE_AWARE = InferenceAwareGraphPass is not _cgp.CustomGraphPass


class PostGradRecorder(InferenceAwareGraphPass):  # type: ignore[misc, valid-type]
    """A post-grad pass that records every graph Inductor hands it, for dumps,
    benchmarks and tests. Put it in ``post_grad_custom_pre_pass`` (around
    traceable_hsdp's passes) or ``post_grad_custom_post_pass`` (after every pass but
    torch's own later ones). Its ``uuid()`` is ``None``, which turns the FX graph
    cache off while it is set: a cache hit would skip the post-grad passes, and the
    graph would not be recorded.

    Args:
        on_graph: called with each :class:`RecordedGraph` as it comes; an exception
            it raises is logged, never raised into the compile (default ``None``).
        keep: keep the records in :attr:`graphs` (default ``True``).

    Attributes:
        graphs: the records, in order (with ``keep``).
        calls: how many graphs it was handed.
        tag: copied into each record (default ``None``).
    """

    def __init__(
        self, on_graph: Callable[[RecordedGraph], None] | None = None, *, keep: bool = True
    ) -> None:
        self.on_graph = on_graph
        self.keep = keep
        self.graphs: list[RecordedGraph] = []
        self.calls = 0
        self.tag: str | None = None

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        self.calls += 1
        cid, kind = _kind(graph)
        gm = graph.owning_module
        rec = RecordedGraph(
            graph, gm if isinstance(gm, fx.GraphModule) else None, cid, kind, self.tag
        )
        if self.keep:
            self.graphs.append(rec)
        if self.on_graph is not None:
            try:
                self.on_graph(rec)
            except Exception:  # a recorder must never break the compile it watches
                log.exception("PostGradRecorder: recording a post-grad graph failed")

    def uuid(self) -> None:
        return None
