"""What a fresh process has and a case may change: taken when a pooled worker starts, put back
before each case it runs, so that no case sees what an earlier one left behind.

Covers what the tests and the library change in a process: environment variables, the working
directory, torch's global switches (default dtype, threads, grad mode, deterministic
algorithms, anomaly detection, matmul precision, the default generator's seed, dynamo's
caches), warning filters, loggers, signal handlers and exception hooks; the library's module
counters (every rank must build its n-th wrapper or checkpointer under the same name, and a
worker that ran an earlier case on fewer ranks would otherwise be ahead of a fresh one); and
the modules a case imported from outside the library and torch (its test module: imported
again, with fresh globals, by the next case). What cannot be put back is checked instead
(:meth:`Pristine.leftovers`): a process group or threads that outlive the case make the pool
replace the worker. A case is a job: the checkpoint folders it claimed are let go after it
(:func:`end_claims`), as a job's are when its processes end.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import random
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MAX_PARKED_THREADS = 16
"""Daemon threads a worker may keep from earlier cases. The library's own end with the objects
that use them (an algorithm's serial worker thread stops once the algorithm is collected), but
one may still be winding down when the case is checked; more than this many means something
keeps them, and the worker is replaced."""


_LIBRARY = Path(__file__).resolve().parents[1]  # the gradsync package
# Harnesses and tools, not the library: their modules are not imported ahead (integrations
# would import the frameworks), and they keep no per-rank counters.
_NOT_LIBRARY = {"testing", "verify", "bench", "cli", "integrations", "__main__"}
_SCALARS = (int, float, bool, str, type(None))


@functools.cache
def library_modules() -> tuple[str, ...]:
    """The name of every module of the library (not its harnesses and tools). Read once: every
    fresh run and every pool worker's start asks for it (``forkserver.py``)."""
    names = []
    for path in sorted(_LIBRARY.rglob("*.py")):
        parts = path.relative_to(_LIBRARY).with_suffix("").parts
        if parts[0] in _NOT_LIBRARY:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(("gradsync", *parts)))
    return tuple(names)


def import_library() -> None:
    """Import every module of the library, so that their counters are seen before any case."""
    for name in library_modules():
        importlib.import_module(name)


def _library_scalars() -> dict[tuple[str, str], Any]:
    """Every number, flag and string held by a library module (``_num_wrappers``...)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("gradsync.") and name.split(".")[1] not in _NOT_LIBRARY:
            for attr, value in vars(module).items():
                if not attr.startswith("__") and isinstance(value, _SCALARS):
                    out[name, attr] = value
    return out


def _from_outside(module: Any) -> bool:
    """A module of neither the library nor an installed package: a test module or its helper."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(_LIBRARY)}
    return not any(file.startswith(p) for p in prefixes)


def _loggers() -> dict[str, tuple[int, list[logging.Handler], bool, bool]]:
    found = {"": logging.getLogger()}
    found.update(
        (name, lg)
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    )
    return {n: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for n, lg in found.items()}


def _handlers() -> dict[signal.Signals, Any]:
    out: dict[signal.Signals, Any] = {}
    for sig in signal.valid_signals():
        if isinstance(sig, signal.Signals) and sig not in (signal.SIGKILL, signal.SIGSTOP):
            out[sig] = signal.getsignal(sig)
    return out


def end_claims() -> None:
    """Let go of the checkpoint folders the case claimed (a job holds them for its processes'
    life, and a pooled worker's process outlives the case)."""
    owner = sys.modules.get("gradsync.checkpoint.owner")
    if owner is not None:
        owner.release_all()


class Pristine:
    """The state of a worker process right after start-up."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.seed = torch.initial_seed()
        self.filters = list(warnings.filters)
        self.loggers = _loggers()
        self.signals = _handlers()
        self.hooks = (sys.excepthook, threading.excepthook)
        self.threads = set(threading.enumerate())
        self.modules = set(sys.modules)
        self.scalars = _library_scalars()

    def restore(self) -> None:
        """Put back everything a case may have changed."""
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        self._restore_torch()
        warnings.filters[:] = self.filters  # type: ignore[index]
        warnings._filters_mutated()  # type: ignore[attr-defined]  # forget "once" registries
        self._restore_loggers()
        for sig, handler in self.signals.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        sys.excepthook, threading.excepthook = self.hooks
        for (name, attr), value in self.scalars.items():
            setattr(sys.modules[name], attr, value)
        for name in set(sys.modules) - self.modules:
            if _from_outside(sys.modules[name]):
                del sys.modules[name]

    def _restore_torch(self) -> None:
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)  # one thread per rank: 2 cores run several ranks
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        torch.set_float32_matmul_precision("highest")
        torch.manual_seed(self.seed)
        random.seed()
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()

    def _restore_loggers(self) -> None:
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger) and name not in self.loggers:
                lg.setLevel(logging.NOTSET)
                lg.handlers, lg.propagate, lg.disabled = [], True, False
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            lg = logging.getLogger(name or None)
            lg.setLevel(level)
            lg.handlers, lg.propagate, lg.disabled = list(handlers), propagate, disabled
        logging.disable(logging.NOTSET)

    def join_threads(self) -> None:
        """Wait for the case's non-daemon threads, as interpreter shutdown would: one that
        never ends hangs the worker, which the pool then reports and kills."""
        for thread in set(threading.enumerate()) - self.threads:
            if not thread.daemon and thread is not threading.current_thread():
                thread.join()

    def leftovers(self) -> str:
        """Why this worker should not run another case (``""``: it may)."""
        if dist.is_initialized():
            return "a process group outlived the case"
        parked = len(set(threading.enumerate()) - self.threads)
        if parked > MAX_PARKED_THREADS:
            return f"{parked} threads left by earlier cases"
        return ""
