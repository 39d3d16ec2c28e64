"""The benchmark harness (``benchmarks/``): where the ranks run and what the report says.

In process, no ranks: ``--device``/``--world`` resolution and their argparse errors,
the memory metric and its labels, the batch slicing for any world size, and the
report's per-rank cells and device line. The CUDA branches of that logic are checked
with ``torch.cuda.is_available``/``device_count`` monkeypatched; nothing here touches
a GPU, and the CUDA run itself is not tested (CI has no GPU).

End-to-end smokes of the CPU harness: ``step_time.py --smoke`` on 2 spawned gloo
ranks, two eager variants, checking the markdown and json it writes; the same with
``--heap`` (each variant's heap peak, counted by ``benchmarks/heap_peak.c``, whose
counts are checked against a tensor of known size in a child process); and the same
with ``--model hf_llama`` (transformers' ``LlamaForCausalLM``) for ours and torch's
eager and compiled variants, whose losses must agree; and ``env_ab.py``, whose ranks
must start under each value of its variable. Never a timing assertion: these
are checks of the harness, not of speed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _harness as H  # noqa: E402
import _heap  # noqa: E402
import _report as R  # noqa: E402
import ac_cost  # noqa: E402
import collective_latency  # noqa: E402
import compile_ab  # noqa: E402
import compile_time  # noqa: E402
import env_ab  # noqa: E402
import guard_cost  # noqa: E402
import hf_models  # noqa: E402
import profile_step  # noqa: E402
import step_time  # noqa: E402


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """``torch.cuda`` says ``gpus`` GPUs are there (0: no CUDA). Only the resolution
    logic reads it; no test here touches a device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


Parse = Callable[[list[str]], Any]
_OUT = ["--out", "never_written"]  # parse_args only; nothing is written


def _parse_error(parse: Parse, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse([*argv, *_OUT])
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ resolution


def test_auto_is_cpu_without_cuda_and_cuda_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 0)
    assert H.resolve_device("auto") == "cpu"
    assert step_time.parse_args(_OUT).placement == H.Placement("cpu", 2)
    _fake_cuda(monkeypatch, 4)
    assert H.resolve_device("auto") == "cuda"
    assert H.resolve_placement("auto", None) == H.Placement("cuda", 4)
    assert H.resolve_device("cpu") == "cpu"  # --device cpu wins over a GPU


def test_auto_on_this_machine() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert H.resolve_device("auto") == want


@pytest.mark.parametrize("parse", [step_time.parse_args, profile_step.parse_args],
                         ids=["step_time", "profile_step"])
def test_cuda_without_cuda_is_an_argparse_error(
    parse: Parse, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_cuda(monkeypatch, 0)
    err = _parse_error(parse, ["--device", "cuda"], capsys)
    assert "--device cuda" in err and "torch.cuda.is_available() is False" in err
    assert "--device cpu" in err  # how to fix it


def test_bad_device_value(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(step_time.parse_args, ["--device", "tpu"], capsys)
    assert "--device" in err and "tpu" in err
    with pytest.raises(ValueError, match="one of auto, cpu, cuda"):
        H.resolve_device("tpu")


def test_bad_vocab_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(step_time.parse_args, ["--vocab", "0", *_OUT], capsys)
    assert "--vocab must be >= 1, got 0" in err
    assert step_time.parse_args(["--vocab", "8192", *_OUT]).vocab == 8192


def test_world_defaults_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 0)
    assert H.resolve_world("cpu", None) == H.CPU_WORLD == 2
    assert H.resolve_world("cpu", 3) == 3  # gloo: any number of CPU ranks
    assert step_time.parse_args(["--device", "cpu", "--world", "1", *_OUT]).placement.world == 1
    _fake_cuda(monkeypatch, 8)
    assert H.resolve_world("cuda", None) == 8  # one rank per visible GPU
    assert H.resolve_world("cuda", 8) == 8
    assert H.resolve_world("cuda", 2) == 2
    assert H.resolve_world("cpu", None) == 2  # the CPU default ignores the GPUs


def test_world_validation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_cuda(monkeypatch, 2)
    err = _parse_error(step_time.parse_args, ["--device", "cuda", "--world", "3"], capsys)
    assert "--world 3" in err and "torch.cuda.device_count() is 2" in err
    assert "between 1 and 2" in err
    err = _parse_error(profile_step.parse_args, ["--device", "cuda", "--world", "3"], capsys)
    assert "--world 3" in err
    for argv in (["--world", "0"], ["--device", "cuda", "--world", "-1"]):
        err = _parse_error(step_time.parse_args, argv, capsys)
        assert "--world must be >= 1" in err
    # CUDA built and "available", but nothing visible (CUDA_VISIBLE_DEVICES="").
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match=r"device_count\(\) is 0"):
        H.resolve_world("cuda", None)


# ---------------------------------------------------------- placement, metric


def test_placement_backend_device_and_memory_metric() -> None:
    cpu, cuda = H.Placement("cpu", 2), H.Placement("cuda", 4)
    assert (cpu.backend, cuda.backend) == ("gloo", "nccl")
    assert cpu.rank_device(1) == torch.device("cpu")
    assert cuda.rank_device(3) == torch.device("cuda", 3)  # a device object, not touched
    assert cpu.memory_metric is H.PEAK_RSS
    assert cuda.memory_metric is H.GPU_MAX_ALLOCATED
    assert (cpu.memory_metric.key, cpu.memory_metric.label) == ("peak_rss_mib", "peak RSS MiB")
    assert (cuda.memory_metric.key, cuda.memory_metric.label) == (
        "gpu_max_allocated_mib", "GPU max allocated MiB"
    )
    assert cpu.memory_metric.column.startswith(cpu.memory_metric.label)
    assert cuda.memory_metric.column.startswith(cuda.memory_metric.label)
    assert H.Placement("cpu", 2, heap=True).memory_metric is H.HEAP_PEAK
    assert H.HEAP_PEAK.key == "heap_peak_above_start_mib"


def test_heap_is_refused_with_processes_or_on_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "leave out --processes" in _parse_error(
        step_time.parse_args, ["--device", "cpu", "--heap", "--processes", "2"], capsys
    )
    _fake_cuda(monkeypatch, 2)
    assert "--heap is for the CPU" in _parse_error(
        step_time.parse_args, ["--device", "cuda", "--heap"], capsys
    )
    assert step_time.parse_args(["--device", "cpu", "--heap", *_OUT]).placement.heap


