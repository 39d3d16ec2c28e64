"""``traceable-hsdp train``: argument checks in process (no ranks started), what
``import traceable_hsdp`` loads, the synthetic data, ``--clip``, ``--mixed-precision``
and the progress bar in process on one rank, and two real runs of the console script
(eager, and eager with ``--clip``) on 2 spawned gloo ranks. The compiled job (the same
``_train`` loop: step lines, losses, the compile report) runs in
``test_dump.py``'s ``traceable-hsdp dump --backend aot_eager`` test, which makes the
same checks on its output.

The real runs check that training works end to end, not parity: the losses printed by
rank 0 must be finite and the last below the first (the data is learnable, see
[Note: Synthetic data] in ``traceable_hsdp/demo/_train.py``; seeds are fixed, so this is
deterministic). Parity with a single-process reference belongs to the runtime tests.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from traceable_hsdp.demo import cli
from traceable_hsdp.demo._train import (
    _BRANCHES,
    TrainConfig,
    TrainResult,
    _global_batch,
    _loss_fn,
    _successor_table,
    progress_enabled,
    resolve_device,
    torchrun_env,
    train_rank,
)
from traceable_hsdp.demo.models import Llama, LlamaConfig

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------- argument checks


def test_missing_cxx_is_named_before_compiling(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    err = _parse_error(["train", "--device", "cpu"], capsys)
    assert "needs a C++ compiler" in err and "--backend aot_eager or --eager" in err, err
    monkeypatch.setenv("PATH", str(tmp_path))  # nor --eager nor aot_eager need one
    monkeypatch.delenv("CXX")
    for flags in (["--eager"], ["--backend", "aot_eager"]):
        assert cli._train_config(cli.build_parser()[0].parse_args(["train", "--device", "cpu", *flags]),
                                 cli.build_parser()[1]["train"]).device == "cpu"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required: COMMAND"),
        (["nope"], "invalid choice: 'nope'"),
        (["train", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["train", "--layers", "-1"], "--layers: expected a positive integer, got -1"),
        (["train", "--batch-size", "x"], "--batch-size: expected a positive integer, got 'x'"),
        (["train", "--world-size", "0"], "--world-size: expected a positive integer"),
        (["train", "--replicate", "0"], "--replicate: expected a positive integer"),
        (["train", "--seq-len", "0"], "--seq-len: expected a positive integer"),
        (["train", "--lr", "0"], "--lr: expected a positive finite number, got 0"),
        (["train", "--lr", "nan"], "--lr: expected a positive finite number, got nan"),
        (["train", "--clip", "0"], "--clip: expected a positive finite number, got 0"),
        (["train", "--clip", "-1.5"], "--clip: expected a positive finite number"),
        (["train", "--clip", "inf"], "--clip: expected a positive finite number, got inf"),
        (["train", "--clip", "x"], "--clip: expected a positive number, got 'x'"),
        (["train", "--seed", "-3"], "--seed: expected a non-negative integer, got -3"),
        (["train", "--replicate", "3"], "--world-size 2 is not divisible by --replicate 3"),
        (["train", "--world-size", "6", "--replicate", "4"],
         "--world-size 6 is not divisible by --replicate 4"),
        (["train", "--dim", "30"], "--dim 30 must split into --heads 4 heads of even size"),
        (["train", "--dim", "64", "--heads", "64"], "heads of even size"),
        (["train", "--backend", "not_a_backend"],
         "invalid choice: 'not_a_backend' (choose from 'inductor', 'aot_eager', 'eager')"),
        (["train", "--device", "gpu"], "invalid choice: 'gpu' (choose from 'auto', 'cpu', 'cuda')"),
        (["train", "--mixed-precision", "fp16"], "invalid choice: 'fp16'"),
    ],
)
def test_invalid_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(argv, capsys)
    assert message in err, err


def test_backends_are_the_real_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """--backend offers inductor, aot_eager and eager, each a registered torch.compile
    backend, and none of the debug/testing ones torch also registers."""
    import torch._dynamo

    assert set(cli.BACKENDS) == {"inductor", "aot_eager", "eager"}
    registered = set(torch._dynamo.list_backends(exclude_tags=()))
    assert set(cli.BACKENDS) <= registered
    testing = {b for b in registered if "TESTING" in b.upper()}
    assert testing, registered  # torch registers some, so the next check can fail
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "--backend {inductor,aot_eager,eager}" in help_text, help_text
    assert not [b for b in testing if b in help_text], help_text
    parser, subparsers = cli.build_parser()
    cfg = cli._train_config(parser.parse_args(["train", "--eager"]), subparsers["train"])
    assert cfg.eager and cfg.world_size == 2 and cfg.replicate == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_device_auto_is_cpu_and_cuda_without_gpus_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without GPUs --device auto (the default) runs gloo ranks on the CPU, and
    --device cuda stops before starting any rank with an error that says why."""
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    parser, subparsers = cli.build_parser()
    cfg = cli._train_config(parser.parse_args(["train"]), subparsers["train"])
    assert (cfg.device, cfg.world_size) == ("cpu", 2)
    err = _parse_error(["train", "--device", "cuda"], capsys)
    assert "--device cuda: torch" in err and "sees no CUDA device" in err, err
    assert "use --device cpu (or auto)" in err, err
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        resolve_device("tpu")


