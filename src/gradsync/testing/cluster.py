"""A simulated multi-node cluster on one Linux machine, for multi-node tests and benchmarks.

:class:`SimulatedCluster` is a :class:`~gradsync.testing.netns.SimulatedNetwork` (nodes as network
namespaces on a shaped bridge, see there) that also launches torchrun on every node at once and
collects each node's result; this module is also the ``gradsync cluster`` command. Needs root
and the ``ip`` and ``tc`` tools; :meth:`SimulatedCluster.available` says whether this machine
qualifies and, if not, why.

Pitfalls of simulating a cluster this way, and how they are handled (comments in this module and
in :mod:`gradsync.testing.netns` refer to these numbers):

1. gloo binds to the address the hostname resolves to (127.0.0.1) unless ``GLOO_SOCKET_IFNAME``
   names the node's interface; :meth:`SimulatedCluster.env` sets it, and
   :meth:`SimulatedCluster.launch` always runs under a hard timeout that kills what it started.
2. c10d rendezvous needs extra flags on every node; :meth:`SimulatedCluster.torchrun_commands`
   uses the static rendezvous (``--master-addr``/``--master-port``), which works across
   namespaces as is; :meth:`SimulatedCluster.elastic_torchrun_commands` adds those flags.
3. torchrun exports ``OMP_NUM_THREADS`` only when ``--nproc-per-node > 1``;
   :meth:`SimulatedCluster.launch` always exports it (cores / total ranks unless the caller chose
   a value). Oversubscribed threads slowed a 2x2 step by 31 %.
4. A too-small tbf burst caps throughput (64 KiB at 1 Gbit/s reached only 87 %); the burst is
   max(64 KiB, 2 ms worth of bytes). A burst also lets that many bytes through unthrottled, so
   claims about bandwidth are made on messages of 16 MB or more.
5. tc rates count frame bytes: TCP payload is ~95.6 % of the rate
   (:data:`~gradsync.testing.netns.PAYLOAD_FRACTION`).
6. ``ip link add a type veth`` parses ``a`` as ``address``; every command spells out ``name``.
7. veth carrier comes up asynchronously; ``__enter__`` returns only once every link is up and
   every bridge port forwards.
8. torchrun leaves ``/tmp/torchelastic_*`` folders; ``TMPDIR`` points into the cluster's own temp
   dir, which teardown removes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradsync.errors import LaunchError
from gradsync.testing.netns import SimulatedNetwork
from gradsync.testing.processes import kill_tree, terminate

DESCRIPTION = """\
Run a torch.distributed script with torchrun across simulated nodes (network namespaces joined by
a bandwidth-shaped bridge), print each node's output, tear everything down, and exit non-zero if
any node failed (2 when simulated clusters cannot be built here). Needs root.
"""


@dataclass
class NodeResult:
    """What one node's launcher (torchrun) did: like :class:`subprocess.CompletedProcess`.

    ``killed`` is true when :meth:`SimulatedCluster.launch` had to end the node itself, either
    because the deadline passed (``timed_out``) or because another node had already failed and
    this one did not exit within the grace period (a peer's failure usually leaves the survivors
    blocked in a collective until their process-group timeout).
    """

    node: int
    namespace: str
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool = False
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.killed

    def check_returncode(self) -> None:
        """Raise :class:`~gradsync.errors.LaunchError` unless this node succeeded."""
        if not self.ok:
            raise _launch_error([self])

    def summary(self, tail_chars: int = 2000) -> str:
        """One failure report: exit status plus the tail of stderr (where tracebacks land)."""
        why = "timed out" if self.timed_out else "killed" if self.killed else "exited"
        tail = (self.stderr or self.stdout)[-tail_chars:]
        return f"node {self.node} ({self.namespace}) {why}, returncode {self.returncode}:\n{tail}"


def _launch_error(results: list[NodeResult]) -> LaunchError:
    """The :class:`~gradsync.errors.LaunchError` for a launch; it keeps every node's result as
    ``results`` and its message holds the summary of each failed node."""
    parts = [r.summary() for r in results if not r.ok]
    err = LaunchError("launch failed:\n" + "\n".join(parts))
    err.results = results
    return err


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


class SimulatedCluster(SimulatedNetwork):
    """K nodes as network namespaces on one shaped bridge, running torchrun; a context manager.

    >>> with SimulatedCluster(2, rate_mbit=1000) as cluster:          # doctest: +SKIP
    ...     results = cluster.launch(["train.py", "--steps", "10"], nproc_per_node=1)

    The constructor, layout and teardown are :class:`~gradsync.testing.netns.SimulatedNetwork`'s;
    teardown also ends whatever a launch left running in the namespaces.
    """

    def env(self, i: int) -> dict[str, str]:
        """Environment variables to add for a process on node ``i``.

        ``GLOO_SOCKET_IFNAME`` (and tensorpipe's ``TP_SOCKET_IFNAME``) pins gloo to the node's
        interface; without it gloo picks 127.0.0.1 and rank 0 hangs (pitfall 1).
        ``TMPDIR`` keeps torchrun's ``torchelastic_*`` folders in the cluster's temp dir
        (pitfall 8). ``GRADSYNC_NODE_RANK``/``GRADSYNC_NODE_ADDR`` are informational.
        """
        env = {
            "GLOO_SOCKET_IFNAME": self.ifname,
            "TP_SOCKET_IFNAME": self.ifname,
            "GRADSYNC_NODE_RANK": str(i),
            "GRADSYNC_NODE_ADDR": self.address(i),
        }
        if self._tmpdir is not None:
            node_tmp = os.path.join(self._tmpdir, f"node{i}")
            os.makedirs(node_tmp, exist_ok=True)
            env["TMPDIR"] = node_tmp
        return env

    def torchrun_commands(
        self,
        script_argv: Sequence[str],
        nproc_per_node: int,
        master_port: int = 29500,
        *,
        python: str | None = None,
    ) -> list[list[str]]:
        """One torchrun command per node (to run inside that node), static rendezvous on node 0.

        Static rendezvous (``--master-addr``/``--master-port``) rather than c10d, which needs
        ``is_host`` and ``--local-addr`` flags per node to work across namespaces (pitfall 2).
        Each cluster has private namespaces, so the fixed default port never collides.
        """
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
        if not script_argv:
            raise ValueError("script_argv must name a script")
        py = python or sys.executable
        return [
            [py, "-m", "torch.distributed.run"]
            + ["--nnodes", str(self.num_nodes), "--node-rank", str(i)]
            + ["--nproc-per-node", str(nproc_per_node)]
            + ["--master-addr", self.address(0), "--master-port", str(master_port)]
            + list(script_argv)
            for i in range(self.num_nodes)
        ]

    def elastic_torchrun_commands(
        self,
        script_argv: Sequence[str],
        nproc_per_node: int,
        rdzv_conf: Mapping[str, object] | None = None,
        *,
        max_restarts: int = 3,
        rdzv_port: int = 29400,
    ) -> list[list[str]]:
        """torchrun's elastic mode on every node (``--nnodes 1:K``, c10d rendezvous hosted on
        node 0, 0.2 s monitor interval); start them with :meth:`start`.

        Pitfall 2: each node names its address (``--local-addr``; else it advertises 127.0.0.1)
        and whether it hosts the store (``is_host``; torch guesses from the hostname, the same in
        every namespace). ``rdzv_conf`` adds settings, e.g. ``last_call_timeout`` (seconds).
        """
        conf = [f"{k}={v}" for k, v in (rdzv_conf or {}).items()]
        return [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"1:{self.num_nodes}"]
            + ["--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts)]
            + ["--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-id", "gradsync"]
            + ["--rdzv-endpoint", f"{self.address(0)}:{rdzv_port}", "--local-addr", self.address(i)]
            + ["--rdzv-conf", ",".join([f"is_host={i == 0}", *conf]), *script_argv]
            for i in range(self.num_nodes)
        ]

    def launch(
        self,
        script_argv: Sequence[str],
        nproc_per_node: int = 1,
        timeout_s: float = 300.0,
        extra_env: Mapping[str, str] | None = None,
        *,
        master_port: int = 29500,
        python: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        fail_grace_s: float = 10.0,
        kill_grace_s: float = 5.0,
        check: bool = False,
    ) -> list[NodeResult]:
        """Run ``script_argv`` with torchrun on every node at once; return each node's result.

        The environment is this process's, plus ``PYTHONUNBUFFERED=1`` and ``OMP_NUM_THREADS``
        (cores / total ranks, at least 1; pitfall 3), plus :meth:`env`, plus ``extra_env``,
        which wins. ``python`` picks the interpreter (default: this one) and ``cwd`` the working
        directory of every node.

        Nothing outlives the call: past ``timeout_s`` every node still running is sent SIGTERM
        (torchrun forwards it to its workers), and after ``kill_grace_s`` SIGKILL goes to its
        process group and all its descendants (workers run in their own sessions). Once a node
        has failed, the others get ``fail_grace_s`` to finish before the same happens to them,
        since a survivor usually sits in a collective until its process-group timeout.
        With ``check=True`` a failure raises :class:`~gradsync.errors.LaunchError` instead of
        being returned.
        """
        cmds = self.torchrun_commands(script_argv, nproc_per_node, master_port, python=python)
        procs, out_dir = self.start(cmds, nproc_per_node, extra_env, cwd=cwd)
        starts = [time.monotonic()] * len(procs)
        try:
            ends, timed_out, killed = self._wait_all(procs, timeout_s, fail_grace_s, kill_grace_s)
        finally:
            # Live processes here only after an exception (e.g. Ctrl-C): end them too.
            live = [p for p in procs if p.poll() is None]
            if live:
                terminate(live, 0.0)
        results = []
        for i, (cmd, p) in enumerate(zip(cmds, procs, strict=True)):
            out, err = (_read_text(f"{out_dir}/node{i}.{ext}") for ext in ("out", "err"))
            wall_s = ends[i] - starts[i]
            r = NodeResult(i, self.nodes[i], self.exec_args(i, cmd), p.returncode, out, err, wall_s)
            r.timed_out, r.killed = i in timed_out, i in killed
            results.append(r)
        if check and not all(r.ok for r in results):
            raise _launch_error(results)
        return results

    def start(
        self,
        cmds: Sequence[Sequence[str]],
        nproc_per_node: int = 1,
        extra_env: Mapping[str, str] | None = None,
        *,
        cwd: str | os.PathLike[str] | None = None,
        first_node: int = 0,
    ) -> tuple[list[subprocess.Popen[bytes]], str]:
        """Start ``cmds[i]`` in node ``first_node + i`` with :meth:`launch`'s environment; return
        at once the processes and the folder of their output (``node{i}.out``/``.err``)."""
        out_dir = tempfile.mkdtemp(prefix="launch", dir=self.tmpdir)
        threads = max(1, (os.cpu_count() or 1) // (len(cmds) * nproc_per_node))
        base_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        procs: list[subprocess.Popen[bytes]] = []
        for i, cmd in enumerate(cmds, first_node):  # teardown ends them if a later one fails
            env = {**base_env, **self.env(i), **(extra_env or {})}
            argv = self.exec_args(i, cmd)
            out, err = (open(f"{out_dir}/node{i}.{ext}", "wb") for ext in ("out", "err"))
            with out, err:  # the child keeps copies; it leads a process group, to kill as a whole
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        cwd=cwd,
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        return procs, out_dir

    @staticmethod
    def kill_node(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL a node :meth:`start` started, as a power loss would: its process group and all
        its descendants (workers run in sessions of their own); then reap it."""
        kill_tree(proc)

    def _wait_all(
        self,
        procs: list[subprocess.Popen[bytes]],
        timeout_s: float,
        fail_grace_s: float,
        kill_grace_s: float,
    ) -> tuple[dict[int, float], set[int], set[int]]:
        deadline = time.monotonic() + timeout_s
        ends: dict[int, float] = {}
        timed_out: set[int] = set()
        killed: set[int] = set()
        while len(ends) < len(procs):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i not in ends and p.poll() is not None:
                    ends[i] = now
                    if p.returncode != 0:
                        deadline = min(deadline, now + fail_grace_s)
            live = [i for i in range(len(procs)) if i not in ends]
            if live and now >= deadline:
                failed_peer = any(procs[i].returncode != 0 for i in ends)
                if not failed_peer:
                    timed_out.update(live)
                killed.update(live)
                terminate([procs[i] for i in live], kill_grace_s)
                end = time.monotonic()
                for i in live:
                    ends[i] = end
                break
            time.sleep(0.02)
        return ends, timed_out, killed


