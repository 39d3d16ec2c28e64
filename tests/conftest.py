import os
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))

# [Note: The suite's time is compile time]
# The suite runs one test at a time, and its ranks keep both of CI's 2 cores busy:
# most of its 18-19 minutes (2 cores of an AMD EPYC; 25-28 minutes on 2 cores of a
# 2.1 GHz Intel Xeon, three runs on 2026-11-26) is dynamo, AOTAutograd and Inductor
# compiling in the rank processes; the tests that take under 3 s each add up to 36 s
# (one run's --durations). Of rank 0's time in test_conformance_compiled_aot_eager,
# dynamo's tracing is about half and AOTAutograd a quarter (cProfile). A C++
# kernel takes Inductor about 1.4 s to build on that Xeon with the header it
# precompiles (0.8 s for an empty kernel; 4.4 s without the header; -O0 or -O1
# instead of -O3 saves nothing: parsing dominates), so a test's first kernels cost
# seconds each and later tests find most of them in the shared cache. Running tests
# side by side does not pay: pytest-xdist with 2 workers took 373 s against 332 s
# one at a time for test_hsdp, test_runtime, test_activation_checkpointing,
# test_cli, test_passes_unit and test_module_methods (155 tests, fresh Inductor
# cache each, 2026-11-26). Nor do Inductor's compile workers (2 on 2 cores, the
# default): test_fsdp_tp_compiled (then with an aot_eager compile too), both
# cases (eager, Inductor) of test_reshard_after_forward_int_4_ranks and of
# test_gpipe_two_stages_fsdp_matches_one_process took 147 and 151 s with them, 146
# and 156 s with TORCHINDUCTOR_COMPILE_THREADS=1. What shortens the suite is less
# compiling: fat tests that check several features per compile, aot_eager where
# Inductor is covered elsewhere, one compile where a second would repeat a check
# made on a larger mesh (test_fsdp_tp_compiled), and rank processes that skip the
# imports and Inductor's per-process probes ([Note: Rank processes from a preloaded
# fork server] in _dist.py).


@pytest.fixture(scope="module")
def one_rank() -> Iterator[DeviceMesh]:
    """A 1-rank gloo process group in this process (for the module's tests), and a
    1-D CPU mesh over it."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


@pytest.fixture
def one_rank_group() -> Iterator[str]:
    """A 1-rank gloo process group for one test; yields its group name."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()


@pytest.fixture
def per_unit_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """One bucket per unit in the ranks this test spawns
    (``TRACEABLE_HSDP_BUCKET_CAP_MB=none``, read by each rank's passes at import). For
    tests of per-unit buckets and their overlap on models so small that the default
    4 MiB cap would merge every unit into one bucket; the default is checked in
    test_inductor_features.py and test_passes_unit.py."""
    monkeypatch.setenv("TRACEABLE_HSDP_BUCKET_CAP_MB", "none")
