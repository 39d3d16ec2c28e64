"""Activation checkpointing with a compiled step: the joint-graph pass that keeps what
leaves a checkpoint region (see [Note: Checkpoint outputs are saved] in
``passes/save_checkpoint_outputs.py``), in three tiers.

1. The pass on hand-built joint graphs: which nodes it marks ``MUST_SAVE``.
2. A tiny compile (no processes): checkpoint + a compiled-autograd hook on the
   region's output; the forward saves the output and the backward runs the hook
   before the region's recompute. Plus a pin of a torch bug we work around.
3. Two gloo ranks, ``traceable_hsdp.demo.models.Llama`` with ``checkpoint_wrapper`` on
   every block (and selective / inner checkpointing), whole step compiled and plain
   loop: parity with the eager run without checkpointing, graph contents, saved
   activation bytes, recompiles. See the tolerance note on the test.
"""

from __future__ import annotations

import functools
import operator
import textwrap
from typing import Any

import pytest
import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.fx.experimental._backward_state import BackwardState
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import traceable_hsdp as th
import traceable_hsdp.passes as passes
from _dist import full_tensor, run_child
from _workers import CFG, LR, STEPS, _data, _loss, _mean_over_ranks, compile_for
from traceable_hsdp.debug._recorder import current_compile
from traceable_hsdp.demo.models import Llama, shard_llama
from traceable_hsdp.passes import save_checkpoint_outputs
from traceable_hsdp.passes._graph import (
    is_all_gather,
    is_fsdp_copy,
    is_placeholder_op,
    is_reduce_scatter,
    is_view,
)

aten = torch.ops.aten
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
SAVE = CheckpointPolicy.MUST_SAVE


# --------------------------------------------------------------------- tier 1
class _Joint:
    """A joint graph built by hand: fake values, AOTAutograd's forward/backward tags
    and the checkpoint's ``recompute`` / ``ac_graph_id`` metadata."""

    def __init__(self, backward_state: bool = True) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.x = self.input("primals_1", 4, 8)
        self.w = self.input("primals_2", 8, 8)
        if backward_state:
            bw = self.graph.placeholder("primals_3")
            bw.meta["val"] = BackwardState()
            bw.meta["partitioner_tag"] = "is_forward"
        self.tangent = self.input("tangents_1", 4, 8, tag="is_backward")

    def input(self, name: str, *shape: int, tag: str = "is_forward") -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape)
        node.meta["partitioner_tag"] = tag
        return node

    def op(self, target: Any, *args: Any, region: int | None = None,
           policy: CheckpointPolicy = RECOMPUTE, bw: bool = False) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = fx.node.map_arg(args, lambda a: a.meta["val"])
        with self.mode:
            node.meta["val"] = target(*vals)
        node.meta["partitioner_tag"] = "is_backward" if bw else "is_forward"
        if region is not None:
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = region
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _policies(gm: fx.GraphModule) -> dict[str, CheckpointPolicy | None]:
    return {n.name: n.meta.get("recompute") for n in gm.graph.nodes if n.op == "call_function"}


def _block(j: _Joint, x: fx.Node, region: int) -> tuple[fx.Node, fx.Node, fx.Node]:
    t = j.op(aten.permute.default, j.w, [1, 0], region=region)
    mm = j.op(aten.mm.default, x, t, region=region)
    return t, mm, j.op(aten.relu.default, mm, region=region)


@pytest.mark.parametrize("backward_state", [True, False])
def test_save_checkpoint_outputs_marks_the_region_output(backward_state: bool) -> None:
    """Region (permute, mm, relu) read by a plain op (sin) and by backward nodes:
    relu is saved, the rest stays recomputed; nothing changes without compiled-autograd
    hooks (no BackwardState input)."""
    j = _Joint(backward_state)
    t, mm, relu = _block(j, j.x, 1)
    s = j.op(aten.sin.default, relu)
    grad = j.op(aten.mul.Tensor, j.tangent, j.op(aten.cos.default, relu, bw=True), bw=True)
    gm = j.done(j.op(aten.sum.default, s), grad)
    before = _policies(gm)
    n = save_checkpoint_outputs(gm)
    after = _policies(gm)
    if not backward_state:
        assert n == 0 and after == before
        return
    assert n == 1
    assert after == {**before, relu.name: SAVE}
    assert after[mm.name] is RECOMPUTE and after[t.name] is RECOMPUTE
    assert save_checkpoint_outputs(gm) == 0  # idempotent: nothing left to mark


