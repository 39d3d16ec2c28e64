"""A clean process exit on gloo: the process groups of dropped models are freed before
the interpreter shuts down.

[Note: Exiting with gloo worker threads]
A gloo process group runs each collective on a worker thread of its own, and the
worker drops its reference to the collective (and to the collective's tensors) just
after marking it complete, so ``work.wait()`` in the caller may return first. On
torch 2.13 a tensor handed to Python holds a strong reference to its Python object
while C++ also holds it, so the worker's release decrefs a Python object and takes
the GIL. When that release is still pending as the interpreter finalizes (the
script's last line was a collective, and the machine is busy), the worker asks for
the GIL of a finalizing interpreter, CPython ends the thread with ``pthread_exit``,
its forced unwind meets the C++ ``noexcept`` destructor of the collective, and the
process aborts: ``terminate called without an active exception``, exit status -6,
after all of the script's work is done (a core dump of ``examples/dcp_resume.py
--eager`` shows the worker in ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork``
-> ``take_gil`` -> ``PyThread_exit_thread``, the main thread in ``Py_FinalizeEx``).

``destroy_process_group()`` does not stop the workers: it forgets the group, and
the workers are joined by the group's destructor (which releases the GIL first).
The group lives on as long as a ``DeviceMesh`` refers to it (its ``_pg_registry``),
and meshes outlive the model: torch's DTensor sharding-propagation caches are keyed
by the specs of the ops the model ran, and a compiled step's caches (dynamo's
guards, AOTAutograd's subclass metadata) hold the meshes too; the same with torch's
``fully_shard``. So the group was destroyed, and its workers joined, only during
finalization, where the race is.

:func:`install_exit_hook` (``fully_shard`` calls it) registers
:func:`release_process_groups` with ``atexit``, which runs while the interpreter is
still whole, after the script has returned. Once every group is destroyed (the
default group is gone; before that it does nothing), it clears torch's
sharding-propagation caches, empties the group tables of the meshes our units use
(the groups in them are destroyed: nothing may use them again) and collects
garbage, so the groups are destroyed there, while their workers can still take the
GIL to finish their releases, and are joined. Those meshes are the ones
:func:`track_meshes` is given where a unit or a post-forward mesh is built, held
weakly, each with its root mesh (whose table holds a submesh's groups), and every
copy of them: a compiled step's DTensor guards (dynamo's ``DTENSOR_SPEC_MATCH``)
deep-copy each spec with its mesh, the copy looks its groups up again by name, and
the guards live in dynamo's C++ cache entries, which only the garbage collector's
list of objects reaches (without the copies, a compiled step kept its 3 gloo threads
to the end). Other meshes are not ours to change. Checked by
``tests/test_reliability.py`` (thread count at exit, with a control run without the
hook), eager and torch's AdamW; with a compiled step (aot_eager) the group's
references fell from 50 to none. Not covered: a script that never calls
``destroy_process_group()`` keeps its groups and the race (torch issue 190489);
and importing ``torch._dynamo`` (which ``from traceable_hsdp import fully_shard``
does) *after* ``init_process_group`` leaves 10 references to the default group
that no Python object shows (measured with ``sys.getrefcount``), so import at the
top of the script, as usual.
:func:`uninstall_exit_hook` undoes the registration.
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
    """Once every process group is destroyed (``destroy_process_group()``), drops the
    references that keep them alive: torch's DTensor sharding-propagation caches, and
    the group tables of the meshes our units use, of their root meshes and of copies
    of either. Then
    collects garbage, so the groups are destroyed now and their gloo worker threads
    joined. Does nothing while the default group exists. See [Note: Exiting with gloo
    worker threads]."""
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
