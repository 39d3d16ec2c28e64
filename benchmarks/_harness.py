"""Per-rank side of the step-time benchmark: the variants, their settings, the timed
round-robin loop, and the graph/collective bookkeeping.

Imported by ``step_time.py`` (the CLI, which spawns the ranks and writes the report)
and ``profile_step.py``. Nothing here touches the runtime or the passes: it only
builds models with the public APIs, flips the documented switches, and reads graphs.

[Note: Where the ranks run]
On the CPU, ``CPU_WORLD`` (2) gloo ranks, one thread each, share the machine's cores.
On CUDA, one NCCL rank per visible GPU (NCCL cannot put two ranks on one GPU): rank
``r`` on ``cuda:r``, the model built on the CPU from the same seed and moved there,
every batch generated on the CPU (the same tokens as on the CPU run) and copied there
before the step's timer starts. CUDA runs asynchronously, so a step's timer starts and
stops after ``torch.cuda.synchronize()``. A :class:`Placement` says which; the CLIs
build it with :func:`resolve_placement`. The global batch is ``world`` times the
per-rank batch, so every rank keeps its per-rank shape whatever the world size.

[Note: Memory per variant]
CPU: the process's peak RSS (``ru_maxrss``), which cannot be reset, read after the
variant's first round: a high-water mark in run order. CPU with ``--heap``: the live
heap of the rank's process, counted by the shim of ``_heap.py`` ([Note: A heap peak on
the CPU] there), its peak reset at each block's start as CUDA's; the figure is the
largest peak above a block's start over the variant's blocks after its first (which
holds its compile). CUDA:
``torch.cuda.reset_peak_memory_stats()`` at the start of each of the variant's blocks
and ``torch.cuda.max_memory_allocated()`` at its end, the variant's figure being the
largest over its blocks. Either way every variant's tensors live in the same process,
so the CUDA figure includes the other variants' models and optimizer states; the
allocated bytes at each block's start are kept as well, and the report also gives the
peak above them. On the CPU, for a variant whose graphs take buffers from the pool our
exchanges keep between steps ([Note: Exchange outputs from a pool] in
``passes/gloo/_pool.py``; :attr:`Variant.pools_exchanges`), those bytes leave the pool out:
its buffers are that step's memory, reused rather than allocated in it, so the peak
above the block's start counts them whole. The pool is the process's, so a buffer
pooled for another variant of ours counts too, and so does the whole pool for a
variant of ours whose passes leave the exchanges out: its figure can only be too
high. Every other variant (torch's, the eager ones) counts the pool in its start, as
any memory it does not touch, so its peak leaves it out (counted in every variant's
figure, the pool would read torch's peaks about 21 MiB too high in an ``ac_cost.py``
run that mixes ours compiled with torch's variants).

[Note: Round-robin timing]
Every variant lives in the same processes (one per rank) for the whole run. A round gives each
variant, in turn, its own warm-up steps and then ``steps`` timed steps; several
rounds are run and the medians are taken over all timed steps of all rounds. A burst
of machine noise (the 2-core box is shared) then lands on every variant alike
instead of on whichever ran during it. Each variant keeps its own model, optimizer
and step counter across rounds, so its k-th step always sees batch k.

The default alternates step by step (``step_time.py``: 1 timed step per variant per
round, 20 rounds, no warm-up after the compile step). The machine's speed moves in
steps of seconds to minutes, which land on whole blocks of steps: on the 2-core
Xeon, blocks of 5 steps put six runs of the same code at 0.44x to 0.61x of torch's
per-block compile, and of two of our compiled variants the one first in the order
lost by 11-26% (swapping the order swapped the winner). Step by step, two runs with
the order of five variants reversed between them give torch's per-block step 214.0
and 209.2 ms and our eager step 1.01x of torch's in both
(``benchmarks/results/step_time_overhead_demo_interleaved{,_rev}_1127.*``). Two of
our compiled variants in one process still differ by 7-10% with the order, the
earlier one faster, so an A/B of two of ours runs each variant in its own processes
(``--processes``), or in both orders, read as the geometric mean of the two.

[Note: One model per process]
A user's process holds one model; the round-robin loop holds every variant's. With
``--processes N``, ``step_time.py`` instead runs each variant alone in its own
spawned ranks (:func:`run_isolated`), ``N`` times, the order reversed every other
time (the variants as given, then backwards, ...), all on one Inductor cache: a
variant's first process compiles cold and its later ones warm. Within a process the
variant takes ``rounds`` rounds of its own steps. The medians are over every timed
step of every process, so machine noise spreads over the variants as the processes
alternate, in slices of a process (tens of seconds) rather than a step. The compile
column is the first process's first step; every process's first step is kept in the
JSON (``first_step_s_per_process``). Each process starts from the same weights and
batches, so every process of a variant must give the same losses
(``losses_same_in_every_process``).

[Note: Per-variant settings]
Some switches are global to the process and read at compile time or run time:
compiled autograd (on only while an ``ours_compiled*`` variant steps, so torch's
variants never run under it), the passes' configuration (``TRACEABLE_HSDP_PASSES``),
``torch._functorch.config.recompute_views`` (our ``fully_shard`` turns it on for the
whole process; torch's variants get torch's default back), and the recording post-grad
pass. :meth:`Runner.active` sets them on entry and restores them on exit, around every
block of a variant's steps, including its first (compiling) step and its model build.

[Note: What counts as a compile]
Two counters: dynamo graphs (``counters["stats"]["unique_graphs"]``, the forward
graphs and the compiled-autograd backward graphs) and Inductor compiles (calls of the
recording post-grad pass, one per graph Inductor compiles: a forward, an AOT backward,
a compiled-autograd backward). Anything either counter gains after a variant's first
step is reported as a recompile after warm-up; it must stay 0.

[Note: Collectives per step]
The recording pass (the graph vocabulary's ``PostGradRecorder``) is appended to
``torch._inductor.config.post_grad_custom_post_pass`` (after whatever is already
there). It keeps the graph it is handed; later post-grad passes (torch's own
bucketing, reinplacing) rewrite that same graph object in place, so reading it after
the compile shows the graph Inductor finally lowered. Collectives are counted from its
nodes and sized from their ``meta["val"]`` by the vocabulary's ``collective_totals``:
an all-gather by its output (the gathered buffer), a reduce-scatter by its input (the
full gradient), an all-reduce by its tensor. Every recorded graph of a variant runs
once per step (the profiled step checks: Inductor graph calls per step equal graphs
recorded).
"""

from __future__ import annotations

