"""What the rank tests share: the test Llama's configuration, data and loss, the
one-process reference run, meshes, graph and collective recorders, and the
comparisons of two runs. Each test file holds its own rank functions, beside the
assertions on their results; this module is preloaded by the ranks' fork server
(tests/_dist.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import traceable_hsdp as th
import traceable_hsdp.passes._graph as G
from _dist import full_tensor
from traceable_hsdp.debug._recorder import current_compile
from traceable_hsdp.demo.models import Llama, LlamaConfig
from traceable_hsdp.passes._graph import (
    bound_args,
    collective_family,
    is_fsdp_copy,
    is_resize,
    is_version_counter_op,
)

# vocab 65: the embedding and output head have an uneven first dim (padded shards).
CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
# One block: for compiled checks that two blocks do not add to (every block costs
# compile time; see [Note: The suite's time is compile time] in conftest.py).
CFG1 = dataclasses.replace(CFG, n_layers=1)
SEQ, BATCH_PER_RANK, STEPS, LR = 8, 2, 5, 1e-2
# The root unit's parameters (embedding, final norm, output head). The default
# reshard_after_forward (None, as torch's) keeps them gathered from a training
# forward to its backward: the backward re-gathers the blocks only.
ROOT_PARAMS = 3
ROOT_BYTES = (2 * CFG.vocab_size * CFG.dim + CFG.dim) * 4  # fp32, unsharded


def dp_mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU mesh for data parallelism: 1-D named ``("shard",)``, 2-D named
    ``("replicate", "shard")`` (HSDP)."""
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _data(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, CFG.vocab_size, (world * BATCH_PER_RANK, SEQ + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def break_after(module: torch.nn.Module) -> None:
    """Makes ``module``'s forward end with a graph break (as a ``print`` or an
    ``.item()`` in a user's forward does), on this instance only."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        torch._dynamo.graph_break()
        return out

    module.forward = forward


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def reference_run(
    world: int, steps: int = STEPS, cfg: LlamaConfig = CFG
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: the ground truth."""
    torch.manual_seed(0)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _data(world, steps):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


_FAMILY_KEY = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}


def dynamo_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """What the runtime tests count in a graph dynamo produced, by the graph
    vocabulary: each collective family under its plain op's name
    (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``; waits
    excluded), ``fsdp.copy_``, ``resize_storage_bytes_`` (both directions), and
    ``version_counter`` (dynamo's version-counter ops: none while the runtime traces;
    [Note: Version counters in a traced step] in traceable_hsdp/_param.py)."""
    counts: Counter[str] = Counter()
    for n in graph.nodes:
        family = collective_family(n)
        if family is not None:
            counts[_FAMILY_KEY[family]] += 1
        elif is_fsdp_copy(n):
            counts["fsdp.copy_"] += 1
        elif is_resize(n):
            counts["resize_storage_bytes_"] += 1
        elif is_version_counter_op(n):
            counts["version_counter"] += 1
    return dict(counts)


class _DispatchedOps(TorchDispatchMode):
    """Records, in dispatch order, the name of each op of :attr:`namespace` run eagerly
    while active."""

    namespace = ""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == self.namespace:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class FunctionalCollectiveOps(_DispatchedOps):
    """The ``_c10d_functional`` ops run eagerly while active
    (``all_gather_into_tensor``, ``all_gather_into_tensor_out``, ``wait_tensor``, ...)."""

    namespace = "_c10d_functional"


class AtenOps(_DispatchedOps):
    """The ``aten`` ops run eagerly while active (``add``, ``add_``, ...)."""

    namespace = "aten"


class GraphRecorder:
    """A torch.compile backend (aot_eager underneath) that counts the collectives in
    every graph dynamo hands it (:func:`dynamo_counts`), split into forward and
    compiled-autograd graphs."""

    def __init__(self) -> None:
        self.forward: list[dict[str, int]] = []
        self.backward: list[dict[str, int]] = []
        self.reduce_ops: set[str] = set()  # the ops of every reduce-scatter and all-reduce

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        for n in gm.graph.nodes:
            if collective_family(n) in ("reduce_scatter", "all_reduce"):
                self.reduce_ops.add(str(bound_args(n)["reduce_op"]))
        _, is_bwd = current_compile()
        (self.backward if is_bwd else self.forward).append(dynamo_counts(gm.graph))
        return aot_eager(gm, example_inputs)


def _mean_over_ranks(value: torch.Tensor, world: int) -> float:
    """``value`` (a scalar tensor, e.g. this rank's loss) averaged over every rank."""
    t = value.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / world


def _managed(model: torch.nn.Module) -> list[Any]:
    """The FSDPParams of every fully_shard unit in ``model``, each unit once."""
    states = {}
    for m in model.modules():
        state = m.__dict__.get("_traceable_hsdp_state")
        if state is not None and state.param_group is not None:
            states[id(state)] = state
    return [fp for s in states.values() for fp in s.param_group.fsdp_params]


def graph_break_reasons() -> dict[str, int]:
    """Dynamo's graph breaks since ``counters`` was last cleared: each reason's first
    line, and how often it broke."""
    return {k.splitlines()[0]: v for k, v in counters["graph_break"].items()}


def model_refs(model: torch.nn.Module) -> list[weakref.ref]:
    """Weak references to ``model`` and its parameters, for :func:`count_alive` once
    the caller has dropped its own references."""
    return [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]


def count_alive(refs: list[weakref.ref]) -> int:
    """How many of ``refs`` still resolve after a full garbage collection. Dropping a
    model frees it and its parameters, as torch's fully_shard's: a cycle through a
    hook that autograd holds in C++ is invisible to the garbage collector (see [Note:
    Parameter hooks hold their unit weakly] in traceable_hsdp/_state.py)."""
    gc.collect()
    return sum(r() is not None for r in refs)


def _placeholder_bytes(model: torch.nn.Module) -> int:
    """Storage bytes of every unsharded placeholder."""
    return sum(fp.unsharded_param.untyped_storage().nbytes() for fp in _managed(model))


def compile_for(model: torch.nn.Module, how: str, backend: Any) -> tuple[Any, Any]:
    """The two ways in (docs/compile.md): ``how="loop"`` turns compiled autograd on
    and returns ``(torch.compile(model, fullgraph=True), None)``; ``how="step"`` sets
    ``compiled_autograd = True`` and returns ``(model, compiled step(x, y) -> loss)``,
    forward, loss and backward in one compiled function. Anything else: ``(model,
    None)``, eager."""
    if how == "loop":
        th.enable_compiled_autograd(backend=backend)
        return torch.compile(model, backend=backend, fullgraph=True), None
    if how == "step":
        torch._dynamo.config.compiled_autograd = True

        def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = _loss(model(x), y)
            loss.backward()
            return loss.detach()

        return model, torch.compile(step_fn, backend=backend)
    return model, None


# The conformance and accelerate tests' comparison: a model's state whole, and two
# runs equal bitwise.
def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every state-dict entry whole: DTensors gathered (float8 ones as their bytes),
    plain tensors cloned."""
    return {k: _full_tensor_bytes(v) if isinstance(v, DTensor) else v.detach().clone()
            for k, v in model.state_dict().items()}


def _full_tensor_bytes(v: DTensor) -> torch.Tensor:
    """The full tensor; a float8 one as its bytes (uint8), which gloo can gather and
    assert_close can compare bitwise."""
    if v.dtype != torch.float8_e4m3fn:
        return full_tensor(v)
    local = v.to_local().view(torch.uint8)
    return full_tensor(DTensor.from_local(local, v.device_mesh, v.placements, shape=v.shape, stride=v.stride()))


def assert_same_run(a: tuple, b: tuple, what: str) -> None:
    """Two runs' ``(losses, final parameters)``, as the workers return them, equal
    bitwise (the tests' side of the comparison)."""
    assert a[0] == b[0], (what, a[0], b[0])
    assert a[1].keys() == b[1].keys(), what
    for k, v in b[1].items():
        torch.testing.assert_close(a[1][k], v, rtol=0, atol=0, msg=f"{what}: {k}")


def hf_llama_config(layers: int = 2) -> Any:
    """An HF ``LlamaConfig`` of the test Llama's sizes (``CFG``'s vocabulary)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )


class GroupRecorder:
    """A torch.compile backend (``backend`` underneath: aot_eager, or Inductor's
    ``compile_fx``) that counts the collectives of every graph dynamo hands it by
    (op, process group), split into forward and compiled-autograd graphs. Every
    group of these meshes has 2 ranks, so groups are told apart by name: ``groups``
    maps a group name to its mesh dim's name (tests/test_tp.py, test_dp_mesh_dims.py)."""

    def __init__(self, groups: dict[str, str], backend: Callable[..., Any] = aot_eager) -> None:
        self.groups = groups
        self.backend = backend
        self.forward: list[dict[str, int]] = []
        self.backward: list[dict[str, int]] = []
        # The input dtype of each all-reduce, in graph order.
        self.all_reduce_dtypes: list[torch.dtype] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        counts: dict[str, int] = {}
        for n in gm.graph.nodes:
            if G.is_fsdp_copy(n):
                counts["fsdp.copy_"] = counts.get("fsdp.copy_", 0) + 1
            if not G.is_collective(n):  # waits are not counted
                continue
            op = G.op_name(n)[1]  # e.g. "all_gather_into_tensor", either op form
            group = G.collective_group_name(n)
            if op == "all_reduce":
                meta = n.args[0].meta
                self.all_reduce_dtypes.append(meta.get("example_value", meta.get("val")).dtype)
            key = f"{op}@{self.groups.get(group, group)}"
            counts[key] = counts.get(key, 0) + 1
        _, is_bwd = current_compile()
        (self.backward if is_bwd else self.forward).append(counts)
        return self.backend(gm, example_inputs)
