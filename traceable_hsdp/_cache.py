"""Compile caches: a cache key that survives the process, and what the caches did.

[Note: FX graph cache keys across processes]
A compiled fully_shard step has two graphs that reach Inductor, the forward and the
compiled-autograd backward (measured in docs/compile.md, "Compile time and caches"):

- **Forward**: the FX graph cache bypasses it: its ``BackwardState`` input (how dynamo
  defers the output hooks to the backward, [Note: Why compiled autograd] in
  ``_compile.py``) is a type Inductor refuses to key. See [Note: The forward's
  BackwardState and the FX graph cache key].
- **Both**: the AOTAutograd cache bypasses them (its node allowlist refuses
  ``_register_hook_trampoline`` and compiled autograd's ``validate_outputs``). Left
  alone: both are decided inside torch by function name.
- **Backward**: the FX graph cache missed in every new process, because the key
  pickles the ``DeviceMesh`` input, whose ``__dict__`` holds ``_hash``, a per-process
  salted ``hash()``.

:func:`install_stable_mesh_key` registers a ``copyreg`` reducer for ``DeviceMesh``
(consulted by ``FxGraphCachePickler``) that drops ``_hash`` from the state; the
unpickled mesh recomputes it. Everything that identifies the mesh stays in the key. On
by default (``fully_shard`` installs it, an entry of [Note: Torch internals]);
``TRACEABLE_HSDP_STABLE_MESH_KEY=0`` leaves it off; a foreign ``DeviceMesh`` reducer is
refused (``TorchInternalError``).

[Note: The forward's BackwardState and the FX graph cache key]
Inductor never reads the ``BackwardState`` input (``GraphLowering.placeholder`` ignores
it, as an input whose example value is ``None``; AOTAutograd's runtime hands it to the
backward), so keying it as ``None`` cannot make a wrong hit.
:func:`install_forward_cache_key` wraps ``FxGraphCache.prepare_key`` so that it sees
``None`` in place of each ``BackwardState`` example input; lookup, save and compile get
the inputs unchanged, and a restart's forward hits like its backward. torch has no
switch for it, so the function is replaced (an entry of [Note: Torch internals]) once
``fully_shard`` has run ([Note: Lazy public names]) and Inductor loads: an eager job
never imports ``torch._inductor.codecache`` (about 2 MiB a rank; [Note: Inductor's
internals, checked when Inductor loads]). ``TRACEABLE_HSDP_FORWARD_CACHE_KEY=0``
leaves it off; where another ``prepare_key`` replaced ours, the first compile raises
``TorchInternalError`` naming the switch.
"""

from __future__ import annotations

import copyreg
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ._torch_internals import (
    cancel_when_inductor_loads,
    internal_error,
    owner,
    resolve,
    when_inductor_loads,
)

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
    """Whether the environment switch ``name`` is on: off for
    ``0``/``false``/``off``/``no``, on when unset or ``1``/``true``/``on``/``yes``/empty.

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
    """Puts torch's ``FxGraphCache.prepare_key`` back, if ours is there, or drops
    the install still waiting for Inductor to load."""
    global _torch_prepare_key
    cancel_when_inductor_loads(_install_forward_cache_key_or_raise)
    if "torch._inductor.codecache" in sys.modules and forward_cache_key_installed():
        cache, name = owner(_PREPARE_KEY)
        setattr(cache, name, staticmethod(_torch_prepare_key))
        _torch_prepare_key = None


def forward_cache_key_installed() -> bool:
    """Whether :func:`install_forward_cache_key`'s ``prepare_key`` is in place."""
    return resolve(_PREPARE_KEY) is _prepare_key_with_backward_state_as_none


def install_forward_cache_key_from_env(environ: Mapping[str, str] | None = None) -> None:
    """``fully_shard``'s call: :func:`install_forward_cache_key` when Inductor loads
    (at once if it is loaded), unless ``TRACEABLE_HSDP_FORWARD_CACHE_KEY`` is ``0``
    (or ``false``/``off``/``no``). See [Note: The forward's BackwardState and the FX
    graph cache key].

    Raises:
        ValueError: any other value than those and ``1``/``true``/``on``/``yes``/empty.
        TorchInternalError: another ``prepare_key`` replaced ours (raised here when
            Inductor is loaded, else by the import that loads it).
    """
    switch = env_switch(ENV_FORWARD_CACHE_KEY, environ, "the forward keyed in the FX graph cache")
    if switch:
        when_inductor_loads(_install_forward_cache_key_or_raise)


def _install_forward_cache_key_or_raise() -> None:
    if not install_forward_cache_key():
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