_HEAP_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, _heap
assert _heap.active()
torch.empty(1)  # torch's own first allocations, before the measurement
_heap.reset_peak()
start = _heap.live_mib()
x = torch.empty(64 * 2**20 // 4)  # 64 MiB
mid = _heap.live_mib()
del x
end = _heap.live_mib()
print(_heap.peak_mib() - start, mid - start, end - start)
_heap.reset_peak()
print(_heap.peak_mib() - _heap.live_mib())
"""


def test_heap_shim_counts_a_tensor_and_its_peak(tmp_path: Path) -> None:
    """The shim, built and preloaded into a fresh interpreter, counts a 64 MiB tensor
    while it lives (torch's CPU allocator takes it from posix_memalign), keeps it in
    the peak after its free, and starts a new peak at the live count on reset."""
    lib = _heap.build(str(tmp_path))
    assert _heap.build(str(tmp_path)) == lib  # built once per source
    assert not _heap.active()  # this process was not started with it
    with _heap.preloaded(lib):
        assert os.environ["LD_PRELOAD"].split(":")[0] == lib
        out = subprocess.run([sys.executable, "-c", _HEAP_CHILD, str(BENCH)],
                             capture_output=True, text=True, check=False, timeout=120)
    assert "LD_PRELOAD" not in os.environ or lib not in os.environ["LD_PRELOAD"]
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.split("\n")[:2]
    peak, mid, end = map(float, first.split())
    assert 64.0 <= peak < 64.5 and 64.0 <= mid < 64.5, (peak, mid)
    assert abs(end) < 0.5, end
    assert 0.0 <= float(second) < 0.01  # a new peak at the live count (ctypes' own calls
    # between the two reads may add a few bytes)


def test_cpu_memory_helpers() -> None:
    cpu = torch.device("cpu")
    H.reset_peak_memory(cpu)  # no-op on the CPU
    H.sync(cpu)
    assert H.allocated_mib(cpu) is None
    assert H.peak_memory_mib(cpu) == pytest.approx(H.peak_rss_mib(), rel=0.05)


def test_memory_runs_without_the_graph_recorder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Runner puts the harness's graph recorder among Inductor's post-grad passes only
    with ``record_graphs``, and ``memory.py`` asks for none: the recorder keeps every
    post-grad graph alive and turns the FX graph cache off, which would count in the
    resident memory measured ([Note: Peak resident memory per variant])."""
    import memory
    import torch._functorch.config as fconfig
    import torch._inductor.config as iconfig
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    variant = next(v for v in H.all_variants()[0] if v.name == "ours_eager")
    shape = H.Shape("tiny", layers=1, dim=8, heads=1, vocab=16, seq=4, batch=1)
    installed = {}
    for record in (True, False):
        runner = H.Runner(variant, shape, None, 0, "inductor", 0, fconfig.recompute_views,
                          record_graphs=record)
        runner.model = torch.nn.Linear(1, 1)  # built: active() builds nothing
        with runner.active():
            passes = get_custom_graph_passes(iconfig.post_grad_custom_post_pass)
            installed[record] = H.RECORDER.pass_ in passes
    assert installed == {True: True, False: False}

    asked: list[bool] = []

    class Built(Exception):
        pass

    def runner(*args: Any, record_graphs: bool = True, **kwargs: Any) -> None:
        asked.append(record_graphs)
        raise Built

    monkeypatch.setattr(H, "Runner", runner)
    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh", lambda *a, **k: None)
    with pytest.raises(Built):
        memory.measure_rank(0, H.resolve_placement("cpu", 2), variant, shape, "demo", 2,
                            "inductor", 0)
    assert asked == [False]


def test_heap_start_leaves_out_pooled_exchange_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU rank that counts its heap, the bytes at a block's start leave out the
    exchange buffers pooled between steps for a variant that takes from the pool, so
    its peak above the start counts them, and only for such a variant ([Note: Memory
    per variant] in _harness.py): a pooled 1 MiB buffer takes 1 MiB off a live heap of
    100 MiB while it is pooled, and nothing once released; the variants of ours
    compiled with compiled autograd take from the pool, and ``compile_block``'s with
    the pool switched on; torch's, the eager ones, ``compile_block``'s by default and
    ours with the pool off do not."""
    from traceable_hsdp.passes import release_exchange_buffers
    from traceable_hsdp.passes.gloo import _pool

    cpu = torch.device("cpu")
    monkeypatch.setattr(_heap, "active", lambda: True)
    monkeypatch.setattr(_heap, "live_mib", lambda: 100.0)
    release_exchange_buffers()
    start = H.allocated_mib(cpu, pooled=True)  # 100 MiB less any buffer a test holds
    assert start is not None and start <= 100.0
    buf = _pool._take([2**18 + 7], torch.float32, cpu)  # 1 MiB and 28 bytes, pooled
    assert H.allocated_mib(cpu, pooled=True) == pytest.approx(start - (2**20 + 28) / 2**20)
    assert H.allocated_mib(cpu) == 100.0  # a variant that does not take from the pool
    del buf
    assert release_exchange_buffers() >= 2**20 + 28
    assert H.allocated_mib(cpu, pooled=True) >= start
    by_name = {v.name: v for v in H.all_variants()[0]}
    assert "ours_compiled_no_pool_exchange_outputs" in by_name  # switched like a pass
    takes = {n for n, v in by_name.items() if v.pools_exchanges}
    assert {"ours_compiled", "ours_compiled_per_unit", "ours_block_compiled_ca",
            "ours_per_block_pool"} <= takes
    assert not takes & {"ours_eager", "torch_eager", "torch_block_compiled",
                        "ours_block_compiled", "unsharded_compiled_1rank", "ours_per_block",
                        "ours_compiled_no_pool_exchange_outputs"}, takes


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_batch_slices_cover_the_global_batch(world: int) -> None:
    shape = H.SHAPES["smoke"]
    xs = [H.batch_for(shape, 5, 0, r, world) for r in range(world)]
    for x, y in xs:
        assert x.shape == y.shape == (shape.batch, shape.seq)  # per rank, any world
    # Disjoint slices of one global batch: stacked they are the world's tokens, and
    # the targets are the inputs shifted by one.
    x_all = torch.cat([x for x, _ in xs])
    y_all = torch.cat([y for _, y in xs])
    assert x_all.shape == (world * shape.batch, shape.seq)
    assert torch.equal(x_all[:, 1:], y_all[:, :-1])
    assert torch.equal(H.batch_for(shape, 5, 0, 0, world)[0], xs[0][0])  # deterministic


# -------------------------------------------------------------------- report


def test_per_rank_cells() -> None:
    assert step_time.ranks_label(1) == "r0"
    assert step_time.ranks_label(2) == "r0/r1"
    assert step_time.ranks_label(8) == "r0/max r1-r7"
    assert step_time.per_rank_cell([312.6], ".0f") == "313"
    assert step_time.per_rank_cell([312.6, 100.0], ".0f") == "313 / 100"
    assert step_time.per_rank_cell([1.0, 5.0, 7.0, 2.0], ".0f") == "1 / 7"  # r0 / max others
    assert step_time.per_rank_cell([3, 0], "d", sep=", ", idle="–") == "3, –"
    assert step_time.per_rank_cell([300.0, None], ".0f") == "300 / –"


def test_device_line_names_the_device() -> None:
    cpu = dict(type="cpu", backend="gloo", world=2, names=["x86_64"] * 2, visible=None, cpus=2)
    assert step_time.device_line(cpu) == (
        "Device `cpu` (x86_64): 2 gloo ranks x 1 thread on 2 CPU cores"
    )
    # A hand-written CUDA meta (no GPU here): what the line would say.
    cuda = dict(type="cuda", backend="nccl", world=2, names=["NVIDIA H100 80GB HBM3"] * 2,
                visible=4, cpus=16)
    line = step_time.device_line(cuda)
    assert line.startswith("Device `cuda`: 2 nccl ranks, one per GPU, on 2 of 4 visible")
    assert "NVIDIA H100 80GB HBM3" in line


def test_variant_memory_per_device() -> None:
    """The per-variant figure from a rank's per-block readings (hand-written, see
    [Note: Memory per variant]): CPU the reading after round 1, CUDA the largest over
    the blocks and the largest rise above a block's start, the CPU's heap the largest
    rise after the first block."""
    cpu_v = dict(peak_mem_mib=[300.0, 310.0, 320.0], allocated_at_start_mib=[None] * 3)
    assert step_time._variant_memory(cpu_v, H.PEAK_RSS.key) == (300.0, None)
    cuda_v = dict(peak_mem_mib=[900.0, 950.0], allocated_at_start_mib=[100.0, 700.0])
    assert step_time._variant_memory(cuda_v, H.GPU_MAX_ALLOCATED.key) == (950.0, 800.0)
    assert step_time._variant_memory(dict(peak_mem_mib=[], allocated_at_start_mib=[]),
                                      H.GPU_MAX_ALLOCATED.key) == (None, None)
    # The CPU's heap: the largest rise above a block's start after the first block
    # (the compile's), both numbers; the first block's when there is no other.
    heap_v = dict(peak_mem_mib=[900.0, 140.0, 150.0], allocated_at_start_mib=[100.0, 110.0, 115.0])
    assert step_time._variant_memory(heap_v, H.HEAP_PEAK.key) == (35.0, 35.0)
    one = dict(peak_mem_mib=[900.0], allocated_at_start_mib=[100.0])
    assert step_time._variant_memory(one, H.HEAP_PEAK.key) == (800.0, 800.0)


# ---------------------------------------------------------- end-to-end smoke


@pytest.mark.slow
def test_step_time_smoke_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CPU harness end to end through its CLI entry point (in this process, which
    has torch imported already; the ranks are spawned): 2 gloo ranks, both eager
    variants and our per-block compile without and with compiled autograd
    (aot_eager), 3 steps each; the report files exist and name the device and the
    memory metric; ``--vocab`` renames the shape and sizes the model's head."""
    # main() sets these for the ranks; monkeypatch puts them back afterwards.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    out = tmp_path / "results"
    rc = step_time.main([
        "--smoke", "--device", "cpu", "--backend", "aot_eager",
        "--variants", "ours_eager,torch_eager,ours_block_compiled,ours_block_compiled_ca",
        "--no-graph-count",
        "--no-progress", "--vocab", "512", "--out", str(out),
    ])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]

    md = (out / "step_time_smoke_vocab512_demo.md").read_text()
    assert "### Shape `smoke_vocab512`" in md and "vocab 512," in md
    assert "Device `cpu`" in md and "2 gloo ranks" in md
    assert "demo Llama (`traceable_hsdp.demo.models`), dim 32, MLP 128" in md
    assert "| peak RSS MiB after round 1, r0/r1 |" in md
    assert "Memory metric: peak RSS MiB:" in md
    assert "**OK**" in md  # every variant: the same step-1 loss
    for name in ("ours_eager", "torch_eager", "ours_block_compiled", "ours_block_compiled_ca"):
        assert f"| {R.label(name)} (`{name}`) |" in md
    # Eager variants: no compile, and collectives that no Inductor graph holds say so.
    row = next(l for l in md.splitlines() if "(`ours_eager`)" in l).split(" | ")
    assert row.count(R.NO_COMPILE) == 2, row  # compile (s), payback
    assert row.count(R.NOT_COUNTED) == 2, row  # collectives/step, MiB/step
    assert "not counted (--no-graph-count)" not in row and "-0.0" not in md, md
    # Our per-block compile compiles (a time in seconds) and trains like the others.
    header = next(l for l in md.splitlines() if l.startswith("| variant |")).split(" | ")
    row = next(l for l in md.splitlines() if "(`ours_block_compiled`)" in l).split(" | ")
    assert float(row[header.index("compile (s)")]) > 0, (header, row)
    # With compiled autograd the collectives are in graphs, but the block graph runs
    # once per block, which a count per graph cannot say: the cells say why.
    row = next(l for l in md.splitlines() if "(`ours_block_compiled_ca`)" in l).split(" | ")
    assert float(row[header.index("compile (s)")]) > 0, (header, row)
    assert row.count(R.NOT_COUNTED_PER_BLOCK) == 2, row

    report = json.loads((out / "step_time_smoke_vocab512_demo.json").read_text())
    assert report["shape"]["vocab"] == 512
    dev = report["meta"]["device"]
    assert (dev["type"], dev["backend"], dev["world"]) == ("cpu", "gloo", 2)
    assert len(dev["names"]) == 2
    assert report["meta"]["memory_metric"]["label"] == "peak RSS MiB"
    assert report["summary"]["memory_metric"]["key"] == "peak_rss_mib"
    assert report["args"]["placement"] == {"device_type": "cpu", "world": 2, "heap": False}
    rows = report["summary"]["rows"]
    assert set(rows) == {
        "ours_eager", "torch_eager", "ours_block_compiled", "ours_block_compiled_ca"
    }
    assert not report["summary"]["failed"]
    for row in rows.values():
        assert len(row["peak_mem_mib"]) == 2 and all(m > 0 for m in row["peak_mem_mib"])
        assert row["peak_above_block_start_mib"] == [None, None]  # CUDA only
    assert [r["device"]["type"] for r in report["raw"]] == ["cpu", "cpu"]
    assert report["meta"]["model"] == "demo" and report["meta"]["torch"] == torch.__version__


