"""Every torch internal traceable_hsdp relies on: the private names it reads and the
process-wide changes it makes to torch, each checked on the torch versions it lists.

[Note: Torch internals]
traceable_hsdp builds on FSDP2 protocols and compile machinery torch does not publish.
Each such internal is one :class:`TorchInternal` of :data:`INTERNALS`: its target, why
it is needed, for a change the functions that install and undo it, and the torch
versions it was checked on; the table is rendered at the end of this docstring. Code
reaches a name of the table only through this module (or :func:`resolve`, for names
that must stay lazy) and changes torch only through the functions the table names.
torch's config modules and documented pass hook are read directly; what we write in
them is in the table.

A target that is missing, or whose code no longer reads what ours relies on (``uses``),
raises :class:`TorchInternalError` naming it, the installed torch and the versions
checked; nothing falls back. :func:`install` (``fully_shard`` calls it) checks every
entry, then makes every change not turned off by its environment switch; :func:`undo`
undoes them all. Both are idempotent. The exit hook and the optimizer check are
installed and undone here too. ``import traceable_hsdp`` changes nothing
(``tests/test_compile_cache.py`` checks ``copyreg`` is left alone).

``tests/test_torch_internals.py`` checks that every entry resolves, that
:func:`install` then :func:`undo` leaves every target the identical object it was,
and that a missing target raises.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INTERNALS", "TorchInternal", "TorchInternalError", "install", "resolve", "undo"]

CHECKED_ON = ("2.13.0", "2.14.1", "2.15.0")
"""The torch versions on which every entry was checked."""


class TorchInternalError(RuntimeError):
    """A torch internal that traceable_hsdp relies on is missing or changed on the
    installed torch. See [Note: Torch internals]."""


@dataclass(frozen=True)
class TorchInternal:
    """One entry of :data:`INTERNALS`. See [Note: Torch internals]."""

    target: str
    """Dotted path; ``registry[key]`` names an entry of a registry."""
    why: str
    """What needs it, in one line."""
    install: str = ""
    """A change: the function (``module.function``) :func:`install` calls to make it,
    or for a ``block`` the context manager that makes it."""
    undo: str = ""
    """A change: the function :func:`undo` calls to undo it."""
    uses: tuple[str, ...] = ()
    """Names the target's code (a class's ``__init__``, or a function nested in the
    target) must read or write: the behaviour ours relies on."""
    block: bool = False
    """Changed only inside a ``with`` block of ours, and undone at its exit."""
    checked_on: tuple[str, ...] = CHECKED_ON


_E = TorchInternal
_PASSES = ("traceable_hsdp.passes.install", "traceable_hsdp.passes.uninstall")

INTERNALS: tuple[TorchInternal, ...] = (
    # fully_shard and FSDPModule: torch's FSDP2 protocols (_module.py, _torch_view.py, _state.py).
    _E("torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction",
       "each unit's post-backward runs in this autograd function, as in torch's fully_shard"),
    _E("torch.distributed.ProcessGroup._get_backend",
       "set_allocate_memory_from_process_group_for_comm allocates from the group's backend"),
    _E("torch.distributed.fsdp.FSDPModule.__new__",
       "it finds a unit's original class at the MRO index our FSDPModule subclass sets",
       uses=("_orig_cls_mro_index",)),
    _E("torch.distributed.fsdp._fully_shard._fully_shard.fully_shard.__wrapped__",
       "the key under which torch's fully_shard.state(module) finds a unit's state"),
    _E("torch.distributed._composable.contract.STATE_KEY",
       "torch's fully_shard.state(module) finds a unit's state there (pipelining calls it)"),
    _E("torch.distributed._composable.contract.REGISTRY_KEY",
       "our units are in torch's registry of composable APIs, which replicate() reads"),
    _E("torch.distributed._composable.contract.RegistryItem",
       "marks a unit as fully_shard's in that registry, which replicate() reads"),
    _E("torch.distributed.tensor._dtensor_spec.DTensorSpec",
       "the spec a tensor-parallel parameter keeps (FSDPParam.tp_spec)"),
    # A unit compiled in place (_compiled_call.py).
    _E("torch._dynamo.eval_frame.OptimizeContext",
       "a unit compiled in place compiles its forward with nn.Module.compile's context"),
    _E("torch._dynamo.trace_rules.check",
       "a unit whose forward dynamo skips (torch's own modules) runs it eagerly"),
    # Compiled autograd and dynamo's side-effect messages (_compile.py).
    _E("torch._dynamo.compiled_autograd",
       "the runtime asks whether compiled autograd is on and capturing"),
    _E("torch._dynamo.compiled_autograd.compiled_autograd_enabled",
       "without compiled autograd a compiled unit runs its hooks eagerly"),
    _E("torch._dynamo.compiled_autograd.in_compiled_autograd_region",
       "a hook traced into a compiled-autograd backward takes the traced path"),
    _E("torch._guards.TracingContext",
       "which unit's forward dynamo is tracing (its frames), for the collectives' labels"),
    _E("torch.utils._python_dispatch._get_current_dispatch_mode_stack",
       "eager collectives issue torch's c10d ops under CommDebugMode, which counts them"),
    _E("torch.utils._pytree.tree_flatten", "a unit's forward inputs and outputs, flattened"),
    _E("torch.utils._pytree.tree_map", "casts a unit's forward inputs and outputs"),
    _E("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper",
       "a checkpoint put around a unit's call is recognised (torch's checkpoint_wrapper)"),
    _E("torch.distributed.tensor.placement_types._StridedShard",
       "FSDP x TP: the sharded parameter's placement on the dp x tp mesh, as torch's"),
    _E("torch.distributed.device_mesh.DeviceMesh._concatenate",
       "FSDP x TP and dp_mesh_dims: the (dp, tp) and HSDP meshes, built as torch's"),
    _E("torch.distributed.device_mesh.DeviceMesh._flatten",
       "dp_mesh_dims naming several dims: flattened into one, as torch's fully_shard"),
    _E("torch._dynamo.compiled_autograd._enable",
       "enable_compiled_autograd and compiled_autograd() turn compiled autograd on"),
    _E("torch._dynamo.compiled_autograd.AutogradCompilerInstance.is_placeholder",
       "wrapped: compiled autograd leaves a hook on no gradient where it is, not failing",
       "traceable_hsdp._compile.tolerate_outputs_without_gradient",
       "traceable_hsdp._compile.restore_compiled_autograd_ordering"),
    _E("torch._dynamo.config.side_effect_replay_policy",
       "set to 'silent' while nothing reads dynamo's side-effect messages",
       "traceable_hsdp._compile.quiet_side_effect_messages_from_env",
       "traceable_hsdp._compile.restore_side_effect_messages"),
    _E("torch._dynamo.side_effects.side_effects_log",
       "whether TORCH_LOGS=side_effects reads those messages"),
    _E("torch._logging._internal.trace_log",
       "whether the structured trace (TORCH_TRACE) reads them"),
    _E("torch._logging._internal.LazyTraceHandler",
       "torch's default trace handler, which writes nothing without a directory",
       uses=("root_dir",)),
    # The FX graph cache keys across processes, and what the caches did (_cache.py).
    _E("copyreg.dispatch_table[torch.distributed.device_mesh.DeviceMesh]",
       "a DeviceMesh pickled into the FX graph cache key leaves out its per-process hash",
       "traceable_hsdp._cache._install_from_env",
       "traceable_hsdp._cache.uninstall_stable_mesh_key"),
    _E("torch.distributed.device_mesh.DeviceMesh.__hash__",
       "DeviceMesh caches its per-process hash in _hash, which the reducer leaves out",
       uses=("_hash",)),
    _E("torch._inductor.codecache.FxGraphCachePickler.__init__",
       "the cache-key pickler starts from copyreg's table, which holds the reducer",
       uses=("copyreg", "dispatch_table")),
    _E("torch._inductor.codecache.FxGraphCache.prepare_key",
       "wrapped: the forward's BackwardState input is keyed as None, so the forward hits",
       "traceable_hsdp._cache.install_forward_cache_key_from_env",
       "traceable_hsdp._cache.uninstall_forward_cache_key"),
    _E("torch.fx.experimental._backward_state.BackwardState",
       "the forward's input that the FX graph cache refuses to key"),
    _E("torch.fx.experimental.proxy_tensor.track_tensor_tree",
       "it keeps the joint trace's proxy on a BackwardState, which the joint pass drops",
       uses=("proxy",)),
    _E("torch._dynamo.utils.counters",
       "CacheCounts reads the FX graph and AOTAutograd cache counts there"),
    _E("torch._dynamo.utils.compilation_time_metrics",
       "CompileTimes reads torch's compile timers there"),
    # The passes' switches in torch's compile configuration (passes/_install.py).
    _E("torch._inductor.config.post_grad_custom_pre_pass",
       "our passes run on every post-grad graph", *_PASSES),
    _E("torch._functorch.config.joint_custom_pass",
       "checkpoint outputs are saved and placeholder views recomputed in joint graphs",
       *_PASSES),
    _E("torch._functorch.config.recompute_views",
       "the partitioner recomputes a placeholder's views after the re-gather", *_PASSES),
    _E("torch._inductor.config.reorder_for_peak_memory",
       "off with overlap: Inductor's scheduler would put each wait back by its collective",
       *_PASSES),
    _E("torch._inductor.graph.GraphLowering.decide_layout_opt",
       "no channels-last copy of a placeholder that the graph resizes and fills",
       *_PASSES),
    # The exchanges' pooled all-to-all (passes/gloo/_pool.py).
    _E("torch._inductor.ir._CollectiveKernel.create_out_of_place",
       "the pooled all-to-all is lowered as Inductor lowers torch's collectives"),
    _E("torch._inductor.ir.TensorBox.create",
       "the pooled all-to-all's lowering returns its node as Inductor's lowerings do"),
    _E("torch._inductor.lowering.register_lowering",
       "Inductor lowers the pooled all-to-all"),
    _E("torch._inductor.lowering.add_layout_constraint",
       "the pooled all-to-all's lowering keeps the graph's strides, as torch's all-to-all's"),
    _E("torch._inductor.lowering.constrain_to_fx_strides",
       "the layout constraint of the pooled all-to-all's lowering"),
    _E("torch._C._distributed_c10d._resolve_process_group",
       "the pooled all-to-all finds its group by name, as torch's functional collectives"),
    _E("torch._C._distributed_c10d._register_work",
       "the pooled all-to-all registers its work for wait_tensor"),
    _E("torch._C._storage_Use_Count",
       "a pooled buffer is handed out only when nothing else holds its storage"),
    # The exit hook and the optimizer check (_exit.py, _optim_check.py).
    _E("torch.distributed.device_mesh.DeviceMesh",
       "at exit, the meshes of our units drop their destroyed process groups",
       "traceable_hsdp._exit.install_exit_hook", "traceable_hsdp._exit.uninstall_exit_hook",
       uses=("_pg_registry",)),
    _E("torch.distributed.device_mesh.DeviceMesh._get_root_mesh",
       "a submesh's process groups are in its root mesh's table"),
    _E("torch.distributed.tensor.debug._clear_sharding_prop_cache",
       "at exit, DTensor's sharding caches drop the meshes they hold"),
    _E("torch.optim.optimizer.register_optimizer_step_pre_hook",
       "no optimizer steps parameters the model no longer trains",
       "traceable_hsdp._optim_check.install_optimizer_check",
       "traceable_hsdp._optim_check.uninstall_optimizer_check"),
    # compile_block (_per_block.py): its gather's autograd.Function in the AOTAutograd
    # cache key while a block compiled per block is called.
    _E("torch._functorch.config.autograd_cache_allow_custom_autograd_functions",
       "compile_block: a warm restart finds the block's AOTAutograd graphs in the cache",
       "traceable_hsdp._torch_internals.cache_custom_autograd_functions", block=True),
    # dump_graphs (_dump.py): dynamo skips depyf's files inside its block.
    _E("torch._dynamo.trace_rules.SKIP_DIRS",
       "dump_graphs: dynamo does not compile depyf's functions",
       "traceable_hsdp._torch_internals.dynamo_skips", block=True),
    _E("torch._dynamo.trace_rules.add",
       "dump_graphs adds depyf's files to dynamo's skipped directories"),
    _E("torch._dynamo.trace_rules._recompile_re",
       "dynamo rereads its skipped directories after dump_graphs' block"),
)

_BY_TARGET = {e.target: e for e in INTERNALS}


def _entry(target: str) -> TorchInternal:
    entry = _BY_TARGET.get(target)
    if entry is None:
        raise KeyError(
            f"{target!r} is not in traceable_hsdp's table of torch internals: add it to "
            "INTERNALS in traceable_hsdp/_torch_internals.py, checked on every supported torch."
        )
    return entry


def internal_error(target: str, problem: str, fix: str = "") -> TorchInternalError:
    """The error for ``target`` (an entry of :data:`INTERNALS`): ``problem`` on this
    torch, what needs it, the versions checked, and the fix (``fix``, or installing a
    supported torch)."""
    entry = _entry(target)
    return TorchInternalError(
        f"traceable_hsdp: {entry.target} {problem} on torch {torch.__version__}. "
        f"traceable_hsdp relies on it ({entry.why}) and was checked on torch "
        f"{', '.join(entry.checked_on)}. Fix: "
        f"{fix or 'install a supported torch (2.13, 2.14 or 2.15)'}."
    )


def _path(target: str, dotted: str) -> Any:
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        name = ".".join(parts[:i])
        if isinstance(obj, types.ModuleType):
            # A submodule wins over its package's attribute of the same name (the
            # package torch.distributed._composable exports the function contract).
            # import_module, not sys.modules: a module another thread is importing
            # sits there half-initialized, and import_module waits for it.
            if sys.modules.get(name) is not None:
                obj = importlib.import_module(name)
                continue
            if not hasattr(obj, part):
                try:
                    obj = importlib.import_module(name)
                except ImportError:
                    raise _missing(target, name) from None
                continue
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _missing(target, name) from None
    return obj


def _missing(target: str, name: str) -> TorchInternalError:
    return internal_error(target, "is missing" if name == target else f"is missing ({name})")


def resolve(target: str) -> Any:
    """The object at ``target``, an entry of :data:`INTERNALS`, after checking that its
    code reads the entry's ``uses``. For ``registry[key]``: the registry's entry for
    ``key``, or ``None``.

    Raises:
        TorchInternalError: ``target`` is missing or changed on this torch.
        KeyError: ``target`` is not in the table.
    """
    entry = _entry(target)
    base, _, key = target.partition("[")
    obj = _path(target, base)
    if key:
        return obj.get(_path(target, key.rstrip("]")))
    code = getattr(obj.__init__ if isinstance(obj, type) else obj, "__code__", None)
    names = _names(code) if code is not None else set()
    missing = [n for n in entry.uses if n not in names]
    if missing:
        raise internal_error(target, f"no longer reads {', '.join(missing)}")
    return obj


def _names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the functions nested in it read or write."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def owner(target: str) -> tuple[Any, str]:
    """The object that holds ``target`` and the attribute's name, to change it."""
    holder, _, name = target.rpartition(".")
    resolve(target)
    return _path(target, holder), name


