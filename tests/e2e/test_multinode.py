"""The main job across simulated nodes: ``examples/train_gpt.py`` on 2x1 and 2x2 ranks.

Each node is a network namespace (``gradsync.testing.cluster``), so gloo really crosses a (shaped)
veth link and torchrun really does a static rendezvous with a remote master, as on two
machines. The job checks itself: rank 0 retrains in one process and prints PASS only if the
parameters agree (float64, tolerance 1e-9), and exits 1 otherwise. Needs root; elsewhere the
module skips with the reason ``SimulatedCluster.available()`` gives.

Six steps of a global batch of 8 sequences keep a case at ~10-15 s on an idle 2-vCPU machine
(torch import dominates: ~3.3 s for 2x1, ~5.9 s for 2x2; the default batch of 32 makes rank 0's
float64 one-process replay alone take ~5 s) while every step still all-reduces every bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gradsync.testing.cluster import NodeResult, SimulatedCluster

AVAILABLE, REASON = SimulatedCluster.available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(120)]

TRAIN_GPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimulatedCluster]:
    with SimulatedCluster(2, rate_mbit=1000) as c:
        yield c


def describe(results: list[NodeResult]) -> str:
    return "\n".join(f"{r.summary()}\nstdout:\n{r.stdout[-2000:]}" for r in results)


@pytest.mark.parametrize("nproc_per_node", [1, 2], ids=["2x1", "2x2"])
def test_train_gpt_across_nodes_matches_one_process(
    cluster: SimulatedCluster, nproc_per_node: int, tmp_path: Path
) -> None:
    world = cluster.num_nodes * nproc_per_node
    argv = [str(TRAIN_GPT), "--max-steps", "6", "--global-batch", "8", "--eval-sequences", "64"]
    argv += ["--out", str(tmp_path / "run")]
    argv += ["--timeout-s", "60"]  # a broken link fails in a minute, not torch's 30
    # The master port differs per case: the previous launch's port may still be in TIME_WAIT.
    results = cluster.launch(
        argv, nproc_per_node=nproc_per_node, timeout_s=100, master_port=29500 + nproc_per_node
    )
    assert all(r.ok for r in results), describe(results)
    node0 = results[0].stdout
    assert f"gradsync: {world} rank(s)" in node0, describe(results)
    # Ranks on two hosts: the default is "scaled" (its 1 MiB floor for this small model).
    assert "(cap 1 MiB)" in node0, describe(results)
    assert "PASS" in node0 and f"N={world} ranks" in node0, describe(results)
    assert (tmp_path / "run" / "checkpoint.pt").exists()  # written by global rank 0, on node 0