def test_step_time_heap_smoke_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--heap``: the ranks start with the shim, and the memory column is each
    variant's heap peak above its blocks' start. Ours and torch's eager step gather,
    compute and reduce the same tensors, so their peaks are close; the peak RSS, read
    instead, would be the same high-water mark for both or grow with the run order."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    out = tmp_path / "results"
    rc = step_time.main([
        "--smoke", "--device", "cpu", "--variants", "ours_eager,torch_eager", "--rounds", "3",
        "--no-graph-count", "--no-progress", "--heap", "--adamw", "fused", "--out", str(out),
    ])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    # --adamw: the report says it and is named for it, and both variants stepped so.
    md = (out / "step_time_smoke_demo_adamw_fused.md").read_text()
    assert "AdamW `fused=True` for every variant" in md
    assert "| heap peak above block start MiB, r0/r1 |" in md
    assert "Memory metric: heap peak above the block's start MiB:" in md
    assert "GPU peak above" not in md
    report = json.loads((out / "step_time_smoke_demo_adamw_fused.json").read_text())
    assert report["args"]["adamw"] == "fused"
    for raw in report["raw"]:
        for v in raw["variants"].values():
            assert v["optimizer"] == "torch.optim.adamw.AdamW(foreach=None, fused=True)", v
    assert report["args"]["placement"]["heap"] is True
    assert report["summary"]["memory_metric"]["key"] == H.HEAP_PEAK.key
    rows = report["summary"]["rows"]
    for row in rows.values():
        assert row["peak_mem_mib"] == row["peak_above_block_start_mib"]
        assert all(0 < m < 64 for m in row["peak_mem_mib"]), row["peak_mem_mib"]
    for raw in report["raw"]:  # the live heap at every block's start was read
        for v in raw["variants"].values():
            assert len(v["allocated_at_start_mib"]) == 3
            assert all(isinstance(a, float) and a > 0 for a in v["allocated_at_start_mib"])
    ours, theirs = rows["ours_eager"]["peak_mem_mib"], rows["torch_eager"]["peak_mem_mib"]
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 0.25 * max(a, b), (ours, theirs)