def __getattr__(name: str) -> Any:
    """``from traceable_hsdp._torch_internals import <name>``: the one entry whose
    target ends with ``.<name>``, resolved once."""
    targets = [e.target for e in INTERNALS if e.target.endswith("." + name)]
    if name.startswith("__") or len(targets) != 1:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = resolve(targets[0])
    return value


def _call(dotted: str) -> None:
    module, _, fn = dotted.rpartition(".")
    getattr(importlib.import_module(module), fn)()


def _changes(kind: str) -> list[str]:
    """Each distinct ``install`` (or ``undo``) function of the process-wide changes,
    in table order."""
    fns = [getattr(e, kind) for e in INTERNALS if getattr(e, kind) and not e.block]
    return list(dict.fromkeys(fns))


# [Note: Inductor's internals, checked when Inductor loads]
# Importing Inductor's lowering modules (``torch._inductor.graph``, ``.ir``,
# ``.lowering``) costs an eager job about 45 MiB a rank, and its code cache
# (``torch._inductor.codecache``) about 2 MiB more, for code it never runs. So the
# entries under ``torch._inductor`` (its config aside) are checked, and the changes
# that need them made (:func:`when_inductor_loads`), as soon as
# ``torch._inductor.graph`` is imported: at once if it is, else right after its import,
# through an import hook first on ``sys.meta_path`` that removes itself then (and
# :func:`undo` removes). Every compile imports that module before it lowers a graph,
# freezing's layout decision included, so no graph misses a change, and a missing
# entry still raises, at the first compile. tests/test_torch_internals.py resolves
# every entry on every CI torch and checks that an eager fully_shard step leaves
# Inductor's lowering and code cache unimported.
INDUCTOR_GRAPH = "torch._inductor.graph"


