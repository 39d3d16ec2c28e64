"""Shard a Hugging Face LlamaForCausalLM built on the meta device, with activation
checkpointing.

    torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py
    torchrun --standalone --nproc-per-node 2 examples/hf_causal_lm.py --check-init

The flow for a model too large for one device: no rank ever holds all of it.

1. Build the model under torch.device("meta"): shapes only, no memory.
2. fully_shard each decoder layer, then the root: each parameter becomes this rank's
   shard, still on meta.
3. model.to_empty(device=...): allocate the shards (uninitialized), and buffers.
4. Recompute the rotary table (a buffer that no state dict holds).
5. Load the weights: here from a model that rank 0 builds on its CPU (in a real job,
   a checkpoint it reads), broadcast to every rank by set_model_state_dict, each rank
   keeping its shard.

--check-init also builds the whole model on every rank's CPU with the same seed,
shards it, and checks that every rank's shards equal, bitwise, those of step 5 (a
check for the example, not part of a real job). Needs transformers 5 (pip install
"transformers>=5").

--compile BACKEND compiles the model (torch.compile) and its backward (compiled
autograd, traceable_hsdp.enable_compiled_autograd), checkpointed layers included;
the optimizer step and the clipping stay eager.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # an extra, not a dependency of traceable_hsdp
    raise SystemExit(
        f"examples/hf_causal_lm.py needs Hugging Face transformers ({e}). Install it: "
        "pip install transformers (or the test extra: pip install -e \".[test]\")."
    ) from None

from traceable_hsdp import enable_compiled_autograd, fully_shard
from traceable_hsdp.optim import AdamW


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping")
    p.add_argument("--seed", type=int, default=0, help="rank 0's initialization")
    p.add_argument("--compile", metavar="BACKEND", default=None,
                   help="torch.compile backend (inductor, aot_eager); default: eager")
    p.add_argument("--check-init", action="store_true",
                   help="check the loaded shards against a model built whole on every rank")
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


def shard(model: LlamaForCausalLM) -> LlamaForCausalLM:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def init_rotary(model: LlamaForCausalLM) -> None:
    """to_empty left the rotary buffers uninitialized: compute them as __init__ does."""
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(model.config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)


def check_init(
    model: LlamaForCausalLM, config: LlamaConfig, seed: int, device: torch.device
) -> None:
    """Every rank builds the model whole with rank 0's seed and shards it: its shards
    must equal the loaded ones, bitwise."""
    torch.manual_seed(seed)
    reference = shard(LlamaForCausalLM(config).to(device))
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if not torch.equal(p.to_local(), q.to_local()):
            raise RuntimeError(
                f"rank {dist.get_rank()}: {name} differs from the CPU-built model's shard")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        if not torch.equal(b, c):
            raise RuntimeError(f"rank {dist.get_rank()}: buffer {name} differs")
    del reference


def synthetic_batch(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    """Each rank its own sequences; token t + 1 is token t's id plus one."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    return (start + torch.arange(args.seq_len)) % args.vocab


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
        tie_word_embeddings=False, use_cache=False,
    )

    # 1-3: build on meta, shard, allocate this rank's shards.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Activation checkpointing: recompute each decoder layer's forward in backward.
    # checkpoint_wrapper (non-reentrant) before fully_shard, torchtitan's order: the
    # checkpoint sits inside the unit, so fully_shard's hooks stay outside it. (HF's
    # own activation_checkpointing_enable puts the checkpoint around the whole layer
    # call, hooks included: that trains eagerly, and compiled only with
    # torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True;
    # see docs/compile.md, "Activation checkpointing".)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    shard(model)
    model.to_empty(device=device)

    # 4-5: buffers, then the weights: rank 0 holds the full state dict, the others
    # pass {} and receive their shards by broadcast.
    init_rotary(model)
    full_sd = {}
    if rank == 0:
        torch.manual_seed(args.seed)
        full_sd = LlamaForCausalLM(config).state_dict()
    set_model_state_dict(
        model, full_sd,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    del full_sd
    if args.check_init:
        check_init(model, config, args.seed, device)
        if rank == 0:
            print("check-init: every rank's shards equal those of the model built whole",
                  flush=True)

    model.train()  # HF checkpoints the layers only in training mode
    # torch.optim.AdamW's numbers, stepped on the local shards (docs/api.md); fused, as
    # HF Trainer's default optimizer (adamw_torch_fused).
    optimizer = AdamW(model.parameters(), lr=args.lr, fused=True)
    forward = model
    if args.compile:
        # transformers 5.25's attention sets a global (the kernels package's) on each
        # call, a side effect dynamo refuses inside a checkpointed region. Without the
        # setting below the job trains all the same (dynamo runs each checkpoint
        # eagerly and fully_shard gives its recompute the gathered parameters), but
        # compiled autograd's backward then breaks at every tensor a checkpoint saved
        # and compiles each piece. Setting and restoring that global need not happen
        # again in the recompute, so let dynamo compile the region whole
        # (docs/compile.md, "Activation checkpointing").
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        enable_compiled_autograd(backend=args.compile)  # traces the backward's hooks
        forward = torch.compile(model, backend=args.compile)
    for step in range(args.steps):
        tokens = synthetic_batch(args, step, rank).to(device)
        loss = forward(input_ids=tokens, labels=tokens).loss  # HF shifts the labels
        loss.backward()
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
