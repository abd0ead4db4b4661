"""Simulated nodes on one Linux machine: network namespaces joined by a bandwidth-shaped bridge.

Why: single-host runs put every rank on loopback, where bandwidth is effectively unlimited, so
they can neither exercise the cross-node code path (interface selection, static rendezvous to a
remote master) nor show what communication costs on a real link. Here each "node" is a network
namespace with one veth interface, all joined through a Linux bridge that lives in its own
namespace, and every link direction is shaped with ``tbf`` to a chosen rate. Nothing is created in
the root namespace and no address exists outside the namespaces, so a network cannot disturb the
host, and two networks (say, parallel test runs) never collide: their names carry the pid plus a
random tag, and each lives on its own private bridge, so they can even reuse the same subnet and
master port.

This module builds and tears down the network (:class:`SimulatedNetwork`);
:class:`gradsync.testing.cluster.SimulatedCluster` adds launching torchrun on its nodes, and its
module docstring lists the pitfalls both handle (the numbers in comments here refer to it).

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and the ``ip`` and ``tc`` tools;
:meth:`SimulatedNetwork.available` says whether this machine qualifies and, if not, why.
"""

from __future__ import annotations

import atexit
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
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any, TypeVar

from gradsync.errors import ClusterError
from gradsync.testing.processes import kill_pids

#: Fraction of a tc rate that is TCP payload at MTU 1500 (1448 payload bytes per 1514-byte
#: frame; pitfall 5). Use it to turn a link rate into the bound a transfer can reach.
PAYLOAD_FRACTION = 1448 / 1514

_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 0.002
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")

SignalHandler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None
_Net = TypeVar("_Net", bound="SimulatedNetwork")


def ip_path() -> str | None:
    """The ``ip`` tool (iproute2), or ``None`` when it is missing."""
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


class SimulatedNetwork:
    """K nodes as network namespaces on one shaped bridge; use as a context manager.

    Layout: node ``i`` is namespace ``{prefix}-n{i}`` holding interface :attr:`ifname` (the same
    name in every node, so one ``GLOO_SOCKET_IFNAME`` fits all) with address :meth:`address`;
    its veth peer ``p{i}`` is a port of bridge ``br0`` in namespace ``{prefix}-br``. With
    ``rate_mbit`` set, both directions of every link are shaped to it (node egress and
    bridge-port egress, i.e. a full-duplex NIC); ``None`` leaves the links unshaped.

    Teardown deletes exactly the namespaces this object created (their veth ends and the bridge
    go with them), ends the processes still inside them and removes the temp dir. It runs on
    ``__exit__`` (also after an exception), on SIGTERM/SIGINT while the network is active (when
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
        """The network's private temp dir (removed at teardown)."""
        if self._tmpdir is None:
            raise RuntimeError("the cluster is not active; use it as a context manager")
        return self._tmpdir

    @property
    def burst_bytes(self) -> int | None:
        """tbf burst per link: max(64 KiB, 2 ms at the rate); a smaller one caps throughput
        (pitfall 4: 64 KiB at 1 Gbit/s reached only 87 %)."""
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
        return [ip_path() or "ip", "netns", "exec", self._nodes[i], *argv]

    @staticmethod
    def available() -> tuple[bool, str]:
        """Whether simulated networks can be built here, and if not, why (the tests skip with this).

        Checks root, the ``ip`` and ``tc`` tools, and actually creates (then deletes) a probe
        namespace holding a veth pair and a bridge, since capabilities, seccomp profiles and
        missing kernel modules only show up when tried.
        """
        if not sys.platform.startswith("linux"):
            return False, f"simulated cluster needs Linux network namespaces (on {sys.platform})"
        if os.geteuid() != 0:
            return False, "simulated cluster needs root (ip netns); not running as root"
        ip = ip_path()
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

    def __enter__(self: _Net) -> _Net:
        with self._lock:
            if self._active:
                raise RuntimeError(f"this {type(self).__name__} is already active")
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
        ip = ip_path()
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
        # router or neighbour solicitations on the shaped links. Pitfall 6: every `link add`
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
        """Pitfall 7: carrier comes up asynchronously; poll until every node interface is UP
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
        ip = ip_path() or "ip"
        # A namespace with processes still inside outlives `ip netns delete` (invisibly), so
        # end those first; they can only be processes run in this network.
        for ns in self._created:
            proc = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
            pids = {int(p) for p in proc.stdout.split() if p.isdigit()} - {os.getpid()}
            kill_pids(pids, signal.SIGKILL)
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
            # Restore only if still ours: a network entered later may have chained onto us.
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
