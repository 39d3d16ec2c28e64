"""HSDP: shard within groups of ranks, replicate across groups, compiled.

    torchrun --standalone --nproc-per-node 4 examples/hsdp_2d.py
    torchrun --standalone --nproc-per-node 4 examples/hsdp_2d.py --backend aot_eager
    torchrun --standalone --nproc-per-node 4 examples/hsdp_2d.py --eager

fully_shard on a 2-D device mesh (replicate, shard) is HSDP: with 4 ranks and
--replicate 2, ranks {0, 1} and {2, 3} each hold one copy of the model, sharded over
the 2 ranks of the group. Every parameter is a DTensor placed (Replicate(), Shard(0)).
A step all-gathers within the shard group, reduce-scatters the gradients within
it, then all-reduces the shards across the replicas. Rank 0 prints one parameter's
layout, each step the loss averaged over all ranks, and at the end checks that the
replicas still hold equal parameters.

One process per rank: gloo on the CPU, or NCCL with one GPU per rank when CUDA is
available. Compiling with the default inductor backend takes a minute or more on a
few CPU cores; --backend aot_eager compiles faster, --eager not at all.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import traceable_hsdp
from traceable_hsdp import fully_shard
from traceable_hsdp.demo.models import Llama, LlamaConfig
from traceable_hsdp.optim import AdamW  # torch.optim.AdamW on the local shards


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicate", type=int, default=2,
                   help="replicas; must divide the world size")
    p.add_argument("--steps", type=int, default=5)
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
    if world % args.replicate:
        raise SystemExit(f"--replicate {args.replicate} must divide the world size {world}")
    mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                            mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same full weights on every rank
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq_len)
    model = Llama(cfg).to(device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = AdamW(model.parameters(), lr=args.lr, fused=True)

    wq = model.layers[0].attn.wq.weight
    if rank == 0:
        print(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}; layers.0.attn.wq.weight: "
              f"{wq.placements}, local {tuple(wq.to_local().shape)} of {tuple(wq.shape)}",
              flush=True)

    step_model = model
    if not args.eager:
        traceable_hsdp.enable_compiled_autograd(backend=args.backend)
        step_model = torch.compile(model, backend=args.backend, fullgraph=True)

    for step in range(args.steps):
        # Data parallel over all ranks: every rank, in every replica, its own batch.
        x, y = (t.to(device) for t in synthetic_batch(args, step, rank))
        loss = F.cross_entropy(step_model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # gloo has no AVG: sum, then divide
        mean_loss = mean_loss.item() / world
        if not math.isfinite(mean_loss):  # the same on every rank: all stop together
            raise RuntimeError(f"step {step + 1}: non-finite loss {mean_loss}")
        if rank == 0:
            print(f"step {step + 1}  loss {mean_loss:.4f}", flush=True)

    # The replicas stayed in sync: each shard equals its copies in the other replicas.
    replicas = mesh.get_group("replicate")
    for name, p in model.named_parameters():
        local = p.to_local()
        copies = [torch.empty_like(local) for _ in range(args.replicate)]
        dist.all_gather(copies, local, group=replicas)
        if not all(torch.equal(c, local) for c in copies):
            raise RuntimeError(f"rank {rank}: the replicas of {name} differ")
    if rank == 0:
        print(f"replicas in sync: every shard equal across the {args.replicate} replicas",
              flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
