"""Save what leaves an activation-checkpoint region, in graphs whose backward runs hooks.

[Note: Checkpoint outputs are saved]
Compiled, a checkpoint region is the ``tag_activation_checkpoint`` higher-order op and
AOTAutograd's partitioner recomputes its ops in the backward, its output included
(a ``*_RECOMPUTE`` node is never saved). Eagerly the output is an ordinary saved tensor.
With fully_shard that difference is fatal: when an op after a checkpointed unit needs
the unit's output ``y`` for its backward (the final norm after the last block), the
recompute is scheduled before ``y``'s gradient exists, so before the hook that
re-gathers the unit, and reads 0-byte placeholders. Before the pass, backward order::

    out_norm_bwd needs y
    mm  = mm(x, permute(wq, [1, 0]))          # recompute of the region: wq is 0 bytes
    ...
    y_grad = norm_backward(...)
    call_hook(y_grad)                         # all_gather, resize wq, fsdp.copy_(wq, ..)

After: ``y`` is saved by the forward, and the recompute is needed only by the region's
own backward, after the re-gather::

    y_grad = norm_backward(y, ...)
    call_hook(y_grad)                         # re-gather fills wq
    mm  = mm(x, permute(wq, [1, 0]))          # recompute reads the gathered wq

torch's ``cleanup_recompute_tags`` means to do this (``meta["has_backward_hook"]``), but
dynamo sets the flag on a ``getitem`` that produces no ATen node. So in a joint graph
with a ``BackwardState`` input, every forward node of a checkpoint region with a forward
user outside its region becomes ``MUST_SAVE``: eager checkpointing's contract.
``MUST_SAVE`` forbids recomputing; it adds no outputs. Other graphs are left alone.

A joint-graph pass, run for every backend through ``joint_custom_pass`` ([Note:
Installing the passes] in ``_install.py``).
"""

from __future__ import annotations

import logging
import operator

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .._torch_internals import BackwardState
from ._graph import is_view
from ._rewrite import tensor_val

log = logging.getLogger(__name__)

_RECOMPUTE = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def is_recomputed(node: fx.Node) -> bool:
    """A node the checkpoint tags for recomputation (``*_RECOMPUTE``)."""
    return node.meta.get("recompute") in _RECOMPUTE


def is_forward(node: fx.Node) -> bool:
    """A node of the forward part of a joint graph (AOTAutograd tags both parts)."""
    return node.meta.get("partitioner_tag") == "is_forward"


def has_backward_state(graph: fx.Graph) -> bool:
    """Whether the graph takes a ``BackwardState``: hooks that dynamo deferred to
    compiled autograd run in its backward."""
    return any(
        isinstance(n.meta.get("val"), BackwardState) for n in graph.find_nodes(op="placeholder")
    )


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _leaves_region(node: fx.Node, region: object) -> bool:
    """Whether a forward user of ``node`` lies outside checkpoint region ``region``
    (any op of another region or of none, or the graph output; untagged ``getitem``s
    are looked through)."""
    for user in node.users:
        if user.op == "output":
            return True
        if user.op != "call_function" or not is_forward(user):
            continue
        if region is not None and user.meta.get("ac_graph_id") == region:
            continue  # inside, whatever its policy (selective checkpointing saves some)
        if _is_getitem(user) and "recompute" not in user.meta:
            if _leaves_region(user, region):
                return True
            continue
        return True
    return False


def _to_save(node: fx.Node) -> list[fx.Node]:
    """The nodes to mark so that ``node`` is available to the backward without
    recomputing its region. A view is never saved (the partitioner recomputes views,
    and cannot ban them), so its recomputed base is; a multi-output op's outputs are
    saved through its ``getitem``s, and the op itself must not be recomputed."""
    base = node
    while is_view(base) and isinstance(base.args[0], fx.Node) and is_recomputed(base.args[0]):
        base = base.args[0]
    if is_view(base):
        return []  # a view of something outside the region: nothing recomputed to keep
    parent = base.args[0] if _is_getitem(base) else None
    if isinstance(parent, fx.Node) and is_recomputed(parent):
        return [parent, *(u for u in parent.users if _is_getitem(u))]
    return [base]


def save_checkpoint_outputs(gm: fx.GraphModule) -> int:
    """Marks ``MUST_SAVE`` what leaves each activation-checkpoint region of the
    forward (read by a forward node outside the region), when ``gm`` (a joint graph)
    has compiled-autograd hooks. See [Note: Checkpoint outputs are saved]. Changes
    node metadata only.

    Args:
        gm: an AOTAutograd joint graph (forward and backward, before partitioning).

    Returns:
        How many region outputs were found (each marked with what it needs).
    """
    graph = gm.graph
    if not has_backward_state(graph):
        return 0
    outputs = [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and is_recomputed(node)
        and is_forward(node)
        and tensor_val(node) is not None  # a multi-output op: its getitems are looked at
        and _leaves_region(node, node.meta.get("ac_graph_id"))
    ]
    for node in outputs:
        for target in _to_save(node):
            target.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    if outputs:
        log.info(
            "save_checkpoint_outputs: %d checkpoint-region outputs saved: %s",
            len(outputs),
            ", ".join(n.name for n in outputs),
        )
    return len(outputs)
