"""``hsdp()``: the entry point of the HSDP systems, mapped onto ``fully_shard``.

[Note: hsdp() on the fully_shard runtime]
Users of HSDP systems call ``hsdp(cell, shard_size=..., threshold=...,
optimizer_level=...)``. Each argument maps onto the same runtime ``fully_shard`` uses:

- ``shard_size``: ``-1`` shards over every rank (a 1-D mesh: FSDP); ``k`` shards over
  groups of ``k`` consecutive ranks and replicates across the ``world / k`` groups (a
  2-D ``(replicate, shard)`` mesh: HSDP). ``k`` must divide the world size.
- ``threshold`` (KiB, default 64, as in those systems): a parameter smaller than this
  stays whole on every rank, its gradient all-reduced DDP-style; ``0`` shards all.
  ``replicate_params`` names parameters to keep whole whatever their size.
- ``optimizer_level``: ``"level3"`` is ``reshard_after_forward=True``; ``"level2"``
  ``False``; ``"level1"`` also never frees the gathered storage (each forward refills
  it). Gradients and optimizer state are sharded at every level.
- ``reduce_dtype``: ``MixedPrecisionPolicy(reduce_dtype=...)``.
- ``comm_fusion`` / ``bucket_size``: bucketing for this unit only (``bucket_size`` in
  MiB, ``-1`` for one bucket per unit), carried in its collectives' annotations
  ([Note: Per-unit pass options] in ``passes/bucket_collectives.py``); where a graph
  lost its annotations the ``PassConfig`` decides.
- ``reduce_op`` ``"mean"`` (default) averages gradients over the data-parallel ranks,
  ``"sum"`` sums them; ``gradient_divide_factor`` sums and divides by that number
  instead (``FSDPModule.set_gradient_divide_factor``).

Like ``fully_shard``, call it on each block and then on the root.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._fully_shard import FSDPModule, shard_unit
from ._init import default_mesh, unit_options
from .passes._graph import UnitPassOptions

__all__ = ["hsdp"]

OptimizerLevel = Literal["level1", "level2", "level3"]
_LEVELS = ("level1", "level2", "level3")


def hsdp(
    module: nn.Module,
    shard_size: int = -1,
    threshold: int = 64,
    optimizer_level: OptimizerLevel = "level3",
    reduce_dtype: torch.dtype | None = None,
    comm_fusion: bool = False,
    bucket_size: int = -1,
    *,
    replicate_params: Iterable[nn.Parameter] | None = None,
    reduce_op: Literal["mean", "sum"] = "mean",
    gradient_divide_factor: float | None = None,
    mesh: DeviceMesh | None = None,
) -> FSDPModule:
    """Shards ``module`` the way HSDP systems' ``hsdp()`` does, on the fully_shard
    runtime. See [Note: hsdp() on the fully_shard runtime].

    Args:
        module: the module to shard as one unit.
        shard_size: ranks per shard group; ``-1`` (default) shards over all ranks.
        threshold: parameters smaller than this many KiB stay replicated (default 64;
            ``0`` shards every parameter).
        optimizer_level: ``"level1"``, ``"level2"`` or ``"level3"`` (default).
        reduce_dtype: dtype of the gradient reduction (default ``None``: the
            parameter's dtype).
        comm_fusion: bucket this unit's collectives (default ``False``); see
            [Note: hsdp() on the fully_shard runtime].
        bucket_size: bucket cap in MiB for ``comm_fusion``; ``-1`` (default) means
            one bucket per unit.
        replicate_params: parameters kept whole whatever their size (default none).
        reduce_op: ``"mean"`` (default) or ``"sum"`` over the data-parallel ranks.
        gradient_divide_factor: sum the gradients and divide by this instead
            (default ``None``); not with ``reduce_op="sum"``.
        mesh: use this mesh instead of building one from ``shard_size`` (default
            ``None``).

    Returns:
        ``module``, now an :class:`FSDPModule`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a bad value: ``shard_size`` not -1 nor a positive divisor of the
            world size, a negative ``threshold``, an unknown ``optimizer_level`` or
            ``reduce_op``, ``bucket_size`` not -1 nor positive, a
            ``gradient_divide_factor`` that is not positive.
        RuntimeError: no process group is initialized.
    """
    _check_int("shard_size", shard_size)
    _check_int("threshold", threshold)
    _check_int("bucket_size", bucket_size)
    if threshold < 0:
        raise ValueError(f"hsdp(threshold=...) must be >= 0 KiB, got {threshold}.")
    if bucket_size != -1 and bucket_size <= 0:
        raise ValueError(
            f"hsdp(bucket_size=...) must be -1 (one bucket per unit) or a positive number "
            f"of MiB, got {bucket_size}."
        )
    if optimizer_level not in _LEVELS:
        raise ValueError(
            f"hsdp(optimizer_level=...) must be one of {', '.join(_LEVELS)}, got "
            f"{optimizer_level!r}."
        )
    if not isinstance(comm_fusion, bool):
        raise TypeError(f"hsdp(comm_fusion=...) must be a bool, got {type(comm_fusion).__name__}.")
    if reduce_op not in ("mean", "sum"):
        raise ValueError(f"hsdp(reduce_op=...) must be 'mean' or 'sum', got {reduce_op!r}.")
    if gradient_divide_factor is not None:
        if isinstance(gradient_divide_factor, bool) or not isinstance(
            gradient_divide_factor, (int, float)
        ):
            raise TypeError(
                "hsdp(gradient_divide_factor=...) must be a number or None, got "
                f"{type(gradient_divide_factor).__name__}."
            )
        if not gradient_divide_factor > 0:
            raise ValueError(
                f"hsdp(gradient_divide_factor=...) must be > 0, got {gradient_divide_factor}."
            )
        if reduce_op == "sum":
            raise ValueError(
                "hsdp: pass either reduce_op='sum' or gradient_divide_factor, not both "
                "(a divide factor already sums, then divides)."
            )
    keep = _replicate_set(replicate_params)
    if mesh is None:
        mesh = default_mesh("hsdp()", shard_size)
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)  # checks the dtype
    cap_bytes = threshold * 1024

    def replicate(p: nn.Parameter) -> bool:
        return id(p) in keep or p.numel() * p.element_size() < cap_bytes

    options = unit_options(
        mesh=mesh,
        reshard_after_forward=optimizer_level == "level3",
        shard_placement_fn=None,
        mp_policy=mp,
        offload_policy=OffloadPolicy(),
        ignored_params=None,
        replicate=replicate,
        keep_storage=optimizer_level == "level1",
        pass_options=UnitPassOptions(
            bucket=comm_fusion,
            bucket_cap_mb=None if bucket_size == -1 else float(bucket_size),
        ),
    )
    out = shard_unit(module, options)
    factor = 1.0 if reduce_op == "sum" else gradient_divide_factor
    if factor is not None:
        out.set_gradient_divide_factor(factor)
    return out


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"hsdp({name}=...) must be an int, got {type(value).__name__} {value!r}.")


def _replicate_set(params: Any) -> set[int]:
    if params is None:
        return set()
    if isinstance(params, nn.Parameter) or not isinstance(params, Iterable):
        raise TypeError(
            "hsdp(replicate_params=...) must be an iterable of nn.Parameter (e.g. a list), "
            f"got {type(params).__name__}."
        )
    out = set()
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"hsdp(replicate_params=...) holds a {type(p).__name__}, not an nn.Parameter.")
        out.add(id(p))
    return out
