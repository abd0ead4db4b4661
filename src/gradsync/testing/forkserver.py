"""Where the test harness gets its processes: forked from one server that imported the library.

[Note: processes from a forkserver]
Fresh ranks (``fresh.py``) and the pool's workers (``pool.py``) are forked from
multiprocessing's forkserver, a process that has imported torch and every module of gradsync
and done nothing else, rather than started with ``spawn``, which imports them again (3-4 s of
CPU a process on the 2-core build machine; the suite starts dozens: a pool grows for a case on
8 ranks, and replaces the workers of every case that fails on purpose). No case ran in the
server and it never touched CUDA, so a forked process is as fresh as a spawned one but for
the imports.

What a spawned process would take from its parent at its start, a forked one is handed
(:func:`take_parents`): the server's environment and working directory are those of the
server's own start, so each process takes the parent's current ones first. A variable set
before ``spawn`` (``CUDA_VISIBLE_DEVICES``, read when CUDA starts) reaches it, as with
``spawn``; a variable torch reads while being imported does not, and wants a subprocess of its
own. A forked process ends in ``os._exit``, without the interpreter's shutdown: each runs its
``atexit`` handlers itself (a fresh rank at its end, a worker when the pool stops it), so a
handler that crashes or hangs still fails the run, but objects are not finalised. The torchrun
jobs of ``tests/e2e`` and the subprocesses of ``tests/unit/test_layout.py`` still end through
the interpreter's shutdown, as users' processes do.
"""

from __future__ import annotations

import os
from typing import Any

import torch.multiprocessing as mp

from gradsync.testing.pristine import library_modules


def forkserver() -> Any:
    """The forkserver context; its server imports torch and the library when it first starts."""
    # One thread per process: on a 2-core machine oversubscription turns seconds into minutes.
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the server starts and imports torch
    ctx = mp.get_context("forkserver")
    # Read only when the server starts (the first process): the same list from every caller.
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", *library_modules(), "gradsync.testing.pool_worker"]
    )
    return ctx


def parents() -> tuple[dict[str, str], str]:
    """What a forked process takes from the parent that starts it: environment, directory."""
    return dict(os.environ), os.getcwd()


def take_parents(env: dict[str, str], cwd: str) -> None:
    """In the forked process: replace the server's environment and directory with the parent's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
