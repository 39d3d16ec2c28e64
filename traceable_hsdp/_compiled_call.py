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
from ._torch_internals import compiled_autograd, internal_error, resolve

__all__ = ["COMPILED_FORWARD", "dispatch_compiled_call"]


# [Note: A unit compiled in place]
# torchtitan compiles each block in place before sharding it (``block.compile(
# fullgraph=True)``), without compiled autograd; HF accelerate's regional compilation
# does the same without fullgraph. ``nn.Module.compile`` stores
# ``torch.compile(module._call_impl)`` as ``module._compiled_call_impl``, and dynamo
# skips ``_call_impl`` (a torch file) as a top frame: with torch's fully_shard the
# hooks run eagerly there and only the block's forward is compiled. Ours puts the
# unit's pre- and post-forward in its forward wrapper, which dynamo then compiles as
# the top frame, where without compiled autograd the backward hooks cannot be traced.
# So below its root and with compiled autograd off, a unit compiled in place calls its
# ``_call_impl`` eagerly: its pre- and post-forward run eagerly and its module's own
# forward is compiled, with the same ``torch.compile`` settings (the ``OptimizeContext``
# that nn.Module.compile's function closes over, applied to the class's original
# forward, one code for every unit of the class). Where that context is not found
# (another torch), ``TorchInternalError`` says so. A module with a forward of its own on
# the instance keeps the compiled call and its refusal; one compiled with
# ``disable=True`` has nothing compiled to route. A root compiled in place, and any unit
# while compiled autograd is on, keep the compiled call: the whole step traced, as with
# torch.compile(model).
#
# A forward that dynamo skips as a frame (one of torch's own modules: a unit that is
# an ``nn.Embedding`` or an ``nn.Linear``, as HF accelerate makes of a model's
# embeddings and head) runs eagerly, as it does under torch's fully_shard: there the
# compiled ``_call_impl`` is a frame dynamo skips, and so is the module's forward, so
# nothing of such a unit is compiled. Compiled explicitly, dynamo would wrap each such
# forward in one shared frame (``external_utils.wrap_inline``) and recompile it for
# every other module class (accelerate's regional compile of HF Llama: two graphs
# more than torch's, the embedding's and the head's), each taking one of the shared
# frame's entries under dynamo's recompile limit (8 by default).
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
    if (
        state is not None
        and not state.is_root
        and not compiled_autograd.compiled_autograd_enabled
        and not compiling()
    ):
        return module._call_impl(*args, **kwargs)
    return compiled(*args, **kwargs)
