"""Save a checkpoint with torch.distributed.checkpoint (DCP), resume from it, and
check that the resumed run equals an uninterrupted one.

    torchrun --standalone --nproc-per-node 2 examples/dcp_resume.py /tmp/ckpt
    torchrun --standalone --nproc-per-node 2 examples/dcp_resume.py /tmp/ckpt --eager

Two runs in one job:

1. Uninterrupted: train --save-at steps, save the model and the optimizer to
   CKPT_DIR (each rank writes its own shards), then train --resume-steps more.
2. Resumed: a fresh model (another initialization) and a fresh optimizer load
   CKPT_DIR and train the same --resume-steps steps on the same data.

The resumed losses and final parameters must equal the uninterrupted run's, bitwise:
the loaded model holds exactly the saved shards, the optimizer exactly the saved
moments and step counts, and the steps run the same operations in the same order.
The script exits non-zero if they differ. Compiled by default (compiling with the
default inductor backend takes a minute or more on a few CPU cores; --backend
aot_eager compiles faster, --eager not at all). Needs numpy (DCP imports it).
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import traceable_hsdp
from traceable_hsdp import fully_shard
from traceable_hsdp.demo.models import Llama, LlamaConfig
from traceable_hsdp.optim import AdamW  # torch.optim.AdamW on the local shards


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="checkpoint directory (created; files in it are overwritten)")
    p.add_argument("--save-at", type=int, default=3, help="steps before the checkpoint")
    p.add_argument("--resume-steps", type=int, default=3, help="steps after it")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--eager", action="store_true", help="do not compile")
    return p.parse_args()


def init_distributed() -> torch.device:
    """One rank per process (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank calls it; each writes its own shards."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank calls it; the model and the optimizer may be fresh."""
    # The structure to fill in: the model's DTensors and the optimizer's state keyed
    # by parameter name (a plain optimizer.state_dict() is empty before a step).
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)  # reads this rank's shards, in place
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def synthetic_batch(
    args: argparse.Namespace, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own sequences; token t + 1 is token t's id plus one. The same
    (step, rank) always gives the same batch, so both runs see the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    tokens = (start + torch.arange(args.seq_len + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


class Run:
    """A sharded model, its optimizer and the callable that steps (compiled or not)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, seed: int) -> None:
        self.args, self.device = args, device
        torch.manual_seed(seed)  # the same full weights on every rank
        cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                          n_heads=args.heads, max_seq_len=args.seq_len)
        self.model = Llama(cfg).to(device)
        for block in self.model.layers:
            fully_shard(block)
        fully_shard(self.model)
        self.optimizer = AdamW(self.model.parameters(), lr=args.lr, fused=True)
        self.forward = self.model
        if not args.eager:
            traceable_hsdp.enable_compiled_autograd(backend=args.backend)
            self.forward = torch.compile(self.model, backend=args.backend, fullgraph=True)

    def train(self, steps: range, label: str) -> list[float]:
        """Trains ``steps``; returns this rank's losses; rank 0 prints the mean over ranks."""
        rank, world = dist.get_rank(), dist.get_world_size()
        losses = []
        for step in steps:
            x, y = (t.to(self.device) for t in synthetic_batch(self.args, step, rank))
            loss = F.cross_entropy(self.forward(x).flatten(0, 1), y.flatten())
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            losses.append(loss.item())
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # gloo has no AVG: sum, then divide
            mean_loss = mean_loss.item() / world
            if not math.isfinite(mean_loss):  # the same on every rank: all stop together
                raise RuntimeError(f"{label} step {step + 1}: non-finite loss {mean_loss}")
            if rank == 0:
                print(f"{label} step {step + 1}  loss {mean_loss:.6f}", flush=True)
        return losses


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank = dist.get_rank()
    before = range(args.save_at)
    after = range(args.save_at, args.save_at + args.resume_steps)

    # 1. Uninterrupted, saving on the way.
    first = Run(args, device, seed=0)
    first.train(before, "uninterrupted")
    save_checkpoint(first.model, first.optimizer, args.ckpt_dir)
    if rank == 0:
        print(f"saved after step {args.save_at} to {args.ckpt_dir}", flush=True)
    expected = first.train(after, "uninterrupted")

    # 2. Resumed: another initialization, overwritten by the checkpoint.
    second = Run(args, device, seed=1)
    load_checkpoint(second.model, second.optimizer, args.ckpt_dir)
    if rank == 0:
        print(f"loaded {args.ckpt_dir} into a fresh model and optimizer", flush=True)
    resumed = second.train(after, "resumed")

    # Bitwise, on every rank: the losses and the final shards.
    same = resumed == expected and all(
        torch.equal(p.to_local(), q.to_local())
        for p, q in zip(first.model.parameters(), second.model.parameters())
    )
    ok = torch.tensor(int(same), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank agrees on the verdict
    dist.destroy_process_group()
    if not ok.item():
        raise SystemExit(f"rank {rank}: the resumed run differs from the uninterrupted one "
                         f"(losses {resumed} vs {expected})")
    if rank == 0:
        print(f"resume check passed: steps {after.start + 1}-{after.stop} equal the "
              "uninterrupted run's, bitwise (losses and parameters)", flush=True)


if __name__ == "__main__":
    main()
