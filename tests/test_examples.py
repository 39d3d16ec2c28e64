"""The scripts in ``examples/``, each launched as its docstring says, with
``python -m torch.distributed.run --standalone --nproc-per-node N`` in a subprocess
(the same as ``torchrun``), and their printed output checked.

What is checked is that each example works as a user runs it, not parity (the
runtime, HSDP, state-dict and conformance tests do that): exit status 0, the losses
finite and the last below the first (the data is learnable and the seeds fixed, so
this is deterministic), and each script's own check (HF shards equal to a model
built whole, HSDP replicas equal, resumed run equal to the uninterrupted one).
``train_llama.py`` and ``hf_causal_lm.py`` are compiled here (aot_eager); the others
run ``--eager``, as their compiled paths are covered by ``test_hsdp.py`` and
``test_state_dict.py``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import traceable_hsdp

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Left to torchrun: a test run under torchrun must not hand its own rank to the job.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")
_STEP = re.compile(r"^(?:(\w+) )?step (\d+)  loss (\S+)(?:  grad norm (\S+))?$", re.M)


def _torchrun(script: str, nproc: int, *args: str, timeout: float = 240) -> str:
    """Runs ``examples/<script>`` on ``nproc`` local ranks; returns rank 0's stdout."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    # The ranks import the traceable_hsdp this test imports (this checkout).
    package_root = str(Path(traceable_hsdp.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), str(_EXAMPLES / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _losses(out: str, label: str | None = None) -> list[float]:
    """The losses of the step lines (with ``label``, only those lines), in order,
    checked to be finite and numbered 1, 2, ... (or on from the first one)."""
    lines = [m for m in _STEP.findall(out) if (m[0] or None) == label]
    steps = [int(m[1]) for m in lines]
    assert lines and steps == list(range(steps[0], steps[0] + len(steps))), out
    losses = [float(m[2]) for m in lines]
    assert all(math.isfinite(v) for v in losses), out
    return losses


def _assert_trains(losses: list[float], steps: int, out: str) -> None:
    # Near log(256) = 5.55 at the start (untrained), then falling.
    assert len(losses) == steps, out
    assert 5.0 < losses[0] < 6.5 and losses[-1] < losses[0], out


def test_docstrings_give_the_launch_command() -> None:
    for script, nproc in [("train_llama.py", 2), ("hf_causal_lm.py", 2), ("hsdp_2d.py", 4),
                          ("dcp_resume.py", 2)]:
        doc = (_EXAMPLES / script).read_text()
        assert f"torchrun --standalone --nproc-per-node {nproc} examples/{script}" in doc, script


@pytest.mark.slow
def test_train_llama_compiled() -> None:
    # One block: the script's path is the same, and every block costs compile time.
    out = _torchrun("train_llama.py", 2, "--backend", "aot_eager", "--layers", "1")
    _assert_trains(_losses(out), 5, out)
    norms = [float(m[3]) for m in _STEP.findall(out)]
    assert all(math.isfinite(n) and n > 0 for n in norms), out


@pytest.mark.slow
def test_hf_causal_lm_meta_init_and_activation_checkpointing_compiled() -> None:
    pytest.importorskip("transformers")
    out = _torchrun("hf_causal_lm.py", 2, "--check-init", "--compile", "aot_eager", "--layers", "1")
    assert "check-init: every rank's shards equal those of the model built whole" in out, out
    _assert_trains(_losses(out), 5, out)


@pytest.mark.slow
def test_hsdp_2d() -> None:
    out = _torchrun("hsdp_2d.py", 4, "--eager")
    assert ("mesh (2, 2) ('replicate', 'shard'); layers.0.attn.wq.weight: "
            "(Replicate(), Shard(dim=0)), local (32, 64) of (64, 64)") in out, out
    _assert_trains(_losses(out), 5, out)
    assert "replicas in sync: every shard equal across the 2 replicas" in out, out


@pytest.mark.slow
def test_dcp_resume(tmp_path: Path) -> None:
    pytest.importorskip("numpy")  # torch.distributed.checkpoint needs it
    ckpt = tmp_path / "ckpt"
    out = _torchrun("dcp_resume.py", 2, str(ckpt), "--eager")
    uninterrupted, resumed = _losses(out, "uninterrupted"), _losses(out, "resumed")
    _assert_trains(uninterrupted, 6, out)
    assert resumed == uninterrupted[3:], out  # as printed; the script compares bitwise
    assert re.search(r"^resume check passed: steps 4-6 equal", out, re.M), out
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix == ".distcp") == [
        "__0_0.distcp", "__1_0.distcp"], list(ckpt.iterdir())  # one file per rank


@pytest.mark.slow
def test_readme_usage_runs_as_written(tmp_path: Path) -> None:
    """README's usage block, copied verbatim to a file and launched as it says (2
    ranks, Inductor, compiled autograd): 5 steps with finite losses that start near
    log(256) (its tokens are random, so nothing is learnable)."""
    readme = (_EXAMPLES.parent / "README.md").read_text()
    block = re.search(r"## Usage.*?```python\n(.*?)```", readme, re.S)
    assert block, "README.md has no python block under '## Usage'"
    script = tmp_path / "train.py"
    script.write_text(block.group(1))
    out = _torchrun(str(script), 2, timeout=600)
    losses = _losses(out)
    assert len(losses) == 5 and 5.0 < losses[0] < 6.5, out


def test_hf_example_without_transformers_names_the_extra() -> None:
    code = ("import runpy, sys; sys.modules['transformers'] = None; "
            f"sys.argv = ['hf_causal_lm.py', '--help']; runpy.run_path({str(_EXAMPLES / 'hf_causal_lm.py')!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "needs Hugging Face transformers" in proc.stderr and "pip install transformers" in proc.stderr, proc.stderr
