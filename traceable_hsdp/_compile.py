"""Compiling a fully_shard model: turning compiled autograd on, and the two things in
dynamo that fully_shard changes: its side-effect messages (see [Note: Dynamo's
side-effect messages] below) and one step of compiled autograd's graph ordering (see
[Note: An output hook that gets no gradient] below).

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
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from ._cache import env_switch
from ._torch_internals import owner, resolve

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
    ctx = _enable(torch.compile(backend=backend, **compile_kwargs))
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
    with _enable(torch.compile(backend=backend, **compile_kwargs)):
        yield


def _enable(compiler_fn: Any) -> AbstractContextManager[None]:
    """Compiled autograd's own context, on with ``compiler_fn``."""
    return resolve("torch._dynamo.compiled_autograd._enable")(compiler_fn)


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
# many objects, and the messages are most of the time dynamo spends emitting its
# side effects (``benchmarks/compile_ab.py --lever side_effects``; docs/compile.md).
#
# So ``fully_shard`` sets the policy to ``"silent"`` when it is torch's default and
# neither reader is on: the policy decides only the messages (the side effects are
# replayed the same), so no graph and no number changes. It leaves a policy the user
# chose (``"warn"``, ``"error"``), and leaves ``"info"`` when either reader is on as
# ``fully_shard`` runs. A reader turned on later (``torch._logging.set_logs(
# side_effects=True)``) gets no messages until :func:`restore_side_effect_messages`
# puts ``"info"`` back; ``TRACEABLE_HSDP_QUIET_SIDE_EFFECTS=0`` leaves torch's
# default alone. torch's default trace handler with no directory counts as no reader:
# it writes only inside Meta's own jobs, whose environment traceable_hsdp does not
# read. ``dump_graphs(trace=True)``, which adds its structured-trace reader
# for its block, has ``"info"`` inside the block (:func:`side_effect_messages_on`).
# Dynamo reads the policy while it compiles, so it is set before compiling starts,
# never during (fully_shard is not traced).

ENV_QUIET_SIDE_EFFECTS = "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS"

_POLICY = "torch._dynamo.config.side_effect_replay_policy"
_quieted: list[str] = []  # [torch's policy] while "silent" is ours to undo


def side_effect_messages_read() -> bool:
    """Whether anything would read dynamo's side-effect messages now: the
    ``side_effects`` logging artifact is on, or the structured trace writes somewhere.
    See [Note: Dynamo's side-effect messages]."""
    if resolve("torch._dynamo.side_effects.side_effects_log").isEnabledFor(logging.DEBUG):
        return True
    default_handler = resolve("torch._logging._internal.LazyTraceHandler")
    for handler in resolve("torch._logging._internal.trace_log").handlers:
        # torch's default handler, with no directory (no TORCH_TRACE): no reader.
        if not (isinstance(handler, default_handler) and handler.root_dir is None):
            return True
    return False


def quiet_side_effect_messages() -> bool:
    """Sets ``torch._dynamo.config.side_effect_replay_policy`` to ``"silent"`` when
    it is torch's default (``"info"``) and nothing reads the messages. Idempotent. See
    [Note: Dynamo's side-effect messages].

    Returns:
        Whether the policy is ``"silent"`` by this call or an earlier one.
    """
    config, name = owner(_POLICY)
    policy = getattr(config, name)
    if _quieted:
        if policy == "silent":
            return True
        _quieted.clear()  # the user set another policy since: theirs stays
    if policy != "info" or side_effect_messages_read():
        return False
    setattr(config, name, "silent")
    _quieted.append(policy)
    return True


def restore_side_effect_messages() -> None:
    """Puts torch's ``"info"`` back if :func:`quiet_side_effect_messages` set
    ``"silent"`` and nobody changed it since."""
    if _quieted:
        torchs = _quieted.pop()
        config, name = owner(_POLICY)
        if getattr(config, name) == "silent":
            setattr(config, name, torchs)


@contextmanager
def side_effect_messages_on() -> Iterator[None]:
    """Torch's ``"info"`` policy inside the block if :func:`quiet_side_effect_messages`
    had set ``"silent"`` (quieted again after): for a reader added for the block, such
    as the structured trace of ``dump_graphs(trace=True)``."""
    ours = bool(_quieted) and resolve(_POLICY) == "silent"
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


# [Note: An output hook that gets no gradient]
# Each unit hooks every forward output that requires grad, to re-gather before its
# backward, as torch's fully_shard does. Some of those outputs get no gradient. HF's
# causal LMs, given labels, return the loss and the logits; the loss is computed
# from the logits inside the same compiled graph, so the logits' slot of that
# graph's backward node receives none. Dynamo usually traces the hook into the
# graph. After a graph break inside the model it cannot: the resumed frame of the
# root's forward receives the outputs as inputs, and dynamo registers their hooks
# after the graph runs, as plain tensor hooks. Compiled autograd then records a call
# of the logits' hook on a gradient of None. torch 2.13's
# ``AutogradCompilerInstance.reorder_tensor_pre_hook_nodes`` fails on that None
# before the backward runs (``AttributeError: 'NoneType' object has no attribute
# 'op'`` in ``is_placeholder``). torch's own fully_shard fails the same way: its
# hooks are always registered outside the graph. Seen with HF ``LlamaForCausalLM``
# and ``labels``, with any graph break inside a block. transformers 5.25 adds such a
# break itself in every checkpointed decoder layer: its attention sets a global
# (the ``kernels`` package's), which the checkpoint's higher-order op cannot trace.
# That pass moves each tensor hook next to the node that makes its gradient. It
# leaves a hook on a graph input (a placeholder) where it is. A hook on no gradient
# has nothing to follow either. So ``fully_shard`` wraps the pass's
# ``is_placeholder`` to answer yes for None, and torch's own function answers for
# every node. The hook then stays where compiled autograd put it and is called with
# None, which the runtime's hooks pass on unchanged. Nothing else changes.
# tests/test_reliability.py trains the test Llama under a root that returns the loss
# and the log-probabilities, with Inductor, against eager.
# :func:`restore_compiled_autograd_ordering` puts torch's function back.

_IS_PLACEHOLDER = "torch._dynamo.compiled_autograd.AutogradCompilerInstance.is_placeholder"
_torch_is_placeholder: list[Any] = []  # torch's function, while ours is installed


def tolerate_outputs_without_gradient() -> None:
    """Makes compiled autograd's tensor-hook ordering leave alone a hook whose gradient
    is None, instead of failing on it. Idempotent. See [Note: An output hook that gets
    no gradient].

    Raises:
        TorchInternalError: this torch's compiled autograd has no ``is_placeholder``.
    """
    cls, name = owner(_IS_PLACEHOLDER)
    if _torch_is_placeholder:
        return
    torch_is_placeholder = getattr(cls, name)

    def is_placeholder(node: Any) -> bool:
        return node is None or torch_is_placeholder(node)

    setattr(cls, name, staticmethod(is_placeholder))
    _torch_is_placeholder.append(torch_is_placeholder)


def restore_compiled_autograd_ordering() -> None:
    """Undoes :func:`tolerate_outputs_without_gradient`. Does nothing if it is not
    installed."""
    if _torch_is_placeholder:
        cls, name = owner(_IS_PLACEHOLDER)
        setattr(cls, name, staticmethod(_torch_is_placeholder.pop()))
