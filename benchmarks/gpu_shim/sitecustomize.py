"""Lets torch 2.11 run traceable_hsdp's passes, for measurements on the lent GPU image
(torch 2.11.0+cu130, where a CUDA build of torch 2.13 cannot be carried). Not a
supported torch: see docs/benchmarks.md, "On GPUs". Put this folder first on
``PYTHONPATH``; ``benchmarks/gpu_session.sh`` does so only where torch lacks
``get_custom_graph_passes``. It changes nothing on torch 2.13.

It gives 2.11 the two things of 2.13 the passes and the harness use:
``torch._inductor.custom_graph_pass.get_custom_graph_passes`` and a list of passes
accepted as ``post_grad_custom_post_pass`` (each applied in turn, and each keyed in
the FX graph cache).
"""

import torch._inductor.custom_graph_pass as cgp

if not hasattr(cgp, "get_custom_graph_passes"):

    def get_custom_graph_passes(p):  # type: ignore[no-untyped-def]
        return () if p is None else tuple(p) if isinstance(p, (list, tuple)) else (p,)

    cgp.get_custom_graph_passes = get_custom_graph_passes
    import torch._inductor.codecache as cc
    from torch.fx.passes.graph_transform_observer import GraphTransformObserver as G

    apply, detail = G.apply_graph_pass, cc.FxGraphHashDetails._get_custom_pass_detail

    def apply_each(self, f):  # type: ignore[no-untyped-def]
        out = None
        for g in f if isinstance(f, (list, tuple)) else (f,):
            out = apply(self, g)
        return out

    def detail_each(self, p):  # type: ignore[no-untyped-def]
        if isinstance(p, (list, tuple)):
            return tuple(detail(self, q) for q in p) or None
        return detail(self, p)

    G.apply_graph_pass = apply_each
    cc.FxGraphHashDetails._get_custom_pass_detail = detail_each
