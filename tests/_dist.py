"""Run a function on N gloo ranks in spawned processes and collect what each returns;
gather a ``DTensor`` whole for a comparison (:func:`full_tensor`)."""

from __future__ import annotations

import faulthandler
import multiprocessing.forkserver
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode


# [Note: Rank processes from a preloaded fork server]
# A spawned rank is a fresh interpreter that imports torch, dynamo, Inductor, the
# runtime, pytest and the shared test helpers before its first line of test code: 3-5
# s of CPU per rank, paid by every rank of every multi-process test. Ranks are instead
# forked from multiprocessing's fork server, which imports those modules once
# (``set_forkserver_preload``) and runs nothing else, so each rank starts in the state
# right after the imports, as a spawned one would, without paying for them. The rank
# function lives in its test file, beside the assertions on its result; a rank
# unpickles it by module name and so imports that test module itself (little on
# top of the preload, which holds the heavy imports). Some modules read environment
# variables at import (``TRACEABLE_HSDP_BUCKET_CAP_MB`` in the passes, Inductor's
# config), and a forked rank has the server's environment, not the test's. So the server is restarted whenever the environment differs from the one it
# started with (tests that set variables come in runs: one restart per run). Pytest's
# PYTEST_CURRENT_TEST, which names the running test, is left out of that comparison:
# counted, it would restart the server, and pay the preload (seconds), for every test.
# Forked ranks also share what a fresh interpreter draws anew: the string hash seed and
# the memory layout (object ids). Tests of keys that must agree between unrelated
# processes (the compile-cache tests) would pass by that coincidence, so they ask for
# spawned ranks (``run_ranks(..., spawn=True)``). So do the fat Inductor tests
# (test_inductor_features.py, the compiled step of test_passes_e2e.py): ranks of a real
# job draw different hash seeds, and a pass or a runtime loop whose order hangs on one
# (a set of names) would issue mismatched collectives across ranks; spawned ranks keep
# that chance to show it. Their time is compile time, so spawning costs them little.
# (``_stop`` is the fork server's private method; Python has no public restart.)
# The server also answers Inductor's once-per-process questions before it forks
# (_warm_inductor.py): which vector instruction sets build and load on this machine
# (a C++ build and a child interpreter per set: seconds in every rank, at its first
# Inductor compile) and the hash of torch's sources that every cache key holds. Those answers are functools caches, so
# a forked rank inherits them. A spawned one is told the first answer through the
# environment when the session's probe passed ([Note: Inductor's vector-ISA probe,
# answered once per session] in conftest.py), and computes the hash. For the server
# to find _workers and _warm_inductor it is started with this directory on
# PYTHONPATH (see _ensure_server); its ranks inherit that variable, which only adds
# this directory to the path of the processes they start.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "traceable_hsdp._fully_shard",
    "pytest",
    "_workers",
    "_warm_inductor",
]
_server_env: dict[str, str] | None = None
_HERE = os.path.dirname(os.path.abspath(__file__))
# Variables that change with every test and mean nothing to a rank.
_PER_TEST_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def _start_method(spawn: bool) -> str:
    """``forkserver``, with a server started in the current environment, unless
    ``spawn``."""
    global _server_env
    if spawn:
        return "spawn"
    env = {k: v for k, v in os.environ.items() if k not in _PER_TEST_ENV}
    if _server_env is None:
        multiprocessing.forkserver.set_forkserver_preload(_PRELOAD)
    elif env != _server_env:
        multiprocessing.forkserver._forkserver._stop()  # the next start runs a new one
    _server_env = env
    _ensure_server()
    return "forkserver"


