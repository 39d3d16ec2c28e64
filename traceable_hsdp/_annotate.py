"""The runtime's side of the collective annotations: entering them around each
collective it issues.

See [Note: Collective annotations] in ``passes/_graph.py``; this module only enters
``torch.fx.traceback.annotate`` with that value. Where it is missing, the helpers are
no-ops and the ``PassConfig`` decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
import torch.fx.traceback

from .passes._graph import ANNOTATION_KEY, UnitPassOptions, annotation_value

__all__ = ["collective_annotation", "call_annotated"]

_T = TypeVar("_T")


def collective_annotation(
    unit: str, params: Sequence[str], options: UnitPassOptions | None = None
) -> AbstractContextManager[Any]:
    """Annotates the nodes traced inside the block as serving ``params`` of ``unit``.
    See [Note: Collective annotations] (``passes/_graph.py``). Eagerly and outside
    tracing it only sets a thread-local dict; on a torch without
    ``torch.fx.traceback.annotate`` it does nothing.

    Args:
        unit: the fully_shard unit's label.
        params: FQNs of the parameters the collective serves.
        options: the unit's own pass options (default ``None``: the process-wide
            ``PassConfig`` decides).
    """
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None:
        return nullcontext()
    return annotate({ANNOTATION_KEY: annotation_value(unit, params, options)})


def call_annotated(
    unit: str,
    param: str,
    fn: Callable[..., _T],
    *args: Any,
    options: UnitPassOptions | None = None,
) -> _T:
    """``fn(*args)`` inside ``collective_annotation(unit, [param], options)``: the
    one-line form for the runtime's list comprehensions, e.g.
    ``[call_annotated(self.label, p.fqn, p.all_gather_start) for p in self.fsdp_params]``.
    """
    with collective_annotation(unit, (param,), options):
        return fn(*args)
