"""Train a small Llama with traceable_hsdp's fully_shard, compiled.

    torchrun --standalone --nproc-per-node 2 examples/train_llama.py
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --backend aot_eager
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py --eager

One process per rank: gloo on the CPU, or NCCL with one GPU per rank when CUDA is
available. Each block is a fully_shard unit, then the root. Compiled (the default),
the forward graph holds the all-gathers and the backward graph that compiled
autograd captures holds the re-gathers and reduce-scatters. The data is synthetic and
learnable (each token is followed by the next id), so the loss falls within a few
steps. Rank 0 prints one line per step: the loss averaged over the ranks and the
gradient norm before clipping. Compiling with the default inductor backend takes a
minute or more on a few CPU cores; --backend aot_eager compiles faster, --eager not at all.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import traceable_hsdp
from traceable_hsdp import fully_shard
from traceable_hsdp.demo.models import Llama, LlamaConfig
from traceable_hsdp.optim import AdamW  # torch.optim.AdamW on the local shards


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
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


def synthetic_batch(
    args: argparse.Namespace, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own sequences; token t + 1 is token t's id plus one."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    tokens = (start + torch.arange(args.seq_len + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    # Same seed on every rank: fully_shard keeps each rank's slice of its own copy,
    # so every rank must start from the same full weights.
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq_len)
    model = Llama(cfg).to(device)
    for block in model.layers:
        fully_shard(block)  # no mesh: a 1-D mesh over all ranks
    fully_shard(model)
    optimizer = AdamW(model.parameters(), lr=args.lr, fused=True)  # torchtitan's default

    if not args.eager:
        # Compiled autograd captures the backward's collectives; it must be on
        # before the first compiled forward.
        traceable_hsdp.enable_compiled_autograd(backend=args.backend)
        model = torch.compile(model, backend=args.backend, fullgraph=True)

    for step in range(args.steps):
        x, y = (t.to(device) for t in synthetic_batch(args, step, rank))
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        # The gradients are sharded DTensors; the norm is that of the whole gradient.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        optimizer.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # gloo has no AVG: sum, then divide
        mean_loss = mean_loss.item() / world
        if not math.isfinite(mean_loss):  # the same on every rank: all stop together
            raise RuntimeError(f"step {step + 1}: non-finite loss {mean_loss}")
        if rank == 0:
            print(f"step {step + 1}  loss {mean_loss:.4f}  grad norm {grad_norm.item():.4f}",
                  flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
