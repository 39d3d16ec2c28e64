"""The table of torch internals. See [Note: Torch internals] in
``traceable_hsdp/_torch_internals.py``.

Fast: no processes, no compile. Every entry resolves on the installed torch;
``install()`` then ``undo()`` leaves every target the identical object it was, and
both are idempotent; a target taken away (or changed) raises ``TorchInternalError``
naming it, this torch and the versions checked, before anything is changed; the
callers that fell back before raise now; the exit hook empties only our meshes'
group tables.
"""

from __future__ import annotations

import copyreg
import importlib
import sys
import tempfile
import types
from copy import deepcopy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from traceable_hsdp import _cache, _exit, _optim_check, _torch_internals
from traceable_hsdp._torch_internals import (
    CHECKED_ON,
    INTERNALS,
    TorchInternalError,
    install,
    resolve,
    undo,
)
from _dist import run_child

# Changes that install() makes whatever the environment says (each switch unset).
_ALWAYS_CHANGED = (
    "torch._inductor.config.post_grad_custom_pre_pass",
    "torch._functorch.config.joint_custom_pass",
    "torch._inductor.graph.GraphLowering.decide_layout_opt",
    "torch._dynamo.compiled_autograd.AutogradCompilerInstance.is_placeholder",
    "torch._inductor.codecache.FxGraphCache.prepare_key",
    "copyreg.dispatch_table[torch.distributed.device_mesh.DeviceMesh]",
)


def _targets() -> dict[str, Any]:
    """Each target's object; a class method's function (each read binds it anew)."""
    values = {e.target: resolve(e.target) for e in INTERNALS}
    return {t: v.__func__ if isinstance(v, types.MethodType) else v for t, v in values.items()}


def _hooks() -> tuple[bool, bool]:
    return _exit._installed, _optim_check._handle is not None