# --------------------------------------------------------------- the `gradsync cluster` command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``cluster`` options to ``parser``."""
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=1000.0,
        help="link rate per direction in Mbit/s; 0 leaves links unshaped (default 1000)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="hard limit, seconds")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("script", help="the training script torchrun runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def run(args: argparse.Namespace) -> int:
    """``gradsync cluster [options] SCRIPT [ARGS...]``: run SCRIPT with torchrun across a fresh
    simulated cluster, print each node's output, tear down; the exit code (see DESCRIPTION)."""
    ok, reason = SimulatedCluster.available()
    if not ok:
        print(f"gradsync cluster: {reason}", file=sys.stderr)
        return 2
    rate = args.rate_mbit if args.rate_mbit > 0 else None
    with SimulatedCluster(args.nodes, rate) as cluster:
        results = cluster.launch(
            [args.script, *args.args],
            nproc_per_node=args.nproc_per_node,
            timeout_s=args.timeout,
            master_port=args.master_port,
        )
    for r in results:
        status = "timed out" if r.timed_out else "killed" if r.killed else f"exit {r.returncode}"
        addr = cluster.address(r.node)
        print(f"===== node {r.node} ({r.namespace}, {addr}): {status}, {r.wall_s:.1f} s =====")
        if r.stdout:
            print(r.stdout, end="" if r.stdout.endswith("\n") else "\n")
        if r.stderr:
            print("----- stderr -----")
            print(r.stderr, end="" if r.stderr.endswith("\n") else "\n")
    sys.stdout.flush()
    return 0 if all(r.ok for r in results) else 1
