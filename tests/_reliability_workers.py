"""Per-rank bodies of tests/test_reliability.py (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th

# ------------------------------------------------------------------- prefetch
# Three units of distinct widths, so the numel of an all-gather's input names its
# unit: on 2 ranks the weight shards hold 24, 30, 20 elements and the bias shards 3,
# 5, 2 (a gather of a whole unit's flat shard: 27, 35, 22).
PREFETCH_WIDTHS = (8, 6, 10, 4)


def _prefetch_model(mesh: Any) -> nn.Sequential:
    torch.manual_seed(0)
    w = PREFETCH_WIDTHS
    model = nn.Sequential(*(nn.Linear(w[i], w[i + 1]) for i in range(len(w) - 1)))
    for layer in model:
        th.fully_shard(layer, mesh=mesh)
    th.fully_shard(model, mesh=mesh)
    return model


def _unit_of_numel(world: int) -> dict[int, int]:
    w = PREFETCH_WIDTHS
    out = {}
    for u in range(len(w) - 1):
        weight, bias = w[u] * w[u + 1] // world, w[u + 1] // world
        out.update({weight: u, bias: u, weight + bias: u})
    return out


def _compress(tokens: list[str]) -> list[str]:
    """Consecutive repeats folded: one unit's per-parameter gathers count once, as do
    back-to-back compute ops."""
    return [t for i, t in enumerate(tokens) if i == 0 or tokens[i - 1] != t]


class _OpOrder(TorchDispatchMode):
    """Records, in dispatch order, each all-gather (as ``ag<unit>``) and each matmul
    (``mm``) that runs eagerly."""

    def __init__(self, unit_of: dict[int, int]) -> None:
        super().__init__()
        self.unit_of, self.tokens = unit_of, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        if "all_gather_into_tensor" in name:
            self.tokens.append(f"ag{self.unit_of[args[0].numel()]}")
        elif name.split(".")[1] in ("mm", "addmm"):
            self.tokens.append("mm")
        return func(*args, **(kwargs or {}))


def _graph_order(gm: torch.fx.GraphModule, unit_of: dict[int, int]) -> list[str]:
    """The same tokens, in the program order of a captured graph."""
    tokens = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if "all_gather_into_tensor" in name:
            inp = n.args[0].meta
            tokens.append(f"ag{unit_of[inp.get('example_value', inp.get('val')).numel()]}")
        elif "linear" in name or name.split(".")[-2:-1] in (["mm"], ["addmm"]):
            tokens.append("mm")
    return tokens


def _set_prefetch(model: nn.Sequential) -> None:
    # Not the default order: unit 0 issues unit 2's gather before unit 1's, and unit
    # 2's backward issues unit 0's (unit 1's comes in its own pre-backward).
    model[0].set_modules_to_forward_prefetch([model[2], model[1]])
    model[2].set_modules_to_backward_prefetch([model[0]])


def prefetch_order_worker(rank: int, world: int) -> dict[str, Any]:
    """The order of all-gathers and matmuls: eagerly without and with explicit
    prefetch, and in the graphs compiled (aot_eager) with it; with the losses and
    gradients of both eager runs and the compiled run."""
    mesh = init_device_mesh("cpu", (world,))
    unit_of = _unit_of_numel(world)
    x = torch.randn(4, PREFETCH_WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for name in ("eager", "eager_prefetch"):
        model = _prefetch_model(mesh)
        if name == "eager_prefetch":
            _set_prefetch(model)
        fwd, bwd = _OpOrder(unit_of), _OpOrder(unit_of)
        with fwd:
            loss = model(x).square().sum()
        with bwd:
            loss.backward()
        out[name] = dict(fwd=_compress(fwd.tokens), bwd=_compress(bwd.tokens), loss=loss.item(),
                         grads=[p.grad.full_tensor() for p in model.parameters()])
    graphs: list[tuple[bool, list[str]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        cid = torch._guards.CompileContext.current_compile_id()
        graphs.append((cid is not None and cid.compiled_autograd_id is not None,
                       _compress(_graph_order(gm, unit_of))))
        return aot_eager(gm, example_inputs)

    model = _prefetch_model(mesh)
    _set_prefetch(model)
    th.enable_compiled_autograd(backend=backend)
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss = compiled(x).square().sum()
        loss.backward()
    finally:
        th.disable_compiled_autograd()
    out["compiled_prefetch"] = dict(
        fwd=[g for is_bwd, g in graphs if not is_bwd],
        bwd=[g for is_bwd, g in graphs if is_bwd],
        loss=loss.item(),
        grads=[p.grad.full_tensor() for p in model.parameters()],
    )
    return out