def test_save_checkpoint_outputs_only_backward_users_is_no_output() -> None:
    """A region value read only by backward nodes (its own gradient formula) stays
    recomputed: that is what checkpointing is for."""
    j = _Joint()
    _, mm, relu = _block(j, j.x, 1)
    grad = j.op(aten.threshold_backward.default, j.tangent, relu, 0.0, bw=True)
    gm = j.done(j.op(aten.sum.default, j.x), grad)
    assert save_checkpoint_outputs(gm) == 0
    assert _policies(gm)[relu.name] is RECOMPUTE


def test_save_checkpoint_outputs_consecutive_regions_and_graph_output() -> None:
    """Region 1's output feeds region 2; region 2's output is a graph output: both
    saved; the ops inside stay recomputed."""
    j = _Joint()
    _, mm1, relu1 = _block(j, j.x, 1)
    _, mm2, relu2 = _block(j, relu1, 2)
    gm = j.done(relu2)
    assert save_checkpoint_outputs(gm) == 2
    p = _policies(gm)
    assert p[relu1.name] is SAVE and p[relu2.name] is SAVE
    assert p[mm1.name] is RECOMPUTE and p[mm2.name] is RECOMPUTE


def test_save_checkpoint_outputs_view_output_saves_its_base() -> None:
    """The partitioner never bans a view from recomputation: the region's last
    non-view node is saved instead, the view recomputed from it."""
    j = _Joint()
    _, _, relu = _block(j, j.x, 1)
    v = j.op(aten.view.default, relu, [32], region=1)
    gm = j.done(j.op(aten.sin.default, v))
    assert save_checkpoint_outputs(gm) == 1
    p = _policies(gm)
    assert p[relu.name] is SAVE and p[v.name] is RECOMPUTE


def test_save_checkpoint_outputs_multi_output_op() -> None:
    """A region ending in a multi-output op (layer norm): the op and all its getitems
    are saved-not-recomputed (the tuple itself cannot be saved, a getitem cannot be
    banned)."""
    j = _Joint()
    _, _, relu = _block(j, j.x, 1)
    ln = j.op(aten.native_layer_norm.default, relu, [8], None, None, 1e-5, region=1)
    outs = [j.op(operator.getitem, ln, i, region=1) for i in range(3)]
    gm = j.done(j.op(aten.sin.default, outs[0]))
    assert save_checkpoint_outputs(gm) == 1
    p = _policies(gm)
    assert p[ln.name] is SAVE and all(p[o.name] is SAVE for o in outs)
    assert p[relu.name] is RECOMPUTE


def test_save_checkpoint_outputs_selective_policy_is_inside() -> None:
    """Selective checkpointing: an op the policy saves is still inside its region, so
    what only it reads is no region output."""
    j = _Joint()
    _, mm, relu = _block(j, j.x, 1)
    mm.meta["recompute"] = SAVE  # the policy saves matmuls
    mm2 = j.op(aten.mm.default, relu, j.w, region=1, policy=SAVE)
    out = j.op(aten.mul.Tensor, mm2, 2.0, region=1)
    gm = j.done(j.op(aten.sin.default, out))
    assert save_checkpoint_outputs(gm) == 1
    p = _policies(gm)
    assert p[out.name] is SAVE and p[relu.name] is RECOMPUTE


@pytest.fixture
def restore_joint_pass():
    import torch._functorch.config as fc

    saved = fc.joint_custom_pass
    yield fc
    fc.joint_custom_pass = saved


