"""Never save a view of an unsharded placeholder: recompute it in the backward.

[Note: Views of a placeholder are recomputed]
The forward graph gathers each unit into its placeholders (``resize_storage_bytes_``
to full, ``fsdp.copy_``) and frees them after the unit (``resize_storage_bytes_`` to
0). A value the backward needs is computed in the forward and saved. When that value
is a *view* of a placeholder, AOTAutograd's partitioner places the op that makes it
wherever it likes in the forward graph, often at its end, after the placeholder was
freed. Views saved that way are unsafe: on aot_eager the view fails its storage
bounds check (``setStorage: ... out of bounds for storage of size 0``); in compiled
code it reads the re-gathered storage only by accident of aliasing.

``torch._functorch.config.recompute_views`` (which :func:`install` sets; see
[Note: Saved views of the placeholder] in ``_install.py``) covers the common case: a
view whose base is saved anyway is recomputed from it. It does not cover a view
whose base the partitioner chose not to save. Seen with HF Mixtral in bf16: the
experts' native ``torch._grouped_mm`` reads ``w.transpose(-2, -1)`` and its backward
transposes that back; the min-cut partitioner saved ``transpose(transpose(w))`` (not
``w``), computed after ``w``'s storage was freed::

    transpose_5  = transpose(primals_22, -2, -1)      # the forward's use
    ...
    resize_storage_bytes_(primals_22, 0)              # the unit's reshard
    ...
    transpose_26 = transpose(transpose_5, -2, -1)     # saved for backward: fails
    return (..., transpose_26, ...)

This pass marks every forward view whose chain of view bases ends at a placeholder
``MUST_RECOMPUTE``. The partitioner then saves the placeholder itself (a graph input,
so saving it costs nothing), and recomputes the views in the backward, where they are
first read by ops that consume the unit's output gradient, so after the hook that
re-gathers the placeholder. Views stay views: no copy, no extra memory.

A placeholder is recognised structurally: a graph input that the graph resizes or
fills with ``fsdp.copy_``. Views already tagged (by a checkpoint region or by
:func:`save_checkpoint_outputs`) keep their tags. Joint graphs without
compiled-autograd hooks (no ``BackwardState`` input) are left alone, as in
``save_checkpoint_outputs.py``.
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