@pytest.mark.slow
def test_memory_smoke_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory.py``: each variant in its own 2 ranks; per rank the resident memory
    before the steps, the peaks over every step and over the steps after the first,
    and the heap peak of those steps; the ratios to torch's eager peak. Ours and
    torch's eager step train the same numbers, so their losses are equal."""
    import memory

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "mem"
    rc = memory.main([
        "--out", str(out), "--device", "cpu", "--variants", "torch_eager,ours_eager",
        "--model", "demo", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "256",
        "--seq", "16", "--steps", "2",
    ])
    assert rc == 0
    report = json.loads((out / "memory.json").read_text())
    assert report["meta"]["variants"] == ["torch_eager", "ours_eager"]
    for name in ("torch_eager", "ours_eager"):
        ranks = report["results"][name]
        assert len(ranks) == 2
        for r in ranks:
            assert 0 < r["rss_before_mib"] <= r["peak_rss_mib"], r
            assert r["peak_rss_steady_mib"] <= r["peak_rss_mib"], r
            assert 0 < r["heap_peak_steady_mib"] < 64, r
            assert len(r["losses"]) == 2
    ours, theirs = report["results"]["ours_eager"], report["results"]["torch_eager"]
    assert [r["losses"] for r in ours] == [r["losses"] for r in theirs]
    md = (out / "memory.md").read_text()
    assert "| variant | rank | rss before (MiB) | peak rss (MiB) |" in md
    assert "| ours_eager | 1 |" in md and "peak / torch_eager" in md
    assert "\nCode: commit " in md, md


@pytest.mark.slow
def test_step_time_hf_llama_smoke_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model hf_llama`` end to end: transformers' ``LlamaForCausalLM`` (hidden 32,
    no weights downloaded) sharded per decoder layer then the root, ours and torch's
    ``fully_shard`` eager and compiled (``aot_eager``: no Inductor compiles, so it
    stays under a minute) and the unsharded model; every variant gets the same step-1
    loss, and the report names the model, its shape, the torch version and the CPU.
    The smoke shape cut from 2 decoder layers to 1: every variant still shards (and
    per block compiles) its layer as it would more, and each layer adds compile time."""
    pytest.importorskip("transformers")
    # The ranks get the shape from this process (pickled), so they build 1 layer.
    monkeypatch.setitem(H.SHAPES, "smoke", dataclasses.replace(H.SHAPES["smoke"], layers=1))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    out = tmp_path / "results"
    variants = ["ours_eager", "ours_compiled", "torch_eager", "torch_block_compiled",
                "unsharded_compiled_1rank"]
    rc = step_time.main([
        "--smoke", "--model", "hf_llama", "--device", "cpu", "--backend", "aot_eager",
        "--variants", ",".join(variants), "--no-graph-count", "--no-progress",
        "--out", str(out),
    ])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    md = (out / "step_time_smoke_hf_llama.md").read_text()
    assert "HF `LlamaForCausalLM` (transformers), hidden 32, MLP 64, 1 layers" in md
    assert f"torch {torch.__version__}" in md and f"CPU {R.cpu_name()}" in md
    assert "**OK**" in md, md  # every variant: the same step-1 loss
    report = json.loads((out / "step_time_smoke_hf_llama.json").read_text())
    assert report["meta"]["model"] == "hf_llama" and report["args"]["model"] == "hf_llama"
    summary = report["summary"]
    assert set(summary["rows"]) == set(variants) and not summary["failed"]
    assert summary["loss_ok"] and summary["loss_compared"] == len(variants)
    assert max(summary["loss_traj_max_diff_vs_torch_eager"].values()) <= step_time.LOSS_TOL
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "step_time_smoke_hf_llama.png").stat().st_size > 0
    # The docs' short table, from the JSON alone.
    table = step_time.doc_table(report)
    assert "HF `LlamaForCausalLM`" in table and f"torch {torch.__version__}" in table
    assert sum(l.startswith("| ") for l in table.splitlines()) == 1 + len(variants)
    assert "**OK**" in table


def test_step_time_goal_lines() -> None:
    def rows(**ms: float) -> dict[str, dict[str, float]]:
        return {k: dict(median_s=v / 1e3) for k, v in ms.items()}

    got = step_time.goal_lines("overhead", rows(ours_compiled=50.0, torch_block_compiled=100.0,
                                                ours_eager=120.0, torch_eager=100.0))
    assert got[0].endswith("at most 0.5x torch fully_shard, per-block torch.compile: "
                           "0.50x, **met**.")
    assert got[1].endswith("at most 1.15x torch fully_shard, eager: 1.20x, **not met**.")
    got = step_time.goal_lines("compute", rows(ours_compiled=70.0, torch_block_compiled=100.0))
    assert "0.70x, **not met**" in got[0] and got[1].endswith("not measured in this run.")
    assert step_time.goal_lines("smoke", rows(ours_compiled=1.0)) == []


def test_processes_alternate_and_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--processes``: every variant alone in its own ranks, the order reversed every
    other time, and its processes merged into one row: the timed steps of all of them,
    the compile of the first, every first step kept, and whether their losses agree.
    ``run_spawned`` is replaced by a fake that says which process it was."""
    calls: list[str] = []

    def fake_spawned(placement: H.Placement, variants: list[H.Variant], **kw: Any) -> list[dict[str, Any]]:
        (v,) = variants
        calls.append(v.name)
        k = calls.count(v.name)  # this variant's k-th process
        losses = [2.0, 1.0] if (v.name, k) != ("torch_eager", 3) else [2.0, 1.5]
        res = H.VariantResult(v.name, first_step_s=30.0 / k, timed=[[0.01 * k, 0.02 * k]],
                              losses=losses, compiles_after=(0, k), peak_mem_mib=[100.0])
        return [{"rank": r, "device": {"type": "cpu", "index": None, "name": "cpu"},
                 "variants": {v.name: dict(vars(res))}, "peak_rss_mib": 100.0 * k + r,
                 "order": [v.name], "rounds_done": kw["rounds"]} for r in range(placement.world)]

    monkeypatch.setattr(H, "run_spawned", fake_spawned)
    variants = H.pick_variants(H.all_variants()[0], "ours_eager,torch_eager")
    placement = H.Placement("cpu", 2)
    ranks = H.run_isolated(placement, variants, 3, rounds=1)
    assert calls == ["ours_eager", "torch_eager", "torch_eager", "ours_eager", "ours_eager", "torch_eager"]
    assert [r["order"] for r in ranks] == [["ours_eager", "torch_eager"]] * 2
    assert [r["peak_rss_mib"] for r in ranks] == [300.0, 301.0]
    ours = ranks[0]["variants"]["ours_eager"]
    assert ours["timed"] == [[0.01, 0.02], [0.02, 0.04], [0.03, 0.06]]
    assert ours["first_step_s"] == 30.0 and ours["first_step_s_per_process"] == [30.0, 15.0, 10.0]
    assert ours["compiles_after"] == (0, 6) and ours["peak_mem_mib"] == [100.0] * 3
    s = step_time.summarize(H.SHAPES["smoke"], ranks, placement)
    row = s["rows"]["ours_eager"]
    assert row["n_timed"] == 6 and row["median_s"] == pytest.approx(0.025)
    assert row["compile_s"] == pytest.approx(30.0 - 0.025)
    assert row["losses_same_in_every_process"]
    assert not s["rows"]["torch_eager"]["losses_same_in_every_process"]  # process 3 differs


