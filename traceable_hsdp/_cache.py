"""Compile caches: a cache key that survives the process, and what the caches did.

[Note: FX graph cache keys across processes]
A compiled fully_shard step has two graphs that reach Inductor: the forward and the
backward that compiled autograd captures. On torch 2.13, measured with
``torch._dynamo.utils.counters`` and the ``torch._inductor.codecache`` debug log
(``benchmarks/compile_time.py``; docs/compile.md, "Compile time and caches"):

- **Forward: the FX graph cache was bypassed ("Reduce unsupported").** With compiled
  autograd on, dynamo defers the tensor hook on each unit's output to the backward
  through a ``BackwardState`` graph input (``torch/_dynamo/variables/tensor.py``,
  ``_method_register_hook``: ``tx.output.add_backward_state_hook(hook)`` and the
  ``_register_hook_trampoline`` node). ``torch/_inductor/codecache.py`` refuses that
  input by type: ``_check_cache_key_object`` raises ``bypass("Reduce unsupported")``
  for ``torch.fx.experimental._backward_state.BackwardState``, and
  ``FxGraphCachePickler`` maps the type to ``_reduce_unsupported``. The hook is how
  the re-gather gets into the backward graph ([Note: Why compiled autograd],
  ``_compile.py``), so the forward was lowered again by Inductor in every process.
- **Both graphs: the AOTAutograd cache is bypassed.** Its node allowlist
  (``torch/_functorch/_aot_autograd/autograd_cache.py``, ``check_node_safe``) refuses
  ``_register_hook_trampoline`` in the forward and
  ``torch._dynamo.compiled_autograd.ops.validate_outputs`` in every compiled-autograd
  backward (the plain model's too).
- **Backward: the FX graph cache missed in every new process.** Its inputs include
  the ``DeviceMesh`` of the sharded parameters (an opaque object; the graph builds
  the sharded gradients with ``DTensor.from_local``), and the cache pickles the real
  mesh (``FxGraphCachePickler._reduce_fake_script_object``). The mesh's pickled state
  is its ``__dict__``, which holds ``_hash``: Python's ``hash()`` of a tuple with
  strings and ``None`` in it, cached on first use (``nn.Parameter(DTensor)`` in
  ``fully_shard`` hashes it). String hashes are salted per process (PYTHONHASHSEED)
  and, before Python 3.12, ``hash(None)`` is the address of ``None``; so the key
  held a number that changes with every process. Nothing else differed (the graph
  code, our pass's ``uuid()`` and every other component were byte-identical).
  Across ranks the mesh's ``_rank`` differs too, so each rank has its own entry.

The backward's miss is fixed here without touching torch: :func:`install_stable_mesh_key`
registers a reducer for ``DeviceMesh`` in Python's ``copyreg`` registry, which
pickle (and ``FxGraphCachePickler``, whose ``dispatch_table`` starts as a copy of
``copyreg.dispatch_table``) consults before the object's own ``__reduce_ex__``. The
reducer returns the mesh's own reduction with ``_hash`` left out of the state; the
unpickled mesh recomputes it on first use (``DeviceMesh.__hash__``), as a new mesh
does. Everything that identifies the mesh (ranks, layout, device type, dimension
names, process-group names, this rank) stays in the pickle and in the key. It is on
by default (``fully_shard`` installs it, through [Note: Torch internals] in
``_torch_internals.py``); ``TRACEABLE_HSDP_STABLE_MESH_KEY=0`` in the
environment leaves it off, and :func:`uninstall_stable_mesh_key` removes it. A reducer
for ``DeviceMesh`` that someone else registered is refused (``TorchInternalError``).

Both AOTAutograd bypasses are decided inside torch by function name, and are left
alone: the forward's ``_register_hook_trampoline`` is a closure over the hook's name,
which its key would not hold, and the backward's list of compiled-autograd ops would
differ for each model (docs/compile.md).

[Note: The forward's BackwardState and the FX graph cache key]
Inductor never reads the ``BackwardState`` input: ``GraphLowering.placeholder``
(``torch/_inductor/graph.py``) returns ``None`` for it ("Ignored arg, must be
unused"), exactly as for an input whose example value is ``None``, and AOTAutograd's
runtime, not the compiled graph, hands the state to the backward
(``ctx._compiled_autograd_backward_state``). So two graphs that differ only in a
``BackwardState`` where the other has ``None`` compile to the same code, and keying
the input as ``None`` cannot make a wrong hit. :func:`install_forward_cache_key`
wraps ``FxGraphCache.prepare_key`` (the one place Inductor's ``compile_fx_inner``
computes the key, and checks what may be keyed) so that it sees ``None`` in the
place of each ``BackwardState`` example input; the lookup, the save and the compile
get the inputs unchanged. Then a restart's forward hits like its backward
(docs/compile.md, "Compile time and caches"). The rest of the key
(the graph's code, the other inputs, the configuration and our passes' ``uuid()``)
is computed by torch as before. torch has no switch for it, so the function is
replaced (an entry of [Note: Torch internals]). ``fully_shard`` installs it (it needs
Inductor, which ``import traceable_hsdp`` does not load: [Note: Lazy public names]);
``TRACEABLE_HSDP_FORWARD_CACHE_KEY=0`` leaves it off, and
:func:`uninstall_forward_cache_key` puts torch's function back. Where another
``prepare_key`` replaced ours since, :func:`install_forward_cache_key` leaves it and
says so, and ``fully_shard`` raises ``TorchInternalError``, naming the switch.
"""

