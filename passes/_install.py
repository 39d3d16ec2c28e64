"""Plugging the passes into Inductor, their configuration, and every change
traceable_hsdp makes to torch's compile configuration.

[Note: Installing the passes]
:func:`install` (called by ``fully_shard``) sets
``torch._inductor.config.post_grad_custom_pre_pass`` to a :class:`TraceableHSDPPass`,
which runs on every post-grad graph (forward and compiled-autograd backward) before
Inductor's own post-grad passes. Around the switched passes (:func:`run_passes`), and
whatever :class:`PassConfig` says, :func:`free_after_last_read` runs first ([Note:
Frees after the last read]) and :func:`gather_into_buffers` after ([Note: CPU
all-gathers into buffers]); last, a graph the C++ wrapper cannot call is refused
([Note: Inductor's C++ wrapper]).

It composes (a user pass already set runs after ours, and the cache key hashes both),
is idempotent, and is cache-safe (``uuid()`` hashes every ``passes/*.py`` source and
the current :class:`PassConfig`).

:func:`install` also sets ``torch._functorch.config.joint_custom_pass`` to a
:class:`TraceableHSDPJointPass` running :func:`save_checkpoint_outputs` and
:func:`recompute_placeholder_views` on every joint graph before partitioning, for every
backend: correctness fixes, so :class:`PassConfig` does not switch them ([Note:
Checkpoint outputs are saved], [Note: Views of a placeholder are recomputed]). A joint
pass already set runs first. It changes only graphs with a ``BackwardState`` input,
which bypass AOTAutograd's cache (whose key ignores ``joint_custom_pass``).

[Note: Pass configuration]
``traceable_hsdp.passes.config`` is the :class:`PassConfig` in effect, read when a graph
is compiled (the cache key follows it). Its initial value comes from the environment:

``TRACEABLE_HSDP_PASSES``
    Comma-separated pass names to run (``bucket`` for both bucketing passes), ``all``
    (default) or ``none``; an unknown name raises ``ValueError``.
``TRACEABLE_HSDP_BUCKET_CAP_MB``
    MiB >= 0, or ``none`` for one bucket per unit ([Note: Bucket size cap] in
    ``bucket_collectives.py``).

In code: ``set_config(PassConfig(...))`` or ``install(config=...)``. A unit's own
options (``hsdp(comm_fusion=...)``) travel in its collective annotations instead
([Note: Per-unit pass options] in ``bucket_collectives.py``).

[Note: Global switches]
Everything traceable_hsdp changes in torch's process-wide compile configuration is
changed here by :func:`install` and restored by :func:`uninstall` to the value from
before the first change:

- ``torch._inductor.config.post_grad_custom_pre_pass`` ([Note: Installing the passes]);
- ``torch._functorch.config.joint_custom_pass``;
- ``torch._inductor.config.reorder_for_peak_memory = False`` when ``overlap`` is on
  ([Note: Overlap and Inductor's scheduler] in ``overlap.py``);
- ``torch._functorch.config.recompute_views = True`` ([Note: Saved views of the
  placeholder]);
- ``GraphLowering.decide_layout_opt``, wrapped ([Note: Layout optimization and the
  placeholders]).

These are entries of [Note: Torch internals]. Nothing else writes process-wide
configuration, but ``dump_graphs`` for the length of its block.

[Note: Saved views of the placeholder]
AOTAutograd's partitioner may save a view of a placeholder for backward and compute it
at the end of the forward, after the placeholder was freed: aot_eager fails its
bounds check, Inductor is right only by accident. ``recompute_views = True`` makes the
partitioner recompute views in the backward, after the re-gather. It does not cover a
view whose base is not saved; :func:`recompute_placeholder_views` does ([Note: Views of
a placeholder are recomputed]).

[Note: Layout optimization and the placeholders]
For a graph with a convolution Inductor lays tensors out channels-last, copying a
placeholder input into a channels-last buffer at the top of the graph, while it still
has 0 bytes, and resizing the copy instead of the input: a segfault in the first
forward. So :func:`install` wraps ``GraphLowering.decide_layout_opt``: a graph that
still holds a resize or ``fsdp.copy_`` after our passes gets no layout optimization;
any other is decided by Inductor. The decision is a function of the hashed graph, so
the cache stays consistent. Cost: such graphs' convolutions run contiguous.

[Note: Per-unit options and the FX graph cache]
The FX graph cache key does not hash node metadata, so it would not see the pass
options a unit carries in its annotations. So ``uuid()`` also hashes the sorted
``label=options`` of every live unit with options of its own
(:func:`track_unit_options`, called by ``hsdp()``); labels are module paths, the same
in every process of a job, so a restarted job still hits.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, fields, make_dataclass
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import fx
from torch._inductor import custom_graph_pass as _cgp

from ._graph import (
    EXCHANGED,
    INFERENCE_AWARE,
    InferenceAwareGraphPass,
    annotation_of,
    is_collective,
    is_placeholder_op,
    is_resize,
)
from .._torch_internals import cancel_when_inductor_loads, owner, when_inductor_loads
from ._registry import ALIASES, PASSES, PassEntry, switched
from .bucket_collectives import DEFAULT_BUCKET_CAP_MB

__all__ = [
    "PassConfig",
    "TraceableHSDPJointPass",
    "TraceableHSDPPass",
    "get_config",
    "set_config",
    "install",
    "uninstall",
    "run_passes",
    "track_unit_options",
]

log = logging.getLogger(__name__)

ENV_PASSES = "TRACEABLE_HSDP_PASSES"
ENV_BUCKET_CAP_MB = "TRACEABLE_HSDP_BUCKET_CAP_MB"
_PASS_NAMES = switched()
_ALIASES = {"all": _PASS_NAMES, "none": (), **ALIASES}
_POST_GRAD = tuple(e for e in PASSES if e.stage == "post_grad")
_JOINT = tuple(e for e in PASSES if e.stage == "joint")

# One bool field per switched pass of the registry, named as the pass, default True,
# in run order; PassConfig adds its other fields after them.
_PassSwitches = make_dataclass(
    "_PassSwitches", [(name, bool, True) for name in _PASS_NAMES], frozen=True,
    namespace={"__module__": __name__},
)


@dataclass(frozen=True)
class PassConfig(_PassSwitches):  # type: ignore[misc, valid-type]
    """Which passes run on traceable_hsdp's compiled graphs.

    Args:
        <pass name>: one bool per pass of ``_registry.PASSES`` that can be switched
            off, in run order (default ``True``): ``remove_resize_copy``,
            ``bucket_all_gathers``, ``bucket_reduce_scatters``, ``overlap``,
            ``reduce_scatter_by_exchange``, ``all_gather_by_exchange``; docs/passes.md
            says what each does.
        pool_exchange_outputs: the exchanges' outputs come from a pool of buffers
            kept across steps (default ``True``); see [Note: Exchange outputs from a
            pool] in ``gloo/_pool.py``.
        bucket_cap_mb: merge adjacent units' collectives up to this many MiB
            (default ``DEFAULT_BUCKET_CAP_MB``, 4; see [Note: The default bucket
            cap]); ``None`` keeps one bucket per unit.

    Raises:
        TypeError: a switch is not a bool, or the cap is not a number or ``None``.
        ValueError: a negative (or NaN) cap.
    """

    remove_resize_copy: bool = True
    bucket_all_gathers: bool = True
    bucket_reduce_scatters: bool = True
    overlap: bool = True
    reduce_scatter_by_exchange: bool = True
    all_gather_by_exchange: bool = True
    pool_exchange_outputs: bool = True
    bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "bucket_cap_mb":
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(
                        f"PassConfig.bucket_cap_mb must be a number of MiB or None, got "
                        f"{type(value).__name__} {value!r}."
                    )
                if not value >= 0:
                    raise ValueError(
                        f"PassConfig.bucket_cap_mb must be >= 0 (MiB), got {value!r}. "
                        "Use None for one bucket per unit."
                    )
            elif not isinstance(value, bool):
                raise TypeError(
                    f"PassConfig.{f.name} must be a bool, got {type(value).__name__} "
                    f"{value!r}."
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PassConfig:
        """Reads ``TRACEABLE_HSDP_PASSES`` and ``TRACEABLE_HSDP_BUCKET_CAP_MB``.
        See [Note: Pass configuration].

        Args:
            environ: the environment to read (default ``os.environ``).

        Raises:
            ValueError: an unknown pass name, ``none`` mixed with names, or a cap
                that is not a number >= 0.
        """
        env = os.environ if environ is None else environ
        raw = env.get(ENV_PASSES, "").strip()
        on: set[str] = set(_PASS_NAMES)
        if raw:
            names = [n.strip().lower() for n in raw.split(",") if n.strip()]
            if "none" in names and len(names) > 1:
                raise ValueError(
                    f"{ENV_PASSES}={raw!r} mixes 'none' with pass names; use 'none' alone "
                    "to turn every pass off."
                )
            on = set()
            for name in names:
                if name in _ALIASES:
                    on.update(_ALIASES[name])
                elif name in _PASS_NAMES:
                    on.add(name)
                else:
                    valid = ", ".join([*_PASS_NAMES, *_ALIASES])
                    raise ValueError(
                        f"{ENV_PASSES}={raw!r} names an unknown pass {name!r}. Valid: "
                        f"{valid} (comma-separated)."
                    )
        cap_raw = env.get(ENV_BUCKET_CAP_MB, "").strip()
        cap: float | None = None if cap_raw.lower() == "none" else DEFAULT_BUCKET_CAP_MB
        if cap_raw and cap_raw.lower() != "none":
            try:
                cap = float(cap_raw)
            except ValueError:
                cap = float("nan")
            if not cap >= 0 or cap == float("inf"):
                raise ValueError(
                    f"{ENV_BUCKET_CAP_MB}={cap_raw!r} is not a number of MiB >= 0; set "
                    "e.g. 25, 'none' for one bucket per unit, or leave it unset for "
                    f"the default ({DEFAULT_BUCKET_CAP_MB:g})."
                )
        return cls(**{name: name in on for name in _PASS_NAMES}, bucket_cap_mb=cap)


_config: PassConfig = PassConfig.from_env()


def get_config() -> PassConfig:
    """The configuration in effect (``traceable_hsdp.passes.config``)."""
    return _config


def set_config(config: PassConfig) -> None:
    """Replaces the configuration for every later compile.

    Raises:
        TypeError: ``config`` is not a :class:`PassConfig`.
    """
    global _config
    if not isinstance(config, PassConfig):
        raise TypeError(
            f"set_config expects a traceable_hsdp.passes.PassConfig, got "
            f"{type(config).__name__}."
        )
    _config = config


def run_passes(gm: fx.GraphModule, config: PassConfig | None = None) -> dict[str, int]:
    """Runs the enabled switched passes on ``gm`` in the registry's order ([Note:
    Removing resize/copy regions], bucketing, [Note: Overlap], then [Note: gloo
    reduce-scatters as an exchange]).

    Args:
        gm: a post-grad graph module, changed in place.
        config: default ``None``: :func:`get_config`.

    Returns:
        What each pass reported (regions removed, buckets made), by pass name.
    """
    cfg = get_config() if config is None else config
    return _run(gm, cfg, tuple(e for e in _POST_GRAD if e.switch))


def _run(gm: fx.GraphModule, cfg: PassConfig, entries: tuple[PassEntry, ...]) -> dict[str, int]:
    """Runs ``entries`` in order: unswitched ones always, switched ones when on, and
    ``per_unit`` ones always ([Note: Per-unit pass options])."""
    done: dict[str, int] = {}
    for e in entries:
        on = not e.switch or getattr(cfg, e.name)
        if on or e.per_unit:
            n = e.run(gm, cfg)
            if on or n:
                done[e.name] = n
    return done


def _sources() -> tuple[str, ...]:
    return tuple(sorted(str(p) for p in Path(__file__).resolve().parent.rglob("*.py")))


_units_with_options: weakref.WeakSet[Any] = weakref.WeakSet()


def track_unit_options(holder: Any) -> None:
    """Notes a unit that carries its own pass options, for as long as ``holder`` is
    alive: its ``pass_options_key()`` (a string naming the unit and its options) then
    enters the FX graph cache key. See [Note: Per-unit options and the FX graph
    cache].

    Args:
        holder: a weakly referenceable object with a ``pass_options_key() -> str``
            method, read when a graph is compiled.
    """
    if not callable(getattr(holder, "pass_options_key", None)):
        raise TypeError(
            f"track_unit_options: {type(holder).__name__} has no pass_options_key() "
            "method; the FX graph cache key needs it."
        )
    _units_with_options.add(holder)


def _unit_options_key() -> str:
    return "|".join(sorted(h.pass_options_key() for h in list(_units_with_options)))


_warned_options_lost = False


def _warn_if_options_lost(graph: fx.Graph) -> None:
    """Warns once per process when units with their own pass options are alive and a
    graph's collectives carry no annotation (a compiled-autograd backward on torch
    2.13): the ``PassConfig`` decides there. See [Note: Per-unit pass options]."""
    global _warned_options_lost
    if _warned_options_lost or not len(_units_with_options):
        return
    if any(is_collective(n) and annotation_of(n) is None for n in graph.nodes):
        _warned_options_lost = True
        log.warning(
            "traceable_hsdp passes: this graph's collectives carry no unit annotation "
            "(compiled-autograd backward graphs lose node metadata on this torch), so "
            "a unit's own pass options (hsdp(comm_fusion=..., bucket_size=...)) cannot "
            "apply here; the process-wide PassConfig decides (%r). Set "
            "traceable_hsdp.passes.set_config(PassConfig(bucket_all_gathers=False, "
            "bucket_reduce_scatters=False)) to keep every graph unbucketed.",
            get_config(),
        )


_UserPass = Any  # a CustomGraphPass, a callable on fx.Graph, or a list/tuple of them


# [Note: Inductor's C++ wrapper]
# Inductor's C++ wrapper (``cpp_wrapper``) has no C++ call for
# ``inductor.resize_storage_bytes_`` nor for the exchanges' all-to-all ([Note: Exchange
# outputs from a pool] in ``gloo/_pool.py``), and a default root holds a resize in both
# graphs. Rather than let Inductor fail on a name the user never wrote, the pass refuses
# the graph, naming the switch and the fix.
def _refuse_cpp_wrapper(graph: fx.Graph) -> None:
    """Raises ``RuntimeError`` if Inductor's C++ wrapper is on and ``graph`` holds an
    op that it cannot call. See [Note: Inductor's C++ wrapper]."""
    if not inductor_config.cpp_wrapper:
        return
    found = sorted(
        {
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and (is_resize(n) or n.meta.get(EXCHANGED))
        }
    )
    if found:
        raise RuntimeError(
            "traceable_hsdp: Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper) "
            f"cannot compile this fully_shard graph on torch {torch.__version__}: it holds "
            f"{', '.join(found)}, which the C++ wrapper has no call for. Fix: compile "
            "without it: leave torch._inductor.config.cpp_wrapper False, or pass "
            "options={'cpp_wrapper': False} to torch.compile (and to "
            "traceable_hsdp.enable_compiled_autograd, which compiles the backward)."
        )


class TraceableHSDPPass(InferenceAwareGraphPass):  # type: ignore[misc, valid-type]
    """The post-grad pre-pass :func:`install` sets: our passes, then the pass the
    user had set (``user_pass``), if any. See [Note: Installing the passes].

    Args:
        user_pass: what ``post_grad_custom_pre_pass`` held before (default ``None``).
    """

    def __init__(self, user_pass: _UserPass = None) -> None:
        self.user_pass = user_pass

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        gm = graph.owning_module
        if isinstance(gm, fx.GraphModule):
            _warn_if_options_lost(graph)
            # Unswitched passes run whatever the configuration.
            _run(gm, get_config(), _POST_GRAD)
            _refuse_cpp_wrapper(graph)
        else:
            log.warning("traceable_hsdp passes skipped: the graph has no owning GraphModule")
        for p in _cgp.get_custom_graph_passes(self.user_pass):
            if INFERENCE_AWARE and isinstance(p, InferenceAwareGraphPass):
                p(graph, is_inference=is_inference)
            else:
                p(graph)

    def uuid(self) -> bytes | None:
        user_ids = []
        for p in _cgp.get_custom_graph_passes(self.user_pass):
            uid = p.uuid() if isinstance(p, _cgp.CustomPassBase) else None
            if not uid:
                return None  # as if the user pass were there alone: no caching
            user_ids.append(uid)
        # See [Note: Per-unit options and the FX graph cache].
        extra = f"{get_config()!r}|{user_ids!r}|{_unit_options_key()}"
        return _cgp.get_hash_for_files(_sources(), extra)


class TraceableHSDPJointPass:
    """The ``joint_custom_pass`` :func:`install` sets: the pass that was there
    (``user_pass``), if any, then :func:`save_checkpoint_outputs` and
    :func:`recompute_placeholder_views`. See
    [Note: Installing the passes].

    Args:
        user_pass: what ``torch._functorch.config.joint_custom_pass`` held before
            (default ``None``): a callable ``(joint_gm, joint_inputs) -> joint_gm``.
    """

    def __init__(self, user_pass: Any = None) -> None:
        self.user_pass = user_pass

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        if callable(self.user_pass):
            gm = self.user_pass(gm, joint_inputs)
        _run(gm, get_config(), _JOINT)
        return gm


def _is_ours(value: object) -> bool:
    if isinstance(value, TraceableHSDPPass):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, TraceableHSDPPass) for v in value)