def test_profile_gpu_time_counts_kernels_not_annotations() -> None:
    """The CUDA profile's GPU time: kernels and copies summed per step, NCCL apart, the
    top kernels named, and the record_function ranges that the profiler mirrors onto
    the GPU's timeline (``is_user_annotation``) left out. Those spans made the first
    CUDA profile report about 6 ms of GPU time per step for 1.2 ms of kernels. Hand
    made events, two steps; no GPU."""
    from types import SimpleNamespace

    def ev(name: str, us: float, device: str = "CUDA", annotation: bool = False) -> Any:
        return SimpleNamespace(
            name=name, is_user_annotation=annotation,
            device_type=SimpleNamespace(name=device),
            time_range=SimpleNamespace(elapsed_us=lambda: us),
        )

    events = (
        [ev("triton_poi_fused_copy_0", 5.0)] * 6
        + [ev("ncclDevKernel_AllGather_RING_LL", 40.0)] * 2
        + [ev("Memcpy DtoD (Device -> Device)", 1.0)] * 4
        + [ev("phase::backward", 3000.0, annotation=True)] * 2
        + [ev("aten::mm", 50.0, device="CPU")] * 8
    )
    got = profile_step._gpu_ms(events, steps=2)
    assert got is not None
    assert got["nccl"] == pytest.approx(0.040)  # 2 x 40 us over 2 steps
    assert got["other"] == pytest.approx(0.017)  # (6 x 5 + 4 x 1) us over 2 steps
    assert got["events"] == 6  # 12 kernels and copies over 2 steps
    assert [k["name"] for k in got["top"]] == [
        "ncclDevKernel_AllGather_RING_LL", "triton_poi_fused_copy_0",
        "Memcpy DtoD (Device -> Device)",
    ]
    assert [k["count"] for k in got["top"]] == [1, 3, 2]
    assert profile_step._gpu_ms([ev("aten::mm", 1.0, device="CPU")], steps=1) is None


def test_profile_graph_ops_count_outermost_events_inside_graphs() -> None:
    """The table of what the compiled graphs spend their time on: per name, the
    outermost events inside each ``## Call CompiledFxGraph`` span (an op nested in
    another is its time, not more), nothing outside the graphs, and the graph time no
    op covers. Hand-made events (us), two steps."""
    graph = "## Call CompiledFxGraph abc ##"
    events = []
    for step in (0, 1000):
        events += [
            (graph, step + 0.0, step + 100.0),
            ("aten::mm", step + 10.0, step + 30.0),
            ("aten::addmm", step + 12.0, step + 20.0),  # nested in the mm: not counted
            ("_c10d_functional::wait_tensor", step + 40.0, step + 75.0),
            ("aten::mm", step + 75.0, step + 85.0),
            ("aten::add_", step + 200.0, step + 300.0),  # outside the graph
        ]
    got = profile_step._graph_ops(events, steps=2)
    assert [(k["name"], k["ms"], k["count"]) for k in got["top"]] == [
        ("_c10d_functional::wait_tensor", pytest.approx(0.035), 1),
        ("aten::mm", pytest.approx(0.030), 2),
    ]
    assert got["uncovered"] == pytest.approx(0.035)  # 100 - 35 - 30 us per step
    no_graph = profile_step._graph_ops([("aten::mm", 0.0, 1.0)], steps=1)
    assert no_graph == {"top": [], "uncovered": 0.0}


def test_profile_cpu_split_counts_time_and_page_faults_per_thread_side() -> None:
    """The CPU table: per step, the main thread's user and system time apart from every
    other thread's, and each side's minor page faults, which the CPU total leaves out.
    Hand-made per-thread counters (clock ticks, faults), two steps; then the real
    reader on this process, whose faults grow when the main thread touches fresh
    pages."""
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    before = {1: (10, 2, 100), 2: (5, 5, 40)}
    after = {1: (14, 4, 300), 2: (5, 9, 50), 3: (2, 0, 6)}  # thread 3 started between
    got = profile_step._cpu_split(before, after, steps=2, main=1)
    assert got == {
        "main_user": pytest.approx(2 * tick_ms), "main_system": pytest.approx(1 * tick_ms),
        "other_user": pytest.approx(1 * tick_ms), "other_system": pytest.approx(2 * tick_ms),
        "main_faults": 100.0, "other_faults": 8.0,
    }
    assert profile_step._cpu_ms(got) == pytest.approx(6 * tick_ms)
    assert profile_step._cpu_split(before, {}, steps=2) is None
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc: the reader returns nothing off Linux")
    import mmap
    import threading

    size = 8 << 20
    t0 = profile_step._thread_cpu()
    with mmap.mmap(-1, size) as fresh:  # anonymous: no page is mapped until touched
        for i in range(0, size, 4096):
            fresh[i] = 1
    t1 = profile_step._thread_cpu()
    me = threading.get_native_id()
    # 2048 faults with 4 KiB pages; at least 4 where the kernel maps 2 MiB huge pages
    assert t1[me][2] - t0[me][2] >= size // (2 << 20)


@pytest.mark.slow
def test_profile_step_smoke_each_variant_compiles_its_own_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``profile_step.py`` end to end on 2 gloo ranks (aot_eager, the smoke shape): two
    of our compiled variants that differ only in their passes, run one after the
    other in the same ranks. The second must compile graphs of its own: without the
    reset between variants it passed the first one's guards and ran its graphs, with
    a first step as short as the others ([Note: Variants that would share compiled
    graphs] in benchmarks/_harness.py). The report has the CPU table with its page
    fault columns."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    out = tmp_path / "results"
    rc = profile_step.main([
        "--shape", "smoke", "--device", "cpu", "--backend", "aot_eager",
        "--variants", "ours_compiled,ours_compiled_per_unit", "--warmup", "1", "--steps", "2",
        "--out", str(out),
    ])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    res = json.loads((out / "profile_smoke.json").read_text())["results"]
    for name in ("ours_compiled", "ours_compiled_per_unit"):
        r = res[name]
        # A dynamo compile of the step takes seconds here; a step, milliseconds.
        assert profile_step._compile_s(r) > 1.0, (name, r["first_step_s"])
        assert r["compiles_while_profiling"] == [0, 0], name
        assert set(r["cpu_ms_per_step"]) >= {"main_faults", "other_faults"}
    md = (out / "profile_smoke.md").read_text()
    assert "| page faults: main thread | page faults: other threads |" in md


