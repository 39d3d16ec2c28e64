"""Graph dumps of compiled fully_shard training: :func:`dump_graphs`.

[Note: What dump_graphs records]
Everything ``torch.compile`` compiles inside ``with dump_graphs(out_dir) as dump:``
is written under ``out_dir``:

``depyf/`` (when depyf is installed), ``post_grad/NN_KIND_{before,after}_passes.py``
(around our passes), ``graphs/NN_KIND_dynamo.py`` ([Note: The recording backend]),
``scheduled/NN_KIND_output_code.py`` ([Note: The final schedule in the dump]),
``collectives.json`` (each collective per graph and stage, with unit, parameters and,
scheduled, overlap distance), ``breaks_and_recompiles.json``, ``summary.txt``, and with
``trace=True`` ``trace/`` and ``tlparse/``.

``NN`` numbers the compiles in order; ``KIND`` is ``fwd`` (a dynamo frame), ``bwd`` (a
compiled-autograd backward) or ``aot_bwd`` (AOTAutograd's own backward, which a
fully_shard model never runs: docs/compile.md).

[Note: Hooking Inductor]
The post-grad graphs come from Inductor's public hook only. On entry ``dump_graphs``
installs the passes and replaces the hook's value ``P`` by ``[before, P, after]``, two
recorders bracketing our passes; ``passes.install()`` recognizes ``P`` inside the list.
On exit the hook gets ``P`` back. The recorders' ``uuid()`` is ``None``, which turns the
FX graph cache off while dumping: a hit would skip the passes and the recording.

[Note: The recording backend]
Compiled-autograd backward graphs lose node metadata in AOTAutograd ([Note: Collective
annotations] in ``passes/_graph.py``), and non-Inductor backends have no post-grad
graphs. ``dump.backend(inner)`` records dynamo's graph, then compiles it with
``inner``: every backend gets a table from dynamo's graph, and with Inductor missing
annotations are copied from dynamo's graph of the same compile id, only when both
hold the same sequence of collectives (otherwise ``collectives.json`` says why).

[Note: The final schedule in the dump]
A handler on torch's structured-trace logger receives each graph's generated code
(``scheduled/``), read into the final order ([Note: The final schedule] in
``_schedule.py``) and checked against torch's ``inductor_collective_schedule``. It
makes torch render every payload, adding compile time as ``TORCH_TRACE`` does.

[Note: depyf writes, dynamo's bytecode runs]
``depyf.prepare_debug``'s bytecode hook returns its recompiled decompilation of
dynamo's bytecode, which can differ from it (a replayed state read in another order,
then a read of freed storage, in the dump only). A dump must run what a plain run runs,
so ``dump_graphs`` registers two bytecode hooks around depyf's: the first remembers
dynamo's code, the last hands it back. depyf's ``__transformed_code_*`` files are a
reading aid, not what ran.

[Note: dynamo must not compile depyf's own functions]
depyf swaps three torch functions for its own while the block runs, and dynamo skips
torch's files by path but not depyf's. In a whole step compiled with compiled autograd,
the backward formats its graph through depyf's function inside a live dynamo frame;
dynamo compiles it and depyf's hook recurses without end. So ``dump_graphs`` adds
depyf's package to dynamo's skipped directories for the block
(``_torch_internals.dynamo_skips``, in [Note: Torch internals]).

[Note: Entering before the first compile]
Only compiles inside the block are seen. ``dump_graphs`` does not reset dynamo to force
recompiles, since ``torch._dynamo.reset()`` also turns compiled autograd off; it warns
instead. Reset yourself before entering (then call
``traceable_hsdp.enable_compiled_autograd()`` again) to dump them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import torch
import torch._dynamo
import torch._dynamo.convert_frame
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch import fx

from .._torch_internals import dynamo_skips
from ..passes._graph import annotation_of, copy_annotations, is_collective
from ._recorder import Kind, PostGradRecorder, RecordedGraph, current_compile
from ._schedule import max_in_flight, read_schedule, with_schedule
from ._table import CollectiveRow, collective_table, family_counts, graph_counts

__all__ = [
    "dump_graphs",
    "GraphDump",
    "GraphRecord",
    "format_table",
    "compare_dumps",
]

log = logging.getLogger(__name__)

Stage = Literal["dynamo", "before_passes", "after_passes", "scheduled"]

_STAGE_TITLE = {
    "dynamo": "dynamo", "before_passes": "before passes", "after_passes": "after passes",
    "scheduled": "final schedule",
}
_STAGE_ORDER = {"dynamo": 0, "before_passes": 1, "after_passes": 2, "scheduled": 3}
_OUR_PATHS = (
    "depyf", "graphs", "post_grad", "scheduled", "trace", "tlparse",
    "collectives.json", "breaks_and_recompiles.json", "summary.txt",
)


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _kernels(n: float) -> str:
    return f"{n:g} kernel" + ("" if n == 1 else "s")


def overlap_line(rows: Sequence[CollectiveRow]) -> str:
    """One line on the overlap distances of a graph's final schedule, per collective
    op: how many have at least one kernel between issue and wait, and the median
    distance in kernels."""
    by_op: dict[str, list[int]] = {}
    unwaited: Counter[str] = Counter()
    for r in rows:
        if r.kernels_before_wait is None:
            unwaited[r.label] += 1
        else:
            by_op.setdefault(r.label, []).append(r.kernels_before_wait)
    parts = []
    for op in dict.fromkeys(r.label for r in rows):
        d = sorted(by_op.get(op, []))
        text = f"{op}: {sum(1 for x in d if x >= 1)} of {len(d)} with >=1 kernel before the wait"
        if d:
            mid = len(d) // 2
            median = d[mid] if len(d) % 2 else (d[mid - 1] + d[mid]) / 2
            text += f", median {_kernels(median)}"
        if unwaited[op]:
            text += f" ({unwaited[op]} not waited for in this graph)"
        parts.append(text)
    return "overlap: " + ("; ".join(parts) if parts else "no collectives")


def _brief(reason: str) -> str:
    """The first line of a graph-break reason, and its ``Explanation:`` line."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    if not lines:
        return "?"
    expl = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), None)
    return lines[0] if expl is None else f"{lines[0]}. {expl}"


