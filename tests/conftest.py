import os
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))


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
