"""What changed in the module after wrapping: its parameter set, and in-place updates.

The reducer hooks the parameters that were trainable when the wrapper was built; buckets are
planned for exactly those. A parameter whose ``requires_grad`` is flipped afterwards, or one
that replaces one or joins the module (``model.fc = nn.Linear(...)``), would train on local
gradients only, or never be broadcast: replicas drift apart silently. (A submodule deleted
with ``del`` is seen as its parameters getting no gradient: an error without
``find_unused_parameters``, harmless with it, since nothing uses them any more.)
:class:`ParameterWatch` notices such changes at each training forward, cheaply:

- ``requires_grad`` and identity of the known parameters: one pass over a cached list
  (about 20 us for 136 parameters);
- parameters or submodules registered anywhere: torch's global registration hooks bump a
  counter, and only then is the module walked again (a walk costs ~0.3 ms for a 12-layer GPT,
  too much for every step).

It also sums the parameters' version counters, which every in-place update bumps (an
optimizer's ``step``, mostly): equal replicas that apply the same updates have the same sum, so
a rank whose sum differs took an extra step or a rank-specific update (see ``tags.py``).
The sum is evidence, not proof (fused optimizers do not bump versions; ``.data`` writes do
not either), so a mismatch is confirmed with exact checksums before anything is raised.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from torch import nn
from torch.nn.modules import module as torch_module

from gradsync.lifetime import HeldHooks

_requires_grad = operator.attrgetter("requires_grad")
_version = operator.attrgetter("_version")  # bumped by every in-place update of a tensor
_registrations = itertools.count(1)
_generation = 0  # bumped whenever any module anywhere registers a parameter or submodule


def _bump(*_args: object) -> None:
    global _generation
    _generation = next(_registrations)


# torch's two global registration hooks, installed with the first live watch, so that
# importing gradsync changes nothing in torch, and removed with the last. A registration while
# no watch lives needs no count: a watch walks its module when it is built, after the hooks are
# in, and the generation only grows, so no live watch can take a later generation for the one
# it saw.
_HOOKS = HeldHooks(
    lambda: [
        torch_module.register_module_parameter_registration_hook(_bump),
        torch_module.register_module_module_registration_hook(_bump),
    ]
)


class ParameterWatch:
    """The parameter set of ``module`` as it was at wrapping time, and how it has changed
    (parameters named in ``ignore`` are not data-parallel: torch DDP's ignore list)."""

    def __init__(self, module: nn.Module, ignore: AbstractSet[str] = frozenset()) -> None:
        _HOOKS.hold(self)
        self.module, self.ignore = module, ignore
        self.named = self._current()
        self._params = [p for _, p in self.named]  # the per-step passes read these alone
        self.trainable = [p.requires_grad for p in self._params]
        self._generation = _generation
        self._wrapped_ids = [id(p) for _, p in self.named]
        self._walked_ids = self._wrapped_ids
        # Where in-place updates are not the same on every rank (a sharded optimizer steps a
        # different number of slices on each), a count of steps that is: see count_with.
        self.count_updates: Callable[[], int] | None = None
        self._version_base = self.version_sum()

    def changes(self) -> list[str]:
        """What differs from wrapping time, one phrase per parameter (empty: nothing)."""
        found = []
        # Every training forward asks: compare the flags as one list first (nearly always
        # equal), and build phrases only when some flag flipped.
        if list(map(_requires_grad, self._params)) != self.trainable:
            found = [
                f"'{name}' requires_grad {'False -> True' if p.requires_grad else 'True -> False'}"
                for (name, p), was in zip(self.named, self.trainable, strict=True)
                if p.requires_grad != was
            ]
        if _generation != self._generation:
            self._generation = _generation
            self._walked_ids = [id(p) for _, p in self._current()]
        if self._walked_ids != self._wrapped_ids:
            found += self._structural_changes()
        return found

    def _structural_changes(self) -> list[str]:
        now = dict(self._current())
        before = {name: p for name, p in self.named}
        out = []
        for name, p in now.items():
            if name not in before:
                out.append(f"'{name}' was added")
            elif before[name] is not p:
                out.append(f"'{name}' was replaced by a new parameter")
        out += [f"'{name}' was removed" for name in before if name not in now]
        return out

    def _current(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.ignore]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.named]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named]

    def version_sum(self) -> int:
        if self.count_updates is not None:
            return self.count_updates()
        return sum(map(_version, self._params))  # once per step: no Python loop body

    def count_with(self, count_updates: Callable[[], int]) -> None:
        """Count updates with ``count_updates`` from now on, instead of version counters: a
        sharded optimizer (``ddp/sharding.py``) steps a different number of slices on each
        rank, but takes the same number of steps."""
        self.count_updates = count_updates
        self.rebase()

    def updates_since_wrapping(self) -> int:
        """In-place updates of the parameters since wrapping (or since :meth:`rebase`)."""
        return self.version_sum() - self._version_base

    def rebase(self) -> None:
        """Count from now: called when checksums proved a version difference harmless."""
        self._version_base = self.version_sum()
