"""Compiling a fully_shard model: turning compiled autograd on, and the one dynamo
setting fully_shard changes (its side-effect messages; see [Note: Dynamo's
side-effect messages] below).

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

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch._dynamo import compiled_autograd as _ca

from ._cache import env_switch

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


# [Note: Dynamo's side-effect messages]
# The runtime's traced Python changes Python state (each parameter's sharded state,
# its gradients, which tensor a module holds), and dynamo replays every object
# changed in a graph after the graph runs. With torch 2.13's default
# ``torch._dynamo.config.side_effect_replay_policy = "info"``, dynamo also records
# the user stack of every change while it traces, and when it emits a graph it
# formats a message for each changed object, walking the Python stack above
# dynamo each time. It does so whether or not anything reads the messages, whose
# only readers are the ``side_effects`` logging artifact (``TORCH_LOGS=side_effects``)
# and the structured trace (``TORCH_TRACE``, tlparse). A fully_shard model changes
# many objects (191 in the two graphs of the demo Llama with 4 layers): emitting the
# side effects took 1.54 s with the messages and 0.12 s without, and the whole first
# compile 3% less (benchmarks/compile_ab.py --lever side_effects, 1 rank, aot_eager; 3.15 s and
# 0.28 s, 4% less, with 8 layers; docs/compile.md).
#
# So ``fully_shard`` sets the policy to ``"silent"`` when it is torch's default and
# neither reader is on: the policy decides only the messages (the side effects are
# replayed the same), so no graph and no number changes. It leaves a policy the user
# chose (``"warn"``, ``"error"``), and leaves ``"info"`` when either reader is on as
# ``fully_shard`` runs. A reader turned on later (``torch._logging.set_logs(
# side_effects=True)``) gets no messages until :func:`restore_side_effect_messages`
# puts ``"info"`` back; ``TRACEABLE_HSDP_QUIET_SIDE_EFFECTS=0`` leaves torch's
# default alone. ``dump_graphs(trace=True)``, which adds its structured-trace reader
# for its block, has ``"info"`` inside the block (:func:`side_effect_messages_on`).
# Dynamo reads the policy while it compiles, so it is set before compiling starts,
# never during (fully_shard is not traced).

ENV_QUIET_SIDE_EFFECTS = "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS"

_quieted: list[bool] = []  # [True] while "silent" is ours to undo


def side_effect_messages_read() -> bool:
    """Whether anything would read dynamo's side-effect messages now: the
    ``side_effects`` logging artifact is on, or the structured trace writes somewhere.
    See [Note: Dynamo's side-effect messages]."""
    from torch._dynamo.side_effects import side_effects_log
    from torch._logging._internal import LazyTraceHandler, trace_log

    if side_effects_log.isEnabledFor(logging.DEBUG):
        return True
    for handler in trace_log.handlers:
        # torch's default handler, with no directory (no TORCH_TRACE), writes nothing
        # outside Meta's jobs (LazyTraceHandler.emit, MAST_HPC_JOB_NAME): no reader.
        default = isinstance(handler, LazyTraceHandler) and handler.root_dir is None
        if not default or os.environ.get("MAST_HPC_JOB_NAME"):
            return True
    return False


def quiet_side_effect_messages() -> bool:
    """Sets ``torch._dynamo.config.side_effect_replay_policy`` to ``"silent"`` when
    it is torch's default (``"info"``) and nothing reads the messages. Idempotent. See
    [Note: Dynamo's side-effect messages].

    Returns:
        Whether the policy is ``"silent"`` by this call or an earlier one.
    """
    config = torch._dynamo.config
    if _quieted:
        if config.side_effect_replay_policy == "silent":
            return True
        _quieted.clear()  # the user set another policy since: theirs stays
    if config.side_effect_replay_policy != "info" or side_effect_messages_read():
        return False
    config.side_effect_replay_policy = "silent"
    _quieted.append(True)
    return True


def restore_side_effect_messages() -> None:
    """Puts torch's ``"info"`` back if :func:`quiet_side_effect_messages` set
    ``"silent"`` and nobody changed it since."""
    if _quieted:
        _quieted.clear()
        if torch._dynamo.config.side_effect_replay_policy == "silent":
            torch._dynamo.config.side_effect_replay_policy = "info"


@contextmanager
def side_effect_messages_on() -> Iterator[None]:
    """Torch's ``"info"`` policy inside the block if :func:`quiet_side_effect_messages`
    had set ``"silent"`` (quieted again after): for a reader added for the block, such
    as the structured trace of ``dump_graphs(trace=True)``."""
    ours = bool(_quieted) and torch._dynamo.config.side_effect_replay_policy == "silent"
    if ours:
        restore_side_effect_messages()
    try:
        yield
    finally:
        if ours:
            quiet_side_effect_messages()


def quiet_side_effect_messages_from_env(environ: Mapping[str, str] | None = None) -> None:
    """:func:`quiet_side_effect_messages` unless ``TRACEABLE_HSDP_QUIET_SIDE_EFFECTS``
    is ``0`` (or ``false``/``off``/``no``).

    Raises:
        ValueError: any other value than those and ``1``/``true``/``on``/``yes``/empty.
    """
    if env_switch(ENV_QUIET_SIDE_EFFECTS, environ, "dynamo's unread side-effect messages off"):
        quiet_side_effect_messages()