import dataclasses
import contextlib
import gc
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import _heap

CPU_WORLD = 2  # gloo ranks on the CPU. See [Note: Where the ranks run]
LR = 1e-3
PASSES_ENV = "TRACEABLE_HSDP_PASSES"


# ------------------------------------------------------------------ placement

DeviceType = Literal["cpu", "cuda"]
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class MemoryMetric:
    """The per-variant memory figure of a run. See [Note: Memory per variant].

    Args:
        key: its name in the JSON report.
        label: its name in the markdown report, with the unit.
        column: the markdown table's column header (before the ranks it lists).
        what: how it is measured, one sentence for the report.
    """

    key: str
    label: str
    column: str
    what: str


PEAK_RSS = MemoryMetric(
    "peak_rss_mib", "peak RSS MiB", "peak RSS MiB after round 1",
    "the process's peak resident set size after the variant's first round (a high-water "
    "mark: every variant shares the process, in run order)",
)
HEAP_PEAK = MemoryMetric(
    "heap_peak_above_start_mib", "heap peak above the block's start MiB",
    "heap peak above block start MiB",
    "the most live heap (glibc's blocks, every thread; benchmarks/_heap.py) above its "
    "size at the start of each of the variant's blocks after the first, the largest "
    "over those blocks: what the variant's steps add at most",
)
GPU_MAX_ALLOCATED = MemoryMetric(
    "gpu_max_allocated_mib", "GPU max allocated MiB", "GPU max allocated MiB",
    "torch.cuda.max_memory_allocated() over each of the variant's blocks, reset at the "
    "start of each (it counts every live tensor of the process, the other variants' "
    "models and optimizer states too), the largest over its blocks",
)


@dataclass(frozen=True)
class Placement:
    """Where a run's ranks live. See [Note: Where the ranks run].

    Args:
        device_type: ``"cpu"`` (gloo ranks) or ``"cuda"`` (NCCL, rank ``r`` on
            ``cuda:r``).
        world: the number of ranks.
        heap: on the CPU, whether the ranks count their heap (``step_time.py --heap``;
            see [Note: Memory per variant]).
    """

    device_type: DeviceType
    world: int
    heap: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def memory_metric(self) -> MemoryMetric:
        if self.device_type == "cuda":
            return GPU_MAX_ALLOCATED
        return HEAP_PEAK if self.heap else PEAK_RSS

    def rank_device(self, rank: int) -> torch.device:
        """This rank's device: ``cuda:rank`` or the CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", rank)
        return torch.device("cpu")


def resolve_device(requested: str) -> DeviceType:
    """The device type a ``--device`` value asks for: ``auto`` is ``cuda`` when
    ``torch.cuda.is_available()``, else ``cpu``.

    Raises:
        ValueError: ``requested`` is not one of ``auto``, ``cpu``, ``cuda``; or it is
            ``cuda`` and this torch sees no usable CUDA device.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(
            f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}."
        )
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda
        why = (
            f"this torch ({torch.__version__}) is a CPU-only build" if built is None
            else f"this torch ({torch.__version__}, CUDA {built}) finds no usable GPU "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        )
        raise ValueError(
            f"--device cuda, but torch.cuda.is_available() is False: {why}. Run on the "
            "CPU with --device cpu (or --device auto), or on a machine with an NVIDIA GPU "
            "and a CUDA build of torch."
        )
    return "cuda" if requested == "cuda" else "cpu"


def resolve_world(device_type: DeviceType, world: int | None) -> int:
    """The number of ranks: ``world`` when given, else ``CPU_WORLD`` on the CPU and one
    per visible GPU (``torch.cuda.device_count()``) on CUDA.

    Raises:
        ValueError: ``world`` is below 1; or, on CUDA, no GPU is visible or ``world``
            is more than the visible GPUs (NCCL needs one GPU per rank).
    """
    if world is not None and world < 1:
        raise ValueError(f"--world must be >= 1, got {world}.")
    if device_type == "cpu":
        return CPU_WORLD if world is None else world
    visible = torch.cuda.device_count()
    where = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    if visible < 1:
        raise ValueError(
            f"--device cuda, but torch.cuda.device_count() is 0 ({where}). Make a GPU "
            "visible or run with --device cpu."
        )
    if world is None:
        return visible
    if world > visible:
        raise ValueError(
            f"--world {world} with --device cuda: NCCL needs one GPU per rank and "
            f"torch.cuda.device_count() is {visible} ({where}). Pass --world between 1 "
            f"and {visible}, or leave it out for one rank per GPU."
        )
    return world


def add_placement_args(parser: Any) -> None:
    """``--device`` and ``--world`` on an ``argparse`` parser (both CLIs)."""
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto: cuda when torch.cuda.is_available(), else cpu (default auto)")
    parser.add_argument("--world", type=int, default=None,
                        help="number of ranks (default: 2 on cpu, torch.cuda.device_count() "
                             "on cuda; at most that many on cuda, one rank per GPU)")


def placement_from_args(parser: Any, args: Any) -> Placement:
    """:func:`resolve_placement` of the parsed ``--device``/``--world``; a bad value
    is the parser's error (exit status 2)."""
    try:
        return resolve_placement(args.device, args.world)
    except ValueError as e:
        parser.error(str(e))
        raise  # parser.error exits; for type checkers


def resolve_placement(device: str, world: int | None) -> Placement:
    """:func:`resolve_device` then :func:`resolve_world`; raises their ``ValueError``."""
    device_type = resolve_device(device)
    return Placement(device_type, resolve_world(device_type, world))


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's (``platform.processor()``, else the machine)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine() or "cpu"


def sync(device: torch.device) -> None:
    """Waits for the work queued on ``device`` (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new CUDA peak, or heap peak on a CPU rank that counts its heap; the
    CPU's peak RSS cannot be reset (a no-op there). See [Note: Memory per variant]."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _heap.active():
        _heap.reset_peak()


def peak_memory_mib(device: torch.device) -> float:
    """The placement's memory metric now: CUDA max allocated since the last
    :func:`reset_peak_memory`, the most live heap since then on a CPU rank that counts
    its heap, or else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if _heap.active():
        return _heap.peak_mib()
    return peak_rss_mib()


