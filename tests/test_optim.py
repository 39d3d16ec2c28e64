"""traceable_hsdp.optim: Adam and AdamW stepping DTensor parameters on their local
shards give the same parameters and state as torch.optim on the same DTensors,
bitwise (tolerance 0: the same kernels on the same local values)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import traceable_hsdp as th
from _dist import run_ranks
from _workers import CFG, _data, _loss, dp_mesh
from traceable_hsdp import optim as th_optim
from traceable_hsdp.demo.models import Llama, shard_llama


class _DTensorOps(TorchDispatchMode):
    """Counts the ops called with a DTensor argument (a mode sees them before DTensor's
    own dispatch turns them into ops on local tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {})))
        return func(*args, **(kwargs or {}))


def _train(world: int, opt_cls: type, kw: dict[str, Any], hsdp: bool) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = Llama(CFG)
    if hsdp:  # 2 ranks as 1 x 2, and parameters under 2 KiB (the norms) replicated (hsdp's threshold)
        mesh = dp_mesh((1, world))
        for layer in model.layers:
            th.hsdp(layer, mesh=mesh, threshold=2)
        th.hsdp(model, mesh=mesh, threshold=2)
    else:
        shard_llama(model, th.fully_shard)
    opt = opt_cls(model.parameters(), lr=1e-2, **kw)
    rank = torch.distributed.get_rank()
    ops = _DTensorOps()
    for i, (x, y) in enumerate(_data(world, 3)):
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        if i == 0:
            opt.step()  # creates the state (zeros_like of DTensors): DTensor ops
        else:
            with ops:
                opt.step()
        opt.zero_grad()
    opt.dtensor_ops = ops.n  # ops given a DTensor in steps 2 and 3
    return model, opt


def optim_worker(rank: int, world: int) -> dict[str, Any]:
    """Per case: whether every parameter and every state tensor of ours equals torch's,
    bitwise, and the kinds of tensors the state holds."""
    cases = {
        "adamw": (torch.optim.AdamW, th_optim.AdamW, {}, False),
        "adamw_foreach_amsgrad": (torch.optim.AdamW, th_optim.AdamW,
                                  dict(foreach=True, amsgrad=True, weight_decay=0.1), False),
        # torchtitan's default and HF Trainer's (adamw_torch_fused).
        "adamw_fused": (torch.optim.AdamW, th_optim.AdamW, dict(fused=True), False),
        "adam_maximize_hsdp": (torch.optim.Adam, th_optim.Adam,
                               dict(maximize=True, weight_decay=0.01), True),
    }
    out: dict[str, Any] = {}
    for name, (theirs_cls, ours_cls, kw, hsdp) in cases.items():
        m_ref, o_ref = _train(world, theirs_cls, kw, hsdp)
        m_ours, o_ours = _train(world, ours_cls, kw, hsdp)
        diffs = [
            n for (n, a), (_, b) in zip(m_ref.named_parameters(), m_ours.named_parameters())
            if not torch.equal(a.to_local(), b.to_local())
        ]
        sd_ref, sd_ours = o_ref.state_dict()["state"], o_ours.state_dict()["state"]
        kinds = set()
        for i, st in sd_ours.items():
            for k, v in st.items():
                kinds.add((k, type(v).__name__, str(getattr(v, "placements", ""))))
                ref = sd_ref[i][k]
                a = v.to_local() if isinstance(v, DTensor) else v
                b = ref.to_local() if isinstance(ref, DTensor) else ref
                if type(v) is not type(ref) or not torch.equal(a, b):
                    diffs.append(f"state {i}.{k}")
        out[name] = dict(diffs=diffs, kinds=sorted(kinds),
                         dtensor_ops=(o_ref.dtensor_ops, o_ours.dtensor_ops),
                         n_params=len(list(m_ours.parameters())))
    # A gradient that is not yet reduced (Partial) is refused, naming the layout.
    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [torch.distributed.tensor.Shard(0)]))
    p.grad = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])
    try:
        th_optim.AdamW([p]).step()
        out["partial"] = "no error"
    except ValueError as e:
        out["partial"] = str(e)
    return out


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
