"""Compiling a fully_shard model: turning compiled autograd on, and the two things in
dynamo that fully_shard changes ([Note: Dynamo's side-effect messages], [Note: An
output hook that gets no gradient]).

[Note: Why compiled autograd]
The backward collectives live in hooks, which only compiled autograd traces into a
backward graph. It must be on when the forward is traced, so that dynamo defers the
hooks to the backward ([Note: Hooks and compiled autograd] in ``_state.py``). Two ways
in:

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
# Under the default ``side_effect_replay_policy = "info"`` dynamo formats a message,
# with the user stack, for every Python object a graph changes, read only by
# ``TORCH_LOGS=side_effects`` and ``TORCH_TRACE``. A fully_shard model changes many
# objects, so the messages dominate emitting side effects (docs/compile.md). So
# ``fully_shard`` sets the policy to ``"silent"`` when it is torch's default and
# neither reader is on; the side effects are replayed the same, so no graph changes. A
# policy the user chose stays; :func:`restore_side_effect_messages` puts ``"info"``
# back; ``TRACEABLE_HSDP_QUIET_SIDE_EFFECTS=0`` leaves it alone; ``dump_graphs(
# trace=True)`` has ``"info"`` inside its block (:func:`side_effect_messages_on`).

ENV_QUIET_SIDE_EFFECTS = "TRACEABLE_HSDP_QUIET_SIDE_EFFECTS"

_POLICY = "torch._dynamo.config.side_effect_replay_policy"
_quieted: list[str] = []  # [torch's policy] while "silent" is ours to undo


def side_effect_messages_read() -> bool:
    """Whether anything reads dynamo's side-effect messages now. See [Note: Dynamo's
    side-effect messages]."""
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
    """Torch's ``"info"`` policy inside the block, for a reader added for it
    (``dump_graphs(trace=True)``), if :func:`quiet_side_effect_messages` quieted it."""
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
# An output hooked for the re-gather may get no gradient (HF causal LMs return the loss
# and the logits; the loss is computed from the logits in the same graph). After a
# graph break inside the model, dynamo registers those hooks as plain tensor hooks, and
# compiled autograd's ``reorder_tensor_pre_hook_nodes`` fails on the None gradient
# (torch's fully_shard fails the same way). That step moves each hook next to the node
# making its gradient and leaves hooks on graph inputs alone; a hook on no gradient has
# nothing to follow either. So ``fully_shard`` wraps ``is_placeholder`` to answer yes
# for None; the hook is called with None, which the runtime passes on.
# tests/test_reliability.py trains a root returning the loss and the log-probabilities,
# with Inductor, against eager. :func:`restore_compiled_autograd_ordering` undoes it.

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
