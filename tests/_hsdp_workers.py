"""Per-rank bodies of the hsdp() tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor
from _workers import (
    CFG,
    CFG1,
    LR,
    GraphRecorder,
    _data,
    _loss,
    _mean_over_ranks,
    _placeholder_bytes,
    dp_mesh,
)
from traceable_hsdp.demo.models import Llama, shard_llama

STEPS = 3


def hsdp_worker(rank: int, world: int, shard_size: int, levels: list[str]) -> dict[str, Any]:
    """Trains one model per optimizer level with hsdp(threshold=1 KiB: the RMSNorm
    weights stay replicated; replicate_params: the output head), eager, and reports
    losses, final parameters, placements and storage. (Compiled, level3 on this model
    is test_clip.py's hsdp run.)"""
    out: dict[str, Any] = {}
    for level in levels:
        torch.manual_seed(0)
        model = Llama(CFG)
        keep = [model.output.weight]
        shard_llama(model, th.hsdp, shard_size=shard_size, threshold=1, optimizer_level=level,
                    replicate_params=keep)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, bytes_after_bwd = [], []
        for x, y in _data(world, STEPS):
            loss = _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            bytes_after_bwd.append(_placeholder_bytes(model))
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(loss, world))
        out[level] = dict(
            losses=losses,
            params={k: full_tensor(v) for k, v in model.state_dict().items()},
            placements={k: str(v.placements) for k, v in model.state_dict().items()},
            bytes_after_bwd=bytes_after_bwd,
        )
    return out


def reduce_op_worker(rank: int, world: int) -> dict[str, float]:
    """One backward with reduce_op="mean", "sum" and gradient_divide_factor=4: the
    sharded gradients must be in ratio 1 : world : world/4."""
    grads = {}
    for name, kwargs in (("mean", {}), ("sum", {"reduce_op": "sum"}),
                         ("div4", {"gradient_divide_factor": 4.0})):
        torch.manual_seed(0)
        model = Llama(CFG)
        shard_llama(model, th.hsdp, threshold=0, **kwargs)
        x, y = _data(world, 1)[0]
        _loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        grads[name] = {k: full_tensor(p.grad) for k, p in model.named_parameters()}
    ratios = {}
    for k, g in grads["mean"].items():
        ratios[k] = (
            (grads["sum"][k] - world * g).abs().max().item(),
            (grads["div4"][k] - world / 4 * g).abs().max().item(),
        )
    return ratios


# comm_options_worker's Llama: one block (the options apply per unit; a second block
# adds compile time and no path).
COMM_CFG = CFG1