def _params_text(params: Sequence[str], limit: int = 4) -> str:
    if not params:
        return "-"
    shown = ", ".join(params[:limit])
    more = f", ... ({len(params)} params)" if len(params) > limit else ""
    return shown + more


def format_table(rows: Sequence[CollectiveRow]) -> str:
    """The collectives as an aligned text table, one line each. Rows placed in a
    final schedule get the column ``wait after``: the kernels that run between the
    collective's issue and its wait."""
    scheduled = any(r.issued_at is not None for r in rows)
    header = ("#", "op", "reduce", "group", "size", "dtype", "in -> out", "unit", "params")
    if scheduled:
        header = header[:-2] + ("wait after",) + header[-2:]
    lines = [header]
    for r in rows:
        distance: tuple[str, ...] = ()
        if scheduled:
            distance = (
                "no wait" if r.kernels_before_wait is None
                else _kernels(r.kernels_before_wait),
            )
        lines.append((
            str(r.index),
            r.label,
            r.reduce_op or "-",
            r.group_name or "?",
            "?" if r.group_size is None else str(r.group_size),
            r.dtype or "?",
            f"{_human_bytes(r.in_bytes)} -> {_human_bytes(r.out_bytes)}",
            *distance,
            r.unit or "-",
            _params_text(r.params),
        ))
    if len(lines) == 1:
        return "  (no collectives)"
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for line in lines:
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths)]
        out.append("  " + "  ".join(cells) + "  " + line[-1])
    return "\n".join(out)


# ---------------------------------------------------------------------- records
@dataclass
class GraphRecord:
    """One recorded graph at one stage.

    Args:
        name: ``NN_KIND`` (see [Note: What dump_graphs records]).
        stage: ``"dynamo"``, ``"before_passes"`` or ``"after_passes"``.
        kind: ``"fwd"``, ``"bwd"`` or ``"aot_bwd"``.
        compile_id: torch's compile id (``"0/0"``; ``"!0/1/0"`` for compiled autograd).
        file: the graph's source, relative to the dump directory.
        counts: :func:`graph_counts` of the graph.
        collectives: :func:`collective_table` of the graph.
        annotations: where the unit/parameter columns come from: ``"node meta"``,
            or what :func:`copy_annotations` reported.
        schedule: the ``"scheduled"`` stage only: the final order, one entry per
            collective issue (``"C3"``), wait (``"W3"``; ``"W-"`` for a wait no
            collective produced, [Note: The input lives until the wait]) or kernel.
        schedule_note: the ``"scheduled"`` stage only: whether the order of issues
            and waits agrees with torch's ``inductor_collective_schedule``, or why
            the schedule could not be read.
        in_flight: the ``"scheduled"`` stage only: the most collectives of each op
            issued and not yet waited for at once.
    """

    name: str
    stage: Stage
    kind: Kind
    compile_id: str | None
    file: str
    counts: dict[str, int]
    collectives: list[CollectiveRow]
    annotations: str = "node meta"
    schedule: list[str] | None = None
    schedule_note: str = ""
    in_flight: dict[str, int] | None = None


