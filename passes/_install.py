"""Plugging the passes into Inductor, their configuration, and every change
traceable_hsdp makes to torch's compile configuration.

[Note: Installing the passes]
:func:`install` (called by ``fully_shard``) sets Inductor's
``post_grad_custom_pre_pass`` to a :class:`TraceableHSDPPass`, which runs on every
post-grad graph (forward and compiled-autograd backward) before Inductor's own passes:
:func:`free_after_last_read` ([Note: Frees after the last read]), the passes
:class:`PassConfig` switches (:func:`run_passes`), :func:`gather_into_buffers` ([Note:
CPU all-gathers into buffers]), then the refusal of a graph the C++ wrapper cannot
call ([Note: Inductor's C++ wrapper]). A user pass already set runs after ours; the
cache key (``uuid()``) hashes both, every ``passes/*.py`` source and the
:class:`PassConfig`. It also sets functorch's ``joint_custom_pass`` to a
:class:`TraceableHSDPJointPass`, which runs the correctness fixes
:func:`save_checkpoint_outputs` and :func:`recompute_placeholder_views` on every joint
graph, for every backend, unswitched, then lets go of the joint trace ([Note: The joint
trace's tracer]). A joint pass already set runs first. It changes
only graphs with a ``BackwardState`` input, which bypass AOTAutograd's cache (whose
key ignores ``joint_custom_pass``).

[Note: Pass configuration]
``traceable_hsdp.passes.config`` is the :class:`PassConfig` in effect, read when a graph
is compiled (the cache key follows it). It starts from ``TRACEABLE_HSDP_PASSES``
(comma-separated pass names, ``bucket`` for both bucketing passes, ``all`` (default)
or ``none``) and ``TRACEABLE_HSDP_BUCKET_CAP_MB`` (MiB >= 0, or ``none`` for one
bucket per unit); in code, ``set_config`` or ``install(config=...)``. A unit's own
options (``hsdp(comm_fusion=...)``) travel in its collective annotations instead
([Note: Per-unit pass options] in ``bucket_collectives.py``).

[Note: Global switches]
Every change traceable_hsdp makes to torch's process-wide compile configuration is made
by :func:`install` and restored by :func:`uninstall` (entries of [Note: Torch
internals]): the two custom-pass hooks above; ``reorder_for_peak_memory = False`` when
``overlap`` is on ([Note: Overlap and Inductor's scheduler] in ``overlap.py``);
``recompute_views = True`` and the wrapped ``GraphLowering.decide_layout_opt`` (the
two Notes below). Only ``dump_graphs`` also writes configuration, for its block.

[Note: Saved views of the placeholder]
AOTAutograd's partitioner may save a view of a placeholder for backward, computed at
the end of the forward after the placeholder was freed. ``recompute_views = True``
recomputes such views in the backward, after the re-gather; one whose base is not
saved is [Note: Views of a placeholder are recomputed].

[Note: Layout optimization and the placeholders]
For a graph with a convolution Inductor lays tensors out channels-last, copying a
placeholder input into a channels-last buffer while it still has 0 bytes and resizing
the copy instead: a segfault in the first forward. The wrapped ``decide_layout_opt``
refuses layout optimization to a graph still holding a resize or ``fsdp.copy_`` after
our passes, a function of the hashed graph (cache-consistent); such convolutions run
contiguous.

[Note: Per-unit options and the FX graph cache]
The FX graph cache key does not hash node metadata, where a unit's pass options
travel. So ``uuid()`` also hashes the sorted ``label=options`` of every live unit with
options of its own (:func:`track_unit_options`, called by ``hsdp()``); labels are
module paths, the same in every process of a job, so a restarted job still hits. It
hashes this process's rank too: over two gloo ranks each rank's graph sends and adds
its own halves ([Note: gloo reduce-scatters as an exchange] in
``gloo/exchange.py``), so ranks that share a cache directory keep one entry each.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, fields, make_dataclass, replace
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
from .._torch_internals import cancel_when_inductor_loads, owner, resolve, when_inductor_loads
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

# One bool field per switched pass, default True, in run order.
_PassSwitches = make_dataclass(
    "_PassSwitches", [(name, bool, True) for name in _PASS_NAMES], frozen=True,
    namespace={"__module__": __name__},
)


@dataclass(frozen=True)
class PassConfig(_PassSwitches):  # type: ignore[misc, valid-type]
    """Which passes run on traceable_hsdp's compiled graphs.

    Args:
        <pass name>: one bool per switched pass of ``_registry.PASSES``, in run order
            (default ``True``); docs/passes.md says what each does.
        pool_exchange_outputs: the exchanges' outputs come from buffers kept across
            steps ([Note: Exchange outputs from a pool]): ``True`` in every graph,
            ``False`` in none; ``None`` (default) in the graphs that fill placeholders
            (a step or block compiled with compiled autograd), not in ``compile_block``'s
            ([Note: Where the exchanges pool]).
        bucket_cap_mb: merge adjacent units' collectives up to this many MiB
            (default 4, [Note: The default bucket cap]); ``None``: one bucket per unit.

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
    pool_exchange_outputs: bool | None = None
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
            elif f.name == "pool_exchange_outputs":
                if value is not None and not isinstance(value, bool):
                    raise TypeError(
                        "PassConfig.pool_exchange_outputs must be a bool, or None to pool "
                        f"only where placeholders fill, got {type(value).__name__} {value!r}."
                    )
            elif not isinstance(value, bool):
                raise TypeError(
                    f"PassConfig.{f.name} must be a bool, got {type(value).__name__} "
                    f"{value!r}."
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PassConfig:
        """Reads ``TRACEABLE_HSDP_PASSES`` and ``TRACEABLE_HSDP_BUCKET_CAP_MB`` from
        ``environ`` (default ``os.environ``); see [Note: Pass configuration]. Raises
        ``ValueError`` for an unknown pass name, ``none`` mixed with names, or a cap
        that is not a number >= 0."""
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
    """Replaces the configuration for every later compile (``TypeError`` unless
    ``config`` is a :class:`PassConfig`)."""
    global _config
    if not isinstance(config, PassConfig):
        raise TypeError(
            f"set_config expects a traceable_hsdp.passes.PassConfig, got "
            f"{type(config).__name__}."
        )
    _config = config


def run_passes(gm: fx.GraphModule, config: PassConfig | None = None) -> dict[str, int]:
    """Runs the enabled switched passes on the post-grad ``gm`` in place, in the
    registry's order, under ``config`` (default: :func:`get_config`); returns what
    each reported (regions removed, buckets made) by pass name."""
    cfg = get_config() if config is None else config
    return _run(gm, cfg, tuple(e for e in _POST_GRAD if e.switch))


# [Note: Where the exchanges pool]
# The exchange pool ([Note: Exchange outputs from a pool]) pays where it is measured to:
# a step compiled whole runs 8% faster with it (docs/benchmarks.md). compile_block's
# graphs gain nothing measurable from it, and its buffers sit idle through their
# backward, which raises the step's peak by the pool's size. So by default
# (``pool_exchange_outputs=None``) a graph pools its exchanges' outputs only if it
# fills placeholders (holds ``fsdp.copy_`` or a resize of a placeholder, as every graph
# of a step or block compiled with compiled autograd does, and no graph of
# ``compile_block``'s); it is decided before the passes remove those ops. ``True`` or
# ``False`` applies to every graph. Tested by ``test_pool_where_placeholders_fill``
# (tests/test_passes_unit.py).


def _pool_decided(gm: fx.GraphModule, cfg: PassConfig) -> PassConfig:
    """``cfg`` with ``pool_exchange_outputs`` decided for ``gm`` where it is ``None``
    ([Note: Where the exchanges pool])."""
    if cfg.pool_exchange_outputs is not None:
        return cfg
    return replace(cfg, pool_exchange_outputs=_holds_placeholder_ops(gm))


def _run(gm: fx.GraphModule, cfg: PassConfig, entries: tuple[PassEntry, ...]) -> dict[str, int]:
    """Runs ``entries`` in order: switched ones when on, the others (and ``per_unit``
    ones, [Note: Per-unit pass options]) always."""
    cfg = _pool_decided(gm, cfg)
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
    """While ``holder`` (weakly referenced) is alive, its ``pass_options_key()``
    (the unit and its options) enters the FX graph cache key; see [Note: Per-unit
    options and the FX graph cache]."""
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
    """Warns once when units with pass options of their own are alive and a graph's
    collectives carry no annotation (torch 2.13's compiled-autograd backward)."""
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
# Inductor's C++ wrapper (``cpp_wrapper``) has no call for
# ``inductor.resize_storage_bytes_`` nor the exchanges' all-to-all, and a default root
# holds a resize in both graphs. Rather than let Inductor fail on a name the user never
# wrote, the pass refuses the graph, naming the switch and the fix.
def _refuse_cpp_wrapper(graph: fx.Graph) -> None:
    """``RuntimeError`` if the C++ wrapper is on and ``graph`` holds an op it cannot call."""
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
    """The post-grad pre-pass :func:`install` sets: our passes, then ``user_pass``
    (what ``post_grad_custom_pre_pass`` held, default ``None``). See [Note:
    Installing the passes]."""

    def __init__(self, user_pass: _UserPass = None) -> None:
        self.user_pass = user_pass

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        gm = graph.owning_module
        if isinstance(gm, fx.GraphModule):
            _warn_if_options_lost(graph)
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
        extra = f"{get_config()!r}|{user_ids!r}|{_unit_options_key()}|rank={_rank()}"
        return _cgp.get_hash_for_files(_sources(), extra)


def _rank() -> int | None:
    """This process's global rank (``None`` outside a process group). See [Note:
    Per-unit options and the FX graph cache]."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


class TraceableHSDPJointPass:
    """The ``joint_custom_pass`` :func:`install` sets: ``user_pass`` (what was there,
    a callable ``(joint_gm, joint_inputs) -> joint_gm``; default ``None``), the joint
    passes, then :func:`release_joint_trace`. See [Note: Installing the passes]."""

    def __init__(self, user_pass: Any = None) -> None:
        self.user_pass = user_pass

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        if callable(self.user_pass):
            gm = self.user_pass(gm, joint_inputs)
        _run(gm, get_config(), _JOINT)
        release_joint_trace(gm)
        return gm


# [Note: The joint trace's tracer]
# AOTAutograd traces the joint graph with make_fx, whose ``track_tensor_tree`` gives
# the graph's ``BackwardState`` input (how dynamo hands a forward's hooks to compiled
# autograd) a ``proxy`` attribute: that trace's proxy, and through it the tracer and
# the whole joint trace. Nothing reads it once the trace is done, but the
# ``BackwardState`` lives on as the ``val`` of a placeholder in the forward and
# backward graphs AOTAutograd keeps for compiled autograd, and the joint trace with it:
# for the whole step of docs/benchmarks.md's 8-layer HF Llama, two graphs of 2,200
# nodes each with their fake tensors and stack traces, kept for the life of the
# process. The joint pass runs after the trace and before the partitioner, so
# :func:`release_joint_trace` drops the attribute there; a later trace sets its own.
# Its effect on the peak is in docs/benchmarks.md ("Memory"). A torch whose
# ``track_tensor_tree`` no longer sets ``proxy`` raises ``TorchInternalError``
# ([Note: Torch internals]). Test: ``test_joint_trace_released`` (test_runtime.py).

_TRACK_TENSOR_TREE = "torch.fx.experimental.proxy_tensor.track_tensor_tree"
_BACKWARD_STATE = "torch.fx.experimental._backward_state.BackwardState"


def release_joint_trace(gm: fx.GraphModule) -> int:
    """Drops the joint trace that each ``BackwardState`` input of the joint graph ``gm``
    holds; returns how many held one. See [Note: The joint trace's tracer]."""
    resolve(_TRACK_TENSOR_TREE)
    backward_state = resolve(_BACKWARD_STATE)
    released = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, backward_state) and value.__dict__.pop("proxy", None) is not None:
            released += 1
    return released


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
    """``decide_layout_opt``: ``False`` for a graph holding a placeholder op, else
    ``wrapped``'s answer ([Note: Layout optimization and the placeholders])."""

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
    """Installs the passes and the other switches of [Note: Global switches]; see
    [Note: Installing the passes]. Idempotent. ``config`` (default ``None``: keep)
    is :func:`set_config` first (``TypeError`` unless a :class:`PassConfig`)."""
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
    """Undoes :func:`install` ([Note: Global switches]); a hook replaced since is
    left. Does nothing where nothing is installed."""
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
