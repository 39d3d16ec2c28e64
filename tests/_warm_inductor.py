"""Imported by the fork server that rank processes fork from (``_PRELOAD`` in
_dist.py): Inductor's once-per-process probes, answered once there, so that each
forked rank inherits the answers. See [Note: Rank processes from a preloaded fork
server] in _dist.py."""

from torch._inductor import codecache, cpu_vec_isa


def _warm() -> None:
    # Which vector instruction sets build and load here: a C++ probe built per set
    # and a child interpreter per set that loads it (functools caches).
    bool(cpu_vec_isa.pick_vec_isa())
    # The hash of torch's own sources that every cache key holds (cached).
    codecache.torch_key()


try:
    _warm()
except Exception:  # noqa: BLE001 - a failed probe here must not stop the server;
    pass  # each rank then asks again itself, and sees the error where it matters.