@dataclass
class _Breaks:
    graph_breaks: list[dict[str, Any]] = field(default_factory=list)
    compiles: list[dict[str, Any]] = field(default_factory=list)
    recompiles: list[dict[str, Any]] = field(default_factory=list)
    compiled_autograd_graphs: int = 0
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ dump
class GraphDump:
    """What :func:`dump_graphs` yields: the recorded graphs so far, and
    :meth:`backend` to record dynamo's graphs too.

    Attributes:
        out_dir: the dump directory.
        records: every recorded graph and stage, in recording order.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.records: list[GraphRecord] = []
        self._names: dict[tuple[str | None, int], str] = {}
        self._post_grad_seen: Counter[str | None] = Counter()
        self._dynamo_graphs: dict[str | None, fx.GraphModule] = {}
        # compile id -> the latest post-grad graph of that compile (name, record)
        self._lowering: dict[str | None, tuple[str, RecordedGraph]] = {}
        self._issue_order: dict[str | None, list[str]] = {}
        self._breaks = _Breaks()
        self._trace_note = "off"
        self._depyf_note = ""  # why depyf/ was not written, if it was not
        self._compiled_before = False
        self._active = True  # False once the dump_graphs block exited

    # ------------------------------------------------------------- recording
    def backend(self, inner: str | Callable[..., Any] = "inductor") -> Callable[..., Any]:
        """A ``torch.compile`` backend that records the graph dynamo hands it and then
        compiles it with ``inner``. See [Note: The recording backend].

        Args:
            inner: a backend name (``"inductor"``, ``"aot_eager"``, ...) or callable
                (default ``"inductor"``).

        Raises:
            ValueError: ``inner`` names no registered backend.
        """
        if isinstance(inner, str):
            known = torch._dynamo.list_backends(exclude_tags=())
            if inner not in known:
                raise ValueError(
                    f"dump.backend({inner!r}): not a torch.compile backend; known: "
                    f"{', '.join(sorted(known))}."
                )
        compile_fn = torch._dynamo.lookup_backend(inner)

        def recording_backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
            try:
                if self._active:
                    self._record_dynamo(gm)
            except Exception:
                log.exception("dump_graphs: recording dynamo's graph failed")
            return compile_fn(gm, example_inputs)

        name = inner if isinstance(inner, str) else getattr(inner, "__name__", "backend")
        recording_backend.__name__ = f"dump_graphs({name})"
        return recording_backend

    def _name(self, key: tuple[str | None, int], kind: Kind) -> str:
        if key not in self._names:
            self._names[key] = f"{len(self._names):02d}_{kind}"
        return self._names[key]

    def _write(self, rel: str, header: str, gm: fx.GraphModule) -> None:
        path = self.out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        path.write_text(f"# {header}\n{code}\n")

    def _record_dynamo(self, gm: fx.GraphModule) -> None:
        cid, is_bwd = current_compile()
        kind: Kind = "bwd" if is_bwd else "fwd"
        name = self._name((cid, 0), kind)
        rel = f"graphs/{name}_dynamo.py"
        self._write(rel, f"dynamo graph {name}, compile id {cid}, as the backend got it", gm)
        self._dynamo_graphs[cid] = gm
        self.records.append(
            GraphRecord(name, "dynamo", kind, cid, rel, graph_counts(gm), collective_table(gm))
        )

    def _record_post_grad(self, rec: RecordedGraph, stage: Stage) -> None:
        gm, graph, cid, kind = rec.gm, rec.graph, rec.compile_id, rec.kind
        if gm is None:
            return
        if stage == "before_passes":
            self._post_grad_seen[cid] += 1
        sub = max(self._post_grad_seen[cid] - 1, 0)
        name = self._name((cid, sub), kind)
        annotations = "node meta"
        missing = any(is_collective(n) and annotation_of(n) is None for n in graph.nodes)
        if stage == "before_passes" and missing:
            source = self._dynamo_graphs.get(cid) if sub == 0 else None
            if source is None:
                annotations = (
                    "none: no dynamo graph of this compile was recorded (compile with "
                    "backend=dump.backend(...)); see [Note: The recording backend]"
                )
            else:
                annotations = "from dynamo's graph: " + copy_annotations(source, graph)
        elif stage == "after_passes":
            before = next(
                (r for r in reversed(self.records)
                 if r.name == name and r.stage == "before_passes"),
                None,
            )
            if before is not None:
                annotations = before.annotations
        if stage == "after_passes":
            self._lowering[cid] = (name, rec)
        rel = f"post_grad/{name}_{stage}.py"
        self._write(rel, f"post-grad graph {name} {_STAGE_TITLE[stage]}, compile id {cid}", gm)
        self.records.append(
            GraphRecord(
                name, stage, kind, cid, rel, graph_counts(graph), collective_table(graph),
                annotations,
            )
        )

    def _record_output_code(self, code: str) -> None:
        """The generated code of the graph Inductor just compiled: written to
        ``scheduled/`` and read into the final schedule. See [Note: The final
        schedule in the dump]."""
        cid, _ = current_compile()
        if cid not in self._lowering:
            return  # a graph whose post-grad passes were not recorded
        name, rec = self._lowering.pop(cid)
        rel = f"scheduled/{name}_output_code.py"
        path = self.out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"# Inductor's generated code of {name}, compile id {cid}: its `call` runs "
            f"in the final schedule\n{code}"
        )
        graph = rec.final_graph()
        rows = collective_table(graph)
        before = next(
            (r for r in reversed(self.records) if r.name == name and r.stage == "after_passes"),
            None,
        )
        record = GraphRecord(
            name, "scheduled", rec.kind, cid, rel, graph_counts(graph), rows,
            before.annotations if before is not None else "node meta",
        )
        try:
            schedule = read_schedule(code)
            record.collectives = with_schedule(rows, schedule)
            record.schedule = [
                op.name if op.kind == "kernel"
                else ("C" if op.kind == "collective" else "W")
                + ("-" if op.collective is None else str(op.collective))
                for op in schedule
            ]
            record.in_flight = max_in_flight(schedule, record.collectives)
            issues_and_waits = [op.name for op in schedule if op.kind != "kernel"]
            if issues_and_waits:
                record.schedule_note = "not checked: torch logged no collective schedule"
                self._issue_order[cid] = issues_and_waits
            else:
                record.schedule_note = f"{len(schedule)} kernels, no collectives"
        except ValueError as e:
            record.schedule_note = f"not read: {e}"
        self.records.append(record)

    def _check_torch_schedule(self, torch_order: list[Any]) -> None:
        """Compares torch's ``inductor_collective_schedule`` artifact (the issues
        and waits of the graph just compiled, by kernel name) with the order read
        from the code."""
        cid, _ = current_compile()
        ours = self._issue_order.pop(cid, None)
        record = next(
            (r for r in reversed(self.records) if r.stage == "scheduled" and r.compile_id == cid),
            None,
        )
        if ours is None or record is None:
            return
        if ours == torch_order:
            record.schedule_note = (
                f"the {len(ours)} issues and waits are in the order torch logged "
                "(inductor_collective_schedule)"
            )
        else:
            where = next(
                (i for i, (a, b) in enumerate(zip(ours, torch_order)) if a != b),
                min(len(ours), len(torch_order)),
            )
            record.schedule_note = (
                f"DIFFERS from torch's inductor_collective_schedule at entry {where} "
                f"({len(ours)} issues and waits read from the code, {len(torch_order)} "
                "logged): the distances may be wrong"
            )

    # -------------------------------------------------------------- results
    def graph_names(self) -> list[str]:
        """The recorded graphs' names, in order."""
        return list(dict.fromkeys(r.name for r in self.records))

    def last_stage(self, name: str) -> GraphRecord:
        """The graph's record at its last stage (the final schedule, else after
        passes, else before, else dynamo's)."""
        recs = [r for r in self.records if r.name == name]
        if not recs:
            raise KeyError(f"no recorded graph named {name!r}; have {self.graph_names()}")
        return max(recs, key=lambda r: _STAGE_ORDER[r.stage])

    def summary(self) -> str:
        """The text printed when the block exits (also in ``summary.txt``)."""
        out: list[str] = []
        rank = dist.get_rank() if dist.is_initialized() else None
        where = "" if rank is None else f" (rank {rank})"
        out.append(
            f"traceable_hsdp.dump_graphs{where}: {len(self.graph_names())} graphs -> "
            f"{self.out_dir}"
        )
        if self._compiled_before:
            out.append(
                "  WARNING: torch.compile had compiled before the dump started; those "
                "graphs are not in it (see [Note: Entering before the first compile])."
            )
        if not self.records:
            out.append(
                "  no graphs recorded: nothing was compiled by Inductor, and no "
                "dump.backend(...) was used; depyf's files are in depyf/."
            )
        else:
            head = ("graph", "stage", "AG", "RS", "AR", "fsdp.copy_", "resize", "file")
            rows = [head]
            for r in self.records:
                c = r.counts
                fam = family_counts(c)  # an all-gather in either form
                rows.append((
                    r.name, _STAGE_TITLE[r.stage],
                    str(fam.get("all_gather", 0)),
                    str(fam.get("reduce_scatter", 0)),
                    str(fam.get("all_reduce", 0)),
                    str(c.get("fsdp.copy_", 0)),
                    str(c.get("resize_to_0", 0) + c.get("resize_to_full", 0)),
                    r.file,
                ))
            widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
            for x in rows:
                out.append("  " + "  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())
            for name in self.graph_names():
                rec = self.last_stage(name)
                out.append("")
                order = "final" if rec.stage == "scheduled" else "graph"
                out.append(
                    f"{name} ({_STAGE_TITLE[rec.stage]}, compile id {rec.compile_id}): "
                    f"{len(rec.collectives)} collectives in {order} order"
                )
                if rec.annotations != "node meta":
                    out.append(f"  unit/params: {rec.annotations}")
                if rec.stage == "scheduled":
                    out.append(f"  schedule: {rec.schedule_note}")
                    if rec.schedule is not None:
                        out.append(f"  {overlap_line(rec.collectives)}")
                    if rec.in_flight:
                        most = ", ".join(f"{op} {n}" for op, n in rec.in_flight.items())
                        out.append(f"  most in flight at once: {most}")
                out.append(format_table(rec.collectives))
        b = self._breaks
        out.append("")
        if b.graph_breaks:
            out.append(
                f"graph breaks: {len(b.graph_breaks)} (full reasons in "
                "breaks_and_recompiles.json)"
            )
            seen = Counter((gb["location"], _brief(gb["reason"])) for gb in b.graph_breaks)
            for (location, reason), n in seen.items():
                out.append(f"  {n} x at {location}: {reason}")
        else:
            out.append("graph breaks: none")
        if b.recompiles:
            out.append(f"recompiles: {len(b.recompiles)}")
            for rc in b.recompiles:
                out.append(f"  {rc['compile_id']} {rc['function']}: {rc['reason']}")
        else:
            out.append("recompiles: none")
        out.append(
            f"compiles: {len(b.compiles)} (compiled-autograd graphs: "
            f"{b.compiled_autograd_graphs})"
        )
        out.extend(f"  note: {n}" for n in b.notes)
        out.append(f"depyf source: {self._depyf_note or self.out_dir / 'depyf'}")
        out.append(f"trace: {self._trace_note}")
        return "\n".join(out)

    def _collectives_json(self) -> dict[str, Any]:
        return {
            "rank": dist.get_rank() if dist.is_initialized() else None,
            "world_size": dist.get_world_size() if dist.is_initialized() else None,
            "torch": torch.__version__,
            "graphs": [
                {**asdict(r), "collectives": [asdict(c) for c in r.collectives]}
                for r in self.records
            ],
        }


# ------------------------------------------------------- breaks and recompiles
def _snapshot() -> tuple[int, int]:
    from torch._dynamo.utils import graph_break_reasons

    return len(graph_break_reasons), time.time_ns() // 1000


def _collect_breaks(since: tuple[int, int]) -> _Breaks:
    """Graph breaks and compiles since ``since`` (from :func:`_snapshot`), from
    dynamo's ``graph_break_reasons`` and ``get_compilation_metrics()``."""
    from torch._dynamo import utils as dynamo_utils

    n_breaks, t0 = since
    b = _Breaks()
    for reason in dynamo_utils.graph_break_reasons[n_breaks:]:
        frame = reason.user_stack[-1] if reason.user_stack else None
        b.graph_breaks.append({
            "reason": reason.reason,
            "location": f"{frame.filename}:{frame.lineno}" if frame else "?",
        })
    metrics = [m for m in dynamo_utils.get_compilation_metrics() if (m.start_time_us or 0) >= t0]
    ca_ids: set[str] = set()
    for m in metrics:
        cid = m.compile_id or "?"
        function = f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})"
        entry = {
            "compile_id": cid,
            "function": function,
            "graph_breaks": m.num_graph_breaks,
            "recompile_reason": m.recompile_reason,
            "fail_type": m.fail_type,
            "fail_reason": m.fail_reason,
        }
        b.compiles.append(entry)
        if m.recompile_reason:
            b.recompiles.append(
                {"compile_id": cid, "function": function, "reason": m.recompile_reason}
            )
        if cid.startswith("!"):
            ca_ids.add(cid.split("/")[0])
    b.compiled_autograd_graphs = len(ca_ids)
    if len(ca_ids) > 1:
        # Compiled autograd compiles a new graph when the autograd graph (or its
        # inputs' properties) changes; the reason goes to the compiled_autograd_verbose
        # log only.
        b.recompiles.append({
            "compile_id": ", ".join(sorted(ca_ids)),
            "function": "compiled autograd",
            "reason": (
                f"{len(ca_ids)} backward graphs compiled: a cache miss after the first; "
                "TORCH_LOGS=compiled_autograd_verbose prints why"
            ),
        })
    limit = dynamo_utils._compilation_metrics.maxlen
    if limit is not None and len(dynamo_utils.get_compilation_metrics()) >= limit:
        b.notes.append(f"torch keeps the last {limit} compiles only; older ones are missing")
    return b


