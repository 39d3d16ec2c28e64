"""A clean process exit on gloo: the process groups of dropped models are freed before
the interpreter shuts down.

[Note: Exiting with gloo worker threads]
A gloo worker thread releases a finished collective's tensors after marking it
complete, which takes the GIL. If that release is still pending while the interpreter
finalizes, CPython ends the thread and its unwind meets a ``noexcept`` C++ destructor:
the process aborts (exit status -6) after all the script's work is done.
``destroy_process_group()`` does not join the workers; the group's destructor does,
and the group lives as long as a ``DeviceMesh`` refers to it (DTensor's
sharding-propagation caches and a compiled step's guards hold meshes), so left alone
it dies only during finalization, where the race is.

:func:`install_exit_hook` (``fully_shard`` calls it) registers
:func:`release_process_groups` with ``atexit``. Once every group is destroyed, it clears
torch's sharding-propagation caches, empties the group tables of the meshes our units
use (given to :func:`track_meshes`, weakly, with their root meshes and every copy, such
as those dynamo's DTensor guards deep-copy) and collects garbage, so the groups die and
their workers are joined while the interpreter is whole. Other meshes are not ours to
change. Checked by ``tests/test_reliability.py`` (thread count at exit, with a control
run without the hook). Not covered: a script that never calls
``destroy_process_group()``, and importing ``torch._dynamo`` after
``init_process_group`` (import at the top of the script).
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import TYPE_CHECKING

from ._torch_internals import resolve

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["install_exit_hook", "uninstall_exit_hook", "release_process_groups", "track_meshes"]

_installed = False
_meshes: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()  # our units' meshes


def track_meshes(*meshes: DeviceMesh) -> None:
    """Notes meshes our units use, for :func:`release_process_groups`, for as long as
    they live. See [Note: Exiting with gloo worker threads]."""
    _meshes.update(meshes)


def release_process_groups() -> None:
    """Once every process group is destroyed, drops the references that keep them
    alive and collects garbage, so their gloo workers are joined now. Does nothing
    while the default group exists. See [Note: Exiting with gloo worker threads]."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    resolve("torch.distributed.tensor.debug._clear_sharding_prop_cache")()
    mesh_type = resolve("torch.distributed.device_mesh.DeviceMesh")  # reads _pg_registry
    root_of = resolve("torch.distributed.device_mesh.DeviceMesh._get_root_mesh")
    ours = [m for mesh in list(_meshes) for m in (mesh, root_of(mesh))]
    if ours:
        for obj in gc.get_objects():  # the copies too: only the collector reaches them
            # The MRO test, not isinstance: DeviceMesh's metaclass inspects the object.
            if mesh_type in type(obj).__mro__ and any(obj == m for m in ours):
                obj._pg_registry.clear()
    gc.collect()


def install_exit_hook() -> None:
    """Registers :func:`release_process_groups` to run at interpreter exit. Idempotent.
    See [Note: Exiting with gloo worker threads]."""
    global _installed
    if not _installed:
        atexit.register(release_process_groups)
        _installed = True


def uninstall_exit_hook() -> None:
    """Undoes :func:`install_exit_hook`. Does nothing if it is not installed."""
    global _installed
    if _installed:
        atexit.unregister(release_process_groups)
        _installed = False