def _after_inductor_loads(target: str) -> bool:
    return target.startswith("torch._inductor.") and not target.startswith("torch._inductor.config.")


class _InductorImportHook(importlib.abc.MetaPathFinder):
    """Runs its callbacks right after ``torch._inductor.graph`` is executed."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != INDUCTOR_GRAPH or not self.callbacks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_call(module: types.ModuleType) -> None:
            exec_module(module)
            self.remove()
            callbacks, self.callbacks = self.callbacks, []
            for fn in callbacks:
                fn()

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_INDUCTOR_HOOK = _InductorImportHook()


def when_inductor_loads(fn: Callable[[], None]) -> None:
    """Calls ``fn`` now if Inductor's lowering is imported, else right after its import
    (once). See [Note: Inductor's internals, checked when Inductor loads]."""
    if sys.modules.get(INDUCTOR_GRAPH) is not None:
        fn()
        return
    if fn not in _INDUCTOR_HOOK.callbacks:
        _INDUCTOR_HOOK.callbacks.append(fn)
    if _INDUCTOR_HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _INDUCTOR_HOOK)


def cancel_when_inductor_loads(fn: Callable[[], None]) -> bool:
    """Drops ``fn`` if it still waits for Inductor to load; whether it did."""
    if fn in _INDUCTOR_HOOK.callbacks:
        _INDUCTOR_HOOK.callbacks.remove(fn)
        if not _INDUCTOR_HOOK.callbacks:
            _INDUCTOR_HOOK.remove()
        return True
    return False


