"""The ``traceable-hsdp`` console command.

Subcommands live in :data:`SUBCOMMANDS`, a registry of :class:`Subcommand`: each adds
its arguments to its own subparser, checks them, and runs. ``main`` parses, looks the
subcommand up by name and returns its exit status. To add one, write a
``Subcommand(name, help, add_arguments, run)`` and append it to ``SUBCOMMANDS``.

Run ``traceable-hsdp train`` (or ``python -m traceable_hsdp.demo.cli train``); under
``torchrun --nproc-per-node N -m traceable_hsdp.demo.cli train`` each process is one rank.
``traceable-hsdp dump OUT_DIR`` runs the same job for 2 steps with
:func:`traceable_hsdp.dump_graphs` on every rank (see docs/debugging.md).

Building the parser imports no part of torch beyond ``import torch``
(``--help`` stays quick; see [Note: Lazy public names] in ``__init__.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._train import TrainConfig

__all__ = ["Subcommand", "SUBCOMMANDS", "build_parser", "main", "BACKENDS"]

# The torch.compile backends the job runs with (the tests run aot_eager and inductor).
# torch registers more (cudagraphs, onnxrt, tvm, and testing-only ones); those are not
# offered: nothing here checks that they work with fully_shard and compiled autograd.
BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class Subcommand:
    """One ``traceable-hsdp <name>`` subcommand.

    Args:
        name: the word on the command line.
        help: one line for ``traceable-hsdp --help``.
        add_arguments: adds the subcommand's arguments to its subparser.
        run: runs it with the parsed arguments; the subparser is passed so that it can
            report invalid combinations with ``parser.error`` (exit status 2). Returns
            the exit status.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


# ----------------------------------------------------------------- argument types


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``low``, else an error naming ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "a non-negative integer")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


# -------------------------------------------------------------------------- train


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    _add_job_arguments(p, steps=None, eager=True)


def _add_job_arguments(p: argparse.ArgumentParser, *, steps: int | None, eager: bool) -> None:
    """The training job's arguments, shared by ``train`` and ``dump``: ``steps``
    overrides the default number of steps; ``eager`` offers ``--eager``."""
    from ._train import RESHARD_AFTER_FORWARD, TrainConfig

    d = TrainConfig()
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=_positive_int, default=d.layers,
                       help="transformer blocks (default %(default)s)")
    model.add_argument("--dim", type=_positive_int, default=d.dim,
                       help="model width (default %(default)s)")
    model.add_argument("--heads", type=_positive_int, default=d.heads,
                       help="attention heads; dim/heads must be even (default %(default)s)")
    data = p.add_argument_group("data and optimizer")
    data.add_argument("--seq-len", type=_positive_int, default=d.seq_len,
                      help="tokens per sequence (default %(default)s)")
    data.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                      help="sequences per rank per step (default %(default)s)")
    data.add_argument("--steps", type=_positive_int, default=d.steps if steps is None else steps,
                      help="optimizer steps (default %(default)s)")
    data.add_argument("--lr", type=_positive_float, default=d.lr,
                      help="AdamW learning rate (default %(default)s)")
    data.add_argument("--ac", choices=("none", "full", "selective"), default=d.ac,
                      help="activation checkpointing on every block: full, or selective "
                           "(saves the matmuls, recomputes the rest) (default: none)")
    data.add_argument("--init", choices=("meta", "cpu"), default=d.init,
                      help="meta: build on the meta device, shard, materialize the shards "
                           "and load rank 0's initial weights; cpu: every rank builds the "
                           "whole model first (same weights) (default: meta)")
    data.add_argument("--clip", type=_positive_float, default=d.clip, metavar="MAX_NORM",
                      help="clip the total gradient norm to MAX_NORM every step "
                           "(torch.nn.utils.clip_grad_norm_) and print each step's norm "
                           "before clipping (default: no clipping)")
    data.add_argument("--seed", type=_non_negative_int, default=d.seed,
                      help="model init and data seed (default %(default)s)")
    dist_ = p.add_argument_group("distribution")
    dist_.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device,
                       help="cuda: NCCL, one rank per GPU; cpu: gloo ranks on the CPU; "
                            "auto: cuda when torch sees a GPU, else cpu (default: auto)")
    dist_.add_argument("--world-size", type=_positive_int, default=None,
                       help=f"ranks to spawn: default {d.world_size} on the CPU, one per "
                            "visible GPU with cuda; ignored under torchrun, which sets the "
                            "ranks")
    dist_.add_argument("--replicate", type=_positive_int, default=d.replicate,
                       help="HSDP replicas: > 1 shards over a 2-D (replicate, shard) mesh; "
                            "must divide the world size (default %(default)s: FSDP)")
    comp = p.add_argument_group("compilation")
    dist_.add_argument("--mixed-precision", choices=("none", "bf16"), default=d.mixed_precision,
                       help="bf16: compute and all-gather parameters in bfloat16, reduce "
                            "gradients and keep the sharded parameters in float32 "
                            "(MixedPrecisionPolicy) (default: none, float32)")
    dist_.add_argument("--reshard-after-forward", choices=tuple(RESHARD_AFTER_FORWARD),
                       default=d.reshard_after_forward,
                       help="fully_shard's reshard_after_forward for every unit: default "
                            "(None: the root stays gathered for backward, the blocks "
                            "reshard), always (True: every unit reshards and re-gathers "
                            "in backward), never (False: every unit stays gathered "
                            "until its backward) (default %(default)s)")
    comp.add_argument("--backend", choices=BACKENDS, default=d.backend,
                      help="torch.compile backend: inductor (generates kernels; the graph "
                           "passes run), aot_eager (traces forward and backward, runs them "
                           "op by op: quick to compile), eager (dynamo only) "
                           "(default %(default)s)")
    if eager:
        comp.add_argument("--eager", action="store_true",
                          help="run without torch.compile")
    else:
        p.set_defaults(eager=False)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar on rank 0's stderr; by default shown only when "
                        "stderr is a terminal (tqdm's convention), so logs get no "
                        "redraws. The per-step lines are printed either way")


