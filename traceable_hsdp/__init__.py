"""traceable_hsdp: torch.compile-first FSDP and HSDP.

A drop-in for ``torch.distributed.fsdp``: ``from traceable_hsdp import fully_shard``.

[Note: Lazy public names]
``import traceable_hsdp`` imports torch, nothing more: it changes nothing in torch
(``fully_shard`` does, through ``_torch_internals.install``). The public names are loaded on first use through the module ``__getattr__`` (PEP 562):
``fully_shard`` brings in the runtime and its Inductor passes, ``dump_graphs`` the
dump tool (depyf and Inductor). So ``traceable-hsdp train --help`` and any program
that only imports the package do not pay for Inductor.
``tests/test_cli.py`` checks that the import leaves ``torch._inductor`` unloaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from ._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from ._compile import compiled_autograd, disable_compiled_autograd, enable_compiled_autograd
    from .debug._dump import dump_graphs
    from ._fully_shard import fully_shard, register_fsdp_forward_method, share_comm_ctx
    from ._module import FSDPModule, GradientReductionHandle, UnshardHandle
    from ._hsdp import hsdp
    from ._per_block import compile_block

# Public name -> the private module that defines it. See [Note: Lazy public names].
_LAZY = {
    "fully_shard": "._fully_shard",
    "FSDPModule": "._module",
    "GradientReductionHandle": "._module",
    "UnshardHandle": "._module",
    "register_fsdp_forward_method": "._fully_shard",
    "share_comm_ctx": "._fully_shard",
    "hsdp": "._hsdp",
    "dump_graphs": ".debug._dump",
    "MixedPrecisionPolicy": "._api",
    "OffloadPolicy": "._api",
    "CPUOffloadPolicy": "._api",
    "enable_compiled_autograd": "._compile",
    "disable_compiled_autograd": "._compile",
    "compiled_autograd": "._compile",
    "compile_block": "._per_block",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    # The public names and the module's own dunders, not its imports.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})

