"""The recorder of Inductor's post-grad graphs (:class:`PostGradRecorder`), for the
dump, the benchmarks and the tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

from ..passes._graph import InferenceAwareGraphPass

log = logging.getLogger(__name__)

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


class PostGradRecorder(InferenceAwareGraphPass):  # type: ignore[misc, valid-type]
    """A post-grad pass that records every graph Inductor hands it, for dumps,
    benchmarks and tests. Its ``uuid()`` is ``None``, which turns the FX graph cache
    off while it is set (a hit would skip the recording).

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
