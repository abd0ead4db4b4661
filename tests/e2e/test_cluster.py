"""End-to-end tests of the simulated multi-node cluster (``gradsync.testing.cluster``).

They need root and ``ip netns``; elsewhere the whole module skips with the reason
``SimulatedCluster.available()`` gives. Every launch runs under a hard timeout, so a networking
mistake fails the test instead of hanging the suite (pitfall 1 in ``gradsync.testing.cluster``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradsync.testing.cluster import SimulatedCluster

AVAILABLE, REASON = SimulatedCluster.available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(120)]

SCRIPTS = Path(__file__).parent / "scripts"


def netns_list() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def netns_pids(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return out.stdout.split()


def describe(results: list) -> str:
    return "\n".join(f"{r.summary()}\nstdout:\n{r.stdout[-2000:]}" for r in results)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimulatedCluster]:
    with SimulatedCluster(2, rate_mbit=1000) as c:
        yield c


def test_setup_and_teardown_leave_nothing_behind() -> None:
    before = netns_list()
    with SimulatedCluster(3, rate_mbit=500) as a, SimulatedCluster(2, rate_mbit=None) as b:
        ours = set(a.nodes) | {a.bridge_namespace} | set(b.nodes) | {b.bridge_namespace}
        assert len(ours) == 7, "two clusters side by side must never share a namespace name"
        assert netns_list() == before | ours
        for i, ns in enumerate(a.nodes):
            show = ["ip", "-n", ns, "-o", "-4", "addr", "show", "dev", a.ifname]
            addr = subprocess.run(show, capture_output=True, text=True, check=True).stdout
            assert f"inet {a.address(i)}/24" in addr
            qdisc = ["tc", "-n", ns, "qdisc", "show", "dev", a.ifname]
            shaped = subprocess.run(qdisc, capture_output=True, text=True, check=True).stdout
            assert "tbf" in shaped and "rate 500Mbit" in shaped
            assert a.burst_bytes == 125_000  # 2 ms at 500 Mbit/s beats the 64 KiB floor
        bridge_q = ["tc", "-n", a.bridge_namespace, "qdisc", "show", "dev", "p0"]
        assert "tbf" in subprocess.run(bridge_q, capture_output=True, text=True).stdout
        # Nothing was assigned in the root namespace.
        root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert a.address(0) not in root
        tmpdirs = [a.tmpdir, b.tmpdir]
    assert netns_list() == before
    assert not any(os.path.exists(d) for d in tmpdirs)


def test_teardown_after_exception_inside_with() -> None:
    before = netns_list()
    with pytest.raises(RuntimeError, match="boom"), SimulatedCluster(2) as c:
        assert set(c.nodes) <= netns_list()
        raise RuntimeError("boom")
    assert netns_list() == before


def test_existing_namespace_is_never_deleted() -> None:
    """A name clash aborts set-up, and teardown removes only what this object created."""
    prefix = f"gstest{os.getpid()}"
    foreign = f"{prefix}-n1"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        before = netns_list()
        with pytest.raises(Exception, match="File exists"), SimulatedCluster(2, prefix=prefix):
            pass
        assert netns_list() == before and foreign in before
    finally:
        subprocess.run(["ip", "netns", "delete", foreign], check=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_on_signal(sig: signal.Signals) -> None:
    """A killed driver still removes its namespaces (signal handler while active)."""
    # A shell that starts a job in the background (`make test &`) makes it ignore SIGINT, and
    # the driver would inherit that; the user this test stands for pressed Ctrl-C in a terminal.
    driver = textwrap.dedent(
        """
        import signal, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from gradsync.testing.cluster import SimulatedCluster
        with SimulatedCluster(2) as c:
            print(" ".join(c.nodes + [c.bridge_namespace]), flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        if len(names) != 3:
            proc.kill()
            pytest.fail(f"driver did not start: {proc.communicate()[1]}")
        assert set(names) <= netns_list()
        proc.send_signal(sig)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    # None of the driver's namespaces is left (its nodes and bridge share one prefix). Only
    # its own are looked at: another test process may be making namespaces meanwhile.
    prefix = names[-1].removesuffix("-br") + "-"
    assert not [ns for ns in netns_list() if ns.startswith(prefix)], netns_list()


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_allreduce_across_nodes(cluster: SimulatedCluster, nproc: int) -> None:
    results = cluster.launch([str(SCRIPTS / "allreduce_check.py")], nproc, timeout_s=90)
    assert all(r.ok for r in results), describe(results)
    world = cluster.num_nodes * nproc
    expected_addrs = ",".join(cluster.address(i // nproc) for i in range(world))
    for r in results:
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ALLREDUCE_OK")]
        assert len(lines) == nproc, r.stdout
        for line in lines:
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            assert fields["world"] == str(world)
            assert fields["sum"] == f"{world * (world + 1) // 2}"
            assert fields["node"] == str(r.node)
            assert fields["addr"] == cluster.address(r.node)  # left through its own veth
            assert fields["addrs"] == expected_addrs
        # TMPDIR took torchrun's torchelastic_* folder into the cluster's temp dir (pitfall 8).
        assert any(p.startswith("torchelastic_") for p in os.listdir(cluster.env(r.node)["TMPDIR"]))


def test_busbw_script_reports_a_number(cluster: SimulatedCluster) -> None:
    argv = [str(SCRIPTS / "busbw.py"), "--size-mb", "16", "--iters", "3", "--warmup", "1"]
    results = cluster.launch(argv, 1, timeout_s=90)
    assert all(r.ok for r in results), describe(results)
    match = re.search(r"BUSBW .*busbw_MBps=([0-9.]+)", results[0].stdout)
    assert match, results[0].stdout
    assert float(match.group(1)) > 0  # performance is measured by benchmarks/, not asserted


HANG_SCRIPT = """
import os, sys, time
print("started node", os.environ["GROUP_RANK"], flush=True)
if os.environ["GROUP_RANK"] == "1" and sys.argv[1] == "fail":
    sys.exit(3)
time.sleep(600)
"""


def test_failed_node_does_not_leave_peers_hanging(
    cluster: SimulatedCluster, tmp_path: Path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    t0 = time.monotonic()
    results = cluster.launch(
        [str(script), "fail"], 1, timeout_s=60, fail_grace_s=1.0, kill_grace_s=2.0
    )
    assert time.monotonic() - t0 < 40
    node0, node1 = results
    assert node1.returncode != 0 and not node1.killed
    assert node0.killed and not node0.timed_out and not node0.ok
    assert all(netns_pids(ns) == [] for ns in cluster.nodes), "a worker survived the launch"


def test_timeout_kills_every_process(cluster: SimulatedCluster, tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    t0 = time.monotonic()
    results = cluster.launch([str(script), "hang"], 1, timeout_s=5, kill_grace_s=2.0)
    assert time.monotonic() - t0 < 15
    assert all(r.timed_out and r.killed and not r.ok for r in results)
    assert all(netns_pids(ns) == [] for ns in cluster.nodes), "a worker survived the timeout"
