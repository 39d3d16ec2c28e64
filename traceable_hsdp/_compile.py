"""Turning compiled autograd on for a compiled fully_shard model.

[Note: Why compiled autograd]
traceable_hsdp's backward collectives live in hooks (the re-gather in a tensor hook on
each unit's output, the reduce-scatter in a post-accumulate-grad hook). Only
compiled autograd traces those hooks into a backward graph, and it must already be
on when the forward is traced, so that dynamo defers the hooks to the backward
instead of AOTAutograd tracing them into its own joint graph (where the partitioner
may move the re-gather into the forward: wrong numbers, no error). Two ways in:

- compile the whole step with ``torch._dynamo.config.compiled_autograd = True`` set
  before ``torch.compile`` (torch's own entry; forward, loss and backward in one
  compiled function);
- keep the plain loop (``out = compiled_model(x); loss.backward()``) and call
  :func:`enable_compiled_autograd` once before it, or run each step inside
  ``with compiled_autograd():``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch._dynamo import compiled_autograd as _ca

_enabled: list[AbstractContextManager[None]] = []  # the context we entered, if any


def enable_compiled_autograd(backend: str | Any = "inductor", **compile_kwargs: Any) -> None:
    """Turns compiled autograd on for every later backward, until
    :func:`disable_compiled_autograd`. Idempotent: a second call changes nothing.

    This is the one line that makes the plain loop work with a compiled model::

        traceable_hsdp.enable_compiled_autograd()
        model = torch.compile(fully_shard(model))
        for x in data:
            model(x).sum().backward()

    Args:
        backend: the ``torch.compile`` backend for the backward graphs (default
            ``"inductor"``).
        compile_kwargs: more ``torch.compile`` keyword arguments for them.
    """
    if _enabled:
        return
    ctx = _ca._enable(torch.compile(backend=backend, **compile_kwargs))
    ctx.__enter__()
    _enabled.append(ctx)


def disable_compiled_autograd() -> None:
    """Undoes :func:`enable_compiled_autograd`. Does nothing if it is not on."""
    if _enabled:
        _enabled.pop().__exit__(None, None, None)


@contextmanager
def compiled_autograd(backend: str | Any = "inductor", **compile_kwargs: Any) -> Iterator[None]:
    """Compiled autograd on inside the block (forward and backward both go inside).

    Args:
        backend: as for :func:`enable_compiled_autograd`.
        compile_kwargs: as for :func:`enable_compiled_autograd`.
    """
    with _ca._enable(torch.compile(backend=backend, **compile_kwargs)):
        yield
