"""Process-wide hooks that live exactly as long as the objects that need them.

torch's global registries (module registration hooks, optimizer step hooks) and the optimizers'
registry of peer finders outlive any one wrapper. Whatever gradsync puts there is held by its
owners: installed with the first live owner, so that importing gradsync changes nothing, and
removed when the last one is collected, as torch's own ``RemovableHandle`` s are meant to be
used.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol


class Removable(Protocol):
    """What an install returns for each hook: torch's ``RemovableHandle``."""

    def remove(self) -> None: ...


class HeldHooks:
    """Hooks that ``install`` puts in place, kept while some object that :meth:`hold` was
    called for is alive. Counted, not a weak set of the owners: an owner's finalizer may run
    before a weak set has dropped it, and one owner may hold twice (each hold is released)."""

    def __init__(self, install: Callable[[], Sequence[Removable]]) -> None:
        self.install = install
        self.handles: list[Removable] = []
        self.holders = 0

    def hold(self, owner: object) -> None:
        """Keep the hooks installed while ``owner`` lives (installing them now if none are)."""
        if self.holders == 0:
            self.handles = list(self.install())
        self.holders += 1
        weakref.finalize(owner, self._release)

    def _release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            for handle in self.handles:
                handle.remove()
            self.handles = []
