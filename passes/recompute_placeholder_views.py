"""Never save a view of an unsharded placeholder: recompute it in the backward.

[Note: Views of a placeholder are recomputed]
AOTAutograd's partitioner may compute a saved view of a placeholder at the end of the
forward, after the placeholder was freed (aot_eager fails the bounds check; compiled
code is right only by aliasing). ``recompute_views`` ([Note: Saved views of the
placeholder] in ``_install.py``) covers views whose base is saved, not others: with
HF Mixtral's ``torch._grouped_mm`` in bf16 the partitioner saves
``transpose(transpose(w))`` instead of ``w``::

    transpose_5  = transpose(primals_22, -2, -1)      # the forward's use
    ...
    resize_storage_bytes_(primals_22, 0)              # the unit's reshard
    ...
    transpose_26 = transpose(transpose_5, -2, -1)     # saved for backward: fails
    return (..., transpose_26, ...)

This pass marks ``MUST_RECOMPUTE`` every forward view whose chain of bases ends at a
placeholder (a graph input the graph resizes or fills with ``fsdp.copy_``). The
partitioner then saves the placeholder (free: a graph input) and recomputes the views
in the backward, after the re-gather. Views stay views. Tagged views keep their tags;
joint graphs without a ``BackwardState`` input are left alone.
"""

from __future__ import annotations

import logging

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ._graph import is_placeholder_op, is_view
from ._rewrite import alias_base
from .save_checkpoint_outputs import has_backward_state, is_forward

log = logging.getLogger(__name__)


def _placeholders(graph: fx.Graph) -> set[fx.Node]:
    """The graph inputs the graph resizes or fills: the unsharded placeholders."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if is_placeholder_op(node):
            target = node.args[0] if node.args else None
            if isinstance(target, fx.Node) and target.op == "placeholder":
                found.add(target)
    return found


def recompute_placeholder_views(gm: fx.GraphModule) -> int:
    """Marks ``MUST_RECOMPUTE`` every untagged forward view of an unsharded
    placeholder in ``gm`` (a joint graph with compiled-autograd hooks). See
    [Note: Views of a placeholder are recomputed]. Changes node metadata only.

    Args:
        gm: an AOTAutograd joint graph (forward and backward, before partitioning).

    Returns:
        How many views were marked.
    """
    graph = gm.graph
    if not has_backward_state(graph):
        return 0
    placeholders = _placeholders(graph)
    if not placeholders:
        return 0
    marked = []
    for node in graph.nodes:
        if (
            is_view(node)
            and is_forward(node)
            and "recompute" not in node.meta
            and alias_base(node) in placeholders
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked.append(node.name)
    if marked:
        log.debug("recompute_placeholder_views: %d views recomputed: %s", len(marked),
                  ", ".join(marked))
    return len(marked)