@pytest.fixture
def undone(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every change undone (torch's own objects in place), the switches unset; after
    the test, the state ``import traceable_hsdp`` leaves (nothing installed; the next
    ``fully_shard`` installs it all)."""
    for name in (_cache.ENV_STABLE_MESH_KEY, _cache.ENV_FORWARD_CACHE_KEY,
                 "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS"):
        monkeypatch.delenv(name, raising=False)
    undo()
    try:
        yield
    finally:
        undo()


def test_every_entry_resolves_on_this_torch() -> None:
    assert torch.__version__.split("+")[0] in CHECKED_ON, torch.__version__
    assert len({e.target for e in INTERNALS}) == len(INTERNALS)
    for entry in INTERNALS:
        resolve(entry.target)
        assert entry.why and "\n" not in entry.why, entry
        assert entry.checked_on == CHECKED_ON, entry
        assert bool(entry.install) == bool(entry.undo) or entry.block, entry
        assert f"``{entry.target}``" in _torch_internals.__doc__, entry.target
    # Names the runtime imports from the module resolve to torch's objects.
    from traceable_hsdp._torch_internals import RegisterPostBackwardFunction
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    assert RegisterPostBackwardFunction is _fsdp_param_group.RegisterPostBackwardFunction
    with pytest.raises(ImportError):
        from traceable_hsdp._torch_internals import NotAnInternal  # noqa: F401
    with pytest.raises(KeyError, match="not in traceable_hsdp's table"):
        resolve("torch.nn.Linear")


def test_install_then_undo_restores_every_target(undone: None) -> None:
    before = _targets()
    assert _hooks() == (False, False)
    install()
    installed = _targets()
    for target in _ALWAYS_CHANGED:
        assert installed[target] is not before[target], target
    assert _hooks() == (True, True)
    install()  # idempotent
    again = _targets()
    assert all(again[t] is installed[t] for t in installed), [
        t for t in installed if again[t] is not installed[t]]
    undo()
    after = _targets()
    assert all(after[t] is before[t] for t in before), [
        t for t in before if after[t] is not before[t]]
    assert _hooks() == (False, False)
    undo()  # idempotent
    assert all(_targets()[t] is before[t] for t in before)


def _assert_names(err: pytest.ExceptionInfo[TorchInternalError], target: str, what: str) -> None:
    msg = str(err.value)
    assert target in msg and what in msg, msg
    assert f"on torch {torch.__version__}" in msg, msg
    assert "checked on torch 2.13.0, 2.14.1, 2.15.0" in msg, msg
    assert "install a supported torch (2.13, 2.14 or 2.15)" in msg, msg
    assert isinstance(err.value, RuntimeError)


def test_a_missing_target_raises_before_anything_changes(
    undone: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    contract = importlib.import_module("torch.distributed._composable.contract")
    target = "torch.distributed._composable.contract.RegistryItem"
    monkeypatch.delattr(contract, "RegistryItem")
    with pytest.raises(TorchInternalError) as err:
        resolve(target)
    _assert_names(err, target, "is missing")
    assert "(marks a unit as fully_shard's in that registry" in str(err.value)  # what needs it
    patched = [e.target for e in INTERNALS if e.install]
    before = {t: resolve(t) for t in patched}
    with pytest.raises(TorchInternalError, match="RegistryItem is missing"):
        install()
    assert all(resolve(t) is before[t] for t in patched)  # nothing changed
    assert _hooks() == (False, False)

    # A module gone: the module is named.
    target = "torch.fx.experimental._backward_state.BackwardState"
    monkeypatch.setitem(sys.modules, "torch.fx.experimental._backward_state", None)
    monkeypatch.delattr(torch.fx.experimental, "_backward_state", raising=False)
    with pytest.raises(TorchInternalError) as err:
        resolve(target)
    _assert_names(err, target, "is missing (torch.fx.experimental._backward_state)")


def test_a_changed_protocol_raises(undone: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import FSDPModule

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(cls)

    monkeypatch.setattr(FSDPModule, "__new__", new)
    with pytest.raises(TorchInternalError) as err:
        install()
    _assert_names(err, "torch.distributed.fsdp.FSDPModule.__new__",
                  "no longer reads _orig_cls_mro_index")


def test_callers_that_fell_back_raise(undone: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each place that fell back silently before raises now, naming what was found."""
    from torch._dynamo import trace_rules
    from torch._inductor.codecache import FxGraphCache

    from traceable_hsdp import _compiled_call

    # No OptimizeContext in the closure of a compiled call: raised, not skipped.
    with pytest.raises(TorchInternalError, match="OptimizeContext is not in the closure"):
        _compiled_call._optimize_context(lambda: None)
    linear = torch.nn.Linear(2, 2)
    assert _compiled_call._optimize_context(torch.compile(linear._call_impl)) is not None
    # compile(disable=True) compiles nothing: nothing to route.
    linear.compile(disable=True)
    _compiled_call.dispatch_compiled_call(linear)
    assert linear._compiled_call_impl.__self__ is linear
    # Dynamo's skip check missing: raised, not "compile it".
    assert _compiled_call._skipped_by_dynamo(torch.nn.Linear.forward)
    with monkeypatch.context() as m:
        m.delattr(trace_rules, "check")
        with pytest.raises(TorchInternalError, match="trace_rules.check is missing on"):
            _compiled_call._skipped_by_dynamo(torch.nn.Linear.forward)
    # Another prepare_key over ours: fully_shard's install raises, naming the switch.
    install()
    theirs = staticmethod(lambda *args, **kwargs: (None, {}))
    with monkeypatch.context() as m:
        m.setattr(FxGraphCache, "prepare_key", theirs)
        with pytest.raises(TorchInternalError, match="TRACEABLE_HSDP_FORWARD_CACHE_KEY=0"):
            _cache.install_forward_cache_key_from_env({})
        _cache.install_forward_cache_key_from_env({_cache.ENV_FORWARD_CACHE_KEY: "0"})
    # Another reducer for DeviceMesh: refused, naming the switch.
    undo()
    with monkeypatch.context() as m:
        m.setitem(copyreg.dispatch_table, DeviceMesh, lambda mesh: (object, ()))
        with pytest.raises(TorchInternalError, match="TRACEABLE_HSDP_STABLE_MESH_KEY=0"):
            _cache.install_stable_mesh_key()


def test_dynamo_skips_only_inside_the_block() -> None:
    from torch._dynamo import trace_rules

    skipped = list(trace_rules.SKIP_DIRS)
    with _torch_internals.dynamo_skips("pytest"):
        assert len(trace_rules.SKIP_DIRS) > len(skipped)
    assert trace_rules.SKIP_DIRS == skipped


def test_exit_hook_empties_only_our_meshes() -> None:
    """[Note: Exiting with gloo worker threads]: after destroy_process_group, the
    meshes our units use (tracked) and copies of them (as dynamo's DTensor guards make)
    drop their groups; another mesh keeps its own."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            ours = init_device_mesh("cpu", (1,))
            theirs = init_device_mesh("cpu", (1,), mesh_dim_names=("theirs",))
            _exit.track_meshes(ours)
            copy = deepcopy(ours)
            assert copy is not ours and copy._pg_registry
            _exit.release_process_groups()  # the default group exists: nothing
            assert ours._pg_registry and theirs._pg_registry
        finally:
            dist.destroy_process_group()
    _exit.release_process_groups()
    assert not ours._pg_registry and not copy._pg_registry
    assert theirs._pg_registry  # not ours to change
    theirs._pg_registry.clear()


def test_an_eager_job_leaves_inductor_unimported() -> None:
    """[Note: Inductor's internals, checked when Inductor loads]: a fully_shard step
    run eagerly, in a fresh interpreter, imports no Inductor lowering (about 45 MiB a
    rank) and no Inductor code cache (about 2 MiB); importing the lowering then checks
    Inductor's entries and makes their changes, and the import hook is gone."""
    run_child(
        "import sys, tempfile, torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "import traceable_hsdp as th\n"
        "from traceable_hsdp import _torch_internals as ti\n"
        "d = tempfile.mkdtemp()\n"
        "dist.init_process_group('gloo', init_method=f'file://{d}/s', rank=0, world_size=1)\n"
        "m = th.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))\n"
        "m(torch.randn(3, 4)).sum().backward()\n"
        "assert 'torch._inductor.graph' not in sys.modules\n"
        "assert 'torch._inductor.lowering' not in sys.modules\n"
        "assert 'torch._inductor.codecache' not in sys.modules\n"
        "assert ti._INDUCTOR_HOOK in sys.meta_path\n"
        "from torch._inductor.graph import GraphLowering\n"
        "assert type(GraphLowering.__dict__['decide_layout_opt']).__name__ == '_LayoutOptDecision'\n"
        "from traceable_hsdp import _cache\n"
        "assert _cache.forward_cache_key_installed()\n"
        "assert ti._INDUCTOR_HOOK not in sys.meta_path\n"
        "dist.destroy_process_group()\n",
        AssertionError,
    )
