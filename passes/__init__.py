"""Inductor FX passes for traceable_hsdp (installed as ``traceable_hsdp.passes``).

Each pass is a plain function over a post-grad ``torch.fx.GraphModule`` that changes
it in place and does nothing when nothing matches:

- :func:`remove_resize_copy`: uses of a placeholder read the gathered tensor; its
  grow/``fsdp.copy_``/free nodes go.
- :func:`bucket_all_gathers` / :func:`bucket_reduce_scatters`: one collective per
  unit, small adjacent units merged up to ``DEFAULT_BUCKET_CAP_MB``.
- :func:`overlap`: all-gathers issued one unit early, reduce-scatters waited late.
- :func:`reduce_scatter_by_exchange` / :func:`all_gather_by_exchange`: over two gloo
  ranks, issued as all-to-alls, with outputs from a pool ([Note: Exchange outputs
  from a pool] in ``gloo/_pool.py``).

Not switchable, on every post-grad graph: :func:`free_after_last_read` first and
:func:`gather_into_buffers` last; on AOTAutograd joint graphs:
:func:`save_checkpoint_outputs` and :func:`recompute_placeholder_views`.

:func:`install` (called by ``fully_shard``) runs them on every graph Inductor compiles,
configured by :class:`PassConfig` ([Note: Pass configuration] in ``_install.py``). Node
predicates live in ``_graph.py``. The package imports only torch. ``docs/passes.md``
describes all ten, their order, switches and memory cost.
"""

from __future__ import annotations

from typing import Any

from ._install import (
    PassConfig,
    TraceableHSDPJointPass,
    TraceableHSDPPass,
    get_config,
    install,
    run_passes,
    set_config,
    track_unit_options,
    uninstall,
)
from ._graph import UnitPassOptions
from .bucket_collectives import DEFAULT_BUCKET_CAP_MB, bucket_all_gathers, bucket_reduce_scatters
from .free_after_last_read import free_after_last_read
from .gloo.gather_into_buffers import gather_into_buffers
from .overlap import overlap
from .recompute_placeholder_views import recompute_placeholder_views
from .gloo._pool import exchange_pool_bytes, release_exchange_buffers
from .gloo.exchange import all_gather_by_exchange, reduce_scatter_by_exchange
from .remove_resize_copy import remove_resize_copy
from .save_checkpoint_outputs import save_checkpoint_outputs

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "PassConfig",
    "TraceableHSDPJointPass",
    "TraceableHSDPPass",
    "UnitPassOptions",
    "all_gather_by_exchange",
    "bucket_all_gathers",
    "bucket_reduce_scatters",
    "config",
    "exchange_pool_bytes",
    "free_after_last_read",
    "gather_into_buffers",
    "get_config",
    "install",
    "overlap",
    "recompute_placeholder_views",
    "reduce_scatter_by_exchange",
    "release_exchange_buffers",
    "remove_resize_copy",
    "run_passes",
    "save_checkpoint_outputs",
    "set_config",
    "track_unit_options",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    # ``config`` is read on access so that it always shows what set_config() set.
    if name == "config":
        return get_config()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
