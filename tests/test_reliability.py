"""Paths that could be silently wrong: CPU offload copies on a GPU, the order of
explicit prefetch, uneven shards at the edges, units compiled below an eager root, a
graph break inside a unit under Inductor, gradient hooks that compiled autograd runs
eagerly (``nested_compile_region`` blocks), and a rank that dies mid-step (the
survivors, and ``traceable-hsdp train``), the exit of a gloo job (its worker threads
joined before the interpreter finalizes), and the tests' own gathering (without
gloo's allocating all-gather, which crashes rarely). Each test states its reference
and tolerance. The Inductor feature tests are in test_inductor_features.py; the
placeholder ops in the real post-grad graphs before our passes are checked in
test_passes_e2e.py, on the fully_shard model of its two-models test (the same kind
of Inductor compile).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import traceable_hsdp as th


# --------------------------------------------------------------- CPU offload
# See [Note: Offload copies and the CPU] (_param.py). No GPU here: the reduced
# gradient is a stand-in for a device tensor, and the stream and event calls are
# recorded, so the test pins the order of copy, record, synchronize and CPU read.


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


class _FakeStream:
    def __init__(self, log: list) -> None:
        self.log = log

    def record_event(self) -> _FakeEvent:
        self.log.append("record_event")
        return _FakeEvent(self.log)


class _DeviceGrad:
    """A reduced gradient shard as if on ``cuda:0``: ``.to`` a dtype is itself, ``.to``
    the CPU logs the copy and returns the data."""

    device = torch.device("cuda", 0)

    def __init__(self, data: torch.Tensor, log: list) -> None:
        self.data, self.log = data, log
        self.dtype = data.dtype

    def to(self, dest: Any, non_blocking: bool = False) -> Any:
        if isinstance(dest, torch.dtype):
            return self
        assert torch.device(dest).type == "cpu", dest
        self.log.append(("copy_to_cpu", non_blocking))
        return self.data.clone()


def _offloaded(one_rank, pin_memory: bool) -> tuple[nn.Module, Any]:
    m = th.fully_shard(nn.Linear(4, 3), mesh=one_rank,
                       offload_policy=th.CPUOffloadPolicy(pin_memory=pin_memory))
    return m, m._traceable_hsdp_state.param_group.fsdp_params[0]


@pytest.fixture
def stream_log(monkeypatch) -> list:
    log: list = []
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a, **k: _FakeStream(log))
    return log


def test_offload_grad_copy_waits_before_cpu_reads(one_rank, stream_log) -> None:
    log = stream_log
    _, fp = _offloaded(one_rank, pin_memory=True)
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4)
    # First reduction, nothing to add to: asynchronous copy, then an event.
    fp._accumulate_reduced(_DeviceGrad(g1, log))
    assert log == [("copy_to_cpu", True), "record_event"]
    assert fp.grad_offload_event is not None
    # The root's end-of-backward callback waits for it (before the optimizer).
    fp.wait_grad_offload()
    assert log[-1] == "synchronize" and fp.grad_offload_event is None
    # Accumulating: the CPU add reads the copy at once, so the copy blocks.
    log.clear()
    fp._accumulate_reduced(_DeviceGrad(g2, log))
    assert log == [("copy_to_cpu", False)]
    torch.testing.assert_close(fp.sharded_param.grad.to_local(), g1 + g2, rtol=0, atol=0)
    # A pending event when the gradient is reduced again is waited for first.
    fp.sharded_param.grad = None
    log.clear()
    fp._accumulate_reduced(_DeviceGrad(g1, log))
    fp._accumulate_reduced(_DeviceGrad(g2, log))
    assert log == [("copy_to_cpu", True), "record_event", "synchronize", ("copy_to_cpu", False)]


def test_offload_grad_copy_blocks_when_read_early(one_rank, stream_log, monkeypatch) -> None:
    log = stream_log
    # Not pinned: blocking (as torch's FSDP2).
    _, fp = _offloaded(one_rank, pin_memory=False)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None
    # A post-accumulate-grad hook on the sharded parameter reads .grad at once.
    log.clear()
    _, fp = _offloaded(one_rank, pin_memory=True)
    fp.sharded_param.register_post_accumulate_grad_hook(lambda p: None)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None
    # Traced (compiled backward): no end-of-backward callback to wait in.
    log.clear()
    _, fp = _offloaded(one_rank, pin_memory=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fp._accumulate_reduced(_DeviceGrad(torch.ones(3, 4), log))
    assert log == [("copy_to_cpu", False)] and fp.grad_offload_event is None


def test_offload_event_waited_before_backward_returns(one_rank) -> None:
    """The wiring: a real eager backward's end-of-backward callback waits for every
    pending copy, and reset_iter_state drops none unwaited."""
    log: list = []
    m, fp = _offloaded(one_rank, pin_memory=True)
    fp.grad_offload_event = _FakeEvent(log)
    m(torch.randn(2, 4)).sum().backward()
    assert log == ["synchronize"] and fp.grad_offload_event is None
    fp.grad_offload_event = _FakeEvent(log)
    m.reset_iter_state()
    assert log == ["synchronize", "synchronize"] and fp.grad_offload_event is None


# ------------------------------------------------------------ explicit prefetch
def test_explicit_prefetch_issue_order() -> None:
    """The order in which all-gathers are issued, read from the ops dispatched
    eagerly and from the program order of the captured graphs (aot_eager), for three
    Linear units in sequence. Unit 0 prefetches [unit 2, unit 1] in forward; unit 2
    prefetches [unit 0] in backward. Tokens: ``ag<u>`` an all-gather of unit u, ``mm``
    matmuls (consecutive repeats folded). Numbers: the prefetching runs' losses and
    gradients equal the plain eager run's, bitwise eagerly (same ops, reordered
    collectives) and within 1e-6 compiled (aot_eager may reorder float math; it was
    equal in our runs)."""
    from _dist import run_ranks
    from _reliability_workers import prefetch_order_worker

    for r in run_ranks(prefetch_order_worker, 2):
        plain, pf, comp = r["eager"], r["eager_prefetch"], r["compiled_prefetch"]
        # Without prefetch: each unit gathers right before its own compute.
        assert plain["fwd"] == ["ag0", "mm", "ag1", "mm", "ag2", "mm"], plain
        assert plain["bwd"] == ["ag2", "mm", "ag1", "mm", "ag0", "mm"], plain
        # With it: the listed units' gathers are issued, in list order, before the
        # prefetching unit's compute.
        assert pf["fwd"] == ["ag0", "ag2", "ag1", "mm"], pf
        assert pf["bwd"] == ["ag2", "ag0", "mm", "ag1", "mm"], pf
        # Compiled: one forward and one backward graph, the same program order.
        assert comp["fwd"] == [pf["fwd"]] and comp["bwd"] == [pf["bwd"]], comp
        assert pf["loss"] == plain["loss"]
        for a, b, c in zip(plain["grads"], pf["grads"], comp["grads"]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            torch.testing.assert_close(c, a, rtol=0, atol=1e-6)
        assert abs(comp["loss"] - plain["loss"]) <= 1e-6


# ---------------------------------------------------------------- uneven shards
@pytest.mark.slow
def test_uneven_shards_at_the_edges() -> None:
    """4 ranks, a chain of Linear units whose widths put ranks at the edges (see
    ``UNEVEN_WIDTHS``): ranks holding 0 rows on a 1-D mesh of 4, uneven shards on
    dim 1 (shard_placement_fn; torch's fully_shard refuses uneven Shard(1), so the
    reference is one process), and a 0-row rank in each HSDP shard group on 2x2.
    Eager and compiled (aot_eager, compiled autograd) runs against a one-process SGD
    reference on the same global batch: losses rtol 1e-6, parameters atol 1e-6 (not
    bitwise: averaging over ranks sums in another order; 3e-8 seen)."""
    from _dist import run_ranks
    from _reliability_workers import uneven_reference, uneven_worker

    results = run_ranks(uneven_worker, 4)
    ref_losses, ref_params = uneven_reference()
    # The edges are really there (local shard shapes on ranks 3 and 1).
    r3, r1 = results[3]["1d_eager"]["local_shapes"], results[1]["hsdp_eager"]["local_shapes"]
    assert r3["0.weight"] == (0, 8) and r3["0.bias"] == (0,), r3  # 3 rows over 4 ranks
    assert r3["2.weight"] == (7, 0), r3  # 3 columns over 4 ranks, Shard(1)
    assert r3["4.weight"] == (5, 1) and results[0]["1d_eager"]["local_shapes"]["4.weight"] == (5, 2)
    assert r1["6.weight"] == (0, 5) and r1["6.bias"] == (0,), r1  # HSDP: 1 row over 2
    assert results[1]["1d_eager"]["placements"]["2.weight"] == "(Shard(dim=1),)"
    for r in results:
        for run, v in r.items():
            torch.testing.assert_close(v["losses"], ref_losses, rtol=1e-6, atol=0, msg=run)
            for k, ref in ref_params.items():
                torch.testing.assert_close(v["params"][k], ref, rtol=0, atol=1e-6, msg=f"{run} {k}")
            # Compiled: one forward and one backward graph over the 3 steps.
            assert v["graphs"] == ((1, 1) if run.endswith("compiled") else (0, 0)), (run, v["graphs"])


# ------------------------------------------- compiled without compiled autograd
@pytest.mark.slow
def test_units_compiled_without_compiled_autograd_train_correctly() -> None:
    """Compiled with compiled autograd off, each unit's hooks run eagerly around the
    compiled compute ([Note: A unit compiled without compiled autograd] in
    _compile_checks.py), and train correctly (aot_eager, 2 ranks, 3 SGD steps): a unit holding
    another unit compiled on its own under an eager root (``torch.compile(model[2])``);
    the same with that block frozen while its input needs grad; the whole model
    compiled (``torch.compile(model)``, torchtitan's plain line); and a wholly frozen
    model compiled whole, fed by a trainable Linear outside it. Against a one-process
    reference: losses rtol 1e-6, parameters (and the outside Linear) atol 1e-6 (not
    bitwise: averaging over ranks sums in another order). Every placeholder is 0
    bytes after each forward and backward (a re-gather moved into the forward would
    leave the parameters gathered)."""
    from _dist import run_ranks
    from _reliability_workers import below_root_worker

    for r in run_ranks(below_root_worker, 2):
        assert set(r) == {"nested", "frozen", "root", "frozen_root"}
        for case, v in r.items():
            torch.testing.assert_close(v["losses"], v["ref_losses"], rtol=1e-6, atol=0, msg=case)
            worst = max(v["diff"].items(), key=lambda kv: kv[1])
            assert worst[1] <= 1e-6, (case, worst)
            assert v["bytes_fwd"] == [0, 0, 0] and v["bytes_bwd"] == [0, 0, 0], (case, v)


# ------------------------------------------- a graph break inside a unit's forward
@pytest.mark.slow
def test_graph_break_inside_a_unit_compiled_with_inductor() -> None:
    """``torch.compile(model)`` without ``fullgraph`` on a model whose blocks (units)
    break the graph in their forward: dynamo then compiles the units' forward as a
    frame of its own, once for the root and once for both blocks ([Note: One graph
    for every unit of a class] in _common.py), and on the second (the blocks after
    the root) its automatic dynamic shapes make the plain ints the runtime reads
    symbolic, which Inductor must lower in the placeholder's resize ([Note: Ints read
    while tracing] in _param.py). The root returns the loss and the
    log-probabilities it was taken from, as HF's causal LMs given labels return loss
    and logits: those get no gradient, and their hook, registered outside the graph
    after the break, must not fail torch's compiled autograd ("'NoneType' object has
    no attribute 'op'": [Note: An output hook that gets no gradient] in _compile.py).
    The last step calls the model's forward eagerly with compiled autograd still on:
    the backward graph then takes the placeholder autograd saved as an input of its
    own beside the one the re-gather fills, and must not read a freed storage after
    ``remove_resize_copy`` ([Note: Removing resize/copy regions]). 2 ranks, Inductor, compiled
    autograd, 4 AdamW steps, against the same model eager: losses rtol 1e-5,
    parameters atol 1e-5 (seen: 2 ulp on a loss, 4.7e-6); every placeholder
    freed after each step; graphs compiled in step 1 only, and the last step's
    backward."""
    from _dist import run_ranks
    from _reliability_workers import GRAPH_BREAK_STEPS, graph_break_worker

    for r in run_ranks(graph_break_worker, 2):
        e, c = r["eager"], r["compiled"]
        torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-5, atol=0)
        assert c["params"].keys() == e["params"].keys()
        for k, v in e["params"].items():
            torch.testing.assert_close(c["params"][k], v, rtol=0, atol=1e-5, msg=k)
        assert c["bytes_after"] == [0] * GRAPH_BREAK_STEPS, c["bytes_after"]
        assert c["graph_breaks"] > 0, c  # the case this test is about happened
        # Graphs compiled in step 1 only, and in the last step (the eager forward) one
        # more: compiled autograd's backward of that forward.
        first = c["graphs"][0]
        assert c["graphs"] == [first] * (GRAPH_BREAK_STEPS - 1) + [first + 1], c["graphs"]
        assert c["unit_forward_entries"] == 2, c["unit_forward_entries"]


# ----------------------------------------- hooks run eagerly by compiled autograd
@pytest.mark.slow
def test_hooks_run_eagerly_by_compiled_autograd_reduce_every_gradient() -> None:
    """Compiled autograd runs what it cannot trace eagerly, hooks included: here the
    backward of blocks marked ``torch.compiler.nested_compile_region`` (a graph break
    at ``invoke_subgraph`` on torch 2.13), and after it the hook frames it compiles
    one by one until dynamo's recompile limit. One unit's gradients were then
    reduced partly traced and partly eagerly, and the eager ones, held for a flat
    reduction that never came, were lost: 2 of 21 parameters got no gradient (the
    embedding and one block weight), and the next steps' losses drifted. See
    [Note: Eager or traced] (``_common.py``).
    2 ranks, the test Llama, 2 AdamW steps: with region blocks, compiled whole
    (aot_eager, compiled autograd, ``automatic_dynamic_shapes`` off), every
    parameter gets its gradient in every step, bitwise equal to the same model's
    eager run without regions (aot_eager runs eager's ops, and a unit's flat eager
    reduction sums what per-parameter ones sum), and so are the losses. The region
    run must have graph-broken, or it did not test the eager hooks. With dynamo's
    default configuration the region model is refused at its first step, naming
    the modules and both fixes (on 2 ranks dynamo fails to compile the hook frames;
    see [Note: A compile region inside a unit] in ``_compile_checks.py``)."""
    from _dist import run_ranks
    from _reliability_workers import region_block_worker

    for r in run_ranks(region_block_worker, 2):
        plain, region = r["plain"], r["region"]
        assert region["graph_breaks"] > 0, "no graph break: the eager hooks did not run"
        for step, (want, got) in enumerate(zip(plain["grads"], region["grads"])):
            missing = [n for n, g in got.items() if g is None]
            assert not missing, (step, missing)
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=(step, name))
        assert region["losses"] == plain["losses"], (region["losses"], plain["losses"])
        refused = r["refused"]
        assert refused is not None and "nested_compile_region" in refused, refused
        assert "automatic_dynamic_shapes = False" in refused and "layers.0" in refused, refused


# ---------------------------------------------------------- a rank that dies
PG_TIMEOUT_S = 30.0


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_rank_dying_mid_step_makes_the_others_raise(tmp_path, compiled: bool) -> None:
    """3 gloo ranks with a 30 s process-group timeout; rank 1 exits (os._exit, as a
    crash) after a step's forward. Ranks 0 and 2 are then in that step's backward
    collectives: each must raise within the timeout (gloo sees the peer's socket
    close), and exit, never hang. Eager, and compiled (aot_eager, compiled
    autograd: the collectives inside the compiled backward graph)."""
    import json
    import multiprocessing

    from _reliability_workers import DIE_AT_STEP, DIE_EXIT_CODE, dying_rank_main

    world = 3
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=dying_rank_main,
                         args=(r, world, str(tmp_path), compiled, PG_TIMEOUT_S))
             for r in range(world)]
    for p in procs:
        p.start()
    # Startup and (compiled) the first step's compile come before the failing step;
    # the bound below is generous for them, and the step itself is timed by the ranks.
    deadline = 240
    for p in procs:
        p.join(deadline)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {deadline} s"
    assert procs[1].exitcode == DIE_EXIT_CODE
    for r in (0, 2):
        assert procs[r].exitcode == 0, (r, procs[r].exitcode)
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["steps"] == DIE_AT_STEP, got  # the steps before it completed
        assert got["error"] is not None and "RuntimeError" in got["error"], got
        assert got["seconds"] < PG_TIMEOUT_S, got


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, in start (pid) order (Linux /proc)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:  # a spawned rank, not a tracker
            out.append(int(entry))
    return sorted(out)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="finds the ranks in /proc")
def test_train_cli_exits_nonzero_naming_the_dead_rank() -> None:
    """``traceable-hsdp train`` (2 spawned gloo ranks, eager, a long run): rank 1 is
    killed (SIGKILL) once steps are being printed. The command must exit with status 1
    at once and name the rank (torch.multiprocessing's error: "process 1 terminated
    with signal SIGKILL"); the survivor is terminated, nothing hangs."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "traceable_hsdp.demo.cli", "train", "--eager", "--steps", "100000",
           "--no-progress", "--layers", "1", "--dim", "16", "--heads", "2", "--seq-len", "8",
           "--init", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # rank 0's step lines: training is under way
            if line.startswith("step 3/"):
                break
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)  # started second: rank 1
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "a rank died: process 1 terminated with signal SIGKILL" in err, err[-2000:]
    assert seconds < 30, seconds
    def running(pid: int) -> bool:  # alive and not a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert not [p for p in ranks if running(p)], ranks  # the survivor was terminated