def _train_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainConfig:
    """Checks the combinations argparse cannot and builds the TrainConfig."""
    from ._train import TrainConfig, resolve_device, torchrun_env

    try:
        env = torchrun_env()
    except ValueError as e:
        parser.error(str(e))
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    cxx = os.environ.get("CXX") or "g++"
    if device == "cpu" and not args.eager and args.backend == "inductor" and not shutil.which(cxx):
        # Found here, not after a minute of tracing inside Inductor's traceback.
        parser.error(
            f"--backend inductor on the CPU builds C++ kernels and needs a C++ compiler, "
            f"but {cxx!r} is not on PATH. Install one (e.g. apt-get install g++), or run "
            "with --backend aot_eager or --eager."
        )
    if env is not None:
        world = env[1]
        where = f"torchrun's WORLD_SIZE={world}"
        if args.world_size is not None and args.world_size != world and env[0] == 0:
            print(f"traceable-hsdp: --world-size {args.world_size} is ignored under torchrun "
                  f"(WORLD_SIZE={world}).", file=sys.stderr)
    elif device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        world = gpus if args.world_size is None else args.world_size
        where = f"--world-size {world}"
        if world > gpus:
            parser.error(f"--world-size {world} with --device cuda needs {world} GPUs (one "
                         f"rank per GPU); {gpus} visible. Pass --world-size {gpus} or less.")
    else:
        world = TrainConfig().world_size if args.world_size is None else args.world_size
        where = f"--world-size {world}"
    if world % args.replicate:
        parser.error(
            f"{where} is not divisible by --replicate {args.replicate}; HSDP needs "
            "world size = replicate x shard. Pick a --replicate that divides it."
        )
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        parser.error(
            f"--dim {args.dim} must split into --heads {args.heads} heads of even size "
            f"(dim/heads = {args.dim / args.heads:g}); e.g. --dim {args.heads * 16}."
        )
    return TrainConfig(
        layers=args.layers, dim=args.dim, heads=args.heads, seq_len=args.seq_len,
        batch_size=args.batch_size, steps=args.steps, world_size=world,
        replicate=args.replicate, lr=args.lr, ac=args.ac, init=args.init, clip=args.clip,
        backend=args.backend, device=device, mixed_precision=args.mixed_precision,
        reshard_after_forward=args.reshard_after_forward, eager=args.eager, seed=args.seed,
        progress=args.progress,
    )