# ------------------------------------------------------------------- trace
@contextlib.contextmanager
def _structured_trace(trace_dir: Path) -> Iterator[list[Path]]:
    """A ``TORCH_TRACE=trace_dir`` structured log for the block (torch's
    ``LazyTraceHandler``, added and removed); yields a list holding the log file once
    the block exits. Side-effect messages are on inside ([Note: Dynamo's side-effect
    messages])."""
    from torch._logging import _internal as tl

    from .._compile import side_effect_messages_on

    trace_dir.mkdir(parents=True, exist_ok=True)
    handler = tl.LazyTraceHandler(str(trace_dir))
    handler.setFormatter(tl.TorchLogsFormatter(trace=True))
    logger = tl.trace_log
    old_level = logger.level
    files: list[Path] = []
    # Outside the handler's add and remove: it is quieted again once it is gone.
    with side_effect_messages_on():
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
        try:
            yield files
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            handler.close()
            files.extend(sorted(trace_dir.glob("*.log")))


def _run_tlparse(log_files: list[Path], out: Path) -> str:
    exe = shutil.which("tlparse")
    if exe is None:
        return "tlparse not found on PATH (pip install tlparse), so no HTML report"
    if not log_files:
        return "no structured log was written (nothing compiled?)"
    cmd = [exe, str(log_files[-1]), "-o", str(out), "--overwrite", "--no-browser"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"tlparse failed to run: {e}"
    if proc.returncode != 0:
        return f"tlparse exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    index = out / "index.html"
    return f"tlparse report {index}" if index.exists() else f"tlparse wrote {out}"


# ---------------------------------------------------------------- schedule
class _ScheduleCapture(logging.Handler):
    """A handler on torch's structured-trace logger that hands the dump each
    graph's generated code and torch's collective schedule. See [Note: The final
    schedule in the dump]."""

    def __init__(self, dump: GraphDump) -> None:
        super().__init__(logging.DEBUG)
        self.dump = dump

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", None)
        payload = getattr(record, "payload", None)
        if not isinstance(meta, dict) or not isinstance(payload, str) or not self.dump._active:
            return
        try:
            if "inductor_output_code" in meta:
                self.dump._record_output_code(payload)
            elif (isinstance(meta.get("artifact"), dict)
                  and meta["artifact"].get("name") == "inductor_collective_schedule"):
                self.dump._check_torch_schedule(json.loads(payload))
        except Exception:  # a dump must never break the compile it watches
            log.exception("dump_graphs: recording Inductor's final schedule failed")


@contextlib.contextmanager
def _capture_schedule(dump: GraphDump) -> Iterator[None]:
    from torch._logging._internal import trace_log

    handler = _ScheduleCapture(dump)
    old_level = trace_log.level
    trace_log.setLevel(logging.DEBUG)
    trace_log.addHandler(handler)
    try:
        yield
    finally:
        trace_log.removeHandler(handler)
        trace_log.setLevel(old_level)


# ----------------------------------------------------------------- entry point
def _recorder(dump: GraphDump, stage: Stage) -> PostGradRecorder:
    """The recording pass of one stage (one before our passes, one after); its
    ``uuid()`` is ``None``. See [Note: Hooking Inductor]."""

    def on_graph(rec: RecordedGraph) -> None:
        dump._record_post_grad(rec, stage)

    return PostGradRecorder(on_graph, keep=False)


def _hook_inductor(dump: GraphDump) -> Callable[[], None]:
    """Brackets the post-grad pre-pass with the recorders; returns the undo.
    See [Note: Hooking Inductor]."""
    from ..passes import install

    install()
    inner = inductor_config.post_grad_custom_pre_pass
    before = _recorder(dump, "before_passes")
    after = _recorder(dump, "after_passes")
    inductor_config.post_grad_custom_pre_pass = [before, inner, after]

    def undo() -> None:
        current = inductor_config.post_grad_custom_pre_pass
        ours = (
            isinstance(current, list) and len(current) == 3
            and current[0] is before and current[2] is after
        )
        if ours:
            inductor_config.post_grad_custom_pre_pass = current[1]
        else:
            warnings.warn(
                "dump_graphs: torch._inductor.config.post_grad_custom_pre_pass was "
                "replaced inside the block; left as it is now.",
                stacklevel=3,
            )

    return undo


_MARKER = ".traceable_hsdp_dump"  # marks a directory an earlier dump wrote into


def _clear(out_dir: Path) -> None:
    """Removes an earlier dump's files from ``out_dir``; refuses to remove files of
    those names that no dump wrote."""
    ours = [out_dir / name for name in _OUR_PATHS if (out_dir / name).exists()]
    if ours and not (out_dir / _MARKER).exists():
        raise ValueError(
            f"dump_graphs: {out_dir} already holds {', '.join(p.name for p in ours)}, "
            "not written by an earlier dump; pick a new or empty directory."
        )
    for p in ours:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (out_dir / _MARKER).write_text("written by traceable_hsdp.dump_graphs\n")


@contextlib.contextmanager
def dump_graphs(
    out_dir: str | os.PathLike[str],
    *,
    trace: bool = False,
    print_summary: bool = True,
    file: TextIO | None = None,
) -> Iterator[GraphDump]:
    """Dumps every graph ``torch.compile`` compiles inside the block, for reading and
    debugging. See [Note: What dump_graphs records] for the files::

        with traceable_hsdp.dump_graphs("dump") as dump:
            traceable_hsdp.enable_compiled_autograd(backend=dump.backend("inductor"))
            model = torch.compile(model, backend=dump.backend("inductor"))
            for step in range(2):
                model(x).sum().backward()

    ``dump.backend(...)`` is optional ([Note: The recording backend]). Enter the block
    before the first compiled call ([Note: Entering before the first compile]). An
    earlier dump's files in ``out_dir`` are replaced. On exit (also on error) the
    files are written and the summary printed.

    Args:
        out_dir: the dump directory (created if needed).
        trace: also write a ``TORCH_TRACE``-style structured log to ``out_dir/trace``,
            and run ``tlparse`` on it into ``out_dir/tlparse`` when it is on ``PATH``
            (default ``False``).
        print_summary: print the summary when the block exits (default ``True``).
        file: where to print it (default ``sys.stdout``).

    Raises:
        TypeError: ``out_dir`` is not a path.
        ValueError: ``out_dir`` holds files of a dump's names (``graphs``,
            ``summary.txt``, ...) that no earlier dump wrote.
    """
    try:
        import depyf
    except ImportError:
        depyf = None  # optional: everything but depyf/ is written; summary.txt says so
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    dump = GraphDump(out)

    from torch._dynamo import convert_frame

    if convert_frame.FRAME_COUNTER > 0:
        dump._compiled_before = True
        warnings.warn(
            "dump_graphs: torch.compile already compiled something in this process; "
            "those graphs will not be in the dump. Enter dump_graphs before the first "
            "compiled call, or call torch._dynamo.reset() first (it also turns "
            "compiled autograd off: call traceable_hsdp.enable_compiled_autograd() "
            "again after it).",
            stacklevel=3,
        )
    since = _snapshot()
    undo_inductor = _hook_inductor(dump)
    stack = contextlib.ExitStack()
    trace_files: list[Path] | None = None
    try:
        if trace:
            trace_files = stack.enter_context(_structured_trace(out / "trace"))
        stack.enter_context(_capture_schedule(dump))
        if depyf is not None:
            # See [Note: depyf writes, dynamo's bytecode runs].
            dynamo_code: dict[types.CodeType, types.CodeType] = {}
            stack.enter_context(
                _bytecode_hook(lambda code, new: dynamo_code.__setitem__(code, new))
            )
            # See [Note: dynamo must not compile depyf's own functions].
            stack.enter_context(dynamo_skips("depyf"))
            with warnings.catch_warnings():
                # depyf warns on every entry that the code must run several times.
                warnings.filterwarnings("ignore", message=".*You are trying to debug `torch.compile`")
                stack.enter_context(depyf.prepare_debug(str(out / "depyf")))
            stack.enter_context(_bytecode_hook(lambda code, new: dynamo_code.pop(code, None)))
        else:
            dump._depyf_note = (
                "not written: depyf is not installed (pip install depyf, or "
                "pip install -e '.[dump]' in a checkout); every other file is"
            )
        yield dump
    finally:
        try:
            stack.close()  # depyf writes its full_code files; the trace log closes
        finally:
            dump._active = False
            undo_inductor()
            try:
                dump._breaks = _collect_breaks(since)
            except Exception as e:  # never hide the block's own exception
                dump._breaks.notes.append(f"could not read dynamo's compile records: {e!r}")
            if trace_files is not None:
                dump._trace_note = f"{out / 'trace'}; " + _run_tlparse(trace_files, out / "tlparse")
            _write_results(dump)
            if print_summary:
                print(dump.summary(), file=sys.stdout if file is None else file, flush=True)


@contextlib.contextmanager
def _bytecode_hook(
    hook: Callable[[types.CodeType, types.CodeType], types.CodeType | None],
) -> Iterator[None]:
    """``hook`` registered with torch's ``register_bytecode_hook`` while the block
    runs."""
    handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def compare_dumps(dirs: Sequence[str | os.PathLike[str]]) -> str:
    """Whether the dumps of several ranks (each a ``dump_graphs`` directory) hold the
    same graphs with the same collectives in the same order: op, reduce op, group
    size, dtype, shapes, unit and parameters (not the group name, which may differ
    between ranks for HSDP's sub-groups). Ranks that disagree would hang or compute
    garbage in a real job.

    Returns:
        One line saying that they agree, or where the first difference is.
    """
    def load(d: str | os.PathLike[str]) -> dict[tuple[str, str], list[tuple[Any, ...]]] | None:
        path = Path(d) / "collectives.json"
        if not path.exists():
            return None
        graphs = json.loads(path.read_text())["graphs"]
        return {
            (g["name"], g["stage"]): [
                (c["op"], c["reduce_op"], c["group_size"], c["dtype"], c["in_shape"],
                 c["out_shape"], c["unit"], tuple(c["params"]))
                for c in g["collectives"]
            ]
            for g in graphs
        }

    if not dirs:
        return "compare_dumps: no dumps given"
    ref = load(dirs[0])
    if ref is None:
        return f"ranks not compared: {dirs[0]} has no collectives.json"
    for i, d in enumerate(dirs[1:], start=1):
        other = load(d)
        if other is None:
            return f"ranks not compared: {d} has no collectives.json"
        if set(other) != set(ref):
            only = sorted(set(ref) ^ set(other))
            return f"ranks DISAGREE: {dirs[0]} and {d} recorded different graphs: {only}"
        for key in sorted(ref):
            a, b = ref[key], other[key]
            if a != b:
                where = next(
                    (j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
                )
                return (
                    f"ranks DISAGREE in graph {key[0]} ({_STAGE_TITLE[key[1]]}): "
                    f"{len(a)} vs {len(b)} collectives, first difference at #{where}"
                )
    return (
        f"ranks agree: all {len(dirs)} dumps hold the same {len(ref)} graph stages with "
        "the same collectives in the same order"
    )


def _write_results(dump: GraphDump) -> None:
    out = dump.out_dir
    (out / "collectives.json").write_text(json.dumps(dump._collectives_json(), indent=1))
    (out / "breaks_and_recompiles.json").write_text(json.dumps(asdict(dump._breaks), indent=1))
    (out / "summary.txt").write_text(dump.summary() + "\n")
