"""``traceable_hsdp.dump_graphs`` and ``traceable-hsdp dump``.

Tier 1 (no processes, no model compile): the final schedule read from a piece of
generated code and tied to the collective table; argument binding; the collective
table, the annotation copy from a dynamo-style graph to a post-grad-style graph, and
the merged annotation of a bucketed collective, on hand-built FX graphs;
``compare_dumps`` on small JSON files; ``dump_graphs`` around a tiny function
compiled with the eager backend (a graph break, a recompile, the files); the
missing-depyf error; the CLI's arguments.

Tier 2 (slow): Inductor on one in-process gloo rank, annotated functional
collectives: the post-grad graph before and after our passes, the bucketed
all-gather listing both parameters, the final schedule with waits right after their
issues. And the console script ``traceable-hsdp dump`` on 2 spawned gloo ranks with
aot_eager, for 3 steps: the collective counts in ``collectives.json`` equal the counts
in the graphs that actually ran, counted independently in depyf's source of
AOTAutograd's graphs; no graph break, no recompile in 3 steps; both ranks agree. The
command runs ``traceable-hsdp train``'s loop (``traceable_hsdp/demo/_train.py``), so the
same run also makes test_cli.py's checks of a compiled job: rank 0's step lines, the
losses finite and falling, the final line, and the first step's compile report.

The final schedule of a fully_shard model's forward and backward Inductor graphs on 2
spawned gloo ranks (checked against torch's collective schedule, with the overlap
distances with the passes on and off) is checked in test_passes_e2e.py, whose
compiled training step runs inside ``dump_graphs``: one Inductor compile for both.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from traceable_hsdp.debug import _dump
from traceable_hsdp.debug import _schedule as S
from traceable_hsdp.debug import _table as T
from traceable_hsdp.demo import cli
from traceable_hsdp._annotate import call_annotated, collective_annotation
from traceable_hsdp.passes import _graph as G
from traceable_hsdp.passes import bucket_all_gathers
from traceable_hsdp.passes._graph import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ANNOTATION_KEY,
    REDUCE_SCATTER,
    WAIT,
    annotation_of,
    set_annotation,
)
from traceable_hsdp.passes._rewrite import set_fake_val

_c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _keep_inductor_hook():
    """dump_graphs leaves traceable_hsdp's passes installed (as fully_shard does);
    other tests in this process get the hook as it was."""
    import torch._inductor.config as ic

    saved = ic.post_grad_custom_pre_pass
    yield
    ic.post_grad_custom_pre_pass = saved


# --------------------------------------------------------------------- graphs
class _Builder:
    """A hand-built graph with fake values: post-grad style (``OpOverload`` targets,
    ``meta["val"]``) or dynamo style (``OpOverloadPacket`` targets,
    ``meta["example_value"]``)."""

    def __init__(self, dynamo_style: bool = False) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.dynamo_style = dynamo_style

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype)
        return node

    def __call__(
        self, target: Any, *args: Any, ann: tuple[str, list[str]] | None = None
    ) -> fx.Node:
        node = self.graph.call_function(target, args)
        set_fake_val(node)
        if ann is not None:
            set_annotation(node, {"unit": ann[0], "params": tuple(ann[1])})
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        if self.dynamo_style:
            for node in self.graph.nodes:
                if node.op == "call_function":
                    node.meta["example_value"] = node.meta.pop("val")
                    node.target = node.target.overloadpacket
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _fsdp_like(
    dynamo_style: bool = False, annotate: bool = True, w0_dtype: torch.dtype = torch.float32
) -> fx.GraphModule:
    """Two parameters of unit "Block" gathered over 2 ranks, one gradient reduced."""
    b = _Builder(dynamo_style)
    w0, w1 = b.input("w0", 4, 8, dtype=w0_dtype), b.input("w1", 3)
    g = b.input("g", 8, 8, dtype=torch.bfloat16)
    a = ("Block", ["attn.wq.weight"]) if annotate else None
    a1 = ("Block", ["attn_norm.weight"]) if annotate else None
    r0 = b(WAIT, b(ALL_GATHER, w0, 2, "0", ann=a))
    r1 = b(WAIT, b(ALL_GATHER, w1, 2, "0", ann=a1))
    s = b(WAIT, b(REDUCE_SCATTER, g, "avg", 2, "0", ann=a))
    return b.done(b(aten.add.Tensor, b(aten.sum.default, r0), b(aten.sum.default, r1)), s)


def test_collective_table_reads_sizes_groups_and_annotations() -> None:
    rows = T.collective_table(_fsdp_like())
    assert [r.op for r in rows] == [
        "all_gather_into_tensor", "all_gather_into_tensor", "reduce_scatter_tensor"
    ]
    ag, _, rs = rows
    assert (ag.index, ag.group_name, ag.group_size, ag.dtype) == (0, "0", 2, "float32")
    assert (ag.in_shape, ag.out_shape, ag.in_bytes, ag.out_bytes) == ([4, 8], [8, 8], 128, 256)
    assert (ag.reduce_op, ag.unit, ag.params) == (None, "Block", ("attn.wq.weight",))
    assert (rs.reduce_op, rs.dtype, rs.in_bytes, rs.out_bytes) == ("avg", "bfloat16", 128, 64)
    assert rows[1].params == ("attn_norm.weight",)
    # Dynamo's graphs hold OpOverloadPackets and example_value: the same table.
    assert T.collective_table(_fsdp_like(dynamo_style=True)) == rows
    counts = T.graph_counts(_fsdp_like())
    assert counts == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1, "wait_tensor": 3}
    text = _dump.format_table(rows)
    assert len(text.splitlines()) == 1 + len(rows)
    assert "256 B" in text and "attn.wq.weight" in text and "avg" in text


def test_copy_annotations_matches_collectives_in_order() -> None:
    source = _fsdp_like(dynamo_style=True)
    target = _fsdp_like(annotate=False)
    assert all(r.unit is None for r in T.collective_table(target))
    assert G.copy_annotations(source, target) == "copied 3"
    assert T.collective_table(target) == T.collective_table(_fsdp_like())
    assert G.copy_annotations(source, target) == "nothing to copy"

    # A different sequence (here: one collective fewer) is not copied.
    b = _Builder()
    w0 = b.input("w0", 4, 8)
    short = b.done(b(WAIT, b(ALL_GATHER, w0, 2, "0")))
    assert G.copy_annotations(source, short).startswith("not copied: 3 collectives")
    assert all(r.unit is None for r in T.collective_table(short))
    # Same count, different shape: not copied either.
    b = _Builder()
    xs = [b.input(f"x{i}", 5) for i in range(3)]
    other = b.done(*[b(WAIT, b(ALL_GATHER, x, 2, "0")) for x in xs])
    assert "collective 0 differs" in G.copy_annotations(source, other)
    # Same shapes, another dtype: not copied.
    other = _fsdp_like(annotate=False, w0_dtype=torch.float64)
    assert "collective 0 differs" in G.copy_annotations(source, other)


def test_bucketed_all_gather_lists_every_parameter() -> None:
    gm = _fsdp_like()
    assert bucket_all_gathers(gm) == 1
    rows = T.collective_table(gm)
    # The bucket goes before the first read of a gathered tensor: after the
    # reduce-scatter, which reads none.
    assert [r.op for r in rows] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
    ag = rows[1]
    assert (ag.unit, ag.params) == ("Block", ("attn.wq.weight", "attn_norm.weight"))
    assert (ag.in_bytes, ag.out_bytes) == ((32 + 3) * 4, 2 * (32 + 3) * 4)


def test_collective_annotation_sets_node_meta_when_traced() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with collective_annotation("Block", ["w"]):
            y = x * 2
        z = call_annotated("Block", "v", torch.neg, y)
        return z + 1

    graphs: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.ones(2))
    torch._dynamo.reset()
    (gm,) = graphs
    anns = {n.name: annotation_of(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert anns == {
        "y": {"unit": "Block", "params": ("w",)},
        "z": {"unit": "Block", "params": ("v",)},
        "add": None,
    }, anns
    assert ANNOTATION_KEY in next(n for n in gm.graph.nodes if n.name == "y").meta["custom"]


# ------------------------------------------------------------ final schedule
# The ``call`` of Inductor's generated code, as torch 2.13 writes it on the CPU (cut
# down from a real compile): two all-gathers issued first, the second waited for
# after three kernels; a storage resize (no compute) and buffer reuse in between.
_OUTPUT_CODE = """
import torch
async_compile = AsyncCompile()
cpp_fused_relu_0 = async_compile.cpp_pybinding(['float*'], r'''...''')
cpp_fused_sum_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''...''')
async_compile.wait(globals())
del async_compile

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        assert_size_stride(arg0_1, (4, 8), (8, 1), 'input')
        buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg0_1, 2, '0')
        buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg2_1, 2, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf0)
        buf4 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
        extern_kernels.mm(arg1_1, buf0, out=buf4)
        buf5 = buf4; del buf4  # reuse
        cpp_fused_relu_0(buf5)
        torch.ops.inductor.resize_storage_bytes_.default(arg1_1, 0)
        buf6 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
        extern_kernels.mm(buf5, reinterpret_tensor(buf5, (8, 8), (1, 8), 0), out=buf6)
        buf7 = reinterpret_tensor(buf1, (8, 8), (8, 1), 0)
        torch.ops._c10d_functional.wait_tensor.default(buf7)
        buf8 = empty_strided_cpu((), (), torch.float32)
        cpp_fused_sum_1(buf6, buf8)
        return (buf8, )
"""


def test_read_schedule_and_overlap_distances() -> None:
    schedule = S.read_schedule(_OUTPUT_CODE)
    short = [
        ("C" if o.kind == "collective" else "W") + str(o.collective) if o.kind != "kernel"
        else o.name
        for o in schedule
    ]
    assert short == [
        "C0", "C1", "W0", "extern_kernels.mm", "cpp_fused_relu_0", "extern_kernels.mm",
        "W1", "cpp_fused_sum_1",
    ], short
    assert [o.position for o in schedule] == list(range(8))
    assert schedule[0].group_name == "0"
    assert _OUTPUT_CODE.splitlines()[schedule[0].line - 1].strip().startswith("buf0 = ")
    # Rows of the graph Inductor compiled: the k-th collective is row k.
    b = _Builder()
    w0, w1 = b.input("w0", 4, 8), b.input("w1", 4, 8)
    rows = T.collective_table(b.done(
        b(WAIT, b(ALL_GATHER, w0, 2, "0", ann=("Block", ["a"]))),
        b(WAIT, b(ALL_GATHER, w1, 2, "0", ann=("Block", ["b"]))),
    ))
    placed = S.with_schedule(rows, schedule)
    assert [(r.params, r.issued_at, r.waited_at, r.kernels_before_wait) for r in placed] == [
        (("a",), 0, 2, 0), (("b",), 1, 6, 3)
    ]
    assert _dump.overlap_line(placed) == (
        "overlap: all_gather_into_tensor: 1 of 2 with >=1 kernel before the wait, "
        "median 1.5 kernels"
    )
    assert "wait after" in _dump.format_table(placed)
    # Both all-gathers are issued before the first wait.
    assert S.max_in_flight(schedule) == {"all_gather_into_tensor": 2}
    # A schedule that is not the graph's is refused, not half-matched.
    with pytest.raises(ValueError, match="2 collectives in the output code, 1 in the graph"):
        S.with_schedule(rows[:1], schedule)
    other = [replace(r, group_name="1") for r in rows]
    with pytest.raises(ValueError, match="collective 0 differs"):
        S.with_schedule(other, schedule)
    with pytest.raises(ValueError, match="not Python"):
        S.read_schedule("void call() {}")
    # Collectives that write into a buffer (in place, or ``out=``) are waited for
    # on that buffer.
    code = (
        "k0 = async_compile.cpp_pybinding([], '')\n"
        "def call(args):\n"
        "    torch.ops._c10d_functional.all_reduce_.default(buf7, 'avg', '3')\n"
        "    torch.ops._c10d_functional.all_gather_into_tensor_out.default(buf1, 2, '0', out=buf3)\n"
        "    k0(buf2)\n"
        "    torch.ops._c10d_functional.wait_tensor.default(buf3)\n"
        "    buf8 = buf7; del buf7  # reuse\n"
        "    torch.ops._c10d_functional.wait_tensor.default(buf8)\n"
    )
    assert [(o.kind, o.collective, o.group_name) for o in S.read_schedule(code)] == [
        ("collective", 0, "3"), ("collective", 1, "0"), ("kernel", None, None),
        ("wait", 1, None), ("wait", 0, None),
    ]
    assert S.max_in_flight(S.read_schedule(code)) == {
        "all_reduce_": 1, "all_gather_into_tensor_out": 1
    }


def test_bound_args_uses_torch_normalized_arguments() -> None:
    """Both op forms bind by the schema's names (torch's helper); a node torch
    cannot bind (an argument missing) falls back to what it has."""
    g = fx.Graph()
    a = g.placeholder("a")
    post_grad = g.call_function(REDUCE_SCATTER, (a, "avg", 2, "0"))
    dynamo = g.call_function(_c10d.reduce_scatter_tensor, (a, "avg"), {"group_size": 2,
                                                                        "group_name": "0"})
    partial = g.call_function(_c10d.all_gather_into_tensor.default, (a, 2))  # no group
    expected = {"input": a, "reduce_op": "avg", "group_size": 2, "group_name": "0"}
    assert G.bound_args(post_grad) == expected == G.bound_args(dynamo)
    assert G.bound_args(partial) == {"input": a, "group_size": 2}
    assert G.bound_args(g.placeholder("b")) == {}


# ----------------------------------------------------------- compare_dumps
def _fake_dump(d: Path, ops: list[str]) -> Path:
    d.mkdir(parents=True)
    rows = [
        {"op": op, "reduce_op": None, "group_size": 2, "dtype": "float32", "in_shape": [2],
         "out_shape": [4], "unit": "Block", "params": ["w"]}
        for op in ops
    ]
    graphs = [{"name": "00_fwd", "stage": "dynamo", "collectives": rows}]
    (d / "collectives.json").write_text(json.dumps({"graphs": graphs}))
    return d


def test_compare_dumps(tmp_path: Path) -> None:
    a = _fake_dump(tmp_path / "rank0", ["all_gather_into_tensor"] * 2)
    b = _fake_dump(tmp_path / "rank1", ["all_gather_into_tensor"] * 2)
    c = _fake_dump(tmp_path / "rank2", ["all_gather_into_tensor", "all_reduce"])
    assert _dump.compare_dumps([a, b]).startswith("ranks agree: all 2 dumps")
    msg = _dump.compare_dumps([a, c])
    assert "DISAGREE in graph 00_fwd (dynamo)" in msg and "first difference at #1" in msg
    assert "has no collectives.json" in _dump.compare_dumps([a, tmp_path / "nope"])


# -------------------------------------------------- dump_graphs, eager backend
def test_dump_graphs_records_breaks_recompiles_and_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    torch._dynamo.reset()
    (tmp_path / ".traceable_hsdp_dump").write_text("")  # an earlier dump was here:
    (tmp_path / "summary.txt").write_text("stale")  # its file is replaced
    (tmp_path / "mine.txt").write_text("keep")  # not ours: kept
    with _dump.dump_graphs(tmp_path) as dump:
        g = torch.compile(f, backend=dump.backend("eager"))
        g(torch.randn(3))
        g(torch.randn(3))
        g(torch.randn(3, dtype=torch.float64))  # dtype change: recompile
    torch._dynamo.reset()
    out = capsys.readouterr().out
    assert (tmp_path / "mine.txt").read_text() == "keep"
    assert out.strip() == (tmp_path / "summary.txt").read_text().strip()
    br = json.loads((tmp_path / "breaks_and_recompiles.json").read_text())
    # One graph break per compile of f (2 compiles: float32, then float64).
    assert len(br["graph_breaks"]) == 2, br["graph_breaks"]
    for gb in br["graph_breaks"]:
        assert gb["reason"].startswith("Call to `torch._dynamo.graph_break()`"), gb
        assert gb["location"].startswith(__file__ + ":"), gb
    assert len(br["recompiles"]) >= 1
    assert all("dtype mismatch" in rc["reason"] for rc in br["recompiles"]), br["recompiles"]
    assert "graph breaks: 2" in out and "recompiles:" in out and "dtype mismatch" in out
    # 4 graphs reached the backend: f and its resume function, each compiled twice.
    coll = json.loads((tmp_path / "collectives.json").read_text())
    names = [g["name"] for g in coll["graphs"]]
    assert names == ["00_fwd", "01_fwd", "02_fwd", "03_fwd"], names
    assert all(g["stage"] == "dynamo" and g["collectives"] == [] for g in coll["graphs"])
    for g in coll["graphs"]:
        assert (tmp_path / g["file"]).read_text().startswith("# dynamo graph")
    assert any(p.name.startswith("full_code_for_f") for p in (tmp_path / "depyf").iterdir())


@pytest.mark.parametrize("tlparse", ["absent", "on PATH"])
def test_dump_graphs_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tlparse: str) -> None:
    if tlparse == "absent":
        monkeypatch.setattr(_dump.shutil, "which", lambda name: None)
    elif shutil.which("tlparse") is None:
        pytest.skip("tlparse is not installed (pip install tlparse)")
    torch._dynamo.reset()
    with _dump.dump_graphs(tmp_path, trace=True, print_summary=False) as dump:
        torch.compile(lambda x: x.sin() + 1, backend=dump.backend("eager"))(torch.ones(2))
    torch._dynamo.reset()
    (log,) = (tmp_path / "trace").glob("*.log")
    text = log.read_text()
    assert '{"dynamo_start"' in text and '{"dynamo_output_graph"' in text, text[:500]
    # The handler is gone: later compiles do not write to the file.
    from torch._logging._internal import trace_log

    trace_dir = str(tmp_path / "trace")
    assert not any(getattr(h, "root_dir", None) == trace_dir for h in trace_log.handlers)
    summary = (tmp_path / "summary.txt").read_text()
    if tlparse == "absent":
        assert "tlparse not found on PATH (pip install tlparse)" in summary
        assert not (tmp_path / "tlparse").exists()
    else:
        assert (tmp_path / "tlparse" / "index.html").exists(), summary
        assert "tlparse report" in summary


def test_dump_graphs_keeps_files_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "mine.py").write_text("x = 1")
    with pytest.raises(ValueError, match="holds graphs, not written by an earlier dump"):
        with _dump.dump_graphs(tmp_path):
            pass
    assert (tmp_path / "graphs" / "mine.py").read_text() == "x = 1"


def test_dump_graphs_without_depyf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """depyf is optional: without it the collective table and every other file are
    written, no depyf/ folder, and the summary says why."""
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf -> ImportError
    torch._dynamo.reset()
    with _dump.dump_graphs(tmp_path) as dump:
        torch.compile(lambda x: x.sin() + 1, backend=dump.backend("eager"))(torch.randn(3))
    torch._dynamo.reset()
    assert not (tmp_path / "depyf").exists()
    assert json.loads((tmp_path / "collectives.json").read_text())["graphs"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "depyf source: not written: depyf is not installed" in summary, summary


def test_dump_graphs_of_a_whole_step_compiled_with_compiled_autograd(tmp_path: Path) -> None:
    """Forward, loss and backward() in one compiled function under
    torch._dynamo.config.compiled_autograd, dumped with depyf on: the step runs as
    without the dump (loss and gradients bitwise, eager backend), depyf writes its
    files, and dynamo's skipped directories are as before after the block. It failed
    inside the dump with a RecursionError before (dynamo compiled depyf's own graph
    formatter; see [Note: dynamo must not compile depyf's own functions] in
    traceable_hsdp/debug/_dump.py)."""
    pytest.importorskip("depyf")
    from torch._dynamo import trace_rules

    def run(backend: Any) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).square().sum()
            loss.backward()
            return loss.detach()

        with torch._dynamo.config.patch(compiled_autograd=True):
            loss = torch.compile(step, backend=backend)(torch.arange(16.0).view(2, 8))
        return loss.item(), [p.grad for p in model.parameters()]

    skipped = list(trace_rules.SKIP_DIRS)
    torch._dynamo.reset()
    want = run("eager")
    torch._dynamo.reset()
    with _dump.dump_graphs(tmp_path, print_summary=False) as dump:
        got = run(dump.backend("eager"))
    torch._dynamo.reset()
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert trace_rules.SKIP_DIRS == skipped
    assert any(p.name.startswith("full_code_for_step") for p in (tmp_path / "depyf").iterdir())
    # The step's forward graph, compiled autograd's backward graph and the graph
    # after the backward() break all reached the dump.
    names = [g["name"] for g in json.loads((tmp_path / "collectives.json").read_text())["graphs"]]
    assert names == ["00_fwd", "01_bwd", "02_fwd"], names


def test_dump_graphs_restores_the_inductor_hook(tmp_path: Path) -> None:
    import torch._inductor.config as ic

    import traceable_hsdp.passes as passes

    with _dump.dump_graphs(tmp_path, print_summary=False):
        hook = ic.post_grad_custom_pre_pass
        assert isinstance(hook, list) and len(hook) == 3
        assert isinstance(hook[1], passes.TraceableHSDPPass)
        passes.install()  # as fully_shard inside the block: must not wrap the recorders
        assert ic.post_grad_custom_pre_pass is hook
    assert ic.post_grad_custom_pre_pass is hook[1]


# ------------------------------------------------------------------------ CLI
def test_dump_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    parser, subparsers = cli.build_parser()
    args = parser.parse_args(["dump", "out", "--backend", "aot_eager", "--trace"])
    assert (args.out_dir, args.steps, args.trace, args.eager) == ("out", 2, True, False)
    cfg = cli._train_config(args, subparsers["dump"])
    assert cfg.backend == "aot_eager" and not cfg.eager
    for argv, message in ([["dump"], "the following arguments are required: OUT_DIR"],
                          [["dump", "out", "--eager"], "unrecognized arguments: --eager"],
                          [["dump", "out", "--backend", "nope"], "invalid choice: 'nope'"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------ tier 2: Inductor


@pytest.mark.slow
def test_dump_inductor_post_grad_before_and_after_passes(one_rank_group: str, tmp_path: Path) -> None:
    group = one_rank_group

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with collective_annotation("Block", ["w0"]):
            x = _c10d.wait_tensor(_c10d.all_gather_into_tensor(a, 1, group))
        with collective_annotation("Block", ["w1"]):
            y = _c10d.wait_tensor(_c10d.all_gather_into_tensor(b, 1, group))
        # As HSDP's all-reduce: the group size is not an argument, it is looked up.
        z = _c10d.wait_tensor(_c10d.all_reduce(x + y.sum(), "avg", group))
        return z.sum()

    torch._dynamo.reset()
    with _dump.dump_graphs(tmp_path, print_summary=False) as dump:
        out = torch.compile(f, backend=dump.backend("inductor"), fullgraph=True)(
            torch.ones(4, 8), torch.ones(3)
        )
    torch._dynamo.reset()
    assert out.item() == 32 * 4.0
    by_stage = {r.stage: r for r in dump.records}
    assert set(by_stage) == {"dynamo", "before_passes", "after_passes", "scheduled"}
    assert {r.name for r in dump.records} == {"00_fwd"}
    before, after = by_stage["before_passes"], by_stage["after_passes"]
    assert before.counts["all_gather_into_tensor"] == 2
    assert [r.params for r in before.collectives] == [("w0",), ("w1",), ()]
    # bucket_all_gathers, then the CPU form (gather_into_buffers): [Note: CPU
    # all-gathers into buffers] in passes/gloo/gather_into_buffers.py.
    assert after.counts["all_gather_into_tensor_out"] == 1
    assert "all_gather_into_tensor" not in after.counts
    ag, ar = after.collectives
    assert (ag.op, ag.params, ag.in_bytes) == ("all_gather_into_tensor_out", ("w0", "w1"), 35 * 4)
    assert (ar.op, ar.reduce_op, ar.group_name, ar.group_size, ar.unit) == (
        "all_reduce", "avg", group, 1, None
    )
    # The final schedule: each wait right after its issue (nothing to overlap
    # with: every kernel reads a gathered tensor), checked against torch's log.
    sched = by_stage["scheduled"]
    assert [(c.op, c.params, c.kernels_before_wait) for c in sched.collectives] == [
        # Inductor's own later post-grad passes made the all-reduce in place.
        ("all_gather_into_tensor_out", ("w0", "w1"), 0), ("all_reduce_", (), 0)
    ], sched.schedule
    assert sched.schedule_note.endswith("in the order torch logged (inductor_collective_schedule)")
    i = sched.schedule.index("C0")
    assert sched.schedule[i + 1] == "W0" and sched.schedule.index("C1") > i
    for r in dump.records:
        assert (tmp_path / r.file).exists()
    assert (tmp_path / "post_grad" / "00_fwd_after_passes.py").read_text().count(
        f"{ALL_GATHER_OUT}("
    ) == 1


# ------------------------------------------------------ tier 2: the command
# How a graph's source calls the vocabulary's ops.
_AG_CALL = re.compile(re.escape(f"= torch.ops.{ALL_GATHER}("))
_RS_CALL = re.compile(re.escape(f"= torch.ops.{REDUCE_SCATTER}("))


def _ag_rs(graph: dict[str, Any]) -> tuple[int, int]:
    c = graph["counts"]
    return c.get("all_gather_into_tensor", 0), c.get("reduce_scatter_tensor", 0)


# The lines ``traceable-hsdp train`` and ``dump`` print on rank 0 (test_cli.py reads
# them the same way). Groups: step, steps, loss, grad norm ("" without --clip), what,
# seconds.
_STEP = re.compile(
    r"^step (\d+)/(\d+)  loss (\S+)(?:  grad norm (\S+))?  (compile\+step|step) (\S+) s$", re.M
)


def _console_script() -> str:
    here = Path(sys.executable).parent / "traceable-hsdp"
    found = str(here) if here.exists() else shutil.which("traceable-hsdp")
    assert found, "the traceable-hsdp console script is not installed (pip install -e .)"
    return found


@pytest.mark.slow
def test_dump_command_counts_match_the_graphs_that_ran(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    # 3 steps at the default batch (4 sequences of 64 tokens per rank): enough for the
    # loss to fall and for a median step time (steps 3-3), as in test_cli.py's runs.
    proc = subprocess.run(
        [_console_script(), "dump", str(tmp_path), "--backend", "aot_eager", "--layers", "1",
         "--dim", "32", "--steps", "3", "--no-progress"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr}"
    # The training job (test_cli.py's checks of a real run): one line per step, the
    # losses finite; no progress bar (tqdm's rate is in "step/s").
    steps = _STEP.findall(out)
    assert [int(s[0]) for s in steps] == list(range(1, len(steps) + 1)), out
    losses = [float(s[2]) for s in steps]
    assert all(math.isfinite(v) for v in losses), out
    assert "step/s" not in proc.stderr, proc.stderr
    assert len(losses) == 3, out
    # Deterministic (fixed seeds); "decreasing-ish": the last below the first, and
    # near log(256) = 5.55 at the start (the model starts untrained). See [Note:
    # Synthetic data] in traceable_hsdp/demo/_train.py.
    assert losses[-1] < losses[0], out
    assert 5.0 < losses[0] < 6.5, out
    assert re.search(r"^done: final loss \S+; median step \S+ s \(steps 3-3\)", out, re.M), out
    assert re.search(r"^step 1/3  loss \S+  compile\+step ", out, re.M), out
    # The compile report (aot_eager: no Inductor, so no FX graph cache lookups).
    report = re.search(
        r"^first step: compile (\S+) s: dynamo (\S+), AOTAutograd \S+, Inductor \S+, kernels "
        r"\S+; FX graph cache: 0 hit, 0 miss, 0 bypass; AOTAutograd cache: \d+ hit, \d+ miss, "
        r"\d+ bypass \(rank 0\)$", out, re.M)
    assert report, out
    assert float(report.group(1)) > 0 and float(report.group(2)) > 0, out
    n_params = 3 + 9  # embedding, final norm, output head; 9 per block
    for rank in (0, 1):
        d = tmp_path / f"rank{rank}"
        coll = json.loads((d / "collectives.json").read_text())
        assert coll["rank"] == rank and coll["world_size"] == 2
        graphs = {g["name"]: g for g in coll["graphs"]}
        assert sorted(graphs) == ["00_fwd", "01_bwd"], sorted(graphs)
        fwd, bwd = graphs["00_fwd"], graphs["01_bwd"]
        assert (fwd["stage"], fwd["kind"], bwd["kind"]) == ("dynamo", "fwd", "bwd")
        for g in (fwd, bwd):
            assert (d / g["file"]).exists()
            ops = Counter(c["op"] for c in g["collectives"])
            for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                assert ops[op] == g["counts"].get(op, 0), (g["name"], ops, g["counts"])
            assert all(c["group_size"] == 2 and c["in_bytes"] for c in g["collectives"])
        # Forward: one gather per parameter. Backward: the block's re-gathers (the
        # root stays gathered: the default reshard_after_forward) and one
        # reduce-scatter per parameter. The run completing at all checks that depyf
        # did not change the program ([Note: depyf writes, dynamo's bytecode runs]).
        assert _ag_rs(fwd) == (n_params, 0)
        assert _ag_rs(bwd) == (n_params - 3, n_params)
        # The runtime annotates every collective with its unit and parameter: the
        # block is labelled by its path, the root by its class.
        for g in (fwd, bwd):
            assert all(c["unit"] in ("layers.0", "Llama") and len(c["params"]) == 1
                       for c in g["collectives"]), g["collectives"]
        assert {c["params"][0] for c in fwd["collectives"] if c["unit"] == "layers.0"} >= {
            "attn.wq.weight", "ffn.w2.weight"}
        # Independently: count the calls in the AOTAutograd graphs that ran (aot_eager
        # runs them as they are), as depyf wrote their source.
        ran = sorted(
            (len(_AG_CALL.findall(p.read_text())), len(_RS_CALL.findall(p.read_text())))
            for p in (d / "depyf").glob("__compiled_fn_*.Forward_graph.*.py")
        )
        dumped = sorted(_ag_rs(g) for g in (fwd, bwd))
        assert ran == dumped, (ran, dumped)
        br = json.loads((d / "breaks_and_recompiles.json").read_text())
        assert br["graph_breaks"] == [] and br["recompiles"] == [], br  # in 3 steps
        assert br["compiled_autograd_graphs"] == 1
    assert "traceable-hsdp dump: Llama 1 layer," in out and "compiled (aot_eager)" in out
    # Rank 0 printed the tables (one row per collective) and compared the ranks.
    assert re.search(r"^00_fwd \(dynamo, compile id 0/0\): 12 collectives", out, re.M), out
    assert re.search(r"^01_bwd \(dynamo, compile id !0/1/0\): 21 collectives", out, re.M), out
    assert len(re.findall(r"^  \d+ +all_gather_into_tensor ", out, re.M)) == 2 * n_params - 3
    assert "ranks agree: all 2 dumps" in out
    assert "graph breaks: none" in out and "recompiles: none" in out
