"""Optimizers that step sharded parameters on their local shards.

``traceable_hsdp.optim.AdamW`` and ``Adam`` are ``torch.optim.AdamW`` and
``torch.optim.Adam`` with one change: the update runs on each ``DTensor``'s local
tensor instead of dispatching every elementwise op through ``DTensor``. The numbers
are the same, the state is the same (``DTensor``s laid out like the parameters, so
``state_dict()``, ``torch.distributed.checkpoint`` and
``get_optimizer_state_dict`` see what they see with torch's optimizers), and so are
every argument and default::

    from traceable_hsdp.optim import AdamW
    optim = AdamW(model.parameters(), lr=3e-4)   # instead of torch.optim.AdamW

[Note: Optimizer steps on local shards]
Adam's update is elementwise, so when parameter, gradient and moments are ``DTensor``s
with the same mesh and placements, updating the local tensors is exactly what
``DTensor``'s dispatch computes, without the per-op dispatch cost (measured in
docs/benchmarks.md). The subclasses let ``_init_group`` run unchanged, then replace
each ``DTensor`` in its lists by its local tensor after checking it is laid out like
its parameter; a gradient laid out otherwise (``Partial``) is refused. Plain tensors
pass through. ``foreach`` and ``fused`` keep their meaning and defaults. The tests
compare every parameter and state tensor with ``torch.optim.AdamW``, bitwise, for all
three implementations. SGD with momentum is not offered: its state would not be a
``DTensor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Adam", "AdamW"]

# _init_group's list arguments after ``group``, in order, and whether each is indexed
# like ``params_with_grad`` (True) or holds no DTensor (False).
_ADAM_LISTS = (
    ("params", True),
    ("grads", True),
    ("exp_avgs", True),
    ("exp_avg_sqs", True),
    ("max_exp_avg_sqs", True),  # empty unless amsgrad
    ("state_steps", False),  # scalar step counters: plain tensors
)


class _LocalShardStep:
    """Mixin over a ``torch.optim`` class whose ``_init_group(group, *lists)`` fills
    lists that its functional step then reads. See [Note: Optimizer steps on local
    shards]."""

    _lists: tuple[tuple[str, bool], ...] = ()

    def _init_group(self, group: dict[str, Any], *lists: list[torch.Tensor]) -> Any:
        out = super()._init_group(group, *lists)  # type: ignore[misc]
        params = list(lists[0])  # the DTensors: lists[0] is rewritten below
        for (what, aligned), lst in zip(self._lists, lists):
            for i, t in enumerate(lst):
                if not isinstance(t, DTensor):
                    continue
                p = params[i] if aligned else None
                if p is not t and isinstance(p, DTensor) and (
                    t.device_mesh != p.device_mesh or t.placements != p.placements
                ):
                    raise ValueError(
                        f"{type(self).__name__}: a tensor in {what!r} for the parameter "
                        f"of shape {tuple(p.shape)} is laid out as {t.placements} on "
                        f"{t.device_mesh}, the parameter as {p.placements} on "
                        f"{p.device_mesh}. Stepping on local shards needs the same "
                        "layout (a Partial gradient is not yet reduced). Redistribute it "
                        "first (t.redistribute(p.device_mesh, p.placements)), or use "
                        f"torch.optim.{type(self).__name__}."
                    )
                if p is not t and aligned and not isinstance(p, DTensor):
                    raise ValueError(
                        f"{type(self).__name__}: a plain parameter of shape "
                        f"{tuple(p.shape)} has a DTensor in {what!r}: use "
                        f"torch.optim.{type(self).__name__}."
                    )
                lst[i] = t._local_tensor
        return out


class Adam(_LocalShardStep, torch.optim.Adam):
    """``torch.optim.Adam``, stepping ``DTensor`` parameters on their local shards. Same
    arguments, numbers and state; see [Note: Optimizer steps on local shards]."""

    _lists = _ADAM_LISTS


class AdamW(_LocalShardStep, torch.optim.AdamW):
    """``torch.optim.AdamW``, stepping ``DTensor`` parameters on their local shards.
    Same arguments, numbers and state; see [Note: Optimizer steps on local shards]."""

    _lists = _ADAM_LISTS