def test_step_time_refuses_variants_that_would_share_graphs(tmp_path: Path) -> None:
    """Our variants compiled the same way with different passes cannot share one set of
    processes (the later would run the earlier's graphs): the round-robin refuses the
    mix before spawning a rank, naming the pair and ``--processes``; the default set
    leaves the pass switches and bucket caps out. Variants whose traced code or
    optimizer differ are not a conflict."""
    known = H.all_variants()[0]
    pick = lambda spec: H.pick_variants(known, spec)  # noqa: E731
    assert H.graph_sharing_conflicts(pick(
        "ours_compiled,ours_compiled_local_adamw,ours_compiled_reshard_root,ours_eager,"
        "ours_block_compiled,ours_block_compiled_ca,torch_block_compiled")) == []
    assert H.graph_sharing_conflicts(pick("ours_compiled,ours_eager,ours_compiled_per_unit")) == [
        ("ours_compiled", "ours_compiled_per_unit")
    ]
    default = [v.name for v in H.default_variants(known)]
    assert "ours_compiled" in default and "torch_block_compiled" in default
    assert not any(n.startswith(("ours_compiled_no", "ours_compiled_cap")) for n in default)
    assert "ours_compiled_per_unit" not in default
    assert H.graph_sharing_conflicts(H.default_variants(known)) == []
    with pytest.raises(SystemExit) as err:
        step_time.main(["--smoke", "--device", "cpu", "--variants",
                        "ours_compiled,ours_compiled_no_overlap", "--out", str(tmp_path)])
    assert "ours_compiled and ours_compiled_no_overlap" in str(err.value)
    assert "--processes" in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_profile_compile_time_is_the_first_step_less_a_median_one() -> None:
    """The profile reports compile time beside step time as ``step_time.py`` counts
    it; results saved before the first step was kept have none."""
    r = {"first_step_s": 30.0, "unprofiled_median_ms": 25.0}
    assert profile_step._compile_s(r) == pytest.approx(29.975)
    assert profile_step._compile_s({"unprofiled_median_ms": 25.0}) is None
    assert profile_step._compile_s({"first_step_s": None, "unprofiled_median_ms": 25.0}) is None


def test_step_time_and_compile_time_share_one_hf_llama_builder() -> None:
    """``compile_time.py`` and ``step_time.py`` build HF Llama with the same function."""
    assert not hasattr(compile_time, "build_hf_llama")
    import inspect

    assert "H.build_model(" in inspect.getsource(compile_time.run_child)
    assert "model=spec[\"model\"]" in inspect.getsource(compile_time.run_child)


# ---------------------------------------------------------------- report cells


def test_out_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    """Results go where the user says: no default into the committed results."""
    for parse in (step_time.parse_args, profile_step.parse_args, compile_time.parse_args,
                  guard_cost.parse_args, hf_models.parse_args):
        with pytest.raises(SystemExit):
            parse([])
        assert "the following arguments are required: --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compile_ab.parse_args(["--lever", "side_effects"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    assert compile_time.parse_args(["--child", "{}"]).out is None  # a child writes nothing
    assert guard_cost.parse_args(["--one", "ours"]).out is None


def test_ac_cost_table_compares_each_system_with_itself() -> None:
    """``ac_cost.py``'s table from hand-written results: every ratio is against the
    same system without checkpointing (time, memory peak, saved bytes), eager variants
    say they compiled nothing, and only our whole-model compile has saved bytes."""
    res: dict[str, Any] = {}
    for ac, scale in (("none", 1.0), ("full", 0.5)):
        for impl in ("torch_eager", "torch_block_compiled", "ours_eager", "ours_compiled"):
            res[f"{impl}_{ac}"] = dict(
                first=3.0, times=[0.1 / scale], losses=[5.0],
                first_compiles=impl.endswith("compiled"),
                peak_above_start_mib=40.0 * scale,
                saved_bytes=4096 * scale if impl == "ours_compiled" else None,
            )
    args = ac_cost.parse_args(["--device", "cpu"])
    table = ac_cost.report(res, args, "test CPU")
    row = next(l for l in table.splitlines() if l.startswith("| torch_eager_full |"))
    assert row.split(" | ")[1:7] == ["0.2000", "2.00x", "(eager)", "20.0", "0.50x",
                                     "not counted: not ours compiled whole"], row
    row = next(l for l in table.splitlines() if l.startswith("| ours_compiled_full |"))
    assert row.split(" | ")[3:7] == ["3.0", "20.0", "0.50x", "2"] and row.endswith(" 0.50x |"), row
    assert "| torch_block_compiled_none | 0.1000 | 1.00x | 3.0 | 40.0 | 1.00x |" in table


def test_guard_cost_filters_drop_only_their_kind() -> None:
    """Each measuring variant of guard_cost.py drops one kind of guard and keeps the
    rest (a filter that dropped everything would measure nothing)."""
    from types import SimpleNamespace as E

    state = "L['self'].__dict__['_traceable_hsdp_state'].param_group.fsdp_params[0].fqn"
    model = "L['self']._modules['output']._parameters['weight']"
    entries = [E(name=n, guard_type=t) for n in (state, model)
               for t in ("EQUALS_MATCH", "CONSTANT_MATCH", "DTENSOR_SPEC_MATCH", "TENSOR_MATCH",
                         "DUPLICATE_INPUT")]

    def kept(variant: str) -> set[tuple[str, str]]:
        return {(e.name, e.guard_type) for e in entries if guard_cost._keep(variant, e)}

    every = {(e.name, e.guard_type) for e in entries}
    assert kept("ours") == kept("unsharded") == every
    assert every - kept("ours_no_dtensor_spec") == {(state, "DTENSOR_SPEC_MATCH"), (model, "DTENSOR_SPEC_MATCH")}
    assert every - kept("ours_no_state_constants") == {(state, "EQUALS_MATCH"), (state, "CONSTANT_MATCH")}
    assert every - kept("ours_no_aliasing") == {(state, "DUPLICATE_INPUT"), (model, "DUPLICATE_INPUT")}
    assert every - kept("ours_no_state") == {(state, t) for _, t in every}


