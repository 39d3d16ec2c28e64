"""Which fully_shard unit and parameters a collective in a traced graph serves.

[Note: Collective annotations]
The runtime issues each parameter's all-gather and reduce-scatter (and, for HSDP, its
all-reduce) inside :func:`collective_annotation` (or :func:`call_annotated`), which
is ``torch.fx.traceback.annotate`` with one key. Every FX node traced inside it gets::

    node.meta["custom"]["traceable_hsdp"] = {"unit": "Block", "params": ("attn.wq.weight",)}

``unit`` is the unit's label (``FSDPParamGroup.label``) and ``params`` the parameter
FQNs relative to the unit's module. It is metadata only: the graph, its code, and
the FX graph cache key are the same with and without it. Graph passes that merge
collectives give the merged node the concatenation (:func:`merge_annotations`), so
after bucketing one collective lists every parameter it serves.

Where it survives, on torch 2.13 (checked with the demo Llama, 2 ranks):

- dynamo's graphs (what a ``torch.compile`` backend receives): forward, and the
  graph compiled autograd hands to dynamo for the backward (the annotation is
  entered inside the backward hooks, which dynamo inlines);
- AOTAutograd's forward graph and so Inductor's post-grad forward graph;
- NOT AOTAutograd's graph of a compiled-autograd backward, nor its post-grad graph:
  that graph takes a boxed list input, so dynamo hands AOTAutograd a ``GmWrapper``
  instead of the ``GraphModule``, and AOTAutograd re-traces it without
  ``preserve_node_meta`` (every node's meta is lost, ``stack_trace`` included).
  ``traceable_hsdp.dump_graphs`` copies the annotations over from dynamo's graph of
  the same compile, matching collectives in graph order (see ``_dump.py``).

``torch.fx.traceback.annotate`` (and dynamo's support for it) exists since torch
2.10, so on torch 2.13, the one version supported and tested; where it is missing,
the helper is a no-op and dumps show no unit or parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
import torch.fx.traceback

__all__ = [
    "ANNOTATION_KEY",
    "collective_annotation",
    "call_annotated",
    "annotation_of",
    "merge_annotations",
    "set_annotation",
]

ANNOTATION_KEY = "traceable_hsdp"
_T = TypeVar("_T")


def collective_annotation(unit: str, params: Sequence[str]) -> AbstractContextManager[Any]:
    """Annotates the nodes traced inside the block as serving ``params`` of ``unit``.
    See [Note: Collective annotations]. Eagerly and outside tracing it only sets a
    thread-local dict; on a torch without ``torch.fx.traceback.annotate`` it does
    nothing.

    Args:
        unit: the fully_shard unit's label.
        params: FQNs of the parameters the collective serves.
    """
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None:
        return nullcontext()
    return annotate({ANNOTATION_KEY: {"unit": unit, "params": tuple(params)}})


def call_annotated(unit: str, param: str, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` inside ``collective_annotation(unit, [param])``: the one-line
    form for the runtime's list comprehensions, e.g.
    ``[call_annotated(self.label, p.fqn, p.all_gather_start) for p in self.fsdp_params]``.
    """
    with collective_annotation(unit, (param,)):
        return fn(*args)


def annotation_of(node: torch.fx.Node) -> dict[str, Any] | None:
    """The ``{"unit": str, "params": tuple[str, ...]}`` annotation of ``node``, or
    ``None`` when it has none (or a malformed one)."""
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    value = custom.get(ANNOTATION_KEY)
    if not isinstance(value, dict) or not isinstance(value.get("unit"), str):
        return None
    params = value.get("params")
    if not isinstance(params, (tuple, list)) or not all(isinstance(p, str) for p in params):
        return None
    return {"unit": value["unit"], "params": tuple(params)}


def merge_annotations(nodes: Iterable[torch.fx.Node]) -> dict[str, Any] | None:
    """The annotation of one collective that replaces ``nodes``: the distinct units
    (joined by ``", "``, in order) and all their parameters, in order. ``None`` when
    no node is annotated."""
    units: list[str] = []
    params: list[str] = []
    for n in nodes:
        a = annotation_of(n)
        if a is None:
            continue
        if a["unit"] not in units:
            units.append(a["unit"])
        params.extend(p for p in a["params"] if p not in params)
    if not units:
        return None
    return {"unit": ", ".join(units), "params": tuple(params)}


def set_annotation(node: torch.fx.Node, annotation: dict[str, Any] | None) -> None:
    """Sets (or, for ``None``, leaves alone) ``node``'s annotation, keeping any other
    key of ``node.meta["custom"]``."""
    if annotation is None:
        return
    custom = node.meta.get("custom")
    custom = dict(custom) if isinstance(custom, dict) else {}
    custom[ANNOTATION_KEY] = {"unit": annotation["unit"], "params": tuple(annotation["params"])}
    node.meta["custom"] = custom
