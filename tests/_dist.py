"""Run a function on N gloo ranks in spawned processes and collect what each returns."""

from __future__ import annotations

import faulthandler
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, tmp: str, fn: Callable[..., Any], args: tuple) -> None:
    faulthandler.enable()  # a crashing rank prints its Python stack
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size
    )
    out_path = os.path.join(tmp, f"rank{rank}.pkl")
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # sent back to the parent, which raises
        result = ("error", traceback.format_exc())
    with open(out_path, "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the
    per-rank results, or raises with every failing rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _worker, args=(world_size, tmp, fn, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
        while not ctx.join():
            pass
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (process died)")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(
                value if status == "ok" else f"rank {r}:\n{value}"
            )
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