def allocated_mib(device: torch.device, pooled: bool = False) -> float | None:
    """CUDA bytes allocated now, or live heap bytes on a CPU rank that counts its heap,
    less our pooled exchange buffers for a variant that takes from the pool
    (``pooled``: [Note: Memory per variant]), in MiB; ``None`` on another CPU rank."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    if _heap.active():
        return _heap.live_mib() - (_pooled_mib() if pooled else 0.0)
    return None


def _pooled_mib() -> float:
    """The MiB our exchanges keep pooled between steps ([Note: Memory per variant])."""
    try:
        from traceable_hsdp.passes import exchange_pool_bytes
    except ImportError:
        return 0.0
    return exchange_pool_bytes() / 2**20


# --------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One model/batch shape (of the demo Llama of ``traceable_hsdp.demo.models`` or of HF's
    ``LlamaForCausalLM``: see :data:`MODELS`).

    Args:
        name: label in the report.
        layers, dim, heads, vocab: the model.
        seq: tokens per sequence.
        batch: sequences per rank per step.
    """

    name: str
    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int
    batch: int

    def model_config(self) -> Any:
        from traceable_hsdp.demo.models import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab, dim=self.dim, n_layers=self.layers,
            n_heads=self.heads, max_seq_len=self.seq,
        )


SHAPES: dict[str, Shape] = {
    "overhead": Shape("overhead", layers=16, dim=64, heads=4, vocab=256, seq=32, batch=2),
    "compute": Shape("compute", layers=4, dim=256, heads=4, vocab=256, seq=128, batch=2),
    "smoke": Shape("smoke", layers=2, dim=32, heads=4, vocab=256, seq=16, batch=2),
}


# ------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One way of running the same training step.

    Args:
        name: label in the report.
        impl: ``"ours"`` (traceable_hsdp.fully_shard), ``"torch"``
            (torch.distributed.fsdp.fully_shard) or ``"unsharded"`` (plain model, rank 0
            only).
        compile: ``"none"`` (eager), ``"whole"`` (``torch.compile(model,
            fullgraph=True)``; for ours with compiled autograd), ``"blocks"`` (each
            block compiled, torchtitan's recipe) or ``"blocks_ca"`` (ours: each block
            compiled in place, ``block.compile(fullgraph=True)``, with compiled
            autograd on: the units' gathers in the block graph, the backward one
            compiled-autograd graph) or ``"per_block"`` (ours: each block compiled per
            block with ``traceable_hsdp.compile_block(block, fullgraph=True)`` after
            fully_shard, compiled autograd off: the unit's gathers and reduce-scatter in
            the block's forward and backward graphs).
        passes: the equivalent ``TRACEABLE_HSDP_PASSES`` value, also put in the
            environment while the variant runs (the passes module reads it only at
            import, so ``passes_config`` is what switches); ``None``: untouched.
        passes_config: the :class:`traceable_hsdp.passes.PassConfig` switches set with
            ``set_config`` while the variant builds, compiles and runs (restored after);
            empty when the module offers no ``PassConfig``.
        optimizer: ``"torch"`` (``torch.optim.AdamW``) or ``"local"``
            (``traceable_hsdp.optim.AdamW``: the same numbers, stepped on the
            ``DTensor``s' local shards; works on torch's ``fully_shard`` too).
        reshard_after_forward: passed to every ``fully_shard`` call; ``None`` is the
            default of both ours and torch's (the root stays gathered for backward).
        adamw: the optimizer's implementation, torch's ``foreach``/``fused``
            argument: ``"default"`` passes neither (torch's choice: on the CPU its
            single-tensor loop; see [Note: The AdamW implementation]).
    """

    name: str
    impl: Literal["ours", "torch", "unsharded"]
    compile: Literal["none", "whole", "blocks", "blocks_ca", "per_block"]
    passes: str | None = None
    passes_config: tuple[tuple[str, Any], ...] = ()
    optimizer: Literal["torch", "local"] = "torch"
    reshard_after_forward: bool | None = None
    adamw: Literal["default", "foreach", "fused"] = "default"

    @property
    def compiled(self) -> bool:
        return self.compile != "none"

    @property
    def uses_compiled_autograd(self) -> bool:
        return self.impl == "ours" and self.compile in ("whole", "blocks_ca")

    @property
    def pools_exchanges(self) -> bool:
        """Whether the graphs Inductor compiles for this variant may take exchange
        buffers from our pool: ours with its collectives in compiled graphs, the pool
        on for its mode: by default the graphs that fill placeholders (whole, per block
        with compiled autograd) and not ``compile_block``'s ([Note: Where the exchanges
        pool] in ``passes/_install.py``; [Note: Memory per variant])."""
        if self.impl != "ours" or self.compile not in ("whole", "blocks_ca", "per_block"):
            return False
        pool = dict(self.passes_config).get("pool_exchange_outputs", _pool_default())
        return self.compile != "per_block" if pool is None else bool(pool)


def _pool_default() -> bool | None:
    """``PassConfig``'s default for the exchange pool (``None``: the mode decides);
    ``False`` where the passes module has no pool."""
    try:
        from traceable_hsdp.passes import PassConfig
    except ImportError:
        return False
    return getattr(PassConfig(), "pool_exchange_outputs", False)


# [Note: The AdamW implementation]
# torch.optim.AdamW picks its implementation from the parameters when given neither
# ``foreach`` nor ``fused`` (``_default_to_fused_or_foreach``): never fused, and
# foreach only on a device with foreach kernels (CUDA, not the CPU; ``DTensor`` is
# registered as a foreach type). So on the CPU every variant here, sharded or not,
# steps with the single-tensor loop: about ten ops per parameter, each dispatched
# through DTensor for a sharded one, which costs the overhead shape's 147 parameters
# 20-25 ms a step (docs/benchmarks.md). torchtitan's default is ``fused`` and HF
# Trainer's ``adamw_torch_fused``: what those jobs run. ``--adamw`` sets the same
# implementation for every variant of a run, so the ratios stay side by side; the
# default keeps torch's choice.
ADAMW_IMPLS: dict[str, dict[str, bool]] = {
    "default": {}, "foreach": {"foreach": True}, "fused": {"fused": True},
}


def add_adamw_argument(p: Any) -> None:
    """``--adamw``, for the scripts that build variants (``step_time.py``,
    ``profile_step.py``)."""
    p.add_argument("--adamw", choices=tuple(ADAMW_IMPLS), default="default",
                   help="AdamW implementation for every variant: foreach=True, fused=True "
                        "(torchtitan's and HF Trainer's default), or torch's choice, which "
                        "on the CPU is the single-tensor loop (default); see [Note: The "
                        "AdamW implementation] in _harness.py")


def adamw_phrase(impl: str) -> str:
    """How every variant's AdamW ran, for the reports (``--adamw``)."""
    if impl == "default":
        return "AdamW as torch picks it (on the CPU its single-tensor loop)"
    return f"AdamW `{impl}=True` for every variant"