def test_compile_ab_order_and_table() -> None:
    """compile_ab.py alternates a lever's variants ABBA, so that neither always
    compiles first, and its table gives each variant's medians against the first's."""
    assert compile_ab._order(("info", "silent"), 3) == [
        "info", "silent", "silent", "info", "info", "silent"]
    args = compile_ab.parse_args(["--lever", "side_effects", "--out", "/unused", "--layers", "2",
                                  "--rounds", "3"])
    assert args.layer_list == [2]
    res = {2: {"info": {"wall_s": [10.0, 12.0, 11.0], "cpu_s": [9.0, 9.5, 9.2], "messages": [50, 50, 50],
                        "emit_s": [1.0, 1.2, 1.1], "nodes": [900, 900, 900]},
               "silent": {"wall_s": [8.0, 9.9, 8.8], "cpu_s": [8.0, 8.1, 8.2], "messages": [0, 0, 0],
                          "emit_s": [0.1, 0.1, 0.2], "nodes": [900, 900, 900]}}}
    text = compile_ab._markdown(res, args, {"head": "abc1234"})
    assert "| 2 | `info` | 11.00 | 9.20 | 900 | 50 | 1.10 | 1.00x |" in text, text
    assert "| 2 | `silent` | 8.80 | 8.10 | 900 | 0 | 0.10 | 0.80x |" in text, text
    assert compile_ab.LEVERS["version_counters"].variants == ("traced", "skipped")
    for bad in (["--lever", "side_effects", "--out", "/unused", "--layers", "two"],
                ["--lever", "nothing", "--out", "/unused"]):
        with pytest.raises(SystemExit):
            compile_ab.parse_args(bad)


def test_guard_cost_table_without_the_floor() -> None:
    """guard_cost.py's table with and without the unsharded floor among --variants
    (a run without the floor still reports its numbers)."""
    row = dict(forward_ms=3.0, backward_ms=4.0, step_ms=50.0, step_skipped_ms=45.0,
               forward_guards={"TENSOR_MATCH": 5})
    floor = dict(row, forward_ms=0.5, backward_ms=0.5)
    args = guard_cost.parse_args(["--out", "/unused", "--shape", "smoke"])
    code = {"head": "abc1234"}
    alone = guard_cost._markdown("smoke", {"ours": row}, args, code)
    assert "| `ours` | 3.00 | 4.00 | 7.00 | (not run) | 5 | 50.0 | 45.0 | 5.0 |" in alone, alone
    both = guard_cost._markdown("smoke", {"unsharded": floor, "ours": row}, args, code)
    assert "| `ours` | 3.00 | 4.00 | 7.00 | +6.00 |" in both and "(the floor)" in both, both


def test_collectives_between_graphs_are_not_counted() -> None:
    """A per-block variant's collectives run between its compiled blocks, so its row
    says so instead of the 0 its graphs hold, ours as torch's; a whole-step row counts
    them; a row saved without its compile mode falls back on the name (torch's)."""
    graphs = {"inductor_graphs": 2, "per_step": {"all_gather": {"count": 3, "bytes": 2**20}}}
    blocks = step_time._coll_cells("ours_block_compiled", {"compile": "blocks",
                                                           "collectives": graphs})
    assert blocks == (R.NOT_COUNTED, R.NOT_COUNTED)
    whole = step_time._coll_cells("ours_compiled", {"compile": "whole", "collectives": graphs})
    assert whole == ("3/0/0", "1.00")
    assert step_time._coll_cells("torch_block_compiled", {"collectives": graphs}) == blocks
    assert step_time._coll_cells("ours_compiled", {"collectives": graphs}) == whole


def test_numbers_names_and_payback() -> None:
    assert R.num(-0.0, ".1f") == "0.0" and R.num(-0.04, ".1f") == "0.0"
    assert R.num(-1.5, ".1f") == "-1.5" and R.num(None, ".1f") == "–"
    keys = [v.name for v in H.all_variants()[0]] + [v.name for v in compile_time.VARIANTS]
    for key in keys:
        assert R.label(key) != key and "eager backward" not in R.label(key), key
    assert R.label("ours_compiled_no_overlap").endswith("without overlap")
    assert R.label("torch_block_compiled") == "torch fully_shard, per-block torch.compile"
    ref = dict(compile_s=20.0, median_s=0.5, compiled=True)
    row = dict(compile_s=50.0, median_s=0.25, compiled=True)  # +30 s, 0.25 s/step faster
    assert step_time.payback_cell(row, ref) == "120"
    assert step_time.payback_cell({**row, "median_s": 0.5}, ref) == "never (steps not faster)"
    assert step_time.payback_cell({**row, "compile_s": 10.0}, ref) == "0 (compiles faster)"
    assert step_time.payback_cell(dict(compile_s=None, median_s=1.0, compiled=False),
                                  ref) == R.NO_COMPILE
    assert step_time.payback_cell(ref, ref) == "–" and step_time.payback_cell(row, None) == "–"


def test_step_time_plot_has_a_legend_and_no_target_lines() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    def row(ms: float) -> dict[str, float]:
        return dict(median_s=ms / 1e3, p25_s=ms / 1e3 * 0.9, p75_s=ms / 1e3 * 1.1)

    names = ["ours_compiled", "torch_eager", "torch_block_compiled", "unsharded_compiled_1rank"]
    s = dict(rows={n: row(100.0 + 10 * i) for i, n in enumerate(names)})
    for i, n in enumerate(names):
        s["rows"][n]["compile_s"] = None if n == "torch_eager" else 10.0 * (i + 1)
    fig = step_time.figure(H.SHAPES["overhead"], s, "2 gloo ranks (cpu)",
                           "demo Llama; torch 2.13.0+cpu; CPU AMD EPYC, 2 cores")
    try:
        ax, cax = fig.axes  # step time, compile time
        assert "torch 2.13.0+cpu" in fig._suptitle.get_text()
        assert "CPU AMD EPYC" in fig._suptitle.get_text()
        assert cax.get_title() == "compile time"
        texts = [t.get_text().strip() for t in cax.texts]
        assert texts == ["10.0", R.NO_COMPILE, "30.0", "40.0"], texts
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["traceable_hsdp fully_shard", "torch fully_shard",
                          "unsharded model (no communication)"]
        assert [t.get_text() for t in ax.get_yticklabels()] == [R.label(n) for n in names]
        dashed = [l for l in ax.lines if l.get_linestyle() in ("--", ":", "-.")]
        assert not dashed and not any("target" in t for t in legend), dashed
    finally:
        plt.close(fig)


# ------------------------------------------------------------------ compile_time


def _ct_run(layers: int, variant: str, cold: float, warm: float, hit: int) -> dict[str, Any]:
    def res(first: float, fx: tuple[int, int, int]) -> dict[str, Any]:
        return dict(
            first_step_s=first, recompiles=0,
            compile=dict(total=first - 1, dynamo=1.0, aot=2.0, inductor=3.0, kernels=first - 7),
            cache=dict(fx_hit=fx[0], fx_miss=fx[1], fx_bypass=fx[2], aot_hit=0, aot_miss=0,
                       aot_bypass=2),
        )
    return dict(layers=layers, repeat=0, variant=variant, cold=res(cold, (0, 1, 1)),
                warm=res(warm, (hit, 1 - hit, 1)))


