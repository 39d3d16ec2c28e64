"""The post-optimizer event: ``FSDPModule.set_post_optim_event`` on the root. See
[Note: The post-optimizer event].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PostOptimEvent"]


# [Note: The post-optimizer event]
# torch's FSDP all-gathers on its own streams and, by default, makes them wait for the
# current stream at the root's pre-forward, so that they follow the optimizer step;
# ``set_post_optim_event(event)`` replaces that wait by a wait on ``event``. Our
# collectives run on the current stream, so they follow the optimizer step already;
# the event is still honoured: before the root's next forward the current stream
# waits on it (``event.wait()``), once, and it is dropped. The wait is eager-only
# (events do not belong in a traced graph, and a new event each step would recompile
# it), in ``PostOptimEvent.wait`` (dynamo-disabled), reached two ways, whichever
# comes first:
# - a forward pre-hook on the root's module(s), registered when the event is set and
#   removed once it fired: eagerly and under ``torch.compile(model)``, which runs the
#   top module's hooks outside dynamo (see [Note: Forward wrapper, not module hooks]),
#   so the forward graph never sees the event;
# - the root's pre-forward, when ``post_optim.pending`` (a bool, the one thing dynamo
#   guards on) is still set: for a step compiled whole, where dynamo inlines the
#   model's call and ignores hooks added after it compiled
#   (``skip_nnmodule_hook_guards``). That step graph-breaks there, in the steps that
#   have an event only (one more graph variant, not a recompile per event).


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