def adamw_suffix(impl: str) -> str:
    """What a report's file name adds for ``--adamw`` (nothing for the default)."""
    return "" if impl == "default" else f"_adamw_{impl}"


def pass_variants() -> tuple[list[Variant], str]:
    """The ``ours_compiled*`` variants the passes module supports, and a line saying
    what was found: ``ours_compiled`` runs every pass (``PassConfig()``),
    ``ours_compiled_nopasses`` none, and one ``ours_compiled_no_<pass>`` per switch of
    :class:`traceable_hsdp.passes.PassConfig` turned off alone."""
    try:
        from traceable_hsdp.passes import PassConfig
    except Exception as e:  # noqa: BLE001 (report, do not crash the benchmark)
        return (
            [
                Variant("ours_compiled", "ours", "whole", passes="all"),
                Variant("ours_compiled_nopasses", "ours", "whole", passes="none"),
            ],
            f"traceable_hsdp.passes.PassConfig not importable ({type(e).__name__}: {e}); "
            f"passes switched by {PASSES_ENV} only",
        )
    import dataclasses

    # The pool's default is None (each graph decides); it is switched like a pass.
    switches = [
        f.name for f in dataclasses.fields(PassConfig)
        if isinstance(getattr(PassConfig(), f.name), bool) or f.name == "pool_exchange_outputs"
    ]
    on = tuple((n, True) for n in switches)
    off = tuple((n, False) for n in switches)
    out = [
        Variant("ours_compiled", "ours", "whole", passes="all", passes_config=on),
        Variant("ours_compiled_nopasses", "ours", "whole", passes="none", passes_config=off),
    ]

    def names_a_pass(n: str) -> bool:  # a switch that is not a pass (the pool) is not
        try:  # named in the environment variable, which names passes only
            PassConfig.from_env({PASSES_ENV: n})
        except ValueError:
            return False
        return True

    passes = [m for m in switches if names_a_pass(m)]
    if len(switches) > 1:
        for n in switches:
            cfg = tuple((m, m != n) for m in switches)
            out.append(
                Variant(
                    f"ours_compiled_no_{n}", "ours", "whole",
                    passes=",".join(m for m in passes if m != n), passes_config=cfg,
                )
            )
    if any(f.name == "bucket_cap_mb" for f in dataclasses.fields(PassConfig)):
        # Every pass, with the bucket cap beside the default's (see [Note: The default
        # bucket cap] in passes/bucket_collectives.py): one bucket per unit, and
        # adjacent units merged up to 1 and 16 MiB.
        for name, cap in (("per_unit", None), ("cap1mb", 1.0), ("cap16mb", 16.0)):
            out.append(
                Variant(f"ours_compiled_{name}", "ours", "whole", passes="all",
                        passes_config=(*on, ("bucket_cap_mb", cap)))
            )
    return out, f"passes (traceable_hsdp.passes.PassConfig switches): {', '.join(switches)}"


# [Note: Variants that would share compiled graphs]
# Dynamo keys what it compiled on the code it traced and the guards that code's run
# installed; compiled autograd keys its backward on the autograd graph's nodes. Neither
# sees the passes' configuration, which only Inductor reads, after both. Since the units
# of one module class share one FSDP class (as torch's), two models of the same class
# and shapes pass each other's guards: in one process, the second variant's first step
# runs the graphs the first variant compiled, with the first one's passes, and compiles
# nothing (in a round-robin, ``ours_compiled_per_unit`` and ``ours_compiled_cap16mb``
# after ``ours_compiled`` report a compile of 0.0 s and the same step time). So variants of ours compiled the same way (``whole`` or
# ``blocks_ca``) but with different passes cannot share a set of processes: in the
# round-robin :func:`graph_sharing_conflicts` names them and ``step_time.py`` refuses
# the mix, naming ``--processes`` (each variant alone in its own ranks), and
# ``profile_step.py``, which runs its variants one after the other, resets dynamo
# (``torch._dynamo.reset()``, compiled autograd's cache included) before each.
# Variants that differ in what the traced code reads (``reshard_after_forward``) or
# in what runs outside the graphs (the optimizer) share nothing wrong: the first
# recompiles on its guards, the second runs the very graphs it would compile. The
# check is conservative: two variants that differ in their passes are a conflict even
# where a third setting would make the second recompile anyway.


def _passes_key(v: Variant) -> tuple[Any, ...] | None:
    """What a variant compiles its graphs of ours with: its passes settings, for a
    variant whose collectives our passes rewrite (ours compiled whole, or per block
    with compiled autograd); ``None`` for the others."""
    if v.impl != "ours" or v.compile not in ("whole", "blocks_ca"):
        return None
    return (v.compile, v.passes, v.passes_config)


def graph_sharing_conflicts(variants: list[Variant]) -> list[tuple[str, str]]:
    """Pairs of ``variants`` (names, in order) that would run each other's compiled
    graphs in one process: ours, compiled the same way, with different passes. See
    [Note: Variants that would share compiled graphs]."""
    out = []
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            ka, kb = _passes_key(a), _passes_key(b)
            if ka is not None and kb is not None and ka[0] == kb[0] and ka != kb:
                out.append((a.name, b.name))
    return out


def default_variants(variants: list[Variant]) -> list[Variant]:
    """The variants a run without ``--variants`` takes: all of ``variants`` but those
    whose passes differ from ``ours_compiled``'s (the pass switches and bucket caps),
    which one process cannot run beside it ([Note: Variants that would share compiled
    graphs]); name them to run them, with ``--processes``."""
    ref = next(v for v in variants if v.name == "ours_compiled")
    return [v for v in variants if not graph_sharing_conflicts([ref, v])]


def pick_variants(variants: list[Variant], spec: str) -> list[Variant]:
    """The variants that ``spec`` (a comma list of names) names, each once, in the
    order given (an A/B run swaps it: [Note: Round-robin timing]).

    Raises:
        ValueError: a name is not one of ``variants``'; the message lists them.
    """
    by_name = {v.name: v for v in variants}
    want = [w.strip() for w in spec.split(",") if w.strip()]
    bad = [w for w in want if w not in by_name]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; known: {sorted(by_name)}")
    return [by_name[w] for w in dict.fromkeys(want)]