from __future__ import annotations

import copyreg
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._torch_internals import internal_error, owner, resolve

__all__ = [
    "CacheCounts",
    "CompileTimes",
    "install_stable_mesh_key",
    "uninstall_stable_mesh_key",
    "stable_mesh_key_installed",
    "install_forward_cache_key",
    "uninstall_forward_cache_key",
    "forward_cache_key_installed",
]

ENV_STABLE_MESH_KEY = "TRACEABLE_HSDP_STABLE_MESH_KEY"
ENV_FORWARD_CACHE_KEY = "TRACEABLE_HSDP_FORWARD_CACHE_KEY"


def _device_mesh_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


_MESH_REDUCER = "copyreg.dispatch_table[torch.distributed.device_mesh.DeviceMesh]"
_MESH_HASH = "torch.distributed.device_mesh.DeviceMesh.__hash__"


def _reduce_device_mesh(mesh: Any) -> tuple[Any, ...]:
    """``mesh``'s own reduction, without the per-process ``_hash`` in its state. See
    [Note: FX graph cache keys across processes].

    Raises:
        TorchInternalError: the reduction holds no state dict (another torch).
    """
    reduced = mesh.__reduce_ex__(2)  # the type's own; copyreg's table is not consulted
    if len(reduced) < 3 or not isinstance(reduced[2], dict):
        raise internal_error(_MESH_HASH, "pickles a DeviceMesh without a state dict")
    if "_hash" not in reduced[2]:  # an unpickled mesh, not hashed since
        return reduced
    state = dict(reduced[2])
    del state["_hash"]
    return (reduced[0], reduced[1], state, *reduced[3:])


def install_stable_mesh_key() -> bool:
    """Registers the ``DeviceMesh`` reducer that keeps the FX graph cache key the same
    across processes. Idempotent. See [Note: FX graph cache keys across processes].

    Returns:
        Whether it is installed now (``False`` without ``torch.distributed``: no mesh
        to key).

    Raises:
        TorchInternalError: another reducer for ``DeviceMesh`` is registered.
    """
    mesh_type = _device_mesh_type()
    if mesh_type is None:
        return False
    current = resolve(_MESH_REDUCER)
    if current is None:
        copyreg.pickle(mesh_type, _reduce_device_mesh)
    elif current is not _reduce_device_mesh:
        raise internal_error(
            _MESH_REDUCER, f"is {current!r}, registered by other code",
            f"set {ENV_STABLE_MESH_KEY}=0 to leave traceable_hsdp's reducer off")
    return True


def uninstall_stable_mesh_key() -> None:
    """Removes the reducer :func:`install_stable_mesh_key` registered, if it is there."""
    mesh_type = _device_mesh_type()
    if mesh_type is not None and resolve(_MESH_REDUCER) is _reduce_device_mesh:
        del copyreg.dispatch_table[mesh_type]


