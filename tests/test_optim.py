"""traceable_hsdp.optim: Adam and AdamW stepping DTensor parameters on their local
shards give the same parameters and state as torch.optim on the same DTensors,
bitwise (tolerance 0: the same kernels on the same local values)."""

from __future__ import annotations

from _dist import run_ranks
from _optim_workers import optim_worker


def test_local_shard_optimizers_match_torch_bitwise() -> None:
    """3 steps of our Llama (uneven shards: vocab 65) on 2 gloo ranks: AdamW with
    defaults (the single-tensor path on the CPU), AdamW foreach + amsgrad + weight
    decay, AdamW fused, and Adam with maximize on an hsdp() model whose small parameters are
    replicated. After the first step (which creates the state) ours calls no op on a
    DTensor and torch's does. Every parameter and every state tensor equals torch's; the state is
    DTensors laid out like the parameters (DCP reads it as torch's); a Partial
    gradient is refused with the fix named."""
    for rank, r in enumerate(run_ranks(optim_worker, 2)):
        for case in ("adamw", "adamw_foreach_amsgrad", "adamw_fused", "adam_maximize_hsdp"):
            assert r[case]["diffs"] == [], (rank, case, r[case]["diffs"])
            theirs, ours = r[case]["dtensor_ops"]  # ops given a DTensor in steps 2-3
            assert theirs > 0 and ours == 0, (case, theirs, ours)
            kinds = {(k, t) for k, t, _ in r[case]["kinds"]}
            assert ("exp_avg", "DTensor") in kinds and ("exp_avg_sq", "DTensor") in kinds
            assert ("step", "Tensor") in kinds
        assert ("max_exp_avg_sq", "DTensor") in {
            (k, t) for k, t, _ in r["adamw_foreach_amsgrad"]["kinds"]
        }
        placements = {p for _, _, p in r["adam_maximize_hsdp"]["kinds"] if p}
        assert any("Replicate" in p for p in placements), placements  # hsdp's small params
        assert any("Shard" in p for p in placements), placements
        assert "Partial" in r["partial"] and "redistribute" in r["partial"], r["partial"]