def all_variants() -> tuple[list[Variant], str]:
    """Every variant, in run order, and the passes line."""
    ours_compiled, what = pass_variants()
    default = next(v for v in ours_compiled if v.name == "ours_compiled")
    return (
        [
            Variant("ours_eager", "ours", "none"),
            *ours_compiled,
            dataclasses.replace(default, name="ours_compiled_local_adamw", optimizer="local"),
            # Every unit resharded after forward, the root too, beside the default
            # (``None``: the root kept gathered for backward).
            dataclasses.replace(default, name="ours_compiled_reshard_root",
                                reshard_after_forward=True),
            # torchtitan's per-block recipe with our fully_shard: the blocks compiled,
            # the gathers and reductions eager around them (docs/compile.md).
            Variant("ours_block_compiled", "ours", "blocks"),
            # The same recipe in torchtitan's in-place form, with compiled autograd
            # on: each block's gathers in its graph, the backward captured whole.
            Variant("ours_block_compiled_ca", "ours", "blocks_ca"),
            # Each block compiled once per kind with compile_block(): the unit's
            # gathers and reduce-scatter in the block's graphs, no compiled autograd.
            Variant("ours_per_block", "ours", "per_block"),
            # The same with the exchange pool, which compile_block's graphs leave out
            # by default: what it would cost and give (docs/benchmarks.md, "Memory").
            Variant("ours_per_block_pool", "ours", "per_block",
                    passes_config=(("pool_exchange_outputs", True),)),
            Variant("torch_eager", "torch", "none"),
            Variant("torch_block_compiled", "torch", "blocks"),
            Variant("torch_block_compiled_local_adamw", "torch", "blocks", optimizer="local"),
            Variant("unsharded_compiled_1rank", "unsharded", "whole"),
        ],
        what,
    )


# ------------------------------------------------- compile / graph bookkeeping


class Recorder:
    """The recording post-grad pass, with the variant that compiled each graph. The
    pass is the graph vocabulary's recorder
    (``traceable_hsdp.debug._recorder.PostGradRecorder``, made on first use so that
    importing this module imports no traceable_hsdp): its ``uuid()`` is ``None``, so
    it bypasses the FX graph cache and sees every graph Inductor compiles. See
    [Note: Collectives per step]."""

    def __init__(self) -> None:
        self._pass: Any = None
        self.variant = "?"

    @property
    def pass_(self) -> Any:
        """The ``PostGradRecorder`` to put in ``post_grad_custom_post_pass``."""
        if self._pass is None:
            from traceable_hsdp.debug._recorder import PostGradRecorder

            self._pass = PostGradRecorder(self._tag)
        return self._pass

    def _tag(self, rec: Any) -> None:
        rec.tag = self.variant

    @property
    def calls(self) -> int:
        return 0 if self._pass is None else self._pass.calls

    def summary(self, variant: str) -> dict[str, Any]:
        from traceable_hsdp.debug._table import collective_totals

        mine = [g for g in (self._pass.graphs if self._pass else []) if g.tag == variant]
        per_graph = []
        total: dict[str, dict[str, int]] = {}
        for g in mine:
            c = collective_totals(g.final_graph())
            per_graph.append({"backward": g.backward, "collectives": c})
            for kind, v in c.items():
                slot = total.setdefault(kind, {"count": 0, "bytes": 0})
                slot["count"] += v["count"]
                slot["bytes"] += v["bytes"]
        return {"inductor_graphs": len(mine), "per_graph": per_graph, "per_step": total}


RECORDER = Recorder()


def compile_counts() -> tuple[int, int]:
    """(dynamo graphs compiled, Inductor graphs compiled) so far in this process.
    See [Note: What counts as a compile]."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), RECORDER.calls


def _unwaited_works() -> int:
    try:
        return int(torch._C._distributed_c10d._get_work_registry_size())
    except Exception:  # noqa: BLE001 (older torch)
        return -1


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------- runner


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch_for(
    shape: Shape, step: int, seed: int, rank: int, world: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (``world * shape.batch``
    sequences, generated on the CPU), on ``device`` (default the CPU): the same on
    every variant."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tok = torch.randint(0, shape.vocab, (world * shape.batch, shape.seq + 1), generator=g)
    mine = tok[rank * shape.batch:(rank + 1) * shape.batch]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    if device is not None and device.type != "cpu":
        x, y = x.to(device), y.to(device)
    return x, y


@contextlib.contextmanager
def set_env(name: str, value: str | None, keep_none: bool = True) -> Iterator[None]:
    """``os.environ[name]`` set to ``value`` for the block (ranks spawned in it inherit
    it), as it was after. ``None`` leaves the variable as it is (``keep_none``) or
    removes it."""
    if value is None and keep_none:
        yield
        return
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _passes_config(items: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """``traceable_hsdp.passes.config`` with ``items`` replaced, and the passes
    installed in Inductor (``fully_shard`` installs them too; idempotent)."""
    if not items:
        yield
        return
    import dataclasses

    from traceable_hsdp import passes as P

    old = P.get_config()
    P.set_config(dataclasses.replace(old, **dict(items)))
    P.install()
    try:
        yield
    finally:
        P.set_config(old)


MODELS = ("demo", "hf_llama")
"""What ``--model`` builds: ``demo``, the Llama of ``traceable_hsdp.demo.models``;
``hf_llama``, Hugging Face ``transformers``' ``LlamaForCausalLM`` (see
:func:`build_hf_llama`)."""


def model_description(model: str, shape: Shape) -> str:
    """The model a report ran, in words (its width and MLP)."""
    if model == "hf_llama":
        return (f"HF `LlamaForCausalLM` (transformers), hidden {shape.dim}, "
                f"MLP {2 * shape.dim}")
    return f"demo Llama (`traceable_hsdp.demo.models`), dim {shape.dim}, MLP {4 * shape.dim}"


def build_hf_llama(
    variant: Variant, shape: Shape, mesh: Any, device: torch.device, backend: str, seed: int,
) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """Hugging Face ``LlamaForCausalLM`` of ``shape`` (hidden ``shape.dim``, MLP twice
    the width, ``shape.heads`` heads with as many key/value heads, untied embeddings,
    ``use_cache=False``; random weights from ``seed``, nothing downloaded), built on the
    CPU, moved to ``device`` and sharded and compiled exactly as :func:`build_model`
    does the demo Llama: ``fully_shard`` per decoder layer, then the root; torch's
    per-block recipe compiles each decoder layer first. The callable returns the
    logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=2 * shape.dim,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads, max_position_embeddings=shape.seq,
        tie_word_embeddings=False, use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    run = _shard_and_compile(model, model.model.layers, variant, mesh, backend)
    return model, lambda x: run(input_ids=x).logits