def test_import_does_not_load_inductor() -> None:
    """``import traceable_hsdp`` and building the CLI parser (``--help``) load neither
    Inductor nor dynamo nor depyf; the public names still resolve on first use.
    In a fresh interpreter, since this one has loaded them already."""
    code = (
        "import sys, traceable_hsdp\n"
        "from traceable_hsdp.demo import cli\n"
        "cli.build_parser()\n"
        "heavy = ('torch._inductor', 'torch._dynamo', 'depyf')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "assert 'fully_shard' in dir(traceable_hsdp) and 'importlib' not in dir(traceable_hsdp)\n"
        "from traceable_hsdp import fully_shard, dump_graphs\n"
        "print('torch._inductor' in sys.modules, fully_shard.__module__, dump_graphs.__module__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=_REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[]", proc.stdout
    # The check above can fail: the public names do load Inductor.
    assert lines[1] == "True traceable_hsdp._fully_shard traceable_hsdp.debug._dump", proc.stdout
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        import traceable_hsdp

        traceable_hsdp.nope


def test_torchrun_world_size_wins(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert torchrun_env() == (0, 4, 0)
    parser, subparsers = cli.build_parser()
    args = parser.parse_args(["train", "--world-size", "3", "--replicate", "2"])
    cfg = cli._train_config(args, subparsers["train"])
    assert (cfg.world_size, cfg.replicate) == (4, 2)
    assert "--world-size 3 is ignored under torchrun" in capsys.readouterr().err
    err = _parse_error(["train", "--replicate", "3"], capsys)
    assert "WORLD_SIZE=4 is not divisible by --replicate 3" in err


def test_partial_torchrun_env_is_an_error(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    err = _parse_error(["train"], capsys)
    assert "Found RANK in the environment but not WORLD_SIZE, LOCAL_RANK" in err


def test_subcommand_registry() -> None:
    names = [c.name for c in cli.SUBCOMMANDS]
    assert "train" in names and len(names) == len(set(names))
    _, subparsers = cli.build_parser()
    assert set(subparsers) == set(names)


# ------------------------------------------------------------ README and CI

_REPO = Path(__file__).resolve().parent.parent


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (_REPO / ".ci" / "run").read_text()
    match = re.search(r"^TEST_CMD='(.+)'$", ci, re.M)
    assert match, ".ci/run has no TEST_CMD='...' line"
    readme = (_REPO / "README.md").read_text()
    block = re.search(r"## Set up.*?```bash\n(.*?)```", readme, re.S)
    assert block, "README.md has no bash block under '## Set up'"
    commands = block.group(1).strip().splitlines()
    assert len(commands) == 2, commands
    assert commands[0] == "pip install torch==2.15.0 && pip install -e . && traceable-hsdp train"
    assert commands[1] == match.group(1)


# ------------------------------------------------------------------------ data


def test_global_batch_is_deterministic_and_follows_the_table() -> None:
    table = _successor_table(256, seed=0)
    a = _global_batch(table, rows=6, seq_len=16, seed=0, step=3)
    b = _global_batch(table, rows=6, seq_len=16, seed=0, step=3)
    c = _global_batch(table, rows=6, seq_len=16, seed=0, step=4)
    assert a.shape == (6, 17) and torch.equal(a, b) and not torch.equal(a, c)
    # Every token is one of its predecessor's _BRANCHES successors.
    succ = table[a[:, :-1]]  # (rows, seq, _BRANCHES)
    assert succ.shape[-1] == _BRANCHES
    assert (succ == a[:, 1:, None]).any(-1).all()


def test_median_step_time_skips_two_steps() -> None:
    r = TrainResult(losses=[1.0] * 5, step_times=[30.0, 2.0, 0.3, 0.1, 0.2], world_size=2,
                    replicate=1)
    assert r.median_step_time == pytest.approx(0.2)
    assert TrainResult([1.0, 1.0], [3.0, 1.0], 2, 1).median_step_time is None


# ------------------------------------------------------------------- real runs

# Groups: step, steps, loss, grad norm ("" without --clip), what, seconds.
_STEP = re.compile(
    r"^step (\d+)/(\d+)  loss (\S+)(?:  grad norm (\S+))?  (compile\+step|step) (\S+) s$", re.M
)


def _console_script() -> list[str]:
    # The console script installed next to this interpreter (the venv's), else on PATH.
    here = Path(sys.executable).parent / "traceable-hsdp"
    found = str(here) if here.exists() else shutil.which("traceable-hsdp")
    assert found, "the traceable-hsdp console script is not installed (pip install -e .)"
    return [found]


def _run_train(*args: str) -> tuple[list[float], str]:
    """Runs the console script with stdout and stderr to pipes (not terminals): the
    progress bar is off unless asked for. Returns rank 0's losses and stdout."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    proc = subprocess.run(
        [*_console_script(), "train", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    steps = _STEP.findall(proc.stdout)
    assert [int(s[0]) for s in steps] == list(range(1, len(steps) + 1)), proc.stdout
    losses = [float(s[2]) for s in steps]
    assert all(math.isfinite(v) for v in losses), proc.stdout
    # No progress bar in a log unless asked for (tqdm's convention); tqdm's rate is
    # in "step/s" (text=True turned its "\r" redraws into newlines).
    assert ("step/s" in proc.stderr) == ("--progress" in args), proc.stderr
    return losses, proc.stdout


def _assert_trains(losses: list[float], steps: int, out: str) -> None:
    assert len(losses) == steps, out
    # Deterministic (fixed seeds); "decreasing-ish": the last below the first, and
    # near log(256) = 5.55 at the start (the model starts untrained).
    assert losses[-1] < losses[0], out
    assert 5.0 < losses[0] < 6.5, out
    assert re.search(r"^done: final loss \S+; median step \S+ s \(steps 3-3\)", out, re.M), out


def test_train_eager_console_script() -> None:
    losses, out = _run_train("--eager", "--steps", "3", "--layers", "2", "--dim", "32",
                             "--progress")
    _assert_trains(losses, 3, out)
    assert "FSDP over 2 ranks on cpu (gloo); eager" in out
    assert "compile+step" not in out
    assert "FX graph cache" not in out  # no compile report when eager


# ------------------------------------------------------------------------ clip


def _reference(cfg: TrainConfig, world: int) -> tuple[list[float], list[float]]:
    """The job of ``cfg`` in one process on the global batch of ``world`` ranks, plain
    tensors: each step's loss and gradient norm (before clipping, if ``cfg.clip``)."""
    torch.manual_seed(cfg.seed)
    model = Llama(LlamaConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.layers,
                              n_heads=cfg.heads, max_seq_len=cfg.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)  # as the job's
    table = _successor_table(cfg.vocab_size, cfg.seed)
    losses, norms = [], []
    for step in range(cfg.steps):
        batch = _global_batch(table, world * cfg.batch_size, cfg.seq_len, cfg.seed, step)
        loss = _loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        if cfg.clip is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


_CLIP_CFG = TrainConfig(layers=2, dim=32, steps=4, world_size=1, eager=True, progress=False,
                        clip=0.1)


def test_train_clip_one_rank_in_process(one_rank_group: str) -> None:
    """train_rank with clip on a 1-rank group against the one-process reference:
    bitwise (on one rank every collective is a copy and the average divides by 1), so
    the check sees clipping under AdamW (which undoes most of a uniform scaling): the
    unclipped reference's losses differ by ~3e-5 from the third step on."""
    out = io.StringIO()
    result = train_rank(_CLIP_CFG, torch.device("cpu"), out=out)
    ref_losses, ref_norms = _reference(_CLIP_CFG, 1)
    assert result.losses == ref_losses, (result.losses, ref_losses)
    assert result.grad_norms == ref_norms, (result.grad_norms, ref_norms)
    assert all(n > _CLIP_CFG.clip for n in ref_norms), ref_norms  # every step clipped
    unclipped, _ = _reference(dataclasses.replace(_CLIP_CFG, clip=None), 1)
    assert unclipped != ref_losses  # the comparison above can fail
    text = out.getvalue()
    assert "; clip grad norm 0.1" in text.splitlines()[0], text
    printed = [s[3] for s in _STEP.findall(text)]
    assert printed == [f"{n:#.4g}" for n in ref_norms], text
    # Without clip: no norms, and the step lines have none.
    out = io.StringIO()
    plain = train_rank(dataclasses.replace(_CLIP_CFG, steps=1, clip=None), torch.device("cpu"),
                       out=out)
    assert plain.grad_norms is None and plain.losses == ref_losses[:1]
    assert [s[3] for s in _STEP.findall(out.getvalue())] == [""], out.getvalue()


@pytest.mark.parametrize("init, ac", [("cpu", "none"), ("meta", "full"), ("cpu", "selective")])
def test_train_init_and_ac_one_rank_in_process(one_rank_group: str, init: str, ac: str) -> None:
    """--init meta (rank 0's weights loaded into shards materialized from meta) and
    --init cpu give the same weights, and activation checkpointing does not change the
    numbers: each run equals the one-process reference bitwise (one rank: every
    collective is a copy; the recompute repeats the same ops)."""
    cfg = dataclasses.replace(_CLIP_CFG, steps=2, clip=None, init=init, ac=ac)
    out = io.StringIO()
    result = train_rank(cfg, torch.device("cpu"), out=out)
    ref_losses, _ = _reference(cfg, 1)
    assert result.losses == ref_losses, (result.losses, ref_losses)
    first = out.getvalue().splitlines()[0]
    assert f"init on {init}" in first and (ac == "none") == ("checkpointing" not in first), first


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_follows_tqdm_convention(one_rank_group: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar is drawn on a terminal, not on a pipe or file, unless forced either way."""
    assert progress_enabled(None, _Terminal()) and not progress_enabled(None, io.StringIO())
    assert progress_enabled(True, io.StringIO()) and not progress_enabled(False, _Terminal())
    cfg = dataclasses.replace(_CLIP_CFG, steps=1, clip=None)
    for progress, stream, drawn in [(None, io.StringIO(), False), (None, _Terminal(), True),
                                    (True, io.StringIO(), True), (False, _Terminal(), False)]:
        monkeypatch.setattr(sys, "stderr", stream)
        train_rank(dataclasses.replace(cfg, progress=progress), torch.device("cpu"),
                   out=io.StringIO())
        assert ("train: 100%" in stream.getvalue()) == drawn, (progress, stream.getvalue())


def test_bf16_mixed_precision_one_rank_in_process(one_rank_group: str) -> None:
    """--mixed-precision bf16 reaches fully_shard: the losses move off the fp32 run's
    (bf16 compute) but stay within bf16's precision of it (abs 5e-2 on a loss of ~5.5,
    3 significant digits), and training still works."""
    cfg = dataclasses.replace(_CLIP_CFG, steps=3, clip=None)
    out = io.StringIO()
    bf16 = train_rank(dataclasses.replace(cfg, mixed_precision="bf16"), torch.device("cpu"),
                      out=out)
    fp32 = train_rank(cfg, torch.device("cpu"), out=io.StringIO())
    assert "; bf16 mixed precision" in out.getvalue().splitlines()[0], out.getvalue()
    assert bf16.losses != fp32.losses
    assert bf16.losses == pytest.approx(fp32.losses, abs=5e-2), (bf16.losses, fp32.losses)
    assert bf16.losses[-1] < bf16.losses[0], bf16.losses


@pytest.mark.parametrize("losses, norms, message", [
    ([1.0, float("nan")], None, "non-finite loss"),
    ([1.0, 1.0], [0.5, float("inf")], "non-finite gradient norm"),
])
def test_non_finite_run_fails(losses: list[float], norms: list[float] | None, message: str,
                              monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    from traceable_hsdp.demo import _train

    monkeypatch.setattr(_train, "launch", lambda cfg: TrainResult(losses, [0.1, 0.1], 2, 1, norms))
    assert cli._launch(_CLIP_CFG, "train") == 1
    assert message in capsys.readouterr().err
    monkeypatch.setattr(_train, "launch", lambda cfg: TrainResult([1.0], [0.1], 2, 1, [0.5]))
    assert cli._launch(_CLIP_CFG, "train") == 0


def test_train_clip_eager_console_script() -> None:
    """``--clip`` on 2 ranks: every step line reports the step's norm before clipping,
    the norm of the whole gradient of the global batch's loss: the one-process
    reference's to the printed precision (4 significant digits; sharded and
    one-process norms differ by ~1e-7 relative). Every step clips, and training works."""
    cfg = dataclasses.replace(_CLIP_CFG, steps=3, world_size=2)
    losses, out = _run_train("--eager", "--steps", "3", "--layers", "2", "--dim", "32",
                             "--clip", "0.1")
    _assert_trains(losses, 3, out)
    assert "eager; batch 4/rank x seq 64; 3 steps; init on meta; clip grad norm 0.1" in out, out
    norms = [float(s[3]) for s in _STEP.findall(out)]
    ref_losses, ref_norms = _reference(cfg, 2)
    assert norms == pytest.approx(ref_norms, rel=1e-3), (norms, ref_norms)
    assert losses == pytest.approx(ref_losses, abs=2e-4), (losses, ref_losses)
    assert all(n > 0.1 for n in norms), norms