def test_install_sets_the_joint_pass_and_composes(restore_joint_pass) -> None:
    fc = restore_joint_pass
    seen: list[int] = []

    def user(gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        seen.append(sum(1 for n in gm.graph.nodes if n.meta.get("recompute") is SAVE))
        return gm

    fc.joint_custom_pass = user
    passes.install()
    installed = fc.joint_custom_pass
    assert isinstance(installed, passes.TraceableHSDPJointPass) and installed.user_pass is user
    passes.install()
    assert fc.joint_custom_pass is installed  # idempotent
    j = _Joint()
    _, _, relu = _block(j, j.x, 1)
    gm = j.done(j.op(aten.sin.default, relu))
    assert installed(gm, None) is gm
    assert seen == [0]  # the user's pass ran first
    assert _policies(gm)[relu.name] is SAVE
    passes.uninstall()
    assert fc.joint_custom_pass is user


# --------------------------------------------------------------------- tier 2
def test_compiled_checkpoint_output_saved_and_hook_before_recompute(restore_joint_pass) -> None:
    """A real joint graph: checkpoint(relu(linear) * 2), a hook on its output (deferred
    to compiled autograd), a layer norm after it. With the pass the forward saves the
    region's output and the backward's hook call precedes the recomputed addmm;
    without it the addmm comes first (the order that reads a freed placeholder under
    fully_shard)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.utils.checkpoint import checkpoint

    def run(with_pass: bool) -> tuple[list[str], list[str]]:
        restore_joint_pass.joint_custom_pass = (
            passes.TraceableHSDPJointPass() if with_pass else None
        )
        seen: dict[str, list[str]] = {}

        def partition(joint: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
            fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
            out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
            seen["saved"] = [n.name for n in out[kw["num_fwd_outputs"]:] if n.op != "placeholder"]
            seen["bw"] = [
                "HOOK" if "_trace_wrapped" in getattr(n.target, "__module__", "") else str(n.target)
                for n in bw.graph.nodes
                if n.op == "call_function"
            ]
            return fw, bw

        backend = aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
            keep_inference_input_mutations=True,
        )
        torch.manual_seed(0)
        lin, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

        def step(x: torch.Tensor) -> torch.Tensor:
            y = checkpoint(lambda t: torch.relu(lin(t)) * 2, x, use_reentrant=False)
            y.register_hook(lambda g: g)
            loss = norm(y).sum()
            loss.backward()
            return loss

        torch._dynamo.reset()
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(step, backend=backend)(torch.randn(4, 8, requires_grad=True))
        return seen["saved"], seen["bw"]

    saved, bw = run(with_pass=True)
    assert "mul" in saved, saved
    assert bw.index("HOOK") < bw.index("aten.addmm.default"), bw
    saved, bw = run(with_pass=False)  # the control: torch 2.13 alone
    assert "mul" not in saved, saved
    assert bw.index("aten.addmm.default") < bw.index("HOOK"), bw
    torch._dynamo.reset()


@pytest.mark.xfail(
    strict=True,
    raises=AttributeError,
    reason="torch 2.13-2.15 compiled autograd: a tensor hook on an output whose gradient is "
    "undefined is recorded as call_hook(hook, None); reorder_tensor_pre_hook_nodes "
    "(torch/_dynamo/compiled_autograd.py) then calls is_placeholder(None). Eager "
    "autograd calls the hook with None. Strict: tells us when torch fixes it. "
    "fully_shard works around it ([Note: An output hook that gets no gradient] in "
    "traceable_hsdp/_compile.py); the child here imports torch only.",
)
def test_torch_compiled_autograd_hook_on_unused_output() -> None:
    # In a child process: the failure leaves torch's compile context entered, and every
    # later compile in this process would then count as a compiled-autograd one.
    code = textwrap.dedent(
        """
        import torch
        from torch._dynamo import compiled_autograd

        x = torch.randn(4, requires_grad=True)
        a, b = torch.ops.aten.split.Tensor(x * 1.0, 2)  # one SplitBackward, two outputs
        a.register_hook(lambda g: g)  # `a` is never used: its gradient is undefined
        with compiled_autograd._enable(torch.compile(backend="eager")):
            b.sum().backward()
        """
    )
    run_child(code, AttributeError)


def _around_unit_models(mesh: Any) -> dict[str, tuple[torch.nn.Module, Any]]:
    """Three models whose checkpoint is around a unit's whole call, keyed by what the
    refusal names, each with its step: HF ``LlamaForCausalLM`` with
    ``gradient_checkpointing_enable()``; our Llama with ``checkpoint_wrapper``
    applied to each block after its ``fully_shard``, before the root's; and our Llama
    with torch's ``apply_activation_checkpointing`` after the root's ``fully_shard``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    import traceable_hsdp as th
    from _workers import CFG, CFG1
    from traceable_hsdp.demo.models import Block, Llama

    torch.manual_seed(0)
    hf = LlamaForCausalLM(HFLlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False,
    ))
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in hf.model.layers:
        th.fully_shard(layer, mesh=mesh)
    th.fully_shard(hf, mesh=mesh)
    # One block each (CFG1): the refusal names the first unit it meets, and every
    # block costs compile time.
    ours = Llama(CFG1)
    for i, block in enumerate(ours.layers):
        ours.layers[i] = checkpoint_wrapper(th.fully_shard(block, mesh=mesh))
    th.fully_shard(ours, mesh=mesh)
    after = Llama(CFG1)
    for block in after.layers:
        th.fully_shard(block, mesh=mesh)
    th.fully_shard(after, mesh=mesh)
    apply_activation_checkpointing(after, check_fn=lambda m: isinstance(m, Block))
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    return {
        "Hugging Face gradient checkpointing": (hf, lambda f: f(input_ids=tokens).logits),
        "checkpoint_wrapper 'layers.0' wraps it.": (ours, lambda f: f(tokens)),
        "checkpoint_wrapper 'layers.0' wraps it (put there after": (after, lambda f: f(tokens)),
    }


