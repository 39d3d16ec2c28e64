"""A small Llama-style transformer for the demo, the tests and the benchmarks.

Pre-norm blocks (RMSNorm, causal self-attention with rotary embeddings, SwiGLU MLP),
a token embedding and an output head, untied unless ``LlamaConfig.tie_embeddings``.
Everything traces with ``fullgraph=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "Block", "shard_llama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of the model.

    Args:
        vocab_size: tokens (default 256).
        dim: model width (default 64).
        n_layers: transformer blocks (default 4).
        n_heads: attention heads; must divide ``dim`` (default 4).
        ffn_mult: MLP hidden width as a multiple of ``dim`` (default 4).
        max_seq_len: longest sequence for the rotary table (default 256).
        tie_embeddings: the output head reuses the token embedding's weight, one
            parameter used twice (default ``False``).

    Raises:
        ValueError: a size that is not a positive int, a width that does not split
            into heads of even size.
        TypeError: ``tie_embeddings`` is not a bool.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    ffn_mult: int = 4
    max_seq_len: int = 256
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_mult", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}.")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"LlamaConfig.dim={self.dim} must split into n_heads={self.n_heads} heads "
                "of even size."
            )
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(
                f"LlamaConfig.tie_embeddings must be a bool, got "
                f"{type(self.tie_embeddings).__name__} {self.tie_embeddings!r}."
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary_tables(head_dim: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # 2D
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        q, k = _apply_rotary(q, cos[:s], sin[:s]), _apply_rotary(k, cos[:s], sin[:s])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # -1: TP holds n_heads/tp heads


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_mult * cfg.dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer block: the usual fully_shard unit."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # One parameter, registered as tok_embeddings.weight and output.weight:
            # its gradient is the sum of both uses.
            self.output.weight = self.tok_embeddings.weight
        cos, sin = _rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recomputes the rotary tables in place, on their device: after
        ``to_empty()`` from the meta device they hold garbage, and no state dict
        holds them (non-persistent)."""
        cos, sin = _rotary_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def shard_llama(model: Llama, fully_shard_fn, **kwargs) -> Llama:
    """Applies ``fully_shard_fn`` (ours or torch's) to each block, then to the root,
    with the same keyword arguments: the usual nested layout."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model
