#!/usr/bin/env python
"""Hugging Face architectures as clients: each model trained with torch's
``fully_shard`` and with ours, eager, and ours compiled, side by side.

    python benchmarks/hf_models.py --out DIR [--models qwen2,t5,...]
                                   [--backend aot_eager|inductor] [--steps 3]

Not a timing: this is the sweep behind the model list of docs/api.md ("Numerics
against torch's fully_shard"), kept so that it can be rerun on a new torch or
transformers. 2 spawned gloo ranks of one thread each; every model from a tiny config
(no weights); each block of each of its block lists (the outermost ``ModuleList``s
of two or more modules) and the root sharded; AdamW (lr 1e-2) for ``--steps`` steps
on each rank's half of a seeded global batch. Per model:

- eager, ours against torch's ``fully_shard``: the largest difference of the losses
  and of the local shards after the last step (both shard every parameter on dim 0
  the same way, so their local shards compare directly; 0 is bitwise);
- ours compiled (``torch.compile(model)`` with compiled autograd, ``--backend``)
  against ours eager, the same two differences;
- placeholder bytes still gathered after each compiled backward (0 expected), and
  the graphs the compiled run made (forward, backward).

A model torch's ``fully_shard`` refuses (CLIP's 0-dim ``logit_scale``) reports the
refusal. The exit status is 1 when an eager run is not bitwise equal to torch's or a
compiled backward left a placeholder gathered.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 256
Step = Callable[[Any, torch.Generator, int, int], torch.Tensor]


def _tokens(g: torch.Generator, rank: int, world: int, n: int = 16) -> torch.Tensor:
    return torch.randint(2, VOCAB, (2 * world, n), generator=g).chunk(world)[rank]


def _lm_step(m: Any, g: torch.Generator, rank: int, world: int) -> torch.Tensor:
    x = _tokens(g, rank, world)
    return m(input_ids=x, labels=x).loss


def _seq2seq_step(m: Any, g: torch.Generator, rank: int, world: int) -> torch.Tensor:
    return m(input_ids=_tokens(g, rank, world), labels=_tokens(g, rank, world)).loss


def _image(g: torch.Generator, rank: int, world: int) -> torch.Tensor:
    return torch.randn(2 * world, 3, 16, 16, generator=g).chunk(world)[rank]


def models() -> dict[str, tuple[Callable[[], Any], Step]]:
    """Name -> (build, step): tiny configs of transformers' classes."""
    import transformers as T

    c = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    enc_dec = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                   decoder_ffn_dim=64, dropout=0.0)
    return {
        "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**c)), _lm_step),
        "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**c, tie_word_embeddings=True)), _lm_step),
        "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**c, head_dim=16)), _lm_step),
        "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**c, sliding_window=4)), _lm_step),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**c, head_dim=16, sliding_window=4)), _lm_step),
        "gemma3": (lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**c, head_dim=16, sliding_window=4)),
                   _lm_step),
        "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**c, pad_token_id=0)), _lm_step),
        "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**c)), _lm_step),
        "granite": (lambda: T.GraniteForCausalLM(T.GraniteConfig(**c)), _lm_step),
        "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=64)), _lm_step),
        "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)), _lm_step),
        "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
            attention_dropout=0.0)), _lm_step),
        "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
            **c, num_local_experts=4, num_experts_per_tok=2)), _lm_step),
        "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **c, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)), _lm_step),
        "deepseek_v3": (lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
            num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64)), _lm_step),
        "mamba": (lambda: T.MambaForCausalLM(T.MambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
            conv_kernel=4, use_cache=False)), _lm_step),
        "bert_mlm": (lambda: T.BertForMaskedLM(T.BertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)), _lm_step),
        "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
            decoder_start_token_id=0, use_cache=False, dropout_rate=0.0)), _seq2seq_step),
        "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
            **enc_dec, max_position_embeddings=64, attention_dropout=0.0,
            activation_dropout=0.0)), _seq2seq_step),
        "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            **enc_dec, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
            pad_token_id=0, decoder_start_token_id=1)),
            lambda m, g, r, w: m(input_features=torch.randn(2 * w, 8, 32, generator=g).chunk(w)[r],
                                 labels=_tokens(g, r, w, 8)).loss),
        "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)),
            lambda m, g, r, w: m(pixel_values=_image(g, r, w),
                                 labels=torch.randint(0, 5, (2 * w,), generator=g).chunk(w)[r]).loss),
        "clip": (lambda: T.CLIPModel(T.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=16, patch_size=4),
            projection_dim=16)),
            lambda m, g, r, w: m(input_ids=_tokens(g, r, w), pixel_values=_image(g, r, w),
                                 return_loss=True).loss),
    }