@pytest.mark.slow
def test_checkpoint_around_a_unit_refused_compiled_without_the_dynamo_flag(one_rank) -> None:
    """A checkpoint around a unit's whole call (HF's gradient_checkpointing_enable(),
    checkpoint_wrapper applied after fully_shard, before or after the root's) puts
    the unit's hooks inside the region. Compiled without dynamo's
    skip_fwd_side_effects_in_bwd_under_checkpoint, that ends in a compiled-autograd
    AttributeError, or (the wrapper put in after the root's fully_shard) in minutes of
    compiling graph breaks; the root's compiled pre-forward refuses it, naming the unit and the fix (see [Note: A checkpoint around a unit's
    call] in traceable_hsdp/_state.py). Eager and forward-only it runs: the root's
    pre-forward checks only when a backward can follow (one check, the same for the
    three models), so the forward-only compile (under no_grad) is made for one
    model. With the flag on, the compiled (aot_eager) gradients of the two
    checkpoint_wrapper models equal the eager ones bitwise (1 rank). HF's model with
    the flag on is trained compiled in tests/test_conformance.py (case hf_ac: 2 ranks,
    aot_eager bitwise and Inductor), so it is not compiled a second time here."""
    import traceable_hsdp as th

    flag = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    for what, (model, call) in _around_unit_models(one_rank).items():
        call(model).sum().backward()  # eager trains
        eager = [full_tensor(p.grad) for p in model.parameters()]
        model.zero_grad()
        torch._dynamo.reset()
        th.enable_compiled_autograd(backend="aot_eager")
        try:
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = False
            # fullgraph first: after a break, the frame's cached entry would answer.
            strict = torch.compile(model, backend="aot_eager", fullgraph=True)
            with pytest.raises(Exception, match="checkpointed around its whole call"):
                call(strict)
            model.reset_iter_state()
            compiled = torch.compile(model, backend="aot_eager")
            with pytest.raises(RuntimeError, match="checkpointed around its whole call") as err:
                call(compiled)
            assert what in str(err.value), str(err.value)
            assert "skip_fwd_side_effects_in_bwd_under_checkpoint = True" in str(err.value)
            assert "fully_shard(checkpoint_wrapper(block))" in str(err.value)
            model.reset_iter_state()
            if what == "checkpoint_wrapper 'layers.0' wraps it.":
                with torch.no_grad():  # no backward, nothing to refuse
                    call(compiled)
            if what == "Hugging Face gradient checkpointing":
                continue  # trained compiled with the flag on in test_conformance.py
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
            call(compiled).sum().backward()
            for p, g in zip(model.parameters(), eager, strict=True):
                torch.testing.assert_close(full_tensor(p.grad), g, rtol=0, atol=0)
        finally:
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = flag
            th.disable_compiled_autograd()
            torch._dynamo.reset()


