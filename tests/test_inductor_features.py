"""Features under the backend users run: Inductor, with every pass on.

One model and one compile, on 4 ranks as a 2x2 (replicate, shard) mesh, combining (see
:func:`_fat_build`):
block 0 through ``hsdp(optimizer_level="level2", threshold=1, comm_fusion=True,
bucket_size=1)`` (reshard_after_forward=False, its RMSNorm weights kept whole and
all-reduced, the bucketing passes on with a 1 MiB cap); block 1 through
``fully_shard`` in bf16 (reduce and output in fp32, reshard_after_forward=True); the
root, holding the tied embedding/output head, through ``hsdp`` level1 (storage kept
across steps). Three optimizer steps (SGD with momentum)
of two micro-batches, gradient sync off on the first; compiled with compiled
autograd and Inductor; a DCP checkpoint saved before the last step and loaded back
after it, and the last step run again.

Checks, from the final post-grad graphs (Inductor's post-grad post-pass, after our
passes):
- the collectives of each graph after bucketing (numbers derived in ``_expected``);
- every graph compiled in step 1 (its two micro-batches), none later, none after
  the resume;
- losses and final parameters against the eager run of the same model and data:
  losses rtol 5e-4, parameters atol 1e-3. Not bitwise:
  block 1 computes in bf16, where eager rounds every op's output to bf16 and
  Inductor keeps fp32 inside its fused kernels;
- the resumed step equals the uninterrupted one bitwise (the same compiled code on
  the same state), run with dynamo's guards skipped
  (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, docs/compile.md): only
  the guards that tell the compiled graphs apart choose between them, and they must
  still pick the no-sync backward for the first micro-batch and the syncing one for
  the second (swapped, the first micro-batch's gradients would be reduced on their
  own and the second's not at all).

One mesh only: HSDP's run takes every path a 1-D mesh of 2 ranks would (the shard
group's collectives, the kept-whole weights' all-reduce over it) and adds the
replicate group's. A 1-D mesh
is compiled under Inductor in test_conformance.py and test_passes_e2e.py.

Not covered here: an int ``reshard_after_forward`` is a real smaller world only on
a shard group of 4 or more (on 2 ranks it is True or False); it is tested under
aot_eager and Inductor on 4 ranks in test_runtime.py
(test_reshard_after_forward_int_4_ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import traceable_hsdp as th
from _dist import full_tensor, run_ranks
from traceable_hsdp.demo.models import Llama, LlamaConfig

N_BLOCK0 = 9  # parameters of block 0: 7 sharded weights and 2 RMSNorm weights kept whole
N_ROOT = 2  # the tied embedding/output (sharded) and the final norm (kept whole)


def _expected() -> list[dict[str, int]]:
    """Collectives and placeholder ops per graph, in compile order: the forward, the
    no-sync backward, the syncing backward.

    - All-gathers: the forward has two buckets, fp32 (the root and block 0, merged
      by the cap: without it they would be two) and bf16 (block 1; another dtype,
      never merged with fp32). Each backward re-gathers block 1 only (bf16): block 0
      (level2) and the root (level1) stay gathered.
    - Reduce-scatters: one in the syncing backward, none without sync. A
      compiled-autograd backward graph carries no unit annotations on torch 2.13, so
      there the process-wide PassConfig decides, not hsdp()'s cap (see [Note:
      Per-unit pass options] in passes/bucket_collectives.py): its default 4 MiB cap
      merges the run before block 1's re-gather (the backward's only all-gather) with
      the run after it (every gradient is reduced in fp32; per unit they would be
      two).
    - All-reduces (never bucketed): the three whole RMSNorm weights (block 0's two,
      the root's) over the shard group and over the replicate group, and every
      sharded gradient over the replicate group (17 sharded parameters, the tied one
      counted once): 3 + 3 + 17.
    - Block 0 (level2) is gathered in the forward and freed in the backward: its 9
      grows and fsdp.copy_ stay in the forward and its 9 frees in each backward (a
      grow/copy/free region spanning two graphs is not removed; see passes.md). The
      root (level1) keeps its storage: each forward grows (a no-op) and refills its
      2 placeholders, never freed. Block 1's regions are removed entirely.
    """
    kept = N_BLOCK0 + N_ROOT
    ar = 3 + 3 + 17
    return [
        dict(all_gather=2, reduce_scatter=0, all_reduce=0, fsdp_copy=kept, resize=kept),
        dict(all_gather=1, reduce_scatter=0, all_reduce=0, fsdp_copy=0, resize=N_BLOCK0),
        dict(all_gather=1, reduce_scatter=1, all_reduce=ar, fsdp_copy=0, resize=N_BLOCK0),
    ]


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        counts = [{k: v for k, v in g.items() if not k.endswith("_in")} for g in r["graphs"]]
        assert counts == _expected(), counts
        # The gathered dtypes: fp32 and bf16 buckets forward, bf16 backward.
        dtypes = [sorted(d for _, d in g["all_gather_in"]) for g in r["graphs"]]
        assert dtypes == [["torch.bfloat16", "torch.float32"]] + [["torch.bfloat16"]] * 2, dtypes
        e, c = r["eager"], r["compiled"]
        assert c["graphs_after_step"] == [3] * FAT_STEPS, c["graphs_after_step"]
        assert c["resumed_graphs"] == 3
        torch.testing.assert_close(c["losses"], e["losses"], rtol=5e-4, atol=0)
        for k, v in e["params"].items():
            torch.testing.assert_close(c["params"][k], v, rtol=0, atol=1e-3, msg=k)
        assert c["resumed_loss"] == c["losses"][-1]
        for k, v in c["params"].items():
            torch.testing.assert_close(c["resumed_params"][k], v, rtol=0, atol=0, msg=k)
        pl = r["placements"]
        whole = "(Replicate(), Replicate())"
        assert pl["layers.0.attn_norm.weight"] == pl["norm.weight"] == whole, pl
        assert "output.weight" in pl and "Shard(dim=0)" in pl["output.weight"], pl



# Tied embeddings: the output head is the token embedding (one parameter in the root).
FAT_CFG = LlamaConfig(vocab_size=65, dim=32, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=True)
FAT_SEQ, FAT_BATCH_PER_RANK, FAT_STEPS, FAT_MICRO, FAT_LR = 8, 2, 3, 2, 0.05
# hsdp(bucket_size=...) in MiB: the whole model's gathered fp32 parameters are
# ~0.1 MiB, so adjacent units of one dtype merge into one bucket.
FAT_BUCKET_MB = 1
FAT_BF16 = th.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               output_dtype=torch.float32)


def _fat_build(mesh: Any) -> Llama:
    """Block 0: hsdp level2 (reshard_after_forward=False; the RMSNorm weights, under
    threshold=1 KiB, kept whole and all-reduced), which also turns comm_fusion on with
    a bucket cap. Block 1: fully_shard in bf16 (reduce in fp32, output fp32),
    reshard_after_forward=True. Root: the tied embedding/output and the final norm
    (kept whole: threshold=1 KiB), through hsdp level1 (its gathered storage is never
    freed; each forward refills it from the shards)."""
    torch.manual_seed(0)
    model = Llama(FAT_CFG)
    assert model.output.weight is model.tok_embeddings.weight
    th.hsdp(model.layers[0], threshold=1, optimizer_level="level2", comm_fusion=True,
            bucket_size=FAT_BUCKET_MB, mesh=mesh)
    th.fully_shard(model.layers[1], mesh=mesh, mp_policy=FAT_BF16, reshard_after_forward=True)
    # The same pass configuration again: hsdp() sets it for the whole process.
    th.hsdp(model, threshold=1, optimizer_level="level1", comm_fusion=True,
            bucket_size=FAT_BUCKET_MB, mesh=mesh)
    return model


def _fat_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(FAT_STEPS):
        tok = torch.randint(0, FAT_CFG.vocab_size, (8 * FAT_BATCH_PER_RANK * FAT_MICRO, FAT_SEQ + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def _any_all_gather(node: torch.fx.Node) -> bool:
    from traceable_hsdp.passes import _graph as P

    return P.collective_family(node) == "all_gather"


def _any_reduce_scatter(node: torch.fx.Node) -> bool:
    from traceable_hsdp.passes import _graph as P

    return P.collective_family(node) == "reduce_scatter"


def _fat_counts(graph: torch.fx.Graph) -> dict[str, int]:
    from traceable_hsdp.passes import _graph as P
    from traceable_hsdp.passes import _rewrite as R

    c = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce", "fsdp_copy", "resize"), 0)
    for n in graph.nodes:
        # An all-gather in either form (on CPU each is issued into a buffer: [Note:
        # CPU all-gathers into buffers] in passes/gloo/gather_into_buffers.py), and a
        # reduce-scatter (over two gloo ranks an exchange: [Note: gloo
        # reduce-scatters as an exchange] in passes/gloo/exchange.py).
        for key, pred in (("all_gather", _any_all_gather), ("reduce_scatter", _any_reduce_scatter),
                          ("all_reduce", P.is_all_reduce), ("fsdp_copy", P.is_fsdp_copy),
                          ("resize", P.is_resize)):
            if pred(n):
                c[key] += 1
                v = R.tensor_val(n.args[0])
                c.setdefault(key + "_in", []).append(
                    (tuple(v.shape), str(v.dtype)) if v is not None else None)
    return c


def fat_worker(rank: int, world: int, mesh_shape: tuple[int, ...], ckpt: str) -> dict[str, Any]:
    """Trains the model of ``_fat_build`` eagerly, then compiled with Inductor (every pass
    on, compiled autograd), FAT_STEPS optimizer steps of FAT_MICRO micro-batches (gradient
    sync off on all but the last). Compiled, a DCP checkpoint is saved after step
    FAT_STEPS-1 and loaded back after step FAT_STEPS, which is then run again under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from _workers import dp_mesh

    mesh = dp_mesh(mesh_shape)
    graphs: list[dict[str, int]] = []

    class Record(CustomGraphPass):
        """Inductor's post-grad post-pass: each graph after our passes."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            graphs.append(_fat_counts(graph))

        def uuid(self) -> None:
            return None  # never from the FX cache: every graph is seen

    def run(compiled: bool) -> dict[str, Any]:
        model = _fat_build(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=FAT_LR, momentum=0.9)
        fwd = model
        if compiled:
            torch._inductor.config.post_grad_custom_post_pass = Record()
            th.enable_compiled_autograd()
            fwd = torch.compile(model, fullgraph=True)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            xs, ys = x.chunk(world)[rank].chunk(FAT_MICRO), y.chunk(world)[rank].chunk(FAT_MICRO)
            total = torch.zeros(())
            for i in range(FAT_MICRO):
                model.set_requires_gradient_sync(i == FAT_MICRO - 1)
                loss = F.cross_entropy(fwd(xs[i]).flatten(0, 1), ys[i].flatten()) / FAT_MICRO
                loss.backward()
                total += loss.detach()
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce(total)
            return total.item() / world

        losses, graphs_after_step = [], []
        data = _fat_data()
        try:
            for i, (x, y) in enumerate(data):
                if compiled and i == FAT_STEPS - 1:
                    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                             checkpoint_id=ckpt)
                losses.append(step(x, y))
                graphs_after_step.append(len(graphs))
            out = dict(losses=losses, graphs_after_step=graphs_after_step,
                       params={k: full_tensor(v) for k, v in model.state_dict().items()})
            if compiled:
                # Resume: load the checkpoint into the same model and optimizer (in
                # place), and run the last step again, with dynamo's guards skipped
                # (docs/compile.md, "Steps without guards"): its graphs (the forward,
                # the backwards with gradient sync off and on) were all compiled in
                # step 1, so only the guards that tell them apart may pick each one.
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=ckpt)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    out["resumed_loss"] = step(*data[-1])
                out["resumed_graphs"] = len(graphs)
                out["resumed_params"] = {k: full_tensor(v) for k, v in model.state_dict().items()}
            return out
        finally:
            if compiled:
                th.disable_compiled_autograd()
                torch._inductor.config.post_grad_custom_post_pass = None

    eager = run(compiled=False)
    compiled = run(compiled=True)
    return dict(eager=eager, compiled=compiled, graphs=graphs,
                placements={k: str(v.placements) for k, v in _fat_build(mesh).state_dict().items()})


@pytest.mark.slow
def test_inductor_features_hsdp_2x2(tmp_path) -> None:
    """4 ranks, a 2x2 (replicate, shard) mesh: HSDP."""
    _check(run_ranks(fat_worker, 4, (2, 2), str(tmp_path / "ckpt"), spawn=True))