def _shard_and_compile(
    model: torch.nn.Module, blocks: torch.nn.ModuleList, variant: Variant, mesh: Any,
    backend: str,
) -> Callable[..., Any]:
    """Shards ``model`` as ``variant`` says (``fully_shard``, ours or torch's, on each of
    ``blocks``, then on the root; nothing for the unsharded variant) and returns what
    runs its forward: the model, or the model compiled whole. With per-block compile
    (torchtitan's recipe) each block is compiled first, in place in ``blocks``."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import traceable_hsdp

    if variant.impl != "unsharded":
        fs = traceable_hsdp.fully_shard if variant.impl == "ours" else torch_fully_shard
        if variant.compile == "blocks":
            for i, block in enumerate(blocks):
                blocks[i] = torch.compile(block, backend=backend, fullgraph=True)
        elif variant.compile == "blocks_ca":
            for block in blocks:
                block.compile(backend=backend, fullgraph=True)
        raf = variant.reshard_after_forward
        for block in blocks:
            fs(block, mesh=mesh, reshard_after_forward=raf)
        fs(model, mesh=mesh, reshard_after_forward=raf)
        if variant.compile == "per_block":
            for block in blocks:
                traceable_hsdp.compile_block(block, backend=backend, fullgraph=True)
    if variant.compile == "whole":
        return torch.compile(model, backend=backend, fullgraph=True)
    return model


def build_model(
    variant: Variant, shape: Shape, mesh: Any, device: torch.device, backend: str, seed: int,
    model: str = "demo",
) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The variant's model (the same initial weights for every variant: built on the CPU
    from ``seed``, moved to ``device``), sharded over ``mesh`` as the variant says, and
    the callable that runs its forward (compiled with ``backend`` as the variant says).
    ``model`` is one of :data:`MODELS` (``hf_llama``: :func:`build_hf_llama`). Sets no
    process-wide switch (see :meth:`Runner.active` for those)."""
    if model == "hf_llama":
        return build_hf_llama(variant, shape, mesh, device, backend, seed)
    if model != "demo":
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    from traceable_hsdp.demo.models import Llama

    torch.manual_seed(seed)
    model = Llama(shape.model_config()).to(device)
    return model, _shard_and_compile(model, model.layers, variant, mesh, backend)


