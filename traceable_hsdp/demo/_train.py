"""The demo training job behind ``traceable-hsdp train``.

A small :class:`~traceable_hsdp.demo.models.Llama` sharded with
:func:`~traceable_hsdp.fully_shard` (FSDP on a 1-D mesh, HSDP on a 2-D
``(replicate, shard)`` mesh), trained with AdamW on synthetic tokens, compiled by
default. :func:`launch` starts the ranks (or joins the ones torchrun started);
:func:`train_rank` is the per-rank loop and returns the losses.

[Note: Synthetic data]
Uniformly random tokens cannot be learned, so the tokens walk a fixed random "bigram
language": every token has ``_BRANCHES`` successors drawn once from the seed, and the
loss falls from ``log(vocab)`` towards ``log(_BRANCHES)``. Step ``i``'s global batch
comes from a generator seeded with ``(seed, i)``, so ranks agree without
communicating; each trains on its own slice of ``batch_size`` rows.

[Note: Gradient clipping]
With ``clip`` set, each step calls ``torch.nn.utils.clip_grad_norm_`` eagerly between
``backward()`` and ``optim.step()``, when every gradient is reduced into ``.grad``. The
gradients are sharded ``DTensor``s, so torch's function reduces the partial norms over
the mesh and every rank scales by the same factor. The printed norm is the one before
clipping. ``tests/test_clip.py`` checks it against torch's ``fully_shard`` and a
one-process model.

[Note: Compile report]
A compiled run prints what step 1 compiled on rank 0: seconds per phase (torch's own
timers, :class:`~traceable_hsdp._cache.CompileTimes`) and FX graph and AOTAutograd
cache hits, misses and bypasses (:class:`~traceable_hsdp._cache.CacheCounts`). A rerun
on the same ``TORCHINDUCTOR_CACHE_DIR`` should show both graphs as hits ([Note: FX
graph cache keys across processes] in ``_cache.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "TrainConfig", "TrainResult", "launch", "train_rank", "torchrun_env", "resolve_device",
    "progress_enabled",
]

_BRANCHES = 4  # successors per token in the synthetic language; see [Note: Synthetic data]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


# ``TrainConfig.reshard_after_forward`` (torchtitan's names) -> ``fully_shard``'s value.
RESHARD_AFTER_FORWARD: dict[str, bool | None] = {"default": None, "always": True, "never": False}


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Args:
        layers: transformer blocks (default 4).
        dim: model width (default 64).
        heads: attention heads; ``dim / heads`` must be even (default 4).
        vocab_size: tokens (default 256).
        seq_len: tokens per sequence (default 64).
        batch_size: sequences per rank per step (default 4).
        steps: optimizer steps (default 8).
        world_size: ranks to spawn when not under torchrun (default 2; with
            ``device="cuda"`` at most one per visible GPU).
        replicate: HSDP replicas; 1 is plain FSDP (default 1).
        lr: AdamW learning rate (default 3e-3).
        ac: activation checkpointing on every block: ``"none"`` (default),
            ``"full"`` (``checkpoint_wrapper``, then fully_shard, torchtitan's order) or
            ``"selective"`` (the same with a policy that saves the matmuls). See
            [Note: Demo initialization and activation checkpointing].
        init: ``"meta"`` (default) or ``"cpu"``; the same weights. See [Note: Demo
            initialization and activation checkpointing].
        clip: clip gradients to this total norm each step (default ``None``). See
            [Note: Gradient clipping].
        backend: ``torch.compile`` backend (default ``"inductor"``).
        device: ``"cpu"`` (gloo ranks), ``"cuda"`` (NCCL, one rank per GPU) or
            ``"auto"`` (default: ``"cuda"`` when a GPU is visible, else ``"cpu"``);
            see :func:`resolve_device` and [Note: Devices and process groups].
        mixed_precision: ``"none"`` (default) or ``"bf16"``: bf16 parameters, fp32
            reduction.
        reshard_after_forward: by torchtitan's names: ``"default"`` (``None``),
            ``"always"`` (``True``) or ``"never"`` (``False``).
        eager: run without ``torch.compile`` (default ``False``).
        seed: model init and data seed (default 0).
        progress: a tqdm bar on rank 0's stderr; ``None`` (default) only when stderr
            is a terminal (:func:`progress_enabled`).
        dump_dir: if set, every rank dumps its compiled graphs to ``dump_dir/rank<r>``
            with :func:`traceable_hsdp.dump_graphs` (default ``None``). Needs
            ``eager=False``.
        dump_trace: with ``dump_dir``, also write a structured trace (and run
            tlparse on it when installed) (default ``False``).
    """

    layers: int = 4
    dim: int = 64
    heads: int = 4
    vocab_size: int = 256
    seq_len: int = 64
    batch_size: int = 4
    steps: int = 8
    world_size: int = 2
    replicate: int = 1
    lr: float = 3e-3
    ac: Literal["none", "full", "selective"] = "none"
    init: Literal["meta", "cpu"] = "meta"
    clip: float | None = None
    backend: str = "inductor"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: Literal["none", "bf16"] = "none"
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    eager: bool = False
    seed: int = 0
    progress: bool | None = None
    dump_dir: str | None = None
    dump_trace: bool = False