def _check_inductor_entries() -> None:
    for entry in INTERNALS:
        if _after_inductor_loads(entry.target):
            resolve(entry.target)


def install() -> None:
    """Checks every entry of :data:`INTERNALS` on this torch (Inductor's when Inductor
    loads: [Note: Inductor's internals, checked when Inductor loads]), then makes every
    process-wide change (each one's environment switch still decides). Idempotent.
    See [Note: Torch internals].

    Raises:
        TorchInternalError: an entry is missing or changed on this torch.
    """
    for entry in INTERNALS:
        if not _after_inductor_loads(entry.target):
            resolve(entry.target)
    when_inductor_loads(_check_inductor_entries)
    for fn in _changes("install"):
        _call(fn)


def undo() -> None:
    """Undoes every process-wide change :func:`install` made, last first, and drops
    the changes still waiting for Inductor to load. Idempotent."""
    _INDUCTOR_HOOK.callbacks.clear()
    _INDUCTOR_HOOK.remove()
    for fn in reversed(_changes("undo")):
        _call(fn)


@contextlib.contextmanager
def dynamo_skips(package: str) -> Iterator[None]:
    """Dynamo skips every frame of ``package``'s files while the block runs, and only
    the frames it skipped before after it (``torch._dynamo.trace_rules.add``, torch's
    function for it)."""
    skip_dirs = resolve("torch._dynamo.trace_rules.SKIP_DIRS")
    recompile = resolve("torch._dynamo.trace_rules._recompile_re")
    before = len(skip_dirs)
    resolve("torch._dynamo.trace_rules.add")(package)
    added = skip_dirs[before:]
    try:
        yield
    finally:
        for d in added:
            skip_dirs.remove(d)
        if added:
            recompile()


def cache_custom_autograd_functions() -> contextlib.AbstractContextManager[None]:
    """AOTAutograd caches graphs holding custom ``autograd.Function``s while the block
    runs (torch's switch, set back at its exit). See [Note: Compiled per block] in
    ``_per_block.py``."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(autograd_cache_allow_custom_autograd_functions=True)


def _render() -> str:
    rows = [f"Checked on torch {', '.join(CHECKED_ON)}.", ""]
    for e in INTERNALS:
        rows.append(f"- ``{e.target}``: {e.why}.")
        if e.uses:
            rows.append(f"  Reads: {', '.join(e.uses)}.")
        if e.install:
            short = [f.removeprefix("traceable_hsdp.") for f in (e.install, e.undo) if f]
            rows.append(f"  {'Inside the block of' if e.block else 'Install, undo:'} "
                        f"{', '.join(short)}.")
        if e.checked_on != CHECKED_ON:
            rows.append(f"  Checked on torch {', '.join(e.checked_on)}.")
    return "\n".join(rows) + "\n"


__doc__ = f"{__doc__}\nThe table:\n\n{_render()}"
