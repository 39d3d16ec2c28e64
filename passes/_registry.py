"""The pass registry: every pass traceable_hsdp runs, once, in run order.

Each :class:`PassEntry` names a pass, the call that runs it under a
:class:`~traceable_hsdp.passes.PassConfig`, the stage it runs at and whether it can be
switched off. What has a list of passes derives it from :data:`PASSES`: the
``PassConfig`` fields (``_install.py``), the names ``TRACEABLE_HSDP_PASSES`` accepts,
the order :func:`~traceable_hsdp.passes.run_passes` and the installed hooks run them
in, and the table in docs/passes.md (:func:`docs_table`; ``tests/test_pass_registry.py``
checks the page against it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import fx

from .bucket_collectives import bucket_all_gathers, bucket_reduce_scatters
from .free_after_last_read import free_after_last_read
from .gloo.exchange import all_gather_by_exchange, reduce_scatter_by_exchange
from .gloo.gather_into_buffers import gather_into_buffers
from .overlap import overlap
from .recompute_placeholder_views import recompute_placeholder_views
from .remove_resize_copy import remove_resize_copy
from .save_checkpoint_outputs import save_checkpoint_outputs

__all__ = ["ALIASES", "PASSES", "PassEntry", "Stage", "docs_table", "switched"]

Stage = Literal["joint", "post_grad"]
"""``"joint"``: AOTAutograd's joint graph, before partitioning, under every backend;
``"post_grad"``: Inductor's post-grad graph (``post_grad_custom_pre_pass``)."""


@dataclass(frozen=True)
class PassEntry:
    """One pass.

    Args:
        name: the pass function's name; for a switched pass also its ``PassConfig``
            field and its ``TRACEABLE_HSDP_PASSES`` name.
        run: runs it on a graph module under a ``PassConfig``; returns what it did
            (matches rewritten, buckets made).
        stage: where it runs (:data:`Stage`).
        switch: ``PassConfig`` can turn it off; ``False``: a correctness fix that
            always runs.
        summary: what it does, one line of docs/passes.md's table.
        per_unit: it runs even when switched off, since a unit's own options can
            turn it on ([Note: Per-unit pass options] in ``bucket_collectives.py``)
            (default ``False``).
    """

    name: str
    run: Callable[[fx.GraphModule, Any], int]
    stage: Stage
    switch: bool
    summary: str
    per_unit: bool = False


PASSES: tuple[PassEntry, ...] = (
    PassEntry(
        "free_after_last_read", lambda gm, cfg: free_after_last_read(gm), "post_grad", False,
        "each free of a placeholder moved to just after the graph's last read of it",
    ),
    PassEntry(
        "remove_resize_copy", lambda gm, cfg: remove_resize_copy(gm), "post_grad", True,
        "the uses of each unsharded placeholder read the gathered tensor; its "
        "grow/`fsdp.copy_`/free nodes go",
    ),
    PassEntry(
        "bucket_all_gathers",
        lambda gm, cfg: bucket_all_gathers(gm, cfg.bucket_cap_mb, enabled=cfg.bucket_all_gathers),
        "post_grad", True,
        "one all-gather per `fully_shard` unit; adjacent units merged up to `bucket_cap_mb` "
        "(4 MiB by default)",
        per_unit=True,
    ),
    PassEntry(
        "bucket_reduce_scatters",
        lambda gm, cfg: bucket_reduce_scatters(
            gm, cfg.bucket_cap_mb, enabled=cfg.bucket_reduce_scatters
        ),
        "post_grad", True,
        "one reduce-scatter per unit (a gradient larger than the rest of it alone); "
        "adjacent units merged up to `bucket_cap_mb`",
        per_unit=True,
    ),
    PassEntry(
        "overlap", lambda gm, cfg: overlap(gm), "post_grad", True,
        "each all-gather issued one unit early; each reduce-scatter waited for late",
    ),
    PassEntry(
        "reduce_scatter_by_exchange",
        lambda gm, cfg: reduce_scatter_by_exchange(gm, cfg.pool_exchange_outputs),
        "post_grad", True,
        "each reduce-scatter over two gloo ranks issued as an all-to-all and an addition: "
        "the same numbers, half the traffic",
    ),
    PassEntry(
        "all_gather_by_exchange",
        lambda gm, cfg: all_gather_by_exchange(gm, cfg.pool_exchange_outputs),
        "post_grad", True,
        "each all-gather over two gloo ranks issued as an all-to-all of the shard sent to "
        "both ranks: the same bytes, without gloo's extra copy of the result (a small gain)",
    ),
    PassEntry(
        "gather_into_buffers", lambda gm, cfg: gather_into_buffers(gm), "post_grad", False,
        "each CPU all-gather left (more than two ranks, or the exchange off) issued into a "
        "buffer allocated beforehand (gloo)",
    ),
    PassEntry(
        "save_checkpoint_outputs", lambda gm, cfg: save_checkpoint_outputs(gm), "joint", False,
        "what leaves an activation-checkpoint region is saved for backward, not recomputed",
    ),
    PassEntry(
        "recompute_placeholder_views", lambda gm, cfg: recompute_placeholder_views(gm),
        "joint", False,
        "each view of an unsharded placeholder recomputed in the backward, not saved",
    ),
)
"""Every pass, in the order it runs within its stage: the post-grad ones, then the
joint ones (AOTAutograd runs those first, before Inductor sees the graph)."""

ALIASES: dict[str, tuple[str, ...]] = {"bucket": ("bucket_all_gathers", "bucket_reduce_scatters")}
"""``TRACEABLE_HSDP_PASSES`` names that stand for several passes (besides ``all`` and
``none``)."""


def switched() -> tuple[str, ...]:
    """The names of the passes ``PassConfig`` switches, in run order."""
    return tuple(e.name for e in PASSES if e.switch)


def docs_table() -> str:
    """The table of docs/passes.md's "Order" section, from :data:`PASSES`."""
    alias_of = {n: a for a, names in ALIASES.items() for n in names}
    rows = [
        "| # | pass | stage | what it does | `TRACEABLE_HSDP_PASSES` name |",
        "|---|---|---|---|---|",
    ]
    index: dict[str, int] = {}
    for e in PASSES:
        i = index[e.stage] = index.get(e.stage, -1) + 1
        if e.switch:
            env = f"`{e.name}`" + (f" (or `{alias_of[e.name]}`)" if e.name in alias_of else "")
        else:
            env = "none: always on"
        rows.append(f"| {i} | `{e.name}` | {e.stage} | {e.summary} | {env} |")
    return "\n".join(rows)
