"""A pooled worker's life (see ``pool.py``): start once, then run case after case.

Messages are pickled by hand and sent as bytes over the worker's own pipe: no queue lock is
shared between workers (a worker killed while writing would leave it held), and no tensor is
shared through a process that may be gone when it is read.

Parent to worker: ``("case", id, sys.path, rank, world_size, init_file, pg_timeout_s,
payload)`` with ``payload`` the pickled ``(fn, args)``, or ``("stop",)``.
Worker to parent: ``("ready", None)`` once it has taken its parent's environment and directory
and imported the library; per case
``("result", id, ok, bytes or RankFailure)`` once ``fn`` has returned or
raised, then ``("clean", id, leftovers)`` once its groups are freed (``leftovers``: why the
worker should be replaced, ``""`` if it should not).
"""

from __future__ import annotations

import atexit
import gc
import pickle
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from gradsync.testing.forkserver import take_parents
from gradsync.testing.pristine import Pristine, end_claims, import_library
from gradsync.testing.ranks import RankFailure, free_groups, run_rank


def send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _run_case(message: tuple[Any, ...]) -> tuple[bool, Any]:
    _, _, sys_path, rank, world_size, init_file, pg_timeout_s, payload = message
    sys.path[:] = sys_path  # the test modules ``fn`` comes from, as a fresh process would see
    try:
        fn, args = pickle.loads(payload)
    except BaseException as exc:  # a function that cannot be imported here fails the rank
        return False, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())
    return run_rank(rank, world_size, fn, args, init_file, pg_timeout_s, "gloo")


def serve(conn: Connection, parent: tuple[dict[str, str], str]) -> None:
    """Run the cases sent over ``conn`` until told to stop (or the parent is gone), then run
    the ``atexit`` handlers, as the interpreter's exit would ([Note: processes from a
    forkserver]): one that crashes or hangs is seen when the pool closes."""
    try:
        _serve(conn, parent)
    finally:
        atexit._run_exitfuncs()


def _serve(conn: Connection, parent: tuple[dict[str, str], str]) -> None:
    take_parents(*parent)  # before the snapshot of what a fresh process has
    torch.set_num_threads(1)
    import_library()  # the forkserver imported it already: nothing to do for a forked worker

    # What is alive now lives for good: leave it out of every later collection, so that the
    # collections that free each case's groups take milliseconds, not most of a second.
    gc.freeze()
    pristine = Pristine()
    send(conn, ("ready", None))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message[0] == "stop":
            return
        pristine.restore()
        ok, value = _run_case(message)
        send(conn, ("result", message[1], ok, value))
        del value
        free_groups()
        end_claims()
        pristine.join_threads()
        send(conn, ("clean", message[1], pristine.leftovers()))
