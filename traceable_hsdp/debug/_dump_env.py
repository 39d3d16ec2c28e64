"""``TRACEABLE_HSDP_DUMP=DIR``: the graph dump of any fully_shard program, switched on
from the environment.

[Note: The dump switch]
With ``TRACEABLE_HSDP_DUMP=DIR`` in the ranks' environment, every process that calls
``fully_shard`` writes the dump of :func:`traceable_hsdp.dump_graphs` to
``DIR/rank<r>``, without a code change. The variable is read at the first
``fully_shard`` call (:func:`start_from_env`), before the first compile in a program
that shards before compiling ([Note: Entering before the first compile] in
``_dump.py``). The dump is closed at process exit (``atexit``, or a
``multiprocessing`` finalizer), only by the process that entered it; :func:`stop`
closes it earlier. It records what ``dump_graphs`` records for a plain
``torch.compile(model)``; the recording backend needs ``dump_graphs`` in code or
``traceable-hsdp dump`` (which refuses to run with the switch on).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ENV_DUMP", "start_from_env", "stop", "active_dir"]

ENV_DUMP = "TRACEABLE_HSDP_DUMP"

# Per process; see [Note: The dump switch].
_checked = False
_stack: contextlib.ExitStack | None = None
_dir: Path | None = None
_rank_: int | None = None
_pid: int | None = None


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raw = os.environ.get("RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV_DUMP} names each rank's directory by RANK, which is {raw!r}, "
                         "not an integer.") from None


def start_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """Reads ``TRACEABLE_HSDP_DUMP`` the first time it is called in this process and,
    when it names a directory, enters ``dump_graphs`` on ``DIR/rank<r>`` until the
    process exits. Later calls return what the first decided.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        This rank's dump directory, or ``None`` when the switch is off.

    Raises:
        RuntimeError: the variable is set but the dump cannot start (a directory
            that holds files no dump wrote); the message names the
            variable and the fix.
    """
    global _checked, _stack, _dir, _rank_, _pid
    if _checked:
        return _dir
    _checked = True
    raw = (os.environ if environ is None else environ).get(ENV_DUMP, "").strip()
    if not raw:
        return None
    rank = _rank()
    out = Path(raw) / f"rank{rank}"
    from ._dump import dump_graphs

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(dump_graphs(out, print_summary=False))
    except (ImportError, TypeError, ValueError) as e:
        raise RuntimeError(
            f"{ENV_DUMP}={raw!r} is set, but the dump cannot start: {e} Unset "
            f"{ENV_DUMP} to run without it."
        ) from e
    _stack, _dir, _rank_, _pid = stack, out, rank, os.getpid()
    atexit.register(stop)
    try:  # ranks started by multiprocessing may leave without running atexit
        from multiprocessing import util

        util.Finalize(None, stop, exitpriority=100)
    except ImportError:
        pass
    return out


def stop() -> None:
    """Leaves the dump the switch entered, which writes its files; does nothing when
    none is active, or in a process that did not enter it."""
    global _stack
    stack = _stack
    if stack is None or os.getpid() != _pid:
        return
    _stack = None
    try:
        stack.close()
    finally:
        print(f"traceable_hsdp: {ENV_DUMP}: wrote rank {_rank_}'s dump to {_dir} "
              "(summary.txt)", file=sys.stderr, flush=True)


def active_dir() -> Path | None:
    """This process's dump directory while the switch's dump is active, else ``None``."""
    return _dir if _stack is not None else None