def block_lists(model: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The outermost ``ModuleList``s of two or more modules (a decoder's layers; an
    encoder-decoder's two)."""
    lists = sorted(((n, m) for n, m in model.named_modules()
                    if isinstance(m, torch.nn.ModuleList) and len(m) >= 2), key=lambda x: len(x[0]))
    chosen: list[tuple[str, torch.nn.ModuleList]] = []
    for name, mod in lists:
        if not any(name.startswith(c + ".") for c, _ in chosen):
            chosen.append((name, mod))
    return chosen


def _train(name: str, lib: str, mesh: Any, rank: int, world: int, steps: int, backend: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import traceable_hsdp as th

    build, step = models()[name]
    torch.manual_seed(0)
    model = build()
    fs = torch_fully_shard if lib == "torch" else th.fully_shard
    for _, blocks in block_lists(model):
        for block in blocks:
            fs(block, mesh=mesh)
    fs(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model
    graphs = {"forward": 0, "backward": 0}
    if lib == "ours_compiled":
        from traceable_hsdp.debug._recorder import current_compile

        def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs["backward" if current_compile()[1] else "forward"] += 1
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

        torch._dynamo.reset()
        th.enable_compiled_autograd(backend=counting)
        run = torch.compile(model, backend=counting)
    g = torch.Generator().manual_seed(1)
    losses, left = [], []
    try:
        for _ in range(steps):
            loss = step(run, g, rank, world)
            loss.backward()
            if lib == "ours_compiled":
                left.append(sum(p.untyped_storage().nbytes() for m in model.modules()
                                if isinstance(m, th.FSDPModule) for p in _placeholders(m)))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if lib == "ours_compiled":
            th.disable_compiled_autograd()
            torch._dynamo.reset()
    shards = {k: v.to_local().detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "shards": shards, "left": left, "graphs": graphs}


def _placeholders(unit: Any) -> list[torch.Tensor]:
    """The unit's own unsharded placeholders (its state's parameter group)."""
    from traceable_hsdp._state import state_of

    state = state_of(unit)
    pg = None if state is None else state.param_group
    return [] if pg is None else [fp.unsharded_param for fp in pg.fsdp_params]


def _diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Largest difference of the losses and of the local shards."""
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
    shard = max(((a["shards"][k] - b["shards"][k]).abs().max().item()
                 for k, v in b["shards"].items() if v.numel()), default=0.0)  # uneven: some empty
    return loss, shard


def _rank(rank: int, placement: Any, names: list[str], steps: int, backend: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (placement.world,))
    out: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {"lists": [n for n, _ in block_lists(models()[name][0]())]}
        runs = {}
        for lib in ("torch", "ours", "ours_compiled"):
            try:
                runs[lib] = _train(name, lib, mesh, rank, placement.world, steps, backend)
            except Exception as e:  # noqa: BLE001 - reported in the table
                row[f"{lib}_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
                if lib != "torch":
                    row["trace"] = traceback.format_exc()[-2000:]
        if "torch" in runs and "ours" in runs:
            row["eager_vs_torch"] = _diff(runs["ours"], runs["torch"])
        if "ours" in runs and "ours_compiled" in runs:
            row["compiled_vs_eager"] = _diff(runs["ours_compiled"], runs["ours"])
            row["left"] = runs["ours_compiled"]["left"]
            row["graphs"] = runs["ours_compiled"]["graphs"]
        out[name] = row
    return out


def _cell(pair: tuple[float, float] | None) -> str:
    if pair is None:
        return "–"
    return "bitwise" if pair == (0.0, 0.0) else f"losses {pair[0]:.1e}, shards {pair[1]:.1e}"


def _markdown(res: dict[str, Any], args: argparse.Namespace, code: dict[str, Any]) -> str:
    import transformers

    import _report as R

    lines = [
        f"### HF models: torch's fully_shard and ours, eager, and ours compiled ({args.backend})",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, {R.cpu_name()}; "
        f"2 gloo ranks, {args.steps} AdamW steps, tiny configs; largest difference on rank 0.",
        "",
        "| model | sharded block lists | eager: ours vs torch's | compiled vs eager "
        "| bytes gathered after each compiled backward | graphs (forward, backward) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        eager = (f"torch refuses: {r['torch_error']}" if "torch_error" in r
                 else _cell(r.get("eager_vs_torch")))
        compiled = r.get("ours_error") or r.get("ours_compiled_error") or _cell(r.get("compiled_vs_eager"))
        graphs = r.get("graphs")
        lines.append(
            f"| {name} | {', '.join(r['lists'])} | {eager} | {compiled} | {r.get('left', '–')} "
            f"| {'–' if graphs is None else (graphs['forward'], graphs['backward'])} |")
    lines += ["", R.code_line(code) + "."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, HERE)
    import _report as R

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated names (default: all)")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend of the compiled run")
    p.add_argument("--steps", type=int, default=3)
    R.add_out_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import _harness as H
    import _report as R

    names = a.models.split(",") if a.models else list(models())
    unknown = [n for n in names if n not in models()]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(models())}")
    res = H.run_spawned_fn(_rank, H.resolve_placement("cpu", 2), names=names, steps=a.steps,
                           backend=a.backend)[0]
    code = R.code_state()
    text = _markdown(res, a, code)
    print(text)
    for name, r in res.items():
        if "trace" in r and "torch_error" not in r:  # a failure of ours alone
            print(f"\n{name}:\n{r['trace']}", file=sys.stderr)
    R.write_report(a.out, f"hf_models_{a.backend}", text,
                   {"results": res, "steps": a.steps, "backend": a.backend, "code": code})
    # Bad: ours not bitwise equal to torch's eagerly, or failing where torch's ran, or a
    # compiled backward that left a placeholder gathered. A model both refuse is not.
    bad = [n for n, r in res.items()
           if ("torch_error" not in r and r.get("eager_vs_torch") != (0.0, 0.0))
           or any(r.get("left", []))
           or ("torch_error" not in r and "ours_compiled_error" in r)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
