"""Public policy dataclasses, drop-in for ``torch.distributed.fsdp``'s.

The names and fields match torch's ``MixedPrecisionPolicy``, ``OffloadPolicy`` and
``CPUOffloadPolicy`` so that switching backends is one import. Values are checked
when the policy is built, so a bad dtype fails at the line that wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(
            f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got "
            f"{type(value).__name__} {value!r}. Pass e.g. torch.bfloat16."
        )
    if isinstance(value, torch.dtype) and not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{name} must be a floating-point dtype, got {value}. "
            "Use torch.float32, torch.bfloat16 or torch.float16."
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters, gradient reduction and outputs.

    Args:
        param_dtype: dtype of the all-gathered (unsharded) parameters used in
            forward and backward. ``None`` (default) keeps the original dtype.
        reduce_dtype: dtype in which gradients are reduce-scattered. ``None``
            (default) uses ``param_dtype``'s gradient dtype.
        output_dtype: dtype to cast floating-point forward outputs to. ``None``
            (default) leaves outputs alone.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` (default ``True``).

    Raises:
        TypeError: a dtype field is not a ``torch.dtype`` or ``None``.
        ValueError: a dtype field is not floating point.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{type(self.cast_forward_inputs).__name__}."
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """Base offload policy: no offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on the CPU between uses.

    Args:
        pin_memory: pin the CPU copies for faster host-to-device copies
            (default ``True``).
    """

    pin_memory: bool = True