# --------------------------------------------------------------------- tier 3
# Each checkpointing kind compiled once, and both compile modes: "loop" with the
# selective policy here, and with checkpoint_wrapper's full recompute in
# test_conformance.py (a meta-built model with AC on every block, compiled in the
# plain loop on 2x2, bitwise against eager).
VARIANTS = [
    ("none", "eager"),
    ("none", "step"),
    ("wrapper", "step"),
    ("sac", "loop"),
    ("inner", "step"),
]


_WRAPPED = "_checkpoint_wrapped_module."


def _mm_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Llama, kind: str) -> None:
    """``wrapper``: checkpoint_wrapper (non-reentrant) around every block, before
    fully_shard (torchtitan's order); ``sac``: the same with a policy that saves
    matmuls; ``inner``: ``checkpoint(use_reentrant=False)`` around each block's MLP,
    called inside the block's forward; ``none``."""
    layers = model.layers
    if kind in ("wrapper", "sac"):
        ctx = (
            {"context_fn": functools.partial(create_selective_checkpoint_contexts, _mm_policy)}
            if kind == "sac"
            else {}
        )
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **ctx)
    elif kind == "inner":
        for layer in layers:
            mlp = layer.ffn
            mlp.forward = functools.partial(checkpoint, type(mlp).forward.__get__(mlp), use_reentrant=False)
    elif kind != "none":
        raise ValueError(kind)


