"""The generated ``FSDP<Class>`` a unit's module becomes (``add_fsdp_class``): the
``FSDPModule`` mixin before the module's own class, with the forward wrapper that
runs the unit's hooks.
"""

from __future__ import annotations

import functools
import types
from typing import Any, NoReturn

from torch import nn

from ._common import compiling
from ._compile_checks import marks_compile_region
from ._compiled_call import COMPILED_FORWARD
from ._module import FSDPModule
from ._state import require_state

__all__ = ["add_fsdp_class"]


# [Note: One FSDP class per module class]
# As torch's fully_shard, every unit of one module class gets the same FSDP<Class>
# (cached in _FSDP_CLASSES): dynamo guards the module's type, so a class per unit would
# recompile each block compiled in place. A unit marked nested_compile_region keeps a
# class of its own: shared, such blocks segfault inside invoke_subgraph
# (test_hooks_run_eagerly_by_compiled_autograd_reduce_every_gradient in
# tests/test_reliability.py).
_FSDP_CLASSES: dict[type, type] = {}


def add_fsdp_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    # See [Note: One FSDP class per module class].
    shared = not marks_compile_region(module)
    new_cls = _FSDP_CLASSES.get(cls) if shared else None
    if new_cls is None:
        orig_forward = cls.forward

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # See [Note: Forward wrapper, not module hooks].
            state = require_state(self)
            fwd = orig_forward
            if not compiling():
                # See [Note: A unit compiled in place] (_compiled_call.py).
                fwd = self.__dict__.get(COMPILED_FORWARD, orig_forward)
            return state.forward(functools.partial(fwd, self), args, kwargs)

        new_cls = type(
            f"FSDP{cls.__name__}",
            (FSDPModule, cls),
            {"forward": forward, "__deepcopy__": _unsupported_deepcopy},
        )
        new_cls._traceable_hsdp_orig_forward = orig_forward
        if shared:
            _FSDP_CLASSES[cls] = new_cls
    module.__class__ = new_cls
    inner = module.__dict__.get("forward")
    if inner is not None:
        # See [Note: A forward set on the instance].
        def instance_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return require_state(self).forward(inner, args, kwargs)

        module.__dict__["forward"] = types.MethodType(instance_forward, module)


# [Note: A forward set on the instance]
# An instance attribute ``forward`` (an ``OptimizedModule``'s compiled call,
# accelerate's autocast wrapper, a user patch) hides the class's forward wrapper, so
# the unit's pre-forward would never run. fully_shard moves such a forward inside the
# wrapper: the instance gets a bound method running pre-forward, that forward, and
# post-forward (for an OptimizedModule the gathers stay outside the compiled region,
# as with torch's fully_shard). A forward assigned after fully_shard replaces the
# wrapper unless it calls the one it replaces.


def _unsupported_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    # A copy would share the unit's state (its placeholders, whose storage is
    # resized to 0 outside forward: copying one read freed memory and killed the
    # process). torch's fully_shard refuses it with the same first sentence.
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization: "
        "build a second model, apply fully_shard to it in the same way, and "
        "load_state_dict(model.state_dict()) into it."
    )