# The flags install() changed, as they were before; see [Note: Global switches].
_saved: dict[tuple[Any, str], Any] = {}


def _switch(module: Any, name: str, value: Any) -> None:
    _saved.setdefault((module, name), getattr(module, name))
    setattr(module, name, value)


def _holds_placeholder_ops(gm: fx.GraphModule) -> bool:
    return any(is_placeholder_op(n) for n in gm.graph.nodes)


class _LayoutOptDecision:
    """``GraphLowering.decide_layout_opt`` that answers ``False`` for a graph
    holding a placeholder's resize or ``fsdp.copy_``, and asks torch's (``wrapped``)
    otherwise. See [Note: Layout optimization and the placeholders]."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def __call__(self, gm: fx.GraphModule, *, is_inference: bool) -> bool:
        if _holds_placeholder_ops(gm):
            return False
        return self.wrapped(gm, is_inference=is_inference)


_DECIDE_LAYOUT_OPT = "torch._inductor.graph.GraphLowering.decide_layout_opt"


def _install_layout_opt_decision() -> None:
    lowering, name = owner(_DECIDE_LAYOUT_OPT)
    current = getattr(lowering, name)  # the function, or ours (not a descriptor)
    if not isinstance(current, _LayoutOptDecision):
        setattr(lowering, name, _LayoutOptDecision(current))


def _uninstall_layout_opt_decision() -> None:
    if cancel_when_inductor_loads(_install_layout_opt_decision):
        return  # it was still waiting for Inductor to load
    lowering, name = owner(_DECIDE_LAYOUT_OPT)
    current = getattr(lowering, name)
    if isinstance(current, _LayoutOptDecision):
        setattr(lowering, name, staticmethod(current.wrapped))


def install(config: PassConfig | None = None) -> None:
    """Makes Inductor run the passes on every post-grad graph, and AOTAutograd run
    :func:`save_checkpoint_outputs` on every joint graph; sets the other switches of
    [Note: Global switches]. Idempotent; keeps and runs a user's
    ``post_grad_custom_pre_pass`` after ours (a user's ``joint_custom_pass`` before
    ours). See [Note: Installing the passes].

    Args:
        config: if given, :func:`set_config` it first (default ``None``: keep).

    Raises:
        TypeError: ``config`` is not a :class:`PassConfig`.
    """
    if config is not None:
        set_config(config)
    if not isinstance(functorch_config.joint_custom_pass, TraceableHSDPJointPass):
        functorch_config.joint_custom_pass = TraceableHSDPJointPass(
            functorch_config.joint_custom_pass
        )
    if not functorch_config.recompute_views:
        _switch(functorch_config, "recompute_views", True)  # See [Note: Saved views of the placeholder].
    if get_config().overlap and inductor_config.reorder_for_peak_memory:
        # See [Note: Overlap and Inductor's scheduler] (overlap.py).
        _switch(inductor_config, "reorder_for_peak_memory", False)
        log.info("traceable_hsdp: torch._inductor.config.reorder_for_peak_memory = False (overlap)")
    # See [Note: Layout optimization and the placeholders], and [Note: Inductor's
    # internals, checked when Inductor loads] (traceable_hsdp/_torch_internals.py).
    when_inductor_loads(_install_layout_opt_decision)
    current = inductor_config.post_grad_custom_pre_pass
    if _is_ours(current):
        return
    inductor_config.post_grad_custom_pre_pass = TraceableHSDPPass(current)
    log.debug("traceable_hsdp passes installed (user pass kept: %r)", current)


def uninstall() -> None:
    """Undoes :func:`install`: the hooks and ``decide_layout_opt`` get back what ours
    wraps (a hook replaced since is left), and every flag of [Note: Global switches]
    its value from before. Does nothing where nothing is installed."""
    current = inductor_config.post_grad_custom_pre_pass
    if isinstance(current, TraceableHSDPPass):
        inductor_config.post_grad_custom_pre_pass = current.user_pass
    joint = functorch_config.joint_custom_pass
    if isinstance(joint, TraceableHSDPJointPass):
        functorch_config.joint_custom_pass = joint.user_pass
    for (module, name), old in _saved.items():
        setattr(module, name, old)
    _saved.clear()
    _uninstall_layout_opt_decision()
