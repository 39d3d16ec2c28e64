"""A unit compiled in place (``module.compile()``): its compiled call routed through
the unit's forward wrapper (``dispatch_compiled_call``). See [Note: A unit compiled
in place].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ._common import compiling
from ._state import state_of
from ._torch_internals import (
    cache_custom_autograd_functions,
    compiled_autograd,
    internal_error,
    resolve,
)

__all__ = ["COMPILED_FORWARD", "dispatch_compiled_call"]


# [Note: A unit compiled in place]
# ``block.compile()`` (torchtitan, accelerate's regional compilation) compiles
# ``_call_impl``, a frame dynamo skips, so with torch's fully_shard the hooks run
# eagerly and only the forward compiles. Ours would compile the unit's forward wrapper
# as the top frame, where without compiled autograd the backward hooks cannot be
# traced. So below its root with compiled autograd off, a unit compiled in place calls
# ``_call_impl`` eagerly and compiles its module's own forward with the same settings
# (the ``OptimizeContext`` nn.Module.compile closes over; ``TorchInternalError`` where
# it is not found). A root, and any unit while compiled autograd is on, keep the
# compiled call: the whole step traced. A forward dynamo skips as a frame (torch's own
# modules, e.g. an ``nn.Embedding`` unit) runs eagerly, as under torch's fully_shard,
# rather than recompiling one shared wrapper frame per module class.
COMPILED_FORWARD = "_traceable_hsdp_compiled_forward"


def _skipped_by_dynamo(fn: Callable[..., Any]) -> bool:
    """Whether dynamo skips ``fn``'s frame (torch's own modules' forwards). See [Note:
    A unit compiled in place].

    Raises:
        TorchInternalError: this torch's dynamo has no ``trace_rules.check``.
    """
    return bool(resolve("torch._dynamo.trace_rules.check")(fn))


_OPTIMIZE_CONTEXT = "torch._dynamo.eval_frame.OptimizeContext"


def _optimize_context(compiled: Any) -> Any:
    """The dynamo ``OptimizeContext`` that ``torch.compile``'s result closes over.

    Raises:
        TorchInternalError: ``compiled`` closes over none (another torch).
    """
    context_type = resolve(_OPTIMIZE_CONTEXT)
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, context_type):
            return value
    raise internal_error(
        _OPTIMIZE_CONTEXT, f"is not in the closure of nn.Module.compile's function {compiled!r}")


def dispatch_compiled_call(module: nn.Module) -> None:
    """Routes the in-place compiled call of ``module``, if any, through
    :func:`_compiled_call`. See [Note: A unit compiled in place]."""
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None or getattr(compiled, "_traceable_hsdp_dispatch", False):
        return
    if "forward" in module.__dict__ or getattr(compiled, "__self__", None) is module:
        return  # a forward on the instance, or compile(disable=True): nothing compiled
    ctx = _optimize_context(compiled)
    orig = type(module)._traceable_hsdp_orig_forward
    module.__dict__[COMPILED_FORWARD] = orig if _skipped_by_dynamo(orig) else ctx(orig)
    dispatch = functools.partial(_compiled_call, module, compiled)
    dispatch._traceable_hsdp_dispatch = True  # type: ignore[attr-defined]
    module._compiled_call_impl = dispatch


def _compiled_call(
    module: nn.Module, compiled: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """What ``nn.Module.__call__`` calls for a unit compiled in place. See [Note: A
    unit compiled in place]."""
    state = state_of(module)
    if state is not None and state.per_block:
        # See [Note: Compiled per block] (_per_block.py).
        with cache_custom_autograd_functions():
            return compiled(*args, **kwargs)
    if (
        state is not None
        and not state.is_root
        and not compiled_autograd.compiled_autograd_enabled
        and not compiling()
    ):
        return module._call_impl(*args, **kwargs)
    return compiled(*args, **kwargs)
