import os
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))

# [Note: The suite's time is compile time]
# The suite runs one test at a time, and its ranks keep both of CI's 2 cores busy; most
# of its time is dynamo, AOTAutograd and Inductor compiling in the rank processes (the
# tests under 3 s add up to well under a minute). Running tests side by side
# (pytest-xdist) or more Inductor compile workers does not shorten it on 2 cores. What
# does is compiling less:
# - fat tests that check several features per compile;
# - aot_eager where an Inductor case of the same feature exists elsewhere;
# - one compile where a second would repeat a check made elsewhere (the compiled parity
#   checks of test_runtime.py and test_hsdp.py ride test_clip.py's compiled runs);
# - the smallest model that still checks the feature (a one-block Llama, one Mixtral
#   decoder layer, ``--layers 1`` for the example scripts), except where a second block
#   is what the test checks (reshard_after_forward int, two checkpointed units in a row);
# - no compile whose outcome the graph alone decides (test_compile_cache.py);
# - rank processes that skip the imports and Inductor's per-process probes ([Note: Rank
#   processes from a preloaded fork server] in _dist.py, and the Note below).


# [Note: Inductor's vector-ISA probe, answered once per session]
# Before its first C++ kernel, every process that runs Inductor asks which vector
# instruction sets this machine can use: for each set the CPU lists, it builds a
# probe and starts a child interpreter that imports torch and loads it (seconds on a
# 2-core machine). Forked ranks inherit the fork server's
# answer (_warm_inductor.py); spawned ranks and torchrun's processes would each ask
# again. This session asks once, here, and when every set the CPU lists built and
# loaded, it says so to every process it starts through Inductor's own switch,
# TORCHINDUCTOR_VEC_ISA_OK=1 (trust the CPU's list). Where any set failed, or the
# variable is already set, or the machine is not x86, nothing is set and each
# process probes for itself. This process keeps its own probed answer (its
# Inductor configuration was read before the variable was set). Every child sees
# the same value, so the cache-key tests compare like with like.
def _share_vec_isa_probe() -> None:
    import platform

    if os.environ.get("TORCHINDUCTOR_VEC_ISA_OK") is not None:
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:
        return
    flags = cpu_vec_isa.x86_isa_checker()
    listed = [
        isa for isa in cpu_vec_isa.supported_vec_isa_list
        if all(flag in flags for flag in str(isa).split())
    ]
    if listed and cpu_vec_isa.valid_vec_isa_list() == listed:  # each built and loaded
        os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "1"


_share_vec_isa_probe()


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


# Tests that fail on torch 2.15 and pass on 2.13 and 2.14: each marked with why,
# strict, so that a fix (or a torch that fixes it) turns the mark into a failure and
# the mark is removed. docs/api.md lists them as known limits on 2.15.
ON_TORCH_2_15: dict[str, str] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < "2.15":
        return
    for item in items:
        why = ON_TORCH_2_15.get(item.originalname)
        if why is not None:
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))
