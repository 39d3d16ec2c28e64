"""The graph vocabulary: what a node of a traceable_hsdp graph is, written once.

Every reader of traced graphs (the passes, ``dump_graphs``, the benchmarks and the
tests) uses this module and matches no op name by itself. It owns the predicates
(collective, wait, ``fsdp.copy_``, resize, view; arguments by schema name), the
collective annotations ([Note: Collective annotations]), and resolving a collective's
process group (:func:`resolve_group`, :func:`group_backend`). It imports only torch.

[Note: Two op forms]
Post-grad and AOTAutograd graphs call the ``OpOverload`` (``...all_gather_into_tensor
.default``); the graph dynamo hands a backend calls the ``OpOverloadPacket``, sometimes
with keyword arguments. Every predicate compares the qualified name, so it accepts
both; :func:`bound_args` binds either form to the schema's names.

[Note: Collective annotations]
The runtime issues each parameter's collectives inside
``traceable_hsdp._annotate.collective_annotation`` (``torch.fx.traceback.annotate``
with :data:`ANNOTATION_KEY`), so every node traced inside gets::

    node.meta["custom"]["traceable_hsdp"] = {"unit": "layers.0", "params": ("attn.wq.weight",)}

``params`` are FQNs relative to the unit's module. A unit with its own pass options
adds ``"bucket"`` and ``"bucket_cap_mb"`` ([Note: Per-unit pass options] in
``bucket_collectives.py``). Merging passes give the merged node the concatenation
(:func:`merge_annotations`).

It survives in dynamo's graphs (forward and compiled-autograd backward) and
AOTAutograd's and Inductor's forward graphs, but NOT in AOTAutograd's graph of a
compiled-autograd backward, which AOTAutograd re-traces from a wrapper without node
meta. ``dump_graphs`` copies the annotations back from dynamo's graph
(:func:`copy_annotations`); the passes cannot, so there the ``PassConfig`` decides.

The annotation is metadata only: graph, code and cache key are the same without it
([Note: Per-unit options and the FX graph cache] in ``_install.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, fields
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
    "EXCHANGED",
    "EXCHANGE_COUNT",
    "FSDP_COPY",
    "RESIZE",
    "REDUCE_SCATTER",
    "UnitPassOptions",
    "WAIT",
    "annotation_of",
    "bound_args",
    "collective_family",
    "collective_group",
    "collective_group_name",
    "copy_annotations",
    "group_backend",
    "has_side_effects",
    "is_all_gather",
    "is_all_reduce",
    "is_collective",
    "is_fsdp_copy",
    "is_grow",
    "is_placeholder_op",
    "is_reduce_scatter",
    "is_resize",
    "is_version_counter_op",
    "is_view",
    "is_wait",
    "merge_annotations",
    "resolve_group",
    "op_name",
    "resize_nbytes",
    "set_annotation",
    "single_wait",
    "unit_pass_options",
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
# the exchanges issue (``gloo/_pool.py``); named here, not imported, as the others are.
_POOLED_NAME = ("traceable_hsdp", "all_to_all_single")
_VERSION_COUNTER_NAMES = (("prims", "_tensor_version"), ("prims", "_unsafe_set_version_counter"))

# Marks an ``all_to_all_single`` issued as an exchange ([Note: gloo reduce-scatters as
# an exchange]); the value is the family it counts in.
EXCHANGED = "traceable_hsdp_exchange"
EXCHANGE_COUNT = "reduce_scatter_by_exchange"
AG_EXCHANGE_COUNT = "all_gather_by_exchange"
_EXCHANGE_COUNTS = {"reduce_scatter": EXCHANGE_COUNT, "all_gather": AG_EXCHANGE_COUNT}

Family = Literal["all_gather", "reduce_scatter", "all_reduce"]
# Op-name prefix of each collective family; variants and exchanges count alike.
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
    ([Note: Exchange outputs from a pool] in ``gloo/_pool.py``), from ``(namespace, name,
    ...)``."""
    return q is not None and (q[0] in COLLECTIVE_NAMESPACES or q[:2] == _POOLED_NAME)


def is_collective(node: fx.Node) -> bool:
    """Any functional c10d op that communicates (every one but the wait), or the
    exchanges' all-to-all with a pooled output."""
    q = op_name(node)
    return _c10d_like(q) and q[1] != _WAIT_NAME


def collective_family(node: fx.Node) -> Family | None:
    """``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"`` for a collective of
    that family (variants and exchanges included); else ``None``."""
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


def is_grow(node: fx.Node, placeholder: fx.Node) -> bool:
    """A resize of ``placeholder`` to a size other than 0 (its grow before a fill)."""
    return is_resize(node) and node.args[0] is placeholder and resize_nbytes(node) != 0


def is_placeholder_op(node: fx.Node) -> bool:
    """A resize or an ``fsdp.copy_``: what grows, fills or frees an unsharded
    placeholder (its first argument)."""
    return is_resize(node) or is_fsdp_copy(node)


def is_version_counter_op(node: fx.Node) -> bool:
    """Dynamo's record of ``_unsafe_preserve_version_counter`` ([Note: Version
    counters in a traced step])."""
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
    """The node's arguments by the op schema's names (either form, defaults filled
    in); ``{}`` for a node that calls no op. ``self`` is named ``input``."""
    if op_name(node) is None:
        return {}
    try:
        pair = node.normalized_arguments(
            node.graph.owning_module, normalize_to_only_use_kwargs=True
        )
    except RuntimeError:
        # Ambiguous overloads: bind to the packet's default overload below.
        pair = None
    if pair is not None:
        return dict(pair.kwargs)
    # torch's helper could not bind: take what the node has, without defaults.
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
    """The live process group named ``name``, or ``None`` where this process knows
    none. Not cached: names are reused after a group is destroyed."""
    import torch.distributed as dist

    if name is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)
    except Exception:  # an unknown name: say nothing
        return None


def group_backend(name: str | None, device: torch.device) -> Any | None:
    """The backend the process group named ``name`` uses for ``device``'s type, or
    ``None`` (no such group, or no backend for that type)."""
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
    """The annotation of one collective replacing ``nodes``: their units and
    parameters, in order, and the pass options they share. ``None`` if none has one."""
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


# Inductor hands ``is_inference`` to passes of this class; older torch lacks it.
InferenceAwareGraphPass: type = getattr(
    _cgp, "CustomInferenceAwareGraphPass", _cgp.CustomGraphPass
)
INFERENCE_AWARE = InferenceAwareGraphPass is not _cgp.CustomGraphPass