class Runner:
    """One variant on this rank: its model, optimizer, settings and step counter.

    Args:
        variant: what to run.
        shape: model and batch shape.
        mesh: the 1-D device mesh over all ranks (unused by ``unsharded``).
        rank: this rank.
        device: this rank's device; the model is built on the CPU and moved there.
        backend: ``torch.compile`` backend for the compiled variants.
        seed: model init seed (the same for all variants) and data seed.
        model: one of :data:`MODELS` (default ``"demo"``).
        default_recompute_views: torch's value of ``recompute_views`` before our
            ``fully_shard`` changed it. See [Note: Per-variant settings].
        default_pre_pass: ``post_grad_custom_pre_pass`` before our ``fully_shard``
            installed the passes there; torch's variants compile with it.
        record_graphs: put :data:`RECORDER` among Inductor's post-grad passes, for the
            collective counts (default ``True``). It keeps every post-grad graph alive
            and turns the FX graph cache off, which a memory measurement must not do
            ([Note: Peak resident memory per variant] in ``memory.py``).
    """

    def __init__(
        self, variant: Variant, shape: Shape, mesh: Any, rank: int, backend: str,
        seed: int, default_recompute_views: bool, default_pre_pass: Any = None,
        device: torch.device | None = None, model: str = "demo", record_graphs: bool = True,
    ) -> None:
        self.v = variant
        self.record_graphs = record_graphs
        self.model_name = model
        self.shape = shape
        self.mesh = mesh
        self.rank = rank
        self.device = torch.device("cpu") if device is None else device
        self.backend = backend
        self.seed = seed
        self.default_recompute_views = default_recompute_views
        self.default_pre_pass = default_pre_pass
        self.model: torch.nn.Module | None = None
        self.fwd: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.steps_done = 0

    @property
    def runs_here(self) -> bool:
        return self.v.impl != "unsharded" or self.rank == 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The variant's process-wide settings, restored on exit.
        See [Note: Per-variant settings]."""
        import torch._functorch.config as fconfig
        import torch._inductor.config as iconfig

        import traceable_hsdp

        from torch._inductor.custom_graph_pass import get_custom_graph_passes

        RECORDER.variant = self.v.name
        old_post = iconfig.post_grad_custom_post_pass
        old_pre = iconfig.post_grad_custom_pre_pass
        existing = get_custom_graph_passes(old_post)
        old_rv = fconfig.recompute_views
        if self.v.impl != "ours":
            # torch's variants compile as torch would: without our passes.
            iconfig.post_grad_custom_pre_pass = self.default_pre_pass
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                set_env(PASSES_ENV, self.v.passes if self.v.impl == "ours" else None))
            stack.enter_context(_passes_config(self.v.passes_config))
            record = self.record_graphs and self.backend == "inductor"
            if record and RECORDER.pass_ not in existing:
                iconfig.post_grad_custom_post_pass = [*existing, RECORDER.pass_]
            fconfig.recompute_views = (
                True if self.v.impl == "ours" else self.default_recompute_views
            )
            if self.v.uses_compiled_autograd:
                traceable_hsdp.enable_compiled_autograd(backend=self.backend)
            try:
                if self.model is None:
                    self._build()
                yield
            finally:
                if self.v.uses_compiled_autograd:
                    traceable_hsdp.disable_compiled_autograd()
                iconfig.post_grad_custom_post_pass = old_post
                if self.v.impl != "ours":
                    iconfig.post_grad_custom_pre_pass = old_pre
                fconfig.recompute_views = old_rv
                RECORDER.variant = "?"

    def _build(self) -> None:
        self.model, self.fwd = build_model(
            self.v, self.shape, self.mesh, self.device, self.backend, self.seed,
            model=self.model_name,
        )
        impl = ADAMW_IMPLS[self.v.adamw]
        if self.v.optimizer == "local":
            from traceable_hsdp.optim import AdamW

            self.opt = AdamW(self.model.parameters(), lr=LR, **impl)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, **impl)

    def optimizer_line(self) -> str:
        """The optimizer as built: ``torch.optim.adamw.AdamW(foreach=None, fused=True)``."""
        assert self.opt is not None
        d = self.opt.defaults
        cls = type(self.opt)
        impl = f"foreach={d.get('foreach')}, fused={d.get('fused')}"
        return f"{cls.__module__}.{cls.__name__}({impl})"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, loss, backward, AdamW step, zero_grad. Returns the detached loss."""
        assert self.fwd is not None and self.opt is not None
        loss = loss_fn(self.fwd(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps_done += 1
        return loss.detach()


# ---------------------------------------------------------------- per rank


@dataclass
class VariantResult:
    """What one rank measured for one variant (all lists in step order)."""

    name: str
    first_step_s: float | None = None
    # timed[r] = the step times of round r
    timed: list[list[float]] = field(default_factory=list)
    warmup: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # this rank's local loss, every step
    compiles_first_step: tuple[int, int] = (0, 0)
    compiles_after: tuple[int, int] = (0, 0)  # (dynamo, inductor) after the first step
    graph_calls: dict[str, int] = field(default_factory=dict)
    profiled_step_compiles: tuple[int, int] = (0, 0)
    # The optimizer as built: its class and implementation switches (Runner.optimizer_line).
    optimizer: str | None = None
    # The placement's memory metric after each block of this variant, and (CUDA only)
    # the MiB allocated at each block's start. See [Note: Memory per variant].
    peak_mem_mib: list[float] = field(default_factory=list)
    allocated_at_start_mib: list[float | None] = field(default_factory=list)
    collectives: dict[str, Any] | None = None
    # Functional-collective works issued but never waited (c10d's registry), after
    # each of this variant's blocks: should stay 0.
    unwaited_works_after: list[int] = field(default_factory=list)
    error: str | None = None  # first line of the exception that stopped the variant
    traceback: str | None = None


def _count_graph_calls(events: Any) -> dict[str, int]:
    calls = {"dynamo_frames": 0, "inductor_graphs": 0, "aot_backward": 0}
    for e in events:
        n = e.name
        if n.startswith("Torch-Compiled Region"):
            calls["dynamo_frames"] += 1
        elif n.startswith("## Call CompiledFxGraph"):
            calls["inductor_graphs"] += 1
        elif n == "CompiledFunctionBackward":
            calls["aot_backward"] += 1
    return calls


FAILED_ELSEWHERE = "failed on another rank"


def run_rank(
    rank: int, placement: Placement, shape: Shape, variants: list[Variant], rounds: int,
    steps: int, warmup: int, backend: str, seed: int, progress: bool, count_graphs: bool,
    model: str = "demo",
) -> dict[str, Any]:
    """The round-robin loop on this rank, on ``model`` (one of :data:`MODELS`). See
    [Note: Round-robin timing] and [Note: Where the ranks run]."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch._dynamo
    import torch._functorch.config as fconfig

    # Many compiled variants share code objects (Module._call_impl); keep them all.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    import torch._inductor.config as iconfig

    default_rv = fconfig.recompute_views
    default_pre = iconfig.post_grad_custom_pre_pass
    world = placement.world
    device = placement.rank_device(rank)
    mesh = init_device_mesh(placement.device_type, (world,), mesh_dim_names=("shard",))
    runners = [
        Runner(v, shape, mesh, rank, backend, seed, default_rv, default_pre, device, model)
        for v in variants
    ]
    results = {v.name: VariantResult(v.name) for v in variants}

    # Round 0: the compile step, then `warmup` warm-up steps; later rounds: `warmup`.
    per_round = warmup + steps
    total = len(runners) * (rounds * per_round + 1)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=shape.name, unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=1.0)

    def one_step(runner: Runner, res: VariantResult) -> float:
        x, y = batch_for(shape, runner.steps_done, seed, rank, world, device)
        before = compile_counts()
        sync(device)  # the copies and anything queued before: not this step's time
        t0 = time.perf_counter()
        loss = runner.step(x, y)
        sync(device)
        dt = time.perf_counter() - t0
        after = compile_counts()
        delta = (after[0] - before[0], after[1] - before[1])
        res.losses.append(float(loss))
        if runner.steps_done == 1:
            res.first_step_s = dt
            res.compiles_first_step = delta
            res.optimizer = runner.optimizer_line()
        else:
            res.compiles_after = (res.compiles_after[0] + delta[0], res.compiles_after[1] + delta[1])
        if bar is not None:
            bar.update(1)
        return dt

    try:
        for rnd in range(rounds):
            for runner in runners:
                res = results[runner.v.name]
                if bar is not None:
                    bar.set_description(f"{shape.name} round {rnd + 1}/{rounds} {runner.v.name}")
                if res.error is not None:
                    if bar is not None:
                        bar.update(per_round)
                    continue
                gc.collect()
                dist.barrier()
                reset_peak_memory(device)
                start = allocated_mib(device, runner.v.pools_exchanges)
                res.allocated_at_start_mib.append(start)
                failed = 0
                if runner.runs_here:
                    try:
                        with runner.active():
                            n_warm = warmup + (1 if rnd == 0 else 0)
                            for _ in range(n_warm):
                                dt = one_step(runner, res)
                                if runner.steps_done > 1:
                                    res.warmup.append(dt)
                            res.timed.append([one_step(runner, res) for _ in range(steps)])
                    except Exception as e:  # noqa: BLE001 (reported, the others go on)
                        import traceback

                        res.error = f"{type(e).__name__}: {e}".strip()
                        res.traceback = traceback.format_exc()
                        failed = 1
                        print(f"[rank {rank}] {runner.v.name} FAILED: {res.error.splitlines()[0]}",
                              file=sys.stderr, flush=True)
                res.peak_mem_mib.append(peak_memory_mib(device))
                # The other ranks idle here while rank 0 runs the unsharded variant alone.
                # All ranks agree on a failure, so they skip the variant from now on
                # together. The flag lives on the rank's device (NCCL needs it there).
                flag = torch.tensor([failed], device=device)
                dist.all_reduce(flag)
                if int(flag) and res.error is None:
                    res.error = FAILED_ELSEWHERE
                res.unwaited_works_after.append(_unwaited_works())
                _checkpoint(_rank_result(rank, runners, results, backend, variants, rnd, device))
            _checkpoint(_rank_result(rank, runners, results, backend, variants, rnd + 1, device))
        if count_graphs:
            _profile_graph_calls(runners, results, shape, seed, rank, world, device)
    finally:
        if bar is not None:
            bar.close()
    return _rank_result(rank, runners, results, backend, variants, rounds, device)


def _rank_result(
    rank: int, runners: list[Runner], results: dict[str, VariantResult], backend: str,
    variants: list[Variant], rounds_done: int, device: torch.device,
) -> dict[str, Any]:
    for runner in runners:
        if runner.v.compiled and backend == "inductor":
            results[runner.v.name].collectives = RECORDER.summary(runner.v.name)
    return {
        "rank": rank,
        "device": {"type": device.type, "index": device.index, "name": device_name(device)},
        "variants": {k: dict(vars(v)) for k, v in results.items()},
        "peak_rss_mib": peak_rss_mib(),  # the host process's, on CUDA too
        "order": [v.name for v in variants],
        "rounds_done": rounds_done,
    }


_PARTIAL_PATH: list[str] = []  # set in a spawned rank: where to checkpoint


def _checkpoint(result: dict[str, Any]) -> None:
    """Writes this rank's results so far, so that a rank that dies later (a crash in
    native code, a kill) still leaves the completed rounds behind."""
    import pickle

    if _PARTIAL_PATH:
        tmp = _PARTIAL_PATH[0] + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, _PARTIAL_PATH[0])


def _profile_graph_calls(
    runners: list[Runner], results: dict[str, VariantResult], shape: Shape, seed: int,
    rank: int, world: int, device: torch.device,
) -> None:
    """One extra, untimed step per compiled variant under the profiler, counting the
    compiled graphs it calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)

    for runner in runners:
        if not runner.v.compiled or results[runner.v.name].error is not None:
            continue
        dist.barrier()
        if runner.runs_here:
            with runner.active():
                x, y = batch_for(shape, runner.steps_done, seed, rank, world, device)
                before = compile_counts()
                with profile(activities=activities) as prof:
                    runner.step(x, y)
                    sync(device)
                after = compile_counts()
            res = results[runner.v.name]
            res.graph_calls = _count_graph_calls(prof.events())
            res.profiled_step_compiles = (after[0] - before[0], after[1] - before[1])
        dist.barrier()