@dataclass(frozen=True)
class TrainResult:
    """What rank 0 saw.

    Args:
        losses: the loss of each step, averaged over all ranks.
        step_times: wall seconds of each step; the first includes compilation.
        world_size: ranks that trained.
        replicate: HSDP replicas (1 for FSDP).
        grad_norms: with ``TrainConfig.clip``, the total gradient norm of each step
            before clipping (what ``clip_grad_norm_`` returned); ``None`` without.
        first_step_compile: what rank 0's first step compiled (``"times"``,
            ``"cache"``); ``None`` when eager. See [Note: Compile report].
    """

    losses: list[float]
    step_times: list[float]
    world_size: int
    replicate: int
    grad_norms: list[float] | None = None
    first_step_compile: dict[str, dict[str, float]] | None = None

    @property
    def median_step_time(self) -> float | None:
        """Median step time without the first two steps (compile and warm-up), or
        ``None`` when there were two steps or fewer."""
        rest = self.step_times[2:]
        return statistics.median(rest) if rest else None


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when torchrun (or another launcher) set
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; ``None`` when none is set.

    Raises:
        ValueError: only some of the three are set, or one is not an integer.
    """
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        return None
    if len(present) != len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise ValueError(
            f"Found {', '.join(present)} in the environment but not {', '.join(missing)}. "
            "Launch with torchrun (which sets all three), or unset them to let "
            "traceable-hsdp spawn its own ranks."
        )
    try:
        rank, world, local = (int(os.environ[v]) for v in _TORCHRUN_VARS)
    except ValueError:
        found = {v: os.environ[v] for v in _TORCHRUN_VARS}
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers, got {found}.")
    return rank, world, local


# [Note: Devices and process groups]
# ``device="cuda"`` is one rank per GPU on NCCL (``cuda:RANK`` spawned,
# ``cuda:LOCAL_RANK`` under torchrun); ``"cpu"`` is gloo ranks. ``"auto"`` is resolved
# once, in the launching process (:func:`resolve_device`), and never falls back
# silently: ``"cuda"`` without a GPU is an error.


def resolve_device(requested: str) -> Literal["cpu", "cuda"]:
    """``"cpu"`` or ``"cuda"`` for ``TrainConfig.device``; see [Note: Devices and
    process groups].

    Raises:
        ValueError: ``requested`` is not ``"auto"``, ``"cpu"`` or ``"cuda"``, or it is
            ``"cuda"`` and torch sees no GPU (or has no NCCL).
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}.")
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = dist.is_available() and dist.is_nccl_available()
    if requested == "auto":
        return "cuda" if gpus and nccl else "cpu"
    if not gpus:
        built = (f"built with CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a CPU-only build")
        raise ValueError(
            f"--device cuda: torch {torch.__version__} ({built}) sees no CUDA device "
            "(torch.cuda.is_available() is False). Run on a machine with GPUs and a CUDA "
            "build of torch, or use --device cpu (or auto)."
        )
    if not nccl:
        raise ValueError(
            "--device cuda: this torch build has no NCCL (torch.distributed."
            "is_nccl_available() is False). Use --device cpu."
        )
    return "cuda"


def progress_enabled(progress: bool | None, stream: TextIO) -> bool:
    """Whether to draw the progress bar on ``stream``: ``progress`` when given, else
    only when ``stream`` is a terminal (tqdm's convention for ``disable=None``)."""
    if progress is not None:
        return progress
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


# ---------------------------------------------------------------------- data


def _successor_table(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, _BRANCHES), generator=g)  # 2D


