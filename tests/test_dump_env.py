"""``TRACEABLE_HSDP_DUMP=DIR``: a program with no dump code writes one dump per rank
when the variable is set before its ranks start (see [Note: The dump switch] in
``traceable_hsdp/debug/_dump_env.py``).

The 2-rank run compiles with aot_eager: what the switch adds is the entry and exit
around the program's own compiles, and aot_eager shows that in depyf's files (its
forward and compiled-autograd graphs with their collectives); Inductor's post-grad
recording is dump_graphs' own and tests/test_dump.py covers it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import traceable_hsdp
from _dist import run_ranks
from traceable_hsdp import fully_shard
from traceable_hsdp.debug import _dump_env
from traceable_hsdp.demo import cli

pytest.importorskip("depyf")


@pytest.fixture
def fresh_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch as in a new process (it reads the environment once per process)."""
    monkeypatch.setattr(_dump_env, "_checked", False)
    monkeypatch.setattr(_dump_env, "_stack", None)
    monkeypatch.setattr(_dump_env, "_dir", None)


def test_switch_off_and_clear_errors(fresh_switch: None, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert _dump_env.start_from_env({}) is None
    assert _dump_env.start_from_env({_dump_env.ENV_DUMP: str(tmp_path)}) is None  # read once
    assert _dump_env.active_dir() is None
    # A directory holding files of a dump's names that no dump wrote: refused, naming
    # the variable.
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "summary.txt").write_text("mine")
    monkeypatch.setattr(_dump_env, "_checked", False)
    with pytest.raises(RuntimeError, match=r"TRACEABLE_HSDP_DUMP='.*' is set, but the dump "
                                           r"cannot start: .*summary.txt"):
        _dump_env.start_from_env({_dump_env.ENV_DUMP: str(tmp_path)})
    assert (tmp_path / "rank0" / "summary.txt").read_text() == "mine"
    assert _dump_env.active_dir() is None


def test_dump_command_refuses_the_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(_dump_env.ENV_DUMP, str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli.main(["dump", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "TRACEABLE_HSDP_DUMP is set: traceable-hsdp dump writes its own" in capsys.readouterr().err


def compiled_train_worker(rank: int, world: int, steps: int) -> list[float]:
    """A program with no dump code: two blocks and a root, compiled with aot_eager,
    ``steps`` training steps; returns the losses. The dump is written when the rank's
    process exits."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()),
        nn.Sequential(nn.Linear(16, 8), nn.ReLU()),
    )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    traceable_hsdp.enable_compiled_autograd(backend="aot_eager")
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    traceable_hsdp.disable_compiled_autograd()
    return losses


@pytest.mark.slow
def test_env_switch_dumps_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 gloo ranks, aot_eager, the variable set in the parent's environment as a user
    would before torchrun: each rank writes DIR/rank<r> at exit, holding its forward
    graph with the all-gathers and its compiled-autograd backward with the
    reduce-scatters (depyf's files), and no graph break."""
    out = tmp_path / "dump"
    monkeypatch.setenv(_dump_env.ENV_DUMP, str(out))
    losses = run_ranks(compiled_train_worker, 2, 2)
    assert all(len(l) == 2 for l in losses), losses
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    for rank in (0, 1):
        d = out / f"rank{rank}"
        for name in ("summary.txt", "collectives.json", "breaks_and_recompiles.json"):
            assert (d / name).is_file(), (d, sorted(p.name for p in d.iterdir()))
        json.loads((d / "collectives.json").read_text())
        assert "graph breaks: none" in (d / "summary.txt").read_text()
        breaks = json.loads((d / "breaks_and_recompiles.json").read_text())
        assert not breaks["graph_breaks"], breaks
        depyf = d / "depyf"
        # AOTAutograd's graphs of both compiles; the compiled-autograd backward is
        # traced as a forward graph too, so both kinds hold "Forward_graph".
        graphs = {p.name: p.read_text() for p in depyf.glob("*Forward_graph*.py")}
        fwd = [n for n, text in graphs.items()
               if "all_gather_into_tensor" in text and "reduce_scatter_tensor" not in text]
        bwd = [n for n, text in graphs.items() if "reduce_scatter_tensor" in text]
        assert len(fwd) == 1 and len(bwd) == 1, sorted(p.name for p in depyf.iterdir())
    # The ranks' dumps compare (aot_eager records no graph tables: nothing to differ).
    assert cli.main(["compare", str(out)]) == 0


def test_compare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``traceable-hsdp compare DIR`` finds DIR/rank<r> and reports whether the ranks'
    collectives agree (exit 0) or where they first differ (exit 1)."""
    def table(shape: list[int]) -> str:
        row = dict(op="all_gather_into_tensor", reduce_op=None, group_size=2, dtype="float32",
                   in_shape=shape, out_shape=[2 * shape[0]], unit="Block", params=["w"])
        return json.dumps(dict(graphs=[dict(name="00_fwd", stage="after_passes",
                                            collectives=[row])]))

    for r, shape in enumerate([[4], [4], [8]]):
        (tmp_path / f"rank{r}").mkdir()
        (tmp_path / f"rank{r}" / "collectives.json").write_text(table(shape))
    assert cli.main(["compare", str(tmp_path)]) == 1
    assert "ranks DISAGREE in graph 00_fwd (after passes)" in capsys.readouterr().out
    (tmp_path / "rank2" / "collectives.json").write_text(table([4]))
    assert cli.main(["compare", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("ranks agree: all 3 dumps")
    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", str(tmp_path / "rank0")])
    assert exc.value.code == 2
    assert "holds 0 rank<r> dump directories" in capsys.readouterr().err
