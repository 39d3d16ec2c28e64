"""traceable_hsdp: torch.compile-first FSDP and HSDP.

A drop-in for ``torch.distributed.fsdp``: ``from traceable_hsdp import fully_shard``.
"""

from ._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._cache import _install_from_env
from ._compile import compiled_autograd, disable_compiled_autograd, enable_compiled_autograd
from ._fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method, share_comm_ctx
from ._dump import dump_graphs
from ._hsdp import hsdp

__all__ = [
    "fully_shard",
    "FSDPModule",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "hsdp",
    "dump_graphs",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "enable_compiled_autograd",
    "disable_compiled_autograd",
    "compiled_autograd",
]

# Stable FX graph cache keys; see [Note: FX graph cache keys across processes] (_cache.py).
_install_from_env()