def test_compile_time_summary_ratios_and_goals() -> None:
    runs = [
        _ct_run(8, "plain_whole", 40.0, 10.0, 1),
        _ct_run(8, "ours_compiled", 50.0, 25.0, 1),  # 1.25x cold, 2.5x warm: both met
        _ct_run(8, "ours_compiled_nofix", 70.0, 35.0, 0),  # 1.75x, 3.5x: neither
        _ct_run(4, "ours_compiled", 30.0, 12.0, 1),
    ]
    runs.append(dict(_ct_run(4, "torch_block_compiled", 1, 1, 0), warm={"error": "exit 1: boom"}))
    s = compile_time.summarize(runs)
    row = s["rows"]["8/ours_compiled"]
    assert row["cold"]["vs_plain"] == pytest.approx(1.25)
    assert row["warm"]["vs_plain"] == pytest.approx(2.5)
    assert s["rows"]["4/ours_compiled"]["warm"]["vs_plain"] is None  # no plain at 4 layers
    g = s["goals"]
    assert g["ours_compiled"]["warm_met"] and g["ours_compiled"]["cold_met"]
    assert not g["ours_compiled_nofix"]["warm_met"] and not g["ours_compiled_nofix"]["cold_met"]
    args = compile_time.parse_args(["--layers", "4,8", *_OUT])
    meta = dict(torch="2.13", python="3.11", cpu="cpu", cpus=2, wall_s=1.0,
                loadavg_before=(0.0, 0.0, 0.0), loadavg_after=(0.0, 0.0, 0.0),
                code=dict(head="abc1234", dirty_runtime=""), device="NVIDIA H100 80GB HBM3")
    md = compile_time.markdown(s, meta, args)
    assert md.startswith("### Compile time, first training step, 1 rank on NVIDIA H100"), md
    del meta["device"]  # a report written before the device was recorded: the CPU
    assert "1 rank on the CPU (cpu, 2 cores" in compile_time.markdown(s, meta, args)
    assert ("| 8 | traceable_hsdp fully_shard, torch.compile(model) (`ours_compiled`) | 50.0 "
            "| 25.0 | 1.25x | 2.50x |") in md
    assert "| 0/1/1 | 1/0/1 | 0/0/2 |" in md  # FX cold, FX warm, AOT warm
    assert ("- traceable_hsdp fully_shard, torch.compile(model): warm 2.50x (goal <= 3x): "
            "**met**; cold 1.25x (goal <= 1.5x): **met**") in md
    assert "TRACEABLE_HSDP_STABLE_MESH_KEY=0: warm 3.50x (goal <= 3x): **not met**" in md
    assert ("**4 layers, torch fully_shard, per-block torch.compile failed** "
            "(warm: exit 1: boom)") in md


def test_compile_time_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_time.parse_args(_OUT).layers == [4, 8, 16]
    err = _parse_error(compile_time.parse_args, ["--variants", "ours_compiled,nope"], capsys)
    assert "unknown variant(s) ['nope']" in err
    err = _parse_error(compile_time.parse_args, ["--layers", "4,x"], capsys)
    assert "comma-separated layer counts" in err
    err = _parse_error(compile_time.parse_args, ["--repeats", "0"], capsys)
    assert "--repeats must be >= 1" in err
    err = _parse_error(compile_time.parse_args, ["--world", "0"], capsys)
    assert "--world must be >= 1, got 0" in err
    assert compile_time.parse_args([*_OUT, "--device", "cpu"]).device_type == "cpu"
    if not torch.cuda.is_available():  # the error says why there is no GPU
        err = _parse_error(compile_time.parse_args, [*_OUT, "--device", "cuda"], capsys)
        assert "--device cuda, but torch.cuda.is_available() is False" in err, err


@pytest.mark.slow
def test_compile_time_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # aot_eager: no Inductor, so no FX graph cache lookups; the harness end to end,
    # on 2 ranks (each phase two processes on one cache dir; the slower rank reported).
    out = tmp_path / "ct"
    rc = compile_time.main(["--layers", "1", "--variants", "ours_compiled", "--world", "2",
                            "--backend", "aot_eager", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    md = (out / "compile_time_demo.md").read_text()
    assert "first training step, 2 ranks (the unsharded model: 1) on the CPU" in md, md
    assert "| 1 | traceable_hsdp fully_shard, torch.compile(model) (`ours_compiled`) |" in md
    report = json.loads((out / "compile_time_demo.json").read_text())
    (run,) = report["raw"]
    for phase in ("cold", "warm"):
        res = run[phase]
        assert res["world"] == 2 and res["first_step_s"] == max(res["rank_first_step_s"]), res
        assert len(res["rank_first_step_s"]) == 2 and res["compile"]["dynamo"] > 0, res
        assert res["stable_mesh_key"] and res["recompiles"] == 0, res


def test_collective_latency_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``collective_latency.py`` on 2 gloo ranks, sizes up to 1 MiB, one timed call
    each: the table has every size and both collectives, and the crossing is found
    from the medians (never a timing assertion)."""
    assert collective_latency.main(["--out", str(tmp_path), "--iters", "1", "--max-mib", "1",
                                    "--device", "cpu"]) == 0
    md = (tmp_path / "collective_latency_cpu.md").read_text()
    for size in ("4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"):
        assert f"| {size} |" in md, md
    assert "all-gather: latency floor" in md and "- reduce-scatter: latency floor" in md
    assert "traceable_hsdp's reduce-scatter: latency floor" in md
    data = json.loads((tmp_path / "collective_latency_cpu.json").read_text())
    assert data["sizes_kib"] == [4, 16, 64, 256, 1024]
    for k in ("all_gather", "reduce_scatter", "ours"):
        assert [len(t) for t in data["times_s"][k]] == [1] * 5, k
    # The crossing: the first size at twice the first size's time.
    assert collective_latency._crossing([4, 16, 64], [1.0, 1.5, 2.0]) == 64
    assert collective_latency._crossing([4, 16], [1.0, 1.9]) is None
    with pytest.raises(SystemExit):
        collective_latency.main([])  # --out is required


@pytest.mark.slow
def test_env_ab_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``env_ab.py`` on 2 gloo ranks, our eager variant on the smoke shape, one pair:
    the ranks start with the variable unset, then set (each rank reports what it saw),
    the parent's environment is as before afterwards, and the report names both values
    with each process's steps and step-1 loss (the same: the variable changes nothing
    here). The A/B order alternates pair by pair; bad ``--values`` are refused."""
    name = "TRACEABLE_HSDP_ENV_AB_TEST"
    assert name not in os.environ
    rc = env_ab.main(["--env", name, "--values", "unset,1", "--variant", "ours_eager",
                      "--shape", "smoke", "--pairs", "1", "--steps", "2", "--warmup", "0",
                      "--out", str(tmp_path)])
    assert rc == 0
    assert name not in os.environ
    md = (tmp_path / f"env_ab_{name}_smoke.md").read_text()
    assert f"| `{name}` unset |" in md and f"| `{name}=1` |" in md, md
    data = json.loads((tmp_path / f"env_ab_{name}_smoke.json").read_text())
    assert [(r["value"], r["seen"]) for r in data["runs"]] == [(0, None), (1, "1")]
    assert all(len(r["steps_s"]) == 2 and r["first_step_s"] > 0 for r in data["runs"])
    assert len({r["loss_step1"] for r in data["runs"]}) == 1
    assert data["summary"]["ratio_b_over_a"] > 0
    assert env_ab.order(3) == [0, 1, 1, 0, 0, 1]
    for values in ("1", "1,1", "0,1,2"):
        with pytest.raises(SystemExit):
            env_ab.main(["--env", name, "--values", values, "--out", str(tmp_path)])
    capsys.readouterr()
