"""The post-optimizer event: ``FSDPModule.set_post_optim_event`` on the root. See
[Note: The post-optimizer event].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PostOptimEvent"]


# [Note: The post-optimizer event]
# Our collectives run on the current stream, so they follow the optimizer step
# already; ``set_post_optim_event(event)`` is still honoured: the current stream waits
# on it once before the root's next forward. The wait is eager-only
# (``PostOptimEvent.wait``, dynamo-disabled: a new event each step would recompile),
# reached by whichever comes first: a forward pre-hook on the root's modules (run
# outside dynamo under ``torch.compile(model)``, [Note: Forward wrapper, not module
# hooks]), or, for a step compiled whole, which ignores hooks added later, the root's
# pre-forward when ``post_optim.pending`` is set (a graph break in those steps only).


class PostOptimEvent:
    """The root's post-optimizer event: set, waited for once before the next forward,
    dropped. See [Note: The post-optimizer event].

    Args:
        modules: the root's module(s), which get the waiting forward pre-hook.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.event: Any = None
        self.pending = False  # an event is set (what dynamo guards on)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def set(self, event: Any) -> None:
        """Sets ``event`` for the next forward."""
        self.event = event
        self.pending = True
        if not self._hooks:
            self._hooks = [
                m.register_forward_pre_hook(self.wait, prepend=True) for m in self.modules
            ]

    def clear(self) -> None:
        """Drops an event set and not yet waited for (eagerly)."""
        if self.pending:
            self.event = None
            self.wait()

    # Disabled as a whole: dynamo must not compile the hook's own frame either (under
    # torch.compile(model, fullgraph=True) that is a hard error).
    @torch._dynamo.disable
    def wait(self, *hook_args: Any) -> None:
        """The current stream waits on the event, once. Eager only. Also the forward
        pre-hook (``hook_args``: the module and its inputs, unused)."""
        event, self.event = self.event, None
        self.pending = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if event is not None:
            event.wait()
