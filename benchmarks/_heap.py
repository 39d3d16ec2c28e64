"""The CPU's memory figure for the benchmarks: live heap bytes and their peak, from
``heap_peak.c`` loaded into the ranks with ``LD_PRELOAD``.

[Note: A heap peak on the CPU]
On CUDA the harness reads ``torch.cuda.max_memory_allocated()`` after resetting it at
each block's start, so each variant gets its own peak although every variant lives in
the same process. The CPU has no such counter: the process's peak RSS cannot be reset,
and the profiler's memory timeline (``torch.profiler._memory_profiler``) read the peak
of one 1024x1024 matmul (its two inputs and its output, 12 MiB) as 8 MiB on torch
2.13. ``heap_peak.c`` counts instead the usable size of every live block that
glibc's allocator hands out, in every thread, and keeps the peak; the harness resets the
peak where it resets CUDA's, so ``peak - live at the block's start`` is what the
variant's steps added at most: its activations, gathered parameters, gradients,
collective buffers and temporaries. It is heap bytes, not RSS: pages that glibc keeps
after a free are not counted, and a block counts whole from its allocation, touched or
not. Everything the process allocates counts, Python's arenas and gloo's threads
included, so the figure of a compiled variant's first block (its compile) is not its
steps': the harness leaves that block out. The wrappers cost two atomic operations and a
``malloc_usable_size`` per call, so ``step_time.py`` loads them only with ``--heap``
(``ac_cost.py``, whose table always has a memory column, on every CPU run).

Needs glibc and a C compiler (``$CC``, else ``cc`` or ``gcc``; Inductor's CPU backend
needs one too). :func:`build` compiles the shim once per source into the folder it is
given.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_peak.c")
_MIB = 2**20


def build(folder: str) -> str:
    """Compiles ``heap_peak.c`` into ``folder`` (once per source; the file name holds
    its hash) and returns the library's path. Raises ``RuntimeError`` naming what is
    missing when there is no C compiler or the build fails."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    lib = os.path.join(folder, f"libheap_peak_{digest}.so")
    if os.path.exists(lib):
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("--heap needs a C compiler to build benchmarks/heap_peak.c: "
                           "none found (set CC, or install gcc)")
    os.makedirs(folder, exist_ok=True)
    tmp = f"{lib}.{os.getpid()}.tmp"
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"building {SOURCE} with {cc} failed:\n{r.stderr[-2000:]}")
    os.replace(tmp, lib)
    return lib


@contextlib.contextmanager
def counting_children() -> Iterator[None]:
    """The processes started inside count their heap: the shim is built (once) in the
    temporary directory's ``traceable_hsdp_heap_peak`` folder and preloaded for them.
    The benchmarks spawn their ranks inside this."""
    with preloaded(build(os.path.join(tempfile.gettempdir(), "traceable_hsdp_heap_peak"))):
        yield


@contextlib.contextmanager
def preloaded(lib: str) -> Iterator[None]:
    """``LD_PRELOAD`` holds ``lib`` (first) for the processes started inside; restored
    on exit. This process is not affected: the loader reads the variable at start."""
    old = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = lib + (f":{old}" if old else "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = old


_lib: ctypes.CDLL | None = None


def _loaded() -> ctypes.CDLL | None:
    """The preloaded shim of this process, or ``None`` when it was not preloaded."""
    global _lib
    if _lib is None:
        for path in os.environ.get("LD_PRELOAD", "").split(":"):
            if os.path.basename(path).startswith("libheap_peak_"):
                lib = ctypes.CDLL(path)  # the already loaded copy: the same counters
                lib.shim_live_bytes.restype = ctypes.c_long
                lib.shim_peak_bytes.restype = ctypes.c_long
                _lib = lib
                break
    return _lib


def active() -> bool:
    """Whether this process counts its heap (it was started with the shim preloaded)."""
    return _loaded() is not None


def reset_peak() -> None:
    """Starts a new peak at the current live bytes."""
    lib = _loaded()
    assert lib is not None, "the heap shim is not preloaded in this process"
    lib.shim_reset_peak()


def live_mib() -> float:
    lib = _loaded()
    assert lib is not None, "the heap shim is not preloaded in this process"
    return lib.shim_live_bytes() / _MIB


def peak_mib() -> float:
    """The most live heap since the last :func:`reset_peak`, in MiB."""
    lib = _loaded()
    assert lib is not None, "the heap shim is not preloaded in this process"
    return lib.shim_peak_bytes() / _MIB
