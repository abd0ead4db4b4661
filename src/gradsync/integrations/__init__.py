"""gradsync's wrapper where a training framework would put torch DDP.

* :mod:`gradsync.integrations.accelerate`: ``GradsyncAccelerator`` (HF Accelerate) and
  ``GradsyncTrainer`` (HF Trainer).
* :mod:`gradsync.integrations.lightning`: ``GradsyncStrategy`` (Lightning ``Trainer``) and
  ``GradsyncFabricStrategy`` (Lightning Fabric).

Each keeps everything its framework does around the wrap (device placement, mixed precision,
compile, gradient accumulation, clipping) and replaces only the construction of
``torch.nn.parallel.DistributedDataParallel``. The frameworks are optional dependencies, imported
by these modules only: ``pip install 'gradsync[integrations]'`` (in a clone of gradsync,
``pip install -e '.[integrations]'``).

This package's own module holds what the integrations share and imports no framework.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from typing import Any

from gradsync.ddp.wrapper import DistributedDataParallel
from gradsync.errors import UsageError

INSTALL = "pip install 'gradsync[integrations]'"
INSTALL_FROM_CLONE = "pip install -e '.[integrations]'"  # at the root of a clone of gradsync


def missing(package: str, needed_by: str, minimum: str | None = None) -> ImportError:
    """The error for a framework that is not installed (or too old), naming the install line."""
    wanted = f"{package}>={minimum}" if minimum else package
    return ImportError(
        f"gradsync: {needed_by} needs {wanted}; install it with {INSTALL} "
        f"(in a clone of gradsync: {INSTALL_FROM_CLONE}), or pip install '{wanted}'",
        name=package,
    )


def require_version(package: str, version: str, minimum: str, needed_by: str) -> None:
    """Raise :func:`missing` when ``version`` of ``package`` is older than ``minimum``: the
    integrations override methods whose shape only these versions have."""
    from packaging.version import Version  # a dependency of every supported framework

    if Version(version) < Version(minimum):
        raise missing(package, needed_by, minimum) from None


def _constructor_arguments() -> frozenset[str]:
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return frozenset(name for name in params if name not in ("self", "module"))


def wrapper_kwargs(
    framework_kwargs: Mapping[str, Any],
    ddp_options: Mapping[str, Any],
    *,
    framework: str,
    set_by_framework: Collection[str] = (),
) -> dict[str, Any]:
    """The keyword arguments of ``gradsync.DistributedDataParallel``: what the framework would
    pass to torch DDP, plus the user's ``ddp_options`` (gradsync's own options, or torch DDP
    arguments the framework does not forward, such as ``process_group``).

    A name given both ways is refused rather than silently resolved, so that a setting made in
    the framework's usual place (``DistributedDataParallelKwargs``, ``TrainingArguments``,
    ``DDPStrategy(...)``) is never overridden without the user knowing. Unknown names are
    refused here, before any process group work, with the list of valid ones."""
    known = _constructor_arguments()
    unknown = sorted(set(ddp_options) - known)
    if unknown:
        raise UsageError(
            f"ddp_options has {unknown}, which gradsync.DistributedDataParallel does not take; "
            f"it takes {sorted(known)}"
        )
    taken = sorted(set(ddp_options) & (set(framework_kwargs) | set(set_by_framework)))
    if taken:
        raise UsageError(
            f"{taken} in ddp_options is already set by {framework}; set it there "
            "(each setting in one place)"
        )
    return {**framework_kwargs, **ddp_options}


__all__ = ["INSTALL", "INSTALL_FROM_CLONE", "missing", "require_version", "wrapper_kwargs"]