def comm_options_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    """FSDPModule's communication options on a 2x2 HSDP mesh, eager or compiled
    (aot_eager, compiled autograd): each run is compared with a plain eager run of the
    same model (``COMM_CFG``) and data (gradients after two backwards). Compiled, it
    also reports the collectives of every graph each run compiled."""
    from torch import nn

    compiled = mode == "compiled"
    mesh = dp_mesh((2, 2))
    data = _data(world * 2, 1)[0]
    xs, ys = data[0].chunk(world)[rank].chunk(2), data[1].chunk(world)[rank].chunk(2)
    graphs: dict[str, tuple[list, list]] = {}

    def run(name: str, model: nn.Module, backwards: Any) -> None:
        """``backwards(fwd)`` runs the backwards, with ``fwd`` the (compiled) model."""
        if not compiled:
            backwards(model)
            return
        rec = GraphRecorder()
        torch._dynamo.reset()
        th.enable_compiled_autograd(backend=rec)
        try:
            backwards(torch.compile(model, backend=rec, fullgraph=True))
        finally:
            th.disable_compiled_autograd()
        graphs[name] = (rec.forward, rec.backward, sorted(rec.reduce_ops))

    def grads(
        name: str, setup: Any, per_backward: Any = None, eager: bool = False
    ) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Llama(COMM_CFG)
        shard_llama(model, th.fully_shard, mesh=mesh)
        setup(model)

        def backwards(fwd: Any) -> None:
            for i in range(2):
                if per_backward is not None:
                    per_backward(model, i)
                _loss(fwd(xs[i]), ys[i]).backward()

        if eager:
            backwards(model)
        else:
            run(name, model, backwards)
        return {k: full_tensor(p.grad) for k, p in model.named_parameters()}

    def _on_units(model: Any, setter: str, value: Any) -> None:
        # These setters apply to one unit, as torch's: set them on every unit.
        for unit in (*model.layers, model):
            getattr(unit, setter)(value)

    def diff(a: dict, b: dict, scale: float = 1.0) -> float:
        return max((a[k] - scale * b[k]).abs().max().item() for k in a)

    # The plain run, eager in both modes (compiled and eager agree to 1e-6, and a
    # compiled base would add a compile without a new graph: force_sum's graphs have
    # the same collectives).
    base = grads("base", lambda m: None, eager=True)
    out: dict[str, Any] = {}
    if compiled:
        # One compiled run for both (compiles are the cost): summed collectives, and
        # no all-reduce on the first backward, all-reduce on the second.
        out["force_sum_all_reduce_later"] = diff(
            grads("force_sum_all_reduce_later", lambda m: _on_units(m, "set_force_sum_reduction_for_comms", True),
                  lambda m, i: m.set_requires_all_reduce(i == 1)),
            base)
    else:
        out["force_sum"] = diff(
            grads("force_sum", lambda m: _on_units(m, "set_force_sum_reduction_for_comms", True)), base)
        # No all-reduce on the first backward, all-reduce on the second: the same sum.
        out["all_reduce_later"] = diff(
            grads("all_reduce_later", lambda m: None, lambda m, i: m.set_requires_all_reduce(i == 1)),
            base)
        # Compiled, these add compile time and nothing new: the deprecated name sets
        # the same divide factor as force_sum's path, and the no-all-reduce graph is
        # all_reduce_later's first backward graph.
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rs = grads("rs_divide", lambda m: _on_units(m, "set_reduce_scatter_divide_factor", 2.0))
        out["rs_divide_warned"] = any(issubclass(w.category, FutureWarning) for w in caught)
        out["rs_divide"] = diff(rs, base, world / 2.0)
        # Without any all-reduce the replicas' gradients differ (so the check above
        # can fail): the first replica group and the second see other data.
        no_ar = grads("no_all_reduce", lambda m: m.set_requires_all_reduce(False))
        out["no_all_reduce"] = diff(no_ar, base)
    # The embedding unit need not re-gather for backward: its weight gradient reads
    # only indices and the output gradient.
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Embedding(CFG.vocab_size, 8), nn.Linear(8, 3))
    ref = nn.Sequential(nn.Embedding(CFG.vocab_size, 8), nn.Linear(8, 3))
    ref.load_state_dict(emb.state_dict())
    th.fully_shard(emb[0], mesh=mesh)
    # The root reshards too, so its re-gather shows beside the embedding's absence.
    th.fully_shard(emb, mesh=mesh, reshard_after_forward=True)
    emb[0].set_unshard_in_backward(False)
    run("embedding_no_unshard", emb, lambda fwd: fwd(xs[0]).sum().backward())
    ref(xs[0]).sum().backward()
    for p in ref.parameters():  # the reference's grads averaged over the 4 ranks
        torch.distributed.all_reduce(p.grad)
        p.grad /= world
    out["embedding_no_unshard"] = max(
        (full_tensor(a.grad) - b.grad).abs().max().item()
        for a, b in zip(emb.parameters(), ref.parameters())
    )
    # A unit that reads its weight in backward fails loudly when not re-gathered.
    lin = th.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=True)
    lin.set_unshard_in_backward(False)
    try:
        run("linear_error", lin, lambda fwd: fwd(torch.randn(2, 4, requires_grad=True)).sum().backward())
        out["linear_error"] = None
    except RuntimeError as e:
        out["linear_error"] = str(e)
    out["graphs"] = graphs
    return out


def ignored_params_worker(rank: int, world: int) -> dict[str, Any]:
    """ignored_params against torch's fully_shard with the same setting, eagerly, 2
    steps of AdamW: the ignored parameter (the final norm) stays a plain tensor that
    each rank steps with its own, unreduced gradient, in both libraries."""
    import torch.distributed.fsdp as torch_fsdp

    out = {}
    for lib, fs in (("ours", th.fully_shard), ("torch", torch_fsdp.fully_shard)):
        torch.manual_seed(0)
        model = Llama(CFG)
        for layer in model.layers:
            fs(layer)
        fs(model, ignored_params={model.norm.weight})
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for xs, ys in _data(world, 2):
            loss = _loss(model(xs.chunk(world)[rank]), ys.chunk(world)[rank])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[lib] = dict(
            losses=losses,
            params={k: full_tensor(v) if isinstance(v, DTensor) else v.detach().clone()
                    for k, v in model.state_dict().items()},
            norm_type=type(model.norm.weight).__name__,
        )
    return out