def _global_batch(
    table: torch.Tensor, rows: int, seq_len: int, seed: int, step: int
) -> torch.Tensor:
    """``rows`` sequences of ``seq_len + 1`` tokens (inputs plus the shifted target).
    See [Note: Synthetic data]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(rows, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, table.size(0), (rows,), generator=g)
    choice = torch.randint(0, _BRANCHES, (rows, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return tokens


# ---------------------------------------------------------------------- model


def _build_mesh(device_type: str, world: int, replicate: int) -> DeviceMesh:
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


# [Note: Demo initialization and activation checkpointing]
# ``init="meta"`` is FSDP2's flow for large models: build on meta, shard, ``to_empty``,
# then ``set_model_state_dict(..., broadcast_from_rank0=True)`` from the model rank 0
# builds (seeded, so equal to ``init="cpu"``, where every rank builds it whole). The
# rotary buffers are recomputed. With ``ac`` every block is wrapped in
# ``checkpoint_wrapper`` before sharding (torchtitan's order).


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _build_sharded(
    cfg: TrainConfig, model_cfg: Any, mesh: DeviceMesh, device: torch.device, rank: int
) -> torch.nn.Module:
    """The demo Llama, sharded; see [Note: Demo initialization and activation
    checkpointing]."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import traceable_hsdp
    from .models import Llama

    mp_policy = traceable_hsdp.MixedPrecisionPolicy()
    if cfg.mixed_precision == "bf16":
        mp_policy = traceable_hsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    raf = RESHARD_AFTER_FORWARD[cfg.reshard_after_forward]
    full_sd: dict[str, torch.Tensor] = {}
    if cfg.init == "cpu" or rank == 0:
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        full = Llama(model_cfg)
        full_sd = full.state_dict()
    if cfg.init == "cpu":
        model = full.to(device)
    else:
        with torch.device("meta"):
            model = Llama(model_cfg)
    for i, layer in enumerate(model.layers):
        if cfg.ac != "none":
            kw = {}
            if cfg.ac == "selective":
                kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            layer = checkpoint_wrapper(layer, **kw)
            model.layers[i] = layer
        traceable_hsdp.fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=raf)
    traceable_hsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=raf)
    if cfg.init == "meta":
        model.to_empty(device=device)
        model.reset_buffers()
        # checkpoint_wrapper's state dict hooks keep the unwrapped keys: full_sd fits.
        set_model_state_dict(
            model, full_sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
    return model


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (the job's summary line)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_rank(cfg: TrainConfig, device: torch.device, out: TextIO | None = None) -> TrainResult:
    """Trains on this rank of the initialized default process group and returns the
    losses (averaged over ranks) and step times. Rank 0 prints each step and a summary
    to ``out`` (default ``sys.stdout``) and shows a progress bar on stderr.

    Args:
        cfg: the run.
        device: this rank's device (``cpu`` for gloo, ``cuda:LOCAL_RANK`` for NCCL).
        out: where rank 0 prints (default ``sys.stdout``).

    Raises:
        RuntimeError: no default process group is initialized.
        ValueError: the world size is not divisible by ``cfg.replicate``.
    """
    # Imported here so that ``traceable_hsdp.demo.cli --help`` stays cheap.
    from tqdm import tqdm

    from .models import LlamaConfig

    if not dist.is_initialized():
        raise RuntimeError(
            "train_rank needs an initialized default process group; use launch(), or "
            "call torch.distributed.init_process_group() first."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cfg.replicate:
        raise ValueError(
            f"The world size {world} is not divisible by replicate={cfg.replicate}; HSDP "
            "needs world_size = replicate * shard. Change --replicate or the number of ranks."
        )
    out = sys.stdout if out is None else out
    is_rank0 = rank == 0

    def say(msg: str) -> None:
        if is_rank0:
            tqdm.write(msg, file=out)
            out.flush()

    mesh = _build_mesh(device.type, world, cfg.replicate)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.layers, n_heads=cfg.heads,
        max_seq_len=cfg.seq_len,
    )
    model = _build_sharded(cfg, model_cfg, mesh, device, rank)
    n_params = sum(p.numel() for p in model.parameters())
    # See [Note: Optimizer steps on local shards] (optim.py); fused, as torchtitan.
    from ..optim import AdamW

    optim = AdamW(model.parameters(), lr=cfg.lr, fused=True)

    mode = "eager" if cfg.eager else f"compiled ({cfg.backend})"
    layout = (
        f"FSDP over {_count(world, 'rank')}" if cfg.replicate == 1
        else f"HSDP {cfg.replicate} replicas x {world // cfg.replicate} shards"
    )
    command = "train" if cfg.dump_dir is None else "dump"
    say(
        f"traceable-hsdp {command}: Llama {_count(cfg.layers, 'layer')}, dim {cfg.dim}, "
        f"{_count(cfg.heads, 'head')}, "
        f"{n_params / 1e6:.2f}M params; {layout} on {device.type} "
        f"({dist.get_backend()}); {mode}; batch {cfg.batch_size}/rank x seq {cfg.seq_len}; "
        f"{_count(cfg.steps, 'step')}; init on {cfg.init}"
        + ("" if cfg.ac == "none" else f"; {cfg.ac} activation checkpointing")
        + ("" if cfg.clip is None else f"; clip grad norm {cfg.clip:g}")
        + ("" if cfg.mixed_precision == "none" else f"; {cfg.mixed_precision} mixed precision")
        + ("" if cfg.reshard_after_forward == "default"
           else f"; reshard after forward: {cfg.reshard_after_forward}")
    )

    if cfg.dump_dir is not None and cfg.eager:
        raise ValueError("TrainConfig.dump_dir dumps compiled graphs; it needs eager=False.")
    with contextlib.ExitStack() as stack:
        backend: Any = cfg.backend
        dump = None
        if cfg.dump_dir is not None:
            from ..debug._dump import dump_graphs

            dump = stack.enter_context(dump_graphs(
                os.path.join(cfg.dump_dir, f"rank{rank}"), trace=cfg.dump_trace,
                print_summary=is_rank0, file=out,
            ))
            backend = dump.backend(cfg.backend)
        losses, times, norms, compiled = _train_loop(
            cfg, model, optim, backend, device, rank, world, say
        )
    if dump is not None:
        _compare_rank_dumps(cfg.dump_dir, world, say)

    result = TrainResult(losses, times, world, cfg.replicate, norms, compiled)
    med = result.median_step_time
    med_text = (
        f"median step {med:.3f} s (steps 3-{cfg.steps})" if med is not None
        else "median step n/a (needs more than 2 steps)"
    )
    say(f"done: final loss {losses[-1]:.4f}; {med_text}; first step {times[0]:.3f} s")
    return result


def _train_loop(
    cfg: TrainConfig,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    backend: Any,
    device: torch.device,
    rank: int,
    world: int,
    say: Callable[[str], None],
) -> tuple[
    list[float], list[float], list[float] | None, dict[str, dict[str, float]] | None
]:
    """Compiles (unless eager) and trains; returns the losses, step times, (with
    ``cfg.clip``) gradient norms, and (compiled) the first step's compile report."""
    from tqdm import tqdm

    import traceable_hsdp
    from traceable_hsdp import _compile
    from traceable_hsdp._cache import CacheCounts, CompileTimes

    # Turn compiled autograd off at the end only if this function turned it on.
    enabled_here = not cfg.eager and not _compile._enabled
    if not cfg.eager:
        # See [Note: Why compiled autograd] in _compile.py.
        traceable_hsdp.enable_compiled_autograd(backend=backend)
        model = torch.compile(model, backend=backend)

    table = _successor_table(cfg.vocab_size, cfg.seed)
    lo, hi = rank * cfg.batch_size, (rank + 1) * cfg.batch_size
    losses: list[float] = []
    times: list[float] = []
    norms: list[float] | None = None if cfg.clip is None else []
    compiled: dict[str, dict[str, float]] | None = None
    counts0, times0 = CacheCounts.now(), CompileTimes.now()
    show_bar = rank == 0 and progress_enabled(cfg.progress, sys.stderr)
    bar = tqdm(total=cfg.steps, desc="train", unit="step", disable=not show_bar,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for step in range(cfg.steps):
            batch = _global_batch(table, world * cfg.batch_size, cfg.seq_len, cfg.seed, step)
            batch = batch[lo:hi].to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            _sync(device)
            t0 = time.perf_counter()
            loss = _loss_fn(model(x), y)
            loss.backward()
            if cfg.clip is not None:
                # Outside the compiled region; see [Note: Gradient clipping].
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            optim.step()
            optim.zero_grad()
            _sync(device)
            dt = time.perf_counter() - t0
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # for the printout only, outside the timed step
            value = mean_loss.item() / world
            losses.append(value)
            times.append(dt)
            norm_text = ""
            if norms is not None:
                norms.append(norm.item())  # replicated: the same on every rank
                norm_text = f"  grad norm {norms[-1]:#.4g}"
            what = "compile+step" if step == 0 and not cfg.eager else "step"
            say(f"step {step + 1}/{cfg.steps}  loss {value:.4f}{norm_text}  {what} {dt:.3f} s")
            if step == 0 and not cfg.eager:
                # See [Note: Compile report].
                counts, ctimes = CacheCounts.now() - counts0, CompileTimes.now() - times0
                compiled = {"times": asdict(ctimes), "cache": asdict(counts)}
                say(f"first step: {ctimes.summary()}; {counts.summary()} (rank {rank})")
            bar.set_postfix(loss=f"{value:.4f}")
            bar.update(1)
    finally:
        bar.close()
        if enabled_here:
            traceable_hsdp.disable_compiled_autograd()

    return losses, times, norms, compiled


def _compare_rank_dumps(dump_dir: str, world: int, say: Callable[[str], None]) -> None:
    """On rank 0, after every rank wrote its dump: do all ranks hold the same
    collectives in the same order? See :func:`traceable_hsdp.debug._dump.compare_dumps`."""
    from ..debug._dump import compare_dumps

    dist.barrier()
    if dist.get_rank() == 0:
        say(compare_dumps([os.path.join(dump_dir, f"rank{r}") for r in range(world)]))


# --------------------------------------------------------------------- launch


def _rank_device(device_type: str, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device and process-group backend; see [Note: Devices and process
    groups]."""
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        if local_rank >= gpus:
            raise ValueError(
                f"Local rank {local_rank} has no GPU: {gpus} visible, and --device cuda "
                "runs one rank per GPU. Start at most that many ranks per node."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _spawned_rank(rank: int, cfg: TrainConfig, tmp: str) -> None:
    device, pg_backend = _rank_device(cfg.device, rank)
    if device.type == "cpu":
        threads = max(1, (os.cpu_count() or 1) // cfg.world_size)
        torch.set_num_threads(threads)
    dist.init_process_group(
        pg_backend, init_method=f"file://{tmp}/store", rank=rank, world_size=cfg.world_size
    )
    try:
        result = train_rank(cfg, device)
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump(asdict(result), f)
    finally:
        dist.destroy_process_group()


def _run_torchrun_rank(cfg: TrainConfig, local_rank: int) -> TrainResult:
    device, backend = _rank_device(cfg.device, local_rank)
    already = dist.is_initialized()
    if not already:
        dist.init_process_group(backend)
    try:
        return train_rank(cfg, device)
    finally:
        if not already:
            dist.destroy_process_group()


def launch(cfg: TrainConfig) -> TrainResult | None:
    """Runs ``cfg`` on every rank and returns rank 0's result.

    Under torchrun this process is one rank (``cfg.world_size`` is ignored; ranks other
    than 0 return ``None``); otherwise it spawns ``cfg.world_size`` processes and waits.

    Raises:
        ValueError: a partial torchrun environment, a world size not divisible by
            ``cfg.replicate``, ``device="cuda"`` without GPUs, or more spawned ranks
            than GPUs.
        torch.multiprocessing.ProcessRaisedException: a spawned rank failed; the
            message holds its traceback.
    """
    cfg = replace(cfg, device=resolve_device(cfg.device))
    env = torchrun_env()
    if env is not None:
        rank, _, local_rank = env
        result = _run_torchrun_rank(cfg, local_rank)
        return result if rank == 0 else None
    if cfg.world_size % cfg.replicate:
        raise ValueError(
            f"world_size={cfg.world_size} is not divisible by replicate={cfg.replicate}."
        )
    if cfg.device == "cuda" and cfg.world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size={cfg.world_size} with device='cuda' needs {cfg.world_size} GPUs "
            f"(one rank per GPU); {torch.cuda.device_count()} visible."
        )
    with tempfile.TemporaryDirectory(prefix="traceable_hsdp_") as tmp:
        mp.start_processes(
            _spawned_rank, args=(cfg, tmp), nprocs=cfg.world_size, start_method="spawn"
        )
        with open(os.path.join(tmp, "result.json")) as f:
            return TrainResult(**json.load(f))
