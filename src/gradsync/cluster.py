"""A simulated multi-node cluster on one Linux machine, for multi-node tests and benchmarks.

Why: single-host runs put every rank on loopback, where bandwidth is effectively unlimited, so
they can neither exercise the cross-node code path (interface selection, static rendezvous to a
remote master) nor show what communication costs on a real link. Here each "node" is a network
namespace with one veth interface, all joined through a Linux bridge that lives in its own
namespace, and every link direction is shaped with ``tbf`` to a chosen rate. Nothing is created in
the root namespace and no address exists outside the namespaces, so a cluster cannot disturb the
host, and two clusters (say, parallel test runs) never collide: their names carry the pid plus a
random tag, and each lives on its own private bridge, so they can even reuse the same subnet and
master port.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and the ``ip`` and ``tc`` tools;
:meth:`SimulatedCluster.available` says whether this machine qualifies and, if not, why.

Pitfalls handled here (numbered as in ``shared/notes/simulated-cluster.md``):

1. gloo binds to the address the hostname resolves to (127.0.0.1) unless ``GLOO_SOCKET_IFNAME``
   names the node's interface; :meth:`SimulatedCluster.env` sets it, and :meth:`launch` always
   runs under a hard timeout that kills what it started.
2. c10d rendezvous needs extra flags on every node; :meth:`torchrun_commands` uses the static
   rendezvous (``--master-addr``/``--master-port``), which works across namespaces as is.
3. torchrun exports ``OMP_NUM_THREADS`` only when ``--nproc-per-node > 1``; :meth:`launch`
   always exports it (cores / total ranks unless the caller chose a value).
4. A too-small tbf burst caps throughput; the burst is max(64 KiB, 2 ms worth of bytes).
5. tc rates count frame bytes: TCP payload is ~95.6 % of the rate (:data:`PAYLOAD_FRACTION`).
7. ``ip link add a type veth`` parses ``a`` as ``address``; every command spells out ``name``.
8. veth carrier comes up asynchronously; ``__enter__`` returns only once every link is up and
   every bridge port forwards.
9. torchrun leaves ``/tmp/torchelastic_*`` folders; ``TMPDIR`` points into the cluster's own temp
   dir, which teardown removes.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

#: Fraction of a tc rate that is TCP payload at MTU 1500 (1448 payload bytes per 1514-byte
#: frame; notes, pitfall 5). Use it to turn a link rate into the bound a transfer can reach.
PAYLOAD_FRACTION = 1448 / 1514

_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 0.002
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

SignalHandler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None


class ClusterError(RuntimeError):
    """Setting up the simulated cluster failed (the message carries the failing command)."""


class LaunchError(RuntimeError):
    """One or more nodes of a :meth:`SimulatedCluster.launch` failed or timed out."""

    def __init__(self, results: list[NodeResult]) -> None:
        self.results = results
        parts = [r.summary() for r in results if not r.ok]
        super().__init__("launch failed:\n" + "\n".join(parts))


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
        """Raise :class:`LaunchError` unless this node succeeded."""
        if not self.ok:
            raise LaunchError([self])

    def summary(self, tail_chars: int = 2000) -> str:
        """One failure report: exit status plus the tail of stderr (where tracebacks land)."""
        why = "timed out" if self.timed_out else "killed" if self.killed else "exited"
        tail = (self.stderr or self.stdout)[-tail_chars:]
        return f"node {self.node} ({self.namespace}) {why}, returncode {self.returncode}:\n{tail}"


def _ip_path() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None
    )


def _tc_path() -> str | None:
    return shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc", "/usr/bin/tc") if os.access(p, os.X_OK)), None
    )


def _run(argv: Sequence[str]) -> str:
    """Run one setup command; a failure becomes a :class:`ClusterError` naming the command."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _batch(tool: str, ns: str, lines: list[str]) -> None:
    """Run ``lines`` as one ``ip``/``tc`` batch inside namespace ``ns`` (stops at an error)."""
    proc = subprocess.run(
        [tool, "-n", ns, "-batch", "-"],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise ClusterError(
            f"{os.path.basename(tool)} -n {ns} -batch failed ({proc.returncode}): "
            f"{proc.stderr.strip()}\nbatch was:\n" + "\n".join(lines)
        )


def _children_of(pids: set[int]) -> set[int]:
    """All live descendants of ``pids``, found through ``/proc`` parent links.

    torchrun starts its workers in new sessions (``start_new_session=True``), so killing the
    launcher's process group misses them; walking the process tree finds exactly those.
    """
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may contain spaces.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parent_of[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier and c not in found}
        found |= frontier
    return found


def _kill(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _killpg(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class SimulatedCluster:
    """K nodes as network namespaces on one shaped bridge; use as a context manager.

    >>> with SimulatedCluster(2, rate_mbit=1000) as cluster:          # doctest: +SKIP
    ...     results = cluster.launch(["train.py", "--steps", "10"], nproc_per_node=1)

    Layout: node ``i`` is namespace ``{prefix}-n{i}`` holding interface :attr:`ifname` (the same
    name in every node, so one ``GLOO_SOCKET_IFNAME`` fits all) with address :meth:`address`;
    its veth peer ``p{i}`` is a port of bridge ``br0`` in namespace ``{prefix}-br``. With
    ``rate_mbit`` set, both directions of every link are shaped to it (node egress and
    bridge-port egress, i.e. a full-duplex NIC); ``None`` leaves the links unshaped.

    Teardown deletes exactly the namespaces this object created (their veth ends and the bridge
    go with them), ends the processes still inside them and removes the temp dir. It runs on
    ``__exit__`` (also after an exception), on SIGTERM/SIGINT while the cluster is active (when
    entered from the main thread) and at interpreter exit.
    """

    def __init__(
        self,
        num_nodes: int,
        rate_mbit: float | None = 1000,
        *,
        prefix: str | None = None,
        subnet: str = "10.213.0.0/24",
        ifname: str = "gs0",
        up_timeout_s: float = 10.0,
    ) -> None:
        net = ipaddress.ip_network(subnet)
        if not isinstance(net, ipaddress.IPv4Network):
            raise ValueError(f"subnet must be IPv4, got {subnet!r}")
        if num_nodes < 1 or num_nodes > net.num_addresses - 2:
            raise ValueError(f"num_nodes must be in 1..{net.num_addresses - 2}, got {num_nodes}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive or None, got {rate_mbit}")
        if prefix is None:
            prefix = f"gs{os.getpid()}x{secrets.token_hex(3)}"
        if not prefix or not set(prefix) <= _NAME_CHARS or len(prefix) > 64:
            raise ValueError(f"prefix must be 1-64 chars of [A-Za-z0-9_.-], got {prefix!r}")
        if not ifname or len(ifname) > 15 or not set(ifname) <= _NAME_CHARS:
            raise ValueError(f"ifname must be 1-15 chars of [A-Za-z0-9_.-], got {ifname!r}")
        self.num_nodes = num_nodes
        self.rate_mbit = rate_mbit
        self.prefix = prefix
        self.up_timeout_s = up_timeout_s
        self._ifname = ifname
        self._net = net
        self._hosts = [str(net.network_address + 1 + i) for i in range(num_nodes)]
        self._nodes = [f"{prefix}-n{i}" for i in range(num_nodes)]
        self._bridge_ns = f"{prefix}-br"
        self._created: list[str] = []  # namespaces this object made, in creation order
        self._tmpdir: str | None = None
        self._active = False
        self._lock = threading.RLock()
        self._prev_handlers: dict[int, SignalHandler] = {}
        self._launches = 0

    # ----------------------------------------------------------------------------- queries

    @property
    def nodes(self) -> list[str]:
        """Namespace name of each node, node 0 first."""
        return list(self._nodes)

    @property
    def bridge_namespace(self) -> str:
        return self._bridge_ns

    @property
    def ifname(self) -> str:
        """The node interface's name, identical in every node."""
        return self._ifname

    @property
    def tmpdir(self) -> str:
        """The cluster's private temp dir (removed at teardown)."""
        if self._tmpdir is None:
            raise RuntimeError("the cluster is not active; use it as a context manager")
        return self._tmpdir

    @property
    def burst_bytes(self) -> int | None:
        """tbf burst per link: max(64 KiB, 2 ms at the rate); a smaller one caps throughput
        (notes, pitfall 4: 64 KiB at 1 Gbit/s reached only 87 %)."""
        if self.rate_mbit is None:
            return None
        return max(_MIN_BURST_BYTES, int(self.rate_mbit * 1e6 / 8 * _BURST_SECONDS))

    @property
    def payload_bytes_per_s(self) -> float | None:
        """TCP payload rate a link can carry: the tc rate times :data:`PAYLOAD_FRACTION`."""
        if self.rate_mbit is None:
            return None
        return self.rate_mbit * 1e6 / 8 * PAYLOAD_FRACTION

    def address(self, i: int) -> str:
        """IPv4 address of node ``i`` (exists only inside that node's namespace)."""
        return self._hosts[i]

    def exec_args(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside node ``i``'s namespace."""
        return [_ip_path() or "ip", "netns", "exec", self._nodes[i], *argv]

    def env(self, i: int) -> dict[str, str]:
        """Environment variables to add for a process on node ``i``.

        ``GLOO_SOCKET_IFNAME`` (and tensorpipe's ``TP_SOCKET_IFNAME``) pins gloo to the node's
        interface; without it gloo picks 127.0.0.1 and rank 0 hangs (notes, pitfall 1).
        ``TMPDIR`` keeps torchrun's ``torchelastic_*`` folders in the cluster's temp dir
        (pitfall 9). ``GRADSYNC_NODE_RANK``/``GRADSYNC_NODE_ADDR`` are informational.
        """
        env = {
            "GLOO_SOCKET_IFNAME": self._ifname,
            "TP_SOCKET_IFNAME": self._ifname,
            "GRADSYNC_NODE_RANK": str(i),
            "GRADSYNC_NODE_ADDR": self._hosts[i],
        }
        if self._tmpdir is not None:
            node_tmp = os.path.join(self._tmpdir, f"node{i}")
            os.makedirs(node_tmp, exist_ok=True)
            env["TMPDIR"] = node_tmp
        return env

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether clusters can be built here, and if not, why (the tests skip with this).

        Checks root, the ``ip`` and ``tc`` tools, and actually creates (then deletes) a probe
        namespace holding a veth pair and a bridge, since capabilities, seccomp profiles and
        missing kernel modules only show up when tried.
        """
        if not sys.platform.startswith("linux"):
            return False, f"simulated cluster needs Linux network namespaces (on {sys.platform})"
        if os.geteuid() != 0:
            return False, "simulated cluster needs root (ip netns); not running as root"
        ip = _ip_path()
        if ip is None:
            return False, "simulated cluster needs the `ip` tool (iproute2), not found"
        if _tc_path() is None:
            return False, "simulated cluster needs the `tc` tool (iproute2), not found"
        probe = f"gsprobe{os.getpid()}x{secrets.token_hex(3)}"
        try:
            _run([ip, "netns", "add", probe])
        except (ClusterError, OSError, subprocess.SubprocessError) as exc:
            return False, f"cannot create a network namespace: {exc}"
        try:
            _run(
                [ip, "-n", probe, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"]
            )
            _run([ip, "-n", probe, "link", "add", "name", "b0", "type", "bridge"])
        except (ClusterError, OSError, subprocess.SubprocessError) as exc:
            return False, f"cannot create veth/bridge devices in a namespace: {exc}"
        finally:
            subprocess.run([ip, "netns", "delete", probe], capture_output=True, timeout=30)
        return True, "ok"

    # ------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> SimulatedCluster:
        with self._lock:
            if self._active:
                raise RuntimeError("this SimulatedCluster is already active")
            self._active = True
            self._install_teardown_hooks()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Tear down (idempotent): end processes left in our namespaces, delete exactly the
        namespaces this object created, remove the temp dir, unhook signals and atexit."""
        with self._lock:
            try:
                self._teardown()
            finally:
                self._remove_teardown_hooks()
                self._active = False

    def _setup(self) -> None:
        ip = _ip_path()
        tc = _tc_path()
        if ip is None or (tc is None and self.rate_mbit is not None):
            raise ClusterError("the `ip` and `tc` tools (iproute2) are required")
        self._tmpdir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
        br = self._bridge_ns
        for ns in [br, *self._nodes]:
            # Recorded only once created: a name that already existed is someone else's.
            _run([ip, "netns", "add", ns])
            self._created.append(ns)
        shape = None
        if self.rate_mbit is not None:
            shape = f"root tbf rate {int(self.rate_mbit * 1e6)}bit burst {self.burst_bytes}"
            shape += " latency 50ms"
        # One `ip -batch` (and `tc -batch`) per namespace keeps setup at a few processes per
        # node. IPv6 stays off (addrgenmode none): no link-local address for gloo to pick and no
        # router or neighbour solicitations on the shaped links. Pitfall 7: every `link add`
        # spells out `name` (a bare `a` would parse as `address`).
        bridge = ["link add name br0 type bridge", "link set dev br0 addrgenmode none"]
        for i, ns in enumerate(self._nodes):
            bridge.append(f"link add name p{i} type veth peer name {self._ifname} netns {ns}")
            bridge.append(f"link set dev p{i} master br0 addrgenmode none")
        _batch(ip, br, bridge)
        if shape is not None and tc is not None:
            _batch(tc, br, [f"qdisc add dev p{i} {shape}" for i in range(self.num_nodes)])
        plen = self._net.prefixlen
        for i, ns in enumerate(self._nodes):
            dev = self._ifname
            if shape is not None and tc is not None:
                _batch(tc, ns, [f"qdisc add dev {dev} {shape}"])
            node = [f"link set dev {dev} addrgenmode none"]
            node += [f"addr add {self._hosts[i]}/{plen} dev {dev}"]
            node += ["link set dev lo up", f"link set dev {dev} up"]
            _batch(ip, ns, node)
        up = ["link set dev lo up", "link set dev br0 up"]
        up += [f"link set dev p{i} up" for i in range(self.num_nodes)]
        _batch(ip, br, up)
        self._wait_until_up(ip)

    def _wait_until_up(self, ip: str) -> None:
        """Pitfall 8: carrier comes up asynchronously; poll until every node interface is UP
        and every bridge port forwards, so a launch right after ``__enter__`` cannot race it."""
        deadline = time.monotonic() + self.up_timeout_s
        pending = "links"
        while time.monotonic() < deadline:
            ports = json.loads(_run([ip, "-j", "-d", "-n", self._bridge_ns, "link", "show"]))
            state = {
                p["ifname"]: (
                    p.get("operstate"),
                    p.get("linkinfo", {}).get("info_slave_data", {}).get("state"),
                )
                for p in ports
            }
            pending = next(
                (
                    f"bridge port p{i} is {state.get(f'p{i}')}"
                    for i in range(self.num_nodes)
                    if state.get(f"p{i}") != ("UP", "forwarding")
                ),
                "",
            )
            for ns in self._nodes:
                if pending:
                    break
                show = [ip, "-j", "-n", ns, "link", "show", "dev", self._ifname]
                (link,) = json.loads(_run(show))
                if link.get("operstate") != "UP":
                    pending = f"{ns}/{self._ifname} is {link.get('operstate')}"
            if not pending:
                return
            time.sleep(0.01)
        raise ClusterError(f"links not up after {self.up_timeout_s} s: {pending}")

    def _teardown(self) -> None:
        ip = _ip_path() or "ip"
        # A namespace with processes still inside outlives `ip netns delete` (invisibly), so
        # end those first; they can only be processes run in this cluster.
        for ns in self._created:
            proc = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
            pids = {int(p) for p in proc.stdout.split() if p.isdigit()} - {os.getpid()}
            _kill(pids, signal.SIGKILL)
        while self._created:
            ns = self._created.pop()
            subprocess.run([ip, "netns", "delete", ns], capture_output=True, timeout=30)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _install_teardown_hooks(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _remove_teardown_hooks(self) -> None:
        atexit.unregister(self.close)
        for sig, prev in self._prev_handlers.items():
            # Restore only if still ours: a cluster entered later may have chained onto us.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Tear down, then behave as the previous handler would have (default SIGTERM kills
        the process, default SIGINT raises KeyboardInterrupt)."""
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.close()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # --------------------------------------------------------------------------- launch

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
            + ["--master-addr", self._hosts[0], "--master-port", str(master_port)]
            + list(script_argv)
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
        (cores / total ranks, at least 1; torchrun sets it only for ``nproc_per_node > 1`` and
        oversubscribed threads slowed a 2x2 step by 31 %, pitfall 3), plus :meth:`env`, plus
        ``extra_env``, which wins. ``python`` picks the interpreter (default: this one) and
        ``cwd`` the working directory of every node.

        Nothing outlives the call: past ``timeout_s`` every node still running is sent SIGTERM
        (torchrun forwards it to its workers), and after ``kill_grace_s`` SIGKILL goes to its
        process group and all its descendants (workers run in their own sessions). Once a node
        has failed, the others get ``fail_grace_s`` to finish before the same happens to them,
        since a survivor usually sits in a collective until its process-group timeout.
        With ``check=True`` a failure raises :class:`LaunchError` instead of being returned.
        """
        if self._tmpdir is None:
            raise RuntimeError("the cluster is not active; use it as a context manager")
        cmds = self.torchrun_commands(script_argv, nproc_per_node, master_port, python=python)
        self._launches += 1
        out_dir = os.path.join(self._tmpdir, f"launch{self._launches}")
        os.makedirs(out_dir)
        threads = max(1, (os.cpu_count() or 1) // (self.num_nodes * nproc_per_node))
        procs: list[subprocess.Popen[bytes]] = []
        starts: list[float] = []
        with contextlib.ExitStack() as files:
            try:
                for i, cmd in enumerate(cmds):
                    env = dict(os.environ)
                    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)})
                    env.update(self.env(i))
                    env.update(extra_env or {})
                    out = files.enter_context(open(os.path.join(out_dir, f"node{i}.out"), "wb"))
                    err = files.enter_context(open(os.path.join(out_dir, f"node{i}.err"), "wb"))
                    starts.append(time.monotonic())
                    procs.append(
                        subprocess.Popen(
                            self.exec_args(i, cmd),
                            env=env,
                            cwd=cwd,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=err,
                            start_new_session=True,  # own process group, to kill as a whole
                        )
                    )
                ends, timed_out, killed = self._wait_all(
                    procs, timeout_s, fail_grace_s, kill_grace_s
                )
            finally:
                # Live processes here only after an exception (e.g. Ctrl-C): end them too.
                live = [p for p in procs if p.poll() is None]
                if live:
                    self._terminate(live, 0.0)
        results = []
        for i, (cmd, p) in enumerate(zip(cmds, procs, strict=True)):
            results.append(
                NodeResult(
                    node=i,
                    namespace=self._nodes[i],
                    args=self.exec_args(i, cmd),
                    returncode=p.returncode,
                    stdout=_read_text(os.path.join(out_dir, f"node{i}.out")),
                    stderr=_read_text(os.path.join(out_dir, f"node{i}.err")),
                    wall_s=ends[i] - starts[i],
                    timed_out=i in timed_out,
                    killed=i in killed,
                )
            )
        if check and not all(r.ok for r in results):
            raise LaunchError(results)
        return results

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
                self._terminate([procs[i] for i in live], kill_grace_s)
                end = time.monotonic()
                for i in live:
                    ends[i] = end
                break
            time.sleep(0.02)
        return ends, timed_out, killed

    @staticmethod
    def _terminate(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
        """SIGTERM each launcher's group, then SIGKILL group and descendants after ``grace_s``."""
        tree = _children_of({p.pid for p in procs})
        for p in procs:
            _killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
        tree |= _children_of({p.pid for p in procs} | tree)
        for p in procs:
            _killpg(p.pid, signal.SIGKILL)
        _kill(tree, signal.SIGKILL)
        for p in procs:
            p.wait()


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradsync.cluster [options] SCRIPT [ARGS...]``: run SCRIPT with torchrun
    across a fresh simulated cluster, print each node's output, tear down, and exit non-zero
    if any node failed (2 when clusters are unavailable here)."""
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.cluster",
        description="Run a torch.distributed script across simulated nodes (network namespaces "
        "joined by a bandwidth-shaped bridge). Needs root.",
    )
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
    ns = parser.parse_args(argv)
    ok, reason = SimulatedCluster.available()
    if not ok:
        print(f"gradsync.cluster: {reason}", file=sys.stderr)
        return 2
    rate = ns.rate_mbit if ns.rate_mbit > 0 else None
    with SimulatedCluster(ns.nodes, rate) as cluster:
        results = cluster.launch(
            [ns.script, *ns.args],
            nproc_per_node=ns.nproc_per_node,
            timeout_s=ns.timeout,
            master_port=ns.master_port,
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


if __name__ == "__main__":
    sys.exit(main())