def early_placeholder_reads(gm: fx.GraphModule) -> list[str]:
    """Nodes of a backward graph that read an unsharded placeholder (directly or
    through views) before the ``fsdp.copy_`` that refills it: a read of 0 bytes."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    bad = []
    for copy in gm.graph.nodes:
        if not is_fsdp_copy(copy) or not isinstance(copy.args[0], fx.Node):
            continue
        p = copy.args[0]
        if any(is_fsdp_copy(u) and order[u] < order[copy] for u in p.users):
            continue  # not the first refill of p
        stack = list(p.users)
        while stack:
            u = stack.pop()
            if u.op != "call_function" or is_placeholder_op(u):
                continue
            if is_view(u):
                stack.extend(u.users)
            elif order[u] < order[copy]:
                bad.append(f"{u.name} reads {p.name}")
    return bad


class ACRecorder:
    """aot_eager with a recording partitioner: per forward graph the bytes of the
    activations it saves for backward (placeholders, i.e. parameters and inputs, not
    counted) and its collectives; per compiled-autograd graph its collectives, its
    matmuls and its early placeholder reads."""

    def __init__(self) -> None:
        self.forward: list[dict[str, int]] = []
        self.backward: list[dict[str, Any]] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Any:
        _, is_bwd = current_compile()
        saved: list[int] = []

        def partition(joint: fx.GraphModule, inputs: Any, **kw: Any) -> Any:
            fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
            out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
            saved.append(int(sum(
                n.meta["val"].numel() * n.meta["val"].element_size()
                for n in out[kw["num_fwd_outputs"]:]
                if isinstance(n, fx.Node) and n.op != "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor)
            )))  # an int even where a size is symbolic (it has a hint)
            return fw, bw

        def compile_graph(g: fx.GraphModule, inputs: Any) -> Any:
            counts = {
                "all_gather": sum(map(is_all_gather, g.graph.nodes)),
                "reduce_scatter": sum(map(is_reduce_scatter, g.graph.nodes)),
                "mm": sum(1 for n in g.graph.nodes if n.target is torch.ops.aten.mm.default),
            }
            if is_bwd:
                self.backward.append({**counts, "early_reads": early_placeholder_reads(g)})
            else:
                self.forward.append({**counts, "saved_bytes": saved[0] if saved else 0})
            return boxed_nop(g, inputs)

        return aot_autograd(
            fw_compiler=compile_graph, bw_compiler=boxed_nop, partition_fn=partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


def _run(rank: int, world: int, kind: str, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(CFG)
    apply_ac(model, kind)
    shard_llama(model, th.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rec = ACRecorder()
    torch._dynamo.reset()
    fwd, compiled_step = compile_for(model, mode, rec)
    losses, graphs = [], []
    try:
        for x, y in _data(world, STEPS):
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            if mode == "step":
                loss = compiled_step(xs, ys)
            else:
                loss = _loss(fwd(xs), ys)
                loss.backward()
            graphs.append((len(rec.forward), len(rec.backward)))
            opt.step()
            opt.zero_grad()
            losses.append(_mean_over_ranks(loss, world))
    finally:
        if mode == "loop":
            th.disable_compiled_autograd()
        torch._dynamo.config.compiled_autograd = False
        torch._dynamo.reset()
    params = {k.replace(_WRAPPED, ""): full_tensor(v) for k, v in model.state_dict().items()}
    return dict(losses=losses, params=params, graphs=graphs, forward=rec.forward, backward=rec.backward)


def ac_worker(rank: int, world: int, variants: list[tuple[str, str]]) -> dict[str, Any]:
    """Trains ``CFG``'s Llama for STEPS steps per (checkpointing kind, mode) variant,
    each from the same initial weights; mode "eager", "step" (whole step compiled
    under ``compiled_autograd = True``) or "loop" (``enable_compiled_autograd`` and a
    compiled model)."""
    return {f"{kind}/{mode}": _run(rank, world, kind, mode) for kind, mode in variants}


@pytest.mark.slow
def test_checkpointed_llama_compiled_2_ranks() -> None:
    """Each checkpointed variant, compiled (aot_eager), against our eager run without
    checkpointing on the same data: losses and final parameters within 1e-6
    (recomputation repeats the same ops on the same inputs, but the compiled graphs
    may order reductions differently). Every
    backward graph holds the re-gathers and reduce-scatters and reads no placeholder
    before refilling it; the forward graph saves fewer activation bytes than the
    compiled run without checkpointing; no graph is compiled after step 1."""
    from _dist import run_ranks
    from _workers import CFG, ROOT_PARAMS

    n_params = 2 + 9 * CFG.n_layers + 1
    r = run_ranks(ac_worker, 2, VARIANTS)[0]
    ref = r["none/eager"]
    base = r["none/step"]
    for name, run in r.items():
        if name == "none/eager":
            continue
        torch.testing.assert_close(run["losses"], ref["losses"], rtol=0, atol=1e-6, msg=name)
        assert run["params"].keys() == ref["params"].keys()
        for k, v in ref["params"].items():
            torch.testing.assert_close(run["params"][k], v, rtol=0, atol=1e-6, msg=f"{name} {k}")
        assert run["graphs"] == [run["graphs"][0]] * len(run["graphs"]), (name, run["graphs"])
        fwd, bwd = run["forward"][0], run["backward"][0]
        assert len(run["backward"]) == 1, name
        # The root stays gathered for backward (the default): the blocks re-gather.
        assert fwd["all_gather"] == n_params, (name, fwd)
        assert bwd["all_gather"] == n_params - ROOT_PARAMS, (name, bwd)
        assert bwd["reduce_scatter"] == n_params, (name, bwd)
        assert bwd["early_reads"] == [], (name, bwd["early_reads"])
        if name != "none/step":
            assert fwd["saved_bytes"] < base["forward"][0]["saved_bytes"], (name, fwd, base["forward"][0])
        if name.split("/")[0] in ("wrapper", "inner"):
            # Their matmuls are recomputed in the backward (the policy of "sac" saves them).
            assert bwd["mm"] > base["backward"][0]["mm"], (name, bwd, base["backward"][0])