def _run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return _launch(_train_config(args, parser), "train")


def _launch(cfg: TrainConfig, command: str) -> int:
    """Runs the job on every rank; the exit status."""
    import torch.multiprocessing as mp

    from ._train import launch

    try:
        result = launch(cfg)
    except mp.ProcessRaisedException as e:
        print(f"traceable-hsdp {command}: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"traceable-hsdp {command}: a rank died: {e}", file=sys.stderr)
        return 1
    if result is not None and not all(math.isfinite(v) for v in result.losses):
        print(f"traceable-hsdp {command}: non-finite loss: {result.losses}", file=sys.stderr)
        return 1
    if result is not None and not all(math.isfinite(v) for v in result.grad_norms or []):
        print(f"traceable-hsdp {command}: non-finite gradient norm: {result.grad_norms}",
              file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- dump
_DUMP_STEPS = 2


def _add_dump_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR",
                   help="where to write the dumps: one directory per rank, OUT_DIR/rank<r>")
    _add_job_arguments(p, steps=_DUMP_STEPS, eager=False)
    p.add_argument("--trace", action="store_true",
                   help="also write a TORCH_TRACE-style structured log per rank and, when "
                        "tlparse is on PATH, its HTML report")


def _run_dump(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import dataclasses
    import os

    from ..debug._dump_env import ENV_DUMP

    if os.environ.get(ENV_DUMP, "").strip():
        parser.error(f"{ENV_DUMP} is set: traceable-hsdp dump writes its own dump (to "
                     f"OUT_DIR), and the two would wrap each other. Unset {ENV_DUMP}.")
    cfg = dataclasses.replace(
        _train_config(args, parser), dump_dir=args.out_dir, dump_trace=args.trace
    )
    return _launch(cfg, "dump")


# ------------------------------------------------------------------------ compare


def _add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump_dir", metavar="DUMP_DIR",
                   help="a directory holding one dump per rank, DUMP_DIR/rank<r> (what "
                        "traceable-hsdp dump and TRACEABLE_HSDP_DUMP=DUMP_DIR write)")


def _run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import os
    import re

    try:
        names = os.listdir(args.dump_dir)
    except OSError as e:
        parser.error(f"cannot read {args.dump_dir}: {e.strerror}")
    ranks = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"rank(\d+)", n))
                   and os.path.isdir(os.path.join(args.dump_dir, n)))
    if len(ranks) < 2:
        parser.error(f"{args.dump_dir} holds {len(ranks)} rank<r> dump directories; "
                     "comparing needs at least 2.")
    from ..debug._dump import compare_dumps

    line = compare_dumps([os.path.join(args.dump_dir, f"rank{r}") for r in ranks])
    print(line)
    return 0 if line.startswith("ranks agree") else 1


SUBCOMMANDS: list[Subcommand] = [
    Subcommand(
        name="train",
        help="train the demo Llama with fully_shard on synthetic data (2 gloo ranks by "
             "default; torchrun-compatible)",
        add_arguments=_add_train_arguments,
        run=_run_train,
    ),
    Subcommand(
        name="dump",
        help="run a short compiled training job of the demo Llama and dump every rank's "
             "graphs, collectives, graph breaks and recompiles (see docs/debugging.md)",
        add_arguments=_add_dump_arguments,
        run=_run_dump,
    ),
    Subcommand(
        name="compare",
        help="compare the ranks' dumps in a directory: the same collectives in the same "
             "order on every rank? (exit status 1 when they differ)",
        add_arguments=_add_compare_arguments,
        run=_run_compare,
    ),
]


# ---------------------------------------------------------------------------- main


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's subparser, by name."""
    parser = argparse.ArgumentParser(
        prog="traceable-hsdp",
        description="torch.compile-first FSDP/HSDP: demo jobs and tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for cmd in SUBCOMMANDS:
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(sp)
        subparsers[cmd.name] = sp
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``) and runs the subcommand.

    Returns:
        The exit status: 0 on success, 1 when the job failed. Invalid arguments exit
        with status 2 through argparse (``SystemExit``).
    """
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    cmd = next(c for c in SUBCOMMANDS if c.name == args.command)
    return cmd.run(args, subparsers[cmd.name])


if __name__ == "__main__":
    sys.exit(main())
