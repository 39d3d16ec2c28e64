"""Compile caches across processes. See [Note: FX graph cache keys across processes]
and [Note: The forward's BackwardState and the FX graph cache key] in
``traceable_hsdp/_cache.py``.

Fast (no compile): the ``DeviceMesh`` reducer's pickle keeps everything but the
cached ``_hash``, round-trips, and gives the same bytes in two fresh processes; with
``TRACEABLE_HSDP_STABLE_MESH_KEY=0`` two fresh processes give different bytes (what
made the compiled-autograd backward miss the FX graph cache), so the check can fail.
Torch's ``FxGraphCache.prepare_key`` bypasses a graph with a ``BackwardState`` input;
with ours installed it gives the key of the same graph with ``None`` there, and a
changed input still changes the key.

Slow (Inductor compiles of a 2-linear model in fresh spawned processes, each with its
own ``TORCHINDUCTOR_CACHE_DIR``): Mega-Cache (``torch.compiler.save_cache_artifacts``
in one process, ``load_cache_artifacts`` in a fresh one whose FX graph cache is empty)
gives FX graph cache hits for both graphs, and no hit for the backward with the
reducer off; and a changed pass configuration (``TRACEABLE_HSDP_PASSES``,
``TRACEABLE_HSDP_BUCKET_CAP_MB``) or world size misses both graphs where an unchanged
compile hits both, a changed mesh shape (1-D against 1x2 HSDP) misses the backward
(the forward, with one replica, is the same graph and hits), and the forward is bypassed
again with ``TRACEABLE_HSDP_FORWARD_CACHE_KEY=0`` (so the forward's hit is the
switch's). What the graph itself shows (the model's shape, a ``fully_shard`` option
that drops the backward's re-gather) is in the key through the graph, torch's part,
and is not compiled here. Counts come from ``torch._dynamo.utils.counters``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from _dist import Ranks, gather, start_ranks
from traceable_hsdp import _cache

ROOT = Path(__file__).resolve().parent.parent

# A fresh process: a 1-rank mesh, hashed as fully_shard's nn.Parameter(DTensor) does,
# pickled by Inductor's cache-key pickler as its opaque-object path does (fast off).
_PICKLE_MESH = r"""
import hashlib, sys, tempfile
import torch, torch.distributed as dist
import traceable_hsdp
from traceable_hsdp._torch_internals import install
from torch._inductor.codecache import FxGraphCachePickler
from torch.distributed.device_mesh import init_device_mesh
with tempfile.TemporaryDirectory() as d:
    dist.init_process_group("gloo", init_method=f"file://{d}/s", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    install()  # as fully_shard does
    hash(mesh)
    pickler = FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    pickler.fast = False
    print(hashlib.sha256(pickler.dumps(mesh)).hexdigest())
    dist.destroy_process_group()
"""


def _mesh_pickle_digests(stable: bool, n: int = 2) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env[_cache.ENV_STABLE_MESH_KEY] = "1" if stable else "0"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, "-c", _PICKLE_MESH], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(n)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        out.append(stdout.strip().splitlines()[-1])
    return out


def test_mesh_pickle_is_the_same_in_every_process() -> None:
    a, b = _mesh_pickle_digests(stable=True)
    assert a == b


def test_mesh_pickle_without_the_reducer_differs_between_processes() -> None:
    # What the FX graph cache key held before the fix: a per-process hash().
    a, b = _mesh_pickle_digests(stable=False)
    assert a != b


def test_import_leaves_copyreg_alone() -> None:
    code = ("import copyreg, traceable_hsdp; from torch.distributed.device_mesh import "
            "DeviceMesh; assert DeviceMesh not in copyreg.dispatch_table")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_reducer_drops_only_the_cached_hash(one_rank: DeviceMesh) -> None:
    from traceable_hsdp._torch_internals import install

    install()
    assert _cache.stable_mesh_key_installed()  # on by default
    mesh = one_rank
    h = hash(mesh)
    assert mesh._hash == h
    state = _cache._reduce_device_mesh(mesh)[2]
    assert "_hash" not in state
    assert set(state) == set(mesh.__getstate__()) - {"_hash"}
    copy = pickle.loads(pickle.dumps(mesh))
    assert copy == mesh and hash(copy) == h
    assert mesh._hash == h  # the original keeps its cache


def test_install_is_idempotent_and_env_switch(one_rank: DeviceMesh) -> None:
    try:
        _cache.uninstall_stable_mesh_key()
        assert not _cache.stable_mesh_key_installed()
        hash(one_rank)  # without the reducer, the cached hash travels with the pickle
        assert pickle.loads(pickle.dumps(one_rank)).__dict__["_hash"] == one_rank._hash
        _cache._install_from_env({_cache.ENV_STABLE_MESH_KEY: "0"})
        assert not _cache.stable_mesh_key_installed()
        _cache._install_from_env({_cache.ENV_STABLE_MESH_KEY: ""})
        assert _cache.stable_mesh_key_installed()
        assert _cache.install_stable_mesh_key() and _cache.stable_mesh_key_installed()
        with pytest.raises(ValueError, match="TRACEABLE_HSDP_STABLE_MESH_KEY='maybe'"):
            _cache._install_from_env({_cache.ENV_STABLE_MESH_KEY: "maybe"})
    finally:
        _cache.install_stable_mesh_key()


def test_forward_key_keys_backward_state_as_none() -> None:
    """Torch's prepare_key bypasses; ours keys the graph as with ``None`` in that
    place, and the key still follows the other inputs."""
    import torch
    from torch._guards import TracingContext, tracing
    from torch._inductor.codecache import FxGraphCache
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental._backward_state import BackwardState
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graph = torch.fx.Graph()  # (x, bw_state) -> (x * 2,), bw_state unused as in ours
    x_node, _ = graph.placeholder("x"), graph.placeholder("bw_state")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x_node, 2)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def key(*inputs: object) -> str | None:
        key_info, info = FxGraphCache.prepare_key(gm, list(inputs), {}, [], False)
        return None if key_info is None else key_info[0]

    assert _cache.install_forward_cache_key()  # as fully_shard does
    with tracing(TracingContext(mode)):
        x, y = mode.from_tensor(torch.randn(4)), mode.from_tensor(torch.randn(8))
        try:
            assert key(x, BackwardState()) == key(x, None) is not None
            assert key(y, BackwardState()) not in (None, key(x, None))
            _cache.uninstall_forward_cache_key()
            assert not _cache.forward_cache_key_installed()
            assert key(x, BackwardState()) is None  # torch's: "Reduce unsupported"
            assert key(x, None) is not None
        finally:
            _cache.install_forward_cache_key()


def test_forward_key_install_is_idempotent_and_env_switch() -> None:
    import torch._inductor.graph  # noqa: F401  (loaded: the env install acts at once)
    from torch._inductor.codecache import FxGraphCache

    assert _cache.install_forward_cache_key() and _cache.install_forward_cache_key()
    torch_fn = _cache._torch_prepare_key
    assert torch_fn is not None and FxGraphCache.prepare_key is not torch_fn
    try:
        _cache.uninstall_forward_cache_key()
        assert FxGraphCache.prepare_key is torch_fn and _cache._torch_prepare_key is None
        _cache.uninstall_forward_cache_key()  # nothing to undo
        assert FxGraphCache.prepare_key is torch_fn
        _cache.install_forward_cache_key_from_env({_cache.ENV_FORWARD_CACHE_KEY: "0"})
        assert not _cache.forward_cache_key_installed()
        _cache.install_forward_cache_key_from_env({})
        assert _cache.forward_cache_key_installed()
        with pytest.raises(ValueError, match="TRACEABLE_HSDP_FORWARD_CACHE_KEY='maybe'"):
            _cache.install_forward_cache_key_from_env({_cache.ENV_FORWARD_CACHE_KEY: "maybe"})
        # Someone else's prepare_key over ours: left alone by both calls.
        theirs = staticmethod(lambda *args, **kwargs: (None, {}))
        FxGraphCache.prepare_key = theirs
        assert not _cache.install_forward_cache_key()
        _cache.uninstall_forward_cache_key()
        assert FxGraphCache.__dict__["prepare_key"] is theirs
        FxGraphCache.prepare_key = staticmethod(_cache._prepare_key_with_backward_state_as_none)
        assert _cache.forward_cache_key_installed()
    finally:
        _cache.install_forward_cache_key()


def test_counts_and_times_subtract() -> None:
    a = _cache.CacheCounts(fx_hit=3, fx_miss=1, aot_bypass=2)
    b = _cache.CacheCounts(fx_hit=1, aot_bypass=2)
    assert a - b == _cache.CacheCounts(fx_hit=2, fx_miss=1)
    assert "FX graph cache: 2 hit, 1 miss, 0 bypass" in (a - b).summary()
    t = _cache.CompileTimes(total=5.0, dynamo=2.0) - _cache.CompileTimes(total=1.0)
    assert t.total == 4.0 and t.dynamo == 2.0


# ----------------------------------------------------------------- compiles


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Inductor cache dir for the spawned ranks; one compile thread."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return tmp_path


def _start(monkeypatch: pytest.MonkeyPatch, fn: Any, world: int, *args: Any,
           spawn: bool = True, **env: str) -> Ranks:
    """Starts ``fn`` on ``world`` fresh spawned ranks with ``env`` set for them only
    (a spawned rank's environment is the one at its start). ``spawn=False`` forks
    them from the preloaded server instead (no ``env`` then): for compiles that must
    miss, or whose entries a spawned process must later hit. Only the process that
    is to hit needs a hash seed of its own; a forked one shares the server's, and a
    key that hung on the seed would hit by coincidence ([Note: Rank processes from a
    preloaded fork server] in _dist.py)."""
    assert spawn or not env, "a forked rank has the server's environment"
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        return start_ranks(fn, world, *args, spawn=spawn)


DIM = 16


def _tiny(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))


def compile_step(rank: int, world: int, mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Shards a 2-linear model (each linear and the root) over a mesh of
    ``mesh_shape`` (default ``(world,)``; two dims: HSDP), compiles it with Inductor
    and compiled autograd, runs one step; returns what the caches did (the
    ``CacheCounts`` fields)."""
    from torch.distributed.device_mesh import init_device_mesh

    import traceable_hsdp
    from traceable_hsdp._cache import CacheCounts

    shape = mesh_shape or (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = _tiny(DIM)
    for m in (model[0], model[2], model):
        traceable_hsdp.fully_shard(m, mesh=mesh)
    before = CacheCounts.now()
    with traceable_hsdp.compiled_autograd():
        torch.compile(model, fullgraph=True)(torch.randn(4, DIM)).sum().backward()
    return dataclasses.asdict(CacheCounts.now() - before)


def mega_cache_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """:func:`compile_step`, then ``torch.compiler.save_cache_artifacts()`` to ``path``."""
    counts = compile_step(rank, world)
    saved = torch.compiler.save_cache_artifacts()
    assert saved is not None, "save_cache_artifacts() returned None: nothing was cached"
    with open(path, "wb") as f:
        f.write(saved[0])
    return counts


def mega_cache_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """``torch.compiler.load_cache_artifacts()`` from ``path``, then :func:`compile_step`."""
    with open(path, "rb") as f:
        info = torch.compiler.load_cache_artifacts(f.read())
    assert info is not None, "load_cache_artifacts() found no artifacts"
    return compile_step(rank, world)


@pytest.mark.slow
def test_mega_cache_second_process_hits(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the reducer and without it (the control: the artifacts then carry a key
    that the next process cannot compute), side by side: each is one rank on one
    core, with its own cache dir."""
    runs = {"reducer": "1", "no_reducer": "0"}
    dirs = {name: fresh_cache / name for name in runs}
    for d in dirs.values():
        d.mkdir()

    def start(name: str, fn: Any) -> Ranks:
        return _start(monkeypatch, fn, 1, str(dirs[name] / "artifacts.bin"),
                      TORCHINDUCTOR_CACHE_DIR=str(dirs[name] / "inductor"),
                      **{_cache.ENV_STABLE_MESH_KEY: runs[name]})

    saved = dict(zip(runs, gather([start(name, mega_cache_save) for name in runs])))
    for name, (counts,) in saved.items():
        assert counts["fx_miss"] == 2 and counts["fx_hit"] == 0, (name, counts)
        # A fresh process, and the FX graph cache emptied: only the artifacts can carry
        # the entry. (The C++ kernel files stay, to save their compile: on the CPU the
        # artifacts do not carry them; see docs/compile.md, Mega-Cache.)
        shutil.rmtree(dirs[name] / "inductor" / "fxgraph")
    loaded = dict(zip(runs, gather([start(name, mega_cache_load) for name in runs])))
    for name, (counts,) in loaded.items():
        assert counts["fx_bypass"] == 0, (name, counts)  # the forward keyed too (_cache.py)
    # Both graphs from the artifacts; without the reducer the backward (whose inputs
    # hold the mesh) misses, the forward (whose inputs do not) still hits.
    assert loaded["reducer"][0]["fx_hit"] == 2 and loaded["reducer"][0]["fx_miss"] == 0, loaded
    no_reducer = loaded["no_reducer"][0]
    assert no_reducer["fx_hit"] == 1 and no_reducer["fx_miss"] == 1, loaded


@pytest.mark.slow
def test_changed_configuration_shape_or_world_misses(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each compile in fresh processes on the same cache dir. (Within one process, a
    # second compile after torch._dynamo.reset() orders the backward's inputs
    # differently and misses anyway, so it could not show a wrong hit.) Compiles that
    # do not depend on each other's entries run side by side: a changed compile can
    # only hit an entry written before it started, so each starts after the compile
    # it must not hit has finished.
    def start(world: int = 1, **env: str) -> Ranks:
        return _start(monkeypatch, compile_step, world, **env)

    def fork(world: int = 1, *args: Any) -> Ranks:
        return _start(monkeypatch, compile_step, world, *args, spawn=False)

    # Two graphs a compile: the forward and the compiled-autograd backward.
    def all_miss(runs: list[dict[str, int]]) -> bool:
        return all(c["fx_hit"] == 0 and c["fx_miss"] == 2 for c in runs)

    def all_hit(runs: list[dict[str, int]]) -> bool:
        return all(c["fx_hit"] == 2 and c["fx_miss"] == 0 for c in runs)

    # Forked where a compile must miss or writes what a spawned one then hits; the
    # compiles that must hit are spawned (their own hash seed: see _start).
    ((first,),) = gather([fork()])
    assert first["fx_miss"] == 2 and first["fx_bypass"] == 0, first
    again, config, world, torch_key = gather([
        start(),  # nothing changed: both graphs hit (the check can see a hit)
        # The pass configuration: overlap off and another bucket cap, one change.
        start(TRACEABLE_HSDP_PASSES="remove_resize_copy,bucket", TRACEABLE_HSDP_BUCKET_CAP_MB="1"),
        fork(2),  # two ranks: the world size changed
        # torch's own key for the forward: bypassed, as before the switch; the backward hits.
        start(**{_cache.ENV_FORWARD_CACHE_KEY: "0"}),
    ])
    assert all_hit(again), again
    assert torch_key == [dict(torch_key[0], fx_hit=1, fx_miss=0, fx_bypass=1)], torch_key
    assert all_miss(config), config
    assert all_miss(world), world
    # Two ranks again: the same (each rank hits its own entry), then the same world
    # with another mesh shape (HSDP 1x2): its backward misses.
    same, mesh = gather([start(2), fork(2, (1, 2))])
    assert all_hit(same), "2 ranks, unchanged"
    # The forward of the 1x2 mesh is the 1-D mesh's graph (the replicate dim has one
    # rank; the all-gathers run on the same group), so it hits; the backward misses.
    assert all(c["fx_hit"] == 1 and c["fx_miss"] == 1 for c in mesh), mesh
