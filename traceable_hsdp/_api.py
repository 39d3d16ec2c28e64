"""Public policy dataclasses, drop-in for ``torch.distributed.fsdp``'s.

The names and fields match torch's ``MixedPrecisionPolicy``, ``OffloadPolicy`` and
``CPUOffloadPolicy`` so that switching backends is one import. Values are checked
when the policy is built, so a bad dtype fails at the line that wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.torch_version import TorchVersion

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


# [Note: reduce_dtype follows the installed torch]
# With ``reduce_dtype=None``, torch 2.13 and 2.14 reduce in ``param_dtype``, torch 2.15
# in the parameter's ``grad_dtype`` (its original dtype unless set). A drop-in computes
# what the installed torch computes, so the default follows the version.
# tests/test_features.py checks the bf16 step against torch's fully_shard bitwise.
REDUCE_IN_GRAD_DTYPE = TorchVersion(torch.__version__) >= "2.15"


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the unsharded parameters, gradient reduction and outputs.

    Args:
        param_dtype: dtype of the all-gathered (unsharded) parameters used in
            forward and backward. ``None`` (default) keeps the original dtype.
        reduce_dtype: dtype in which gradients are reduced (and accumulated while
            gradient sync is off). ``None`` (default) follows the installed torch:
            ``param_dtype`` on torch 2.13 and 2.14, the parameter's ``grad_dtype``
            (its original dtype) on 2.15. See [Note: reduce_dtype follows the
            installed torch].
        output_dtype: dtype to cast floating-point forward outputs to. ``None``
            (default) leaves outputs alone.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` (default ``True``).
        param_dtype_override_fn: keyword only; called once per managed parameter
            at ``fully_shard``, it returns ``None`` or ``param_dtype`` (use
            ``param_dtype``) or the parameter's own dtype (keep it, e.g. fp32
            norms under bf16), as torch 2.15's. It must answer the same on every
            rank. Forward inputs are still cast to ``param_dtype``. Default
            ``None``.

    Raises:
        TypeError: a dtype field is not a ``torch.dtype`` or ``None``, or
            ``param_dtype_override_fn`` is not callable.
        ValueError: a dtype field is not floating point; at ``fully_shard``,
            ``param_dtype_override_fn`` returned another dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{type(self.cast_forward_inputs).__name__}."
            )
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise TypeError(
                "MixedPrecisionPolicy.param_dtype_override_fn must be callable or None, "
                f"got {type(fn).__name__}."
            )

    def resolve_for_param(self, param: nn.Parameter, fqn: str) -> MixedPrecisionPolicy:
        """This policy for one parameter: ``param_dtype_override_fn`` applied and
        dropped. Raises ``ValueError`` for an answer torch 2.15 refuses."""
        fn = self.param_dtype_override_fn
        if fn is None:
            return self
        dtype = fn(param)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(
                "param_dtype_override_fn must return a torch.dtype or None but got "
                f"{type(dtype)} for parameter {fqn!r}"
            )
        if dtype is not None and dtype not in (self.param_dtype, param.dtype):
            raise ValueError(
                "param_dtype_override_fn must return None, param_dtype, or the "
                f"parameter's original dtype but got {dtype} for parameter {fqn!r} with "
                f"dtype {param.dtype} and param_dtype {self.param_dtype}"
            )
        return replace(
            self, param_dtype=self.param_dtype if dtype is None else dtype,
            param_dtype_override_fn=None,
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