def _ensure_server() -> None:
    """Starts the fork server unless it runs, with this directory on its path: the
    server of Python 3.11 ignores the parent's ``sys.path`` for its preload (it is
    passed, never applied), so the modules of ``_PRELOAD`` that live here would be
    skipped without a word (an ``ImportError`` is ignored). Through ``PYTHONPATH``,
    set for the server's start only, it finds them. The ranks it forks get the
    parent's ``sys.path`` as before."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, old) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


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


class Ranks:
    """Rank processes started by :func:`start_ranks`; :meth:`results` waits for them."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple, spawn: bool) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self._world_size = world_size
        # The environment is read here: a spawned or forked rank starts with the
        # environment of this moment, whatever the caller sets afterwards.
        self._ctx = mp.start_processes(
            _worker, args=(world_size, self._tmp.name, fn, args), nprocs=world_size,
            join=False, start_method=_start_method(spawn),
        )

    def results(self) -> list[Any]:
        """The per-rank results, once every rank has exited; raises with every
        failing rank's traceback."""
        try:
            while not self._ctx.join():
                pass
            results, errors = [], []
            for r in range(self._world_size):
                path = os.path.join(self._tmp.name, f"rank{r}.pkl")
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
        finally:
            self._tmp.cleanup()


def start_ranks(fn: Callable[..., Any], world_size: int, *args: Any, spawn: bool = False) -> Ranks:
    """Starts ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks of their own
    (a process group per call) and returns at once, so that independent jobs can run
    side by side: a 1-rank job leaves a core of the 2 idle. Jobs that run side by side
    in different environments must be ``spawn``ed (a changed environment restarts
    the fork server). See :func:`run_ranks` and :func:`gather`."""
    return Ranks(fn, world_size, args, spawn)


def gather(jobs: list[Ranks]) -> list[list[Any]]:
    """Every job's results, in order, once all have exited; raises the first job's
    error only after the others finished (none is left running)."""
    out: list[list[Any]] = []
    error: BaseException | None = None
    for job in jobs:
        try:
            out.append(job.results())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        raise error
    return out


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, spawn: bool = False) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the
    per-rank results, or raises with every failing rank's traceback. The ranks fork
    from a preloaded server, or with ``spawn`` start as fresh interpreters; see
    [Note: Rank processes from a preloaded fork server]."""
    return start_ranks(fn, world_size, *args, spawn=spawn).results()


def run_child(code: str, expected: type[Exception]) -> None:
    """Runs ``code`` in a fresh interpreter (for a torch failure that may leave its
    compile context entered in the process that hits it); raises ``expected`` with
    the child's last line when that is how it failed, ``RuntimeError`` with its
    stderr's end for any other failure, and nothing when it succeeds (a strict xfail
    then reports torch fixed)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1]
        if last.startswith(expected.__name__):
            raise expected(last)
        raise RuntimeError(proc.stderr[-2000:])


# [Note: The tests gather without gloo's allocating all-gather]
# torch 2.13's gloo crashes, rarely, in the allocating functional all-gather
# (``_c10d_functional.all_gather_into_tensor``, which reaches gloo's
# ``allgather_into_tensor_coalesced``) even with nothing else in flight and waited
# for at once: a rank dies with SIGSEGV about once in a million bare calls (2 gloo
# ranks, ``benchmarks/gloo_in_flight.py --pattern ag``; no traceable_hsdp code runs
# there). ``DTensor.full_tensor()`` issues that op, and the suite calls it thousands
# of times a run to compare parameters and gradients. The tests therefore gather through :func:`full_tensor` below:
# torch's own ``full_tensor()``, with that one op issued as
# ``all_gather_into_tensor_out`` into a buffer allocated before it (gloo's
# ``_allgather_base``, the op the runtime and the passes use on gloo; the same
# bytes). Only the tests' own comparisons go through it; the code under test, and
# torch's ``fully_shard`` beside it, run as users run them.
class _GatherIntoBuffers(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        c10d = torch.ops._c10d_functional
        if func is c10d.all_gather_into_tensor.default:
            shard, world, group = args
            out = shard.new_empty((world * shard.size(0), *shard.shape[1:]))
            return c10d.all_gather_into_tensor_out(shard, world, group, out=out)
        return func(*args, **kwargs)


def full_tensor(t: Any) -> Any:
    """``t.full_tensor()`` for a ``DTensor`` (``t`` itself otherwise), gathered without
    gloo's allocating all-gather: see [Note: The tests gather without gloo's
    allocating all-gather]."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with _GatherIntoBuffers():
        return t.full_tensor()
