"""Inductor FX passes for traceable_hsdp (installed as ``traceable_hsdp.passes``).

Each pass is a plain function over a post-grad ``torch.fx.GraphModule`` that changes
it in place and does nothing when nothing matches:

- :func:`remove_resize_copy`: the uses of an unsharded placeholder read the gathered
  tensor; its grow/``fsdp.copy_``/free nodes go.
- :func:`bucket_all_gathers` / :func:`bucket_reduce_scatters`: one collective per
  fully_shard unit, adjacent small units merged up to a size cap
  (``DEFAULT_BUCKET_CAP_MB``, 4 MiB, by default).
- :func:`overlap`: each all-gather is issued one unit early (before the previous
  unit's compute), each reduce-scatter waited for just before the next one.
- :func:`reduce_scatter_by_exchange`: a reduce-scatter over two gloo ranks is
  issued as an all-to-all and an addition (gloo's own is an all-reduce).
- :func:`all_gather_by_exchange`: an all-gather over two gloo ranks is issued as an
  all-to-all of the shard sent to both ranks (gloo's own copies the result once
  more).

Both exchanges take their outputs from a pool of buffers kept across steps
(``PassConfig.pool_exchange_outputs``; :func:`exchange_pool_bytes` says what it
holds, :func:`release_exchange_buffers` drops what nothing reads; see [Note: Exchange
outputs from a pool] in ``gloo/_pool.py``).

and, on every post-grad graph and not switchable, one before them and one after:

- :func:`free_after_last_read`: each free of a placeholder moves after the graph's
  last read of it (compiled autograd can put a weight's gradient, and so the hook
  that frees it, before the weight's last read);
- :func:`gather_into_buffers`: each all-gather of CPU tensors is issued into a
  buffer allocated beforehand (``all_gather_into_tensor_out``), which gloo needs
  when another collective is in flight.

and two passes over AOTAutograd joint graphs (any backend), not switchable:

- :func:`save_checkpoint_outputs`: what leaves an activation-checkpoint region is
  saved for backward, not recomputed before the unit's re-gather;
- :func:`recompute_placeholder_views`: a view of an unsharded placeholder is
  recomputed in the backward, never computed after the placeholder is freed.

:func:`install` (called by ``fully_shard``; :func:`uninstall` undoes it) runs them
on every graph Inductor compiles, configured by ``traceable_hsdp.passes.config`` (a :class:`PassConfig`, from
the environment variables ``TRACEABLE_HSDP_PASSES`` and
``TRACEABLE_HSDP_BUCKET_CAP_MB``; see [Note: Pass configuration] in ``_install.py``).
What each of them matches (an all-gather, a wait, an ``fsdp.copy_``, a resize, a
unit's annotation) is the graph vocabulary of ``_graph.py``, which the dump tool, the
benchmarks and the tests use as well. The package imports only torch.
``docs/passes.md`` describes all ten, their order, switches and memory cost, and
what :func:`install` changes in torch's configuration.
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