def stable_mesh_key_installed() -> bool:
    """Whether :func:`install_stable_mesh_key`'s reducer is registered."""
    return _device_mesh_type() is not None and resolve(_MESH_REDUCER) is _reduce_device_mesh


def env_switch(name: str, environ: Mapping[str, str] | None, what: str) -> bool:
    """Whether the environment switch ``name`` is on (this module's two, and
    ``_compile.py``'s): off for ``0``/``false``/``off``/``no``, on
    when unset or ``1``/``true``/``on``/``yes``/empty.

    Raises:
        ValueError: any other value.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip().lower()
    if raw in ("0", "false", "off", "no"):
        return False
    if raw not in ("", "1", "true", "on", "yes"):
        raise ValueError(f"{name}={env[name]!r}: expected 1 (the default: {what}) or 0 (off).")
    return True


def _install_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Installs the reducer unless ``TRACEABLE_HSDP_STABLE_MESH_KEY`` is
    ``0`` (or ``false``/``off``/``no``).

    Raises:
        ValueError: any other value than those and ``1``/``true``/``on``/``yes``/empty.
    """
    if env_switch(ENV_STABLE_MESH_KEY, environ, "stable FX graph cache keys"):
        install_stable_mesh_key()


# ------------------------------------------------------------------ the forward's key


_PREPARE_KEY = "torch._inductor.codecache.FxGraphCache.prepare_key"


def _prepare_key_with_backward_state_as_none(
    gm: Any, example_inputs: Any, *args: Any, **kwargs: Any
) -> Any:
    """``FxGraphCache.prepare_key`` with ``None`` in the place of each ``BackwardState``
    example input. See [Note: The forward's BackwardState and the FX graph cache key]."""
    bw_state = resolve("torch.fx.experimental._backward_state.BackwardState")
    if any(isinstance(x, bw_state) for x in example_inputs):
        example_inputs = [None if isinstance(x, bw_state) else x for x in example_inputs]
    return _torch_prepare_key(gm, example_inputs, *args, **kwargs)


# torch's FxGraphCache.prepare_key, kept while ours replaces it.
_torch_prepare_key: Any = None


def install_forward_cache_key() -> bool:
    """Lets the FX graph cache key a forward graph whose inputs include a
    ``BackwardState``. Idempotent. See [Note: The forward's BackwardState and the FX
    graph cache key].

    Returns:
        Whether it is installed now: ``False`` when another ``prepare_key`` replaced
        ours since, which is left alone (:func:`install_forward_cache_key_from_env`
        raises then).
    """
    global _torch_prepare_key
    if forward_cache_key_installed():
        return True
    if _torch_prepare_key is not None:  # ours was installed, then replaced: not ours to touch
        return False
    cache, name = owner(_PREPARE_KEY)
    _torch_prepare_key = getattr(cache, name)
    setattr(cache, name, staticmethod(_prepare_key_with_backward_state_as_none))
    return True


def uninstall_forward_cache_key() -> None:
    """Puts torch's ``FxGraphCache.prepare_key`` back, if ours is there."""
    global _torch_prepare_key
    if forward_cache_key_installed():
        cache, name = owner(_PREPARE_KEY)
        setattr(cache, name, staticmethod(_torch_prepare_key))
        _torch_prepare_key = None


def forward_cache_key_installed() -> bool:
    """Whether :func:`install_forward_cache_key`'s ``prepare_key`` is in place."""
    return resolve(_PREPARE_KEY) is _prepare_key_with_backward_state_as_none


def install_forward_cache_key_from_env(environ: Mapping[str, str] | None = None) -> None:
    """``fully_shard``'s call: :func:`install_forward_cache_key` unless
    ``TRACEABLE_HSDP_FORWARD_CACHE_KEY`` is ``0`` (or ``false``/``off``/``no``).

    Raises:
        ValueError: any other value than those and ``1``/``true``/``on``/``yes``/empty.
        TorchInternalError: another ``prepare_key`` replaced ours.
    """
    switch = env_switch(ENV_FORWARD_CACHE_KEY, environ, "the forward keyed in the FX graph cache")
    if switch and not install_forward_cache_key():
        raise internal_error(
            _PREPARE_KEY, f"is {resolve(_PREPARE_KEY)!r}, which replaced traceable_hsdp's",
            f"set {ENV_FORWARD_CACHE_KEY}=0 to leave traceable_hsdp's key off")