# ------------------------------------------------------------------- exiting
# See [Note: Exiting with gloo worker threads] (_exit.py). The abort itself is a race
# (4 of 30 runs of examples/dcp_resume.py --eager on 2 busy cores before the fix, 0
# of 40 after); what removes it is deterministic: by the time the interpreter
# finalizes, the gloo group of a dropped model is destroyed and its worker threads
# are joined. The script counts this process's threads from an atexit function
# registered before fully_shard registers ours, so it runs after ours (LIFO). The
# control run unregisters our hook: the workers are then still there, which shows
# that the count can fail and that the hook is what joins them.

_EXIT_SCRIPT = """
import atexit, os, sys, tempfile
import torch
import torch.distributed as dist

torch.set_num_threads(1)
def threads():
    # gloo's threads (pt_gloo_runloop, gloo_tcp_loop) and any other but the autograd
    # engine's device threads (pt_autograd_N), which CUDA builds start at the first
    # backward and keep for the process, whatever the FSDP.
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(not n.startswith("pt_autograd_") for n in names)
base = threads()
atexit.register(lambda: print("extra threads at exit", threads() - base, flush=True))
from traceable_hsdp import fully_shard
from traceable_hsdp._exit import uninstall_exit_hook
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store",
                        rank=0, world_size=1)

def main():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if sys.argv[1] == "compiled":  # dynamo's guards hold copies of the mesh
        import traceable_hsdp
        traceable_hsdp.enable_compiled_autograd()
        model = torch.compile(model, backend="aot_eager")
    model(torch.randn(2, 8)).sum().backward()
    torch.optim.AdamW(model.parameters()).step()  # DTensor ops: the caches hold the mesh
    print("extra threads while training", threads() - base, flush=True)
    dist.destroy_process_group()
    if sys.argv[1] == "control":
        uninstall_exit_hook()

main()
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts threads in /proc")
def test_gloo_workers_are_joined_before_the_interpreter_finalizes(tmp_path) -> None:
    """No gloo thread is left at exit, eagerly and after a compiled step (aot_eager,
    compiled autograd), whose dynamo guards hold copies of the mesh that only the
    garbage collector reaches; without the exit hook the threads stay. See [Note:
    Exiting with gloo worker threads] in traceable_hsdp/_exit.py."""
    import re
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)

    def extra_threads(mode: str) -> tuple[int, int]:
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        training = re.search(r"extra threads while training (\d+)", proc.stdout)
        at_exit = re.search(r"extra threads at exit (\d+)", proc.stdout)
        assert training and at_exit, proc.stdout
        return int(training.group(1)), int(at_exit.group(1))

    for mode in ("hook", "compiled"):
        training, at_exit = extra_threads(mode)
        assert training > 0, "the gloo group started no worker threads: the test checks nothing"
        assert at_exit == 0, (mode, training, at_exit)
    control_training, control_at_exit = extra_threads("control")
    assert control_at_exit == control_training > 0, (control_training, control_at_exit)


# ------------------------------------------------------- the tests' own gathering
# See [Note: The tests gather without gloo's allocating all-gather] in tests/_dist.py.


def test_the_gather_helper_matches_torch_without_the_allocating_all_gather() -> None:
    """Reference: torch's ``full_tensor()`` and the unsharded tensor, bitwise, on a 2x2
    mesh with uneven shards. torch's own gather issues the allocating all-gather; the
    helper issues the ``_out`` one into a buffer and never the allocating one."""
    from _dist import run_ranks
    from _reliability_workers import gather_helper_worker

    for r in run_ranks(gather_helper_worker, 4):
        for name, case in r.items():
            assert case["torch_equal"] and case["helper_equal"], (name, case)
            ag, ag_out = "all_gather_into_tensor", "all_gather_into_tensor_out"
            assert ag in case["ops"]["torch"], (name, case["ops"])  # else the check is empty
            assert ag_out in case["ops"]["helper"] and ag not in case["ops"]["helper"], (name, case["ops"])


def test_the_tests_gather_through_the_helper() -> None:
    """No test module gathers a DTensor by calling torch's method itself: every
    comparison goes through ``_dist.full_tensor``."""
    import pathlib

    needle = ".full_tensor(" + ")"
    here = pathlib.Path(__file__).parent
    calls = [f"{f.name}:{i}" for f in sorted(here.glob("*.py")) if f.name != "_dist.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if needle in line.split("#")[0]]
    assert calls == [], calls