# ------------------------------------------------------------------- spawning


def spawn_worker(
    rank: int, tmp: str, placement: Placement, fn: Callable[..., Any], kwargs: dict[str, Any],
) -> None:
    """Entry point of a spawned rank: one thread (as torchrun sets for several ranks),
    gloo on the CPU or NCCL on ``cuda:rank``, ``fn(rank, placement, **kwargs)``, write
    the result."""
    import pickle
    import traceback

    import datetime
    import faulthandler

    faulthandler.enable()  # a native crash (SIGSEGV, SIGABRT) prints the Python stack
    _PARTIAL_PATH.append(os.path.join(tmp, f"rank{rank}.partial.pkl"))
    torch.set_num_threads(1)
    device = placement.rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A variant that fails on one rank only leaves the others in a collective; the
    # timeout turns that hang into an error.
    dist.init_process_group(
        placement.backend, init_method=f"file://{tmp}/store", rank=rank,
        world_size=placement.world, timeout=datetime.timedelta(minutes=15),
        # NCCL: bind the group to this rank's GPU (barriers then need no guess).
        device_id=device if device.type == "cuda" else None,
    )
    try:
        result: Any = ("ok", fn(rank, placement, **kwargs))
    except BaseException:  # sent to the parent, which prints it and fails
        result = ("error", traceback.format_exc())
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_spawned(placement: Placement, **kwargs: Any) -> list[dict[str, Any]]:
    """Runs :func:`run_rank` on ``placement.world`` spawned ranks; returns their
    results (rank order) or raises ``RuntimeError`` with every failing rank's
    traceback."""
    return run_spawned_fn(run_rank, placement, **kwargs)


def run_isolated(placement: Placement, variants: list[Variant], processes: int,
                 **kwargs: Any) -> list[dict[str, Any]]:
    """Each of ``variants`` alone in its own spawned ranks, ``processes`` times, the
    order reversed every other time; returns per-rank results shaped as
    :func:`run_spawned`'s, each variant's rounds those of all its processes. See
    [Note: One model per process]."""
    runs: dict[str, list[list[dict[str, Any]]]] = {v.name: [] for v in variants}
    for p in range(processes):
        for v in (variants if p % 2 == 0 else variants[::-1]):
            runs[v.name].append(run_spawned(placement, variants=[v], **kwargs))
    return [_merge_processes(r, runs) for r in range(placement.world)]


def _merge_processes(rank: int, runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Rank ``rank``'s results of every variant's processes as one rank result."""
    first = next(iter(runs.values()))[0][rank]
    merged: dict[str, Any] = {
        "rank": rank, "device": first["device"], "variants": {},
        "peak_rss_mib": max(proc[rank]["peak_rss_mib"] for procs in runs.values() for proc in procs),
        "order": list(runs), "rounds_done": first["rounds_done"],  # per process
    }
    for name, procs in runs.items():
        vs = [proc[rank]["variants"][name] for proc in procs]
        m = dict(vs[0])  # the first process's: compile, graph calls, collectives
        for key in ("timed", "warmup", "peak_mem_mib", "allocated_at_start_mib", "unwaited_works_after"):
            m[key] = [x for v in vs for x in v[key]]
        m["compiles_after"] = tuple(sum(v["compiles_after"][i] for v in vs) for i in (0, 1))
        bad = next((v for v in vs if v["error"]), None)
        m["error"], m["traceback"] = (bad["error"], bad["traceback"]) if bad else (None, None)
        m["first_step_s_per_process"] = [v["first_step_s"] for v in vs]
        m["losses_same_in_every_process"] = all(v["losses"] == vs[0]["losses"] for v in vs)
        merged["variants"][name] = m
    return merged


def run_spawned_fn(fn: Callable[..., Any], placement: Placement, **kwargs: Any) -> list[Any]:
    """Runs ``fn(rank, placement, **kwargs)`` on ``placement.world`` spawned ranks,
    like :func:`run_spawned`."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        ctx = mp.start_processes(
            spawn_worker, args=(tmp, placement, fn, kwargs), nprocs=placement.world,
            join=False, start_method="spawn",
        )
        try:
            while not ctx.join():
                pass
        except Exception as e:  # a rank died without writing (segfault, kill)
            died = str(e)
        else:
            died = ""
        results, errors = [], []
        partial = []
        for r in range(placement.world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (process died) {died}")
                ppath = os.path.join(tmp, f"rank{r}.partial.pkl")
                if os.path.exists(ppath):
                    with open(ppath, "rb") as f:
                        partial.append(pickle.load(f))
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {r}:\n{value}")
        if errors:
            if len(partial) == placement.world and not results:
                # Checkpointed after every variant block: keep what all ranks finished.
                done = min(p["rounds_done"] for p in partial)
                for p in partial:
                    p["incomplete"] = (
                        f"the run died during round {done + 1}; what ran before is kept: "
                        + "; ".join(errors)
                    )
                return partial
            raise RuntimeError("\n".join(errors))
        return results