# ------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class CacheCounts:
    """What the FX graph cache (Inductor) and the AOTAutograd cache did, from
    ``torch._dynamo.utils.counters`` (one count per graph compiled)."""

    fx_hit: int = 0
    fx_miss: int = 0
    fx_bypass: int = 0
    aot_hit: int = 0
    aot_miss: int = 0
    aot_bypass: int = 0

    @classmethod
    def now(cls) -> CacheCounts:
        """The counts so far in this process."""
        counters = resolve("torch._dynamo.utils.counters")
        ind, aot = counters["inductor"], counters["aot_autograd"]
        return cls(
            fx_hit=int(ind["fxgraph_cache_hit"]),
            fx_miss=int(ind["fxgraph_cache_miss"]),
            fx_bypass=int(ind["fxgraph_cache_bypass"]),
            aot_hit=int(aot["autograd_cache_hit"]),
            aot_miss=int(aot["autograd_cache_miss"]),
            aot_bypass=int(aot["autograd_cache_bypass"]),
        )

    def __sub__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(**{k: v - getattr(other, k) for k, v in asdict(self).items()})

    def summary(self) -> str:
        """``FX graph cache: 1 hit, 0 miss, 1 bypass; AOTAutograd cache: ...``."""
        return (
            f"FX graph cache: {self.fx_hit} hit, {self.fx_miss} miss, {self.fx_bypass} bypass; "
            f"AOTAutograd cache: {self.aot_hit} hit, {self.aot_miss} miss, "
            f"{self.aot_bypass} bypass"
        )


# compilation_time_metrics keys (functions timed with dynamo_timed) behind each phase.
_TOTAL = "_compile.compile_inner"  # every dynamo frame compile, the backward's too
_DYNAMO = "bytecode_tracing"
_AOT = "create_aot_dispatcher_function"  # includes the Inductor compiles it calls
_INDUCTOR = "compile_fx_inner"  # one per graph Inductor compiles (or loads)
_KERNELS = "compile_file"  # C++ compiler runs (in this process with 1 compile thread)


@dataclass(frozen=True)
class CompileTimes:
    """Seconds spent compiling, from torch's own timers
    (``torch._dynamo.utils.compilation_time_metrics``, filled by ``dynamo_timed``).

    Args:
        total: every dynamo frame compile (``_compile.compile_inner``), the
            compiled-autograd backward's included.
        dynamo: dynamo's bytecode tracing (``bytecode_tracing``).
        aot: AOTAutograd without the Inductor compiles it calls
            (``create_aot_dispatcher_function`` - ``compile_fx_inner``).
        inductor: Inductor lowering and code generation, and cache lookups
            (``compile_fx_inner`` - ``compile_file``).
        kernels: C++ kernel compiles (``compile_file``). Counted only when they run in
            this process (``TORCHINDUCTOR_COMPILE_THREADS=1``); with a worker pool
            ``inductor`` holds the wait for them instead.
    """

    total: float = 0.0
    dynamo: float = 0.0
    aot: float = 0.0
    inductor: float = 0.0
    kernels: float = 0.0

    @classmethod
    def now(cls) -> CompileTimes:
        """The totals so far in this process."""
        m = resolve("torch._dynamo.utils.compilation_time_metrics")

        def s(key: str) -> float:
            return float(sum(m.get(key, ())))

        kernels = s(_KERNELS)
        return cls(
            total=s(_TOTAL),
            dynamo=s(_DYNAMO),
            aot=max(0.0, s(_AOT) - s(_INDUCTOR)),
            inductor=max(0.0, s(_INDUCTOR) - kernels),
            kernels=kernels,
        )

    def __sub__(self, other: CompileTimes) -> CompileTimes:
        return CompileTimes(**{k: v - getattr(other, k) for k, v in asdict(self).items()})

    def summary(self) -> str:
        """``compile 41.2 s: dynamo 9.8, AOTAutograd 6.1, Inductor 12.0, kernels 13.3``."""
        return (
            f"compile {self.total:.1f} s: dynamo {self.dynamo:.1f}, AOTAutograd {self.aot:.1f}, "
            f"Inductor {self.inductor:.1f}, kernels {self.kernels:.1f}"
        )
