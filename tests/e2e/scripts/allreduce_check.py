"""Cross-node smoke test run by torchrun on every simulated node (see tests/e2e/test_cluster.py).

All-reduces ``rank + 1`` and checks the sum, then gathers every rank's source address towards the
master so the test can confirm that traffic left through each node's own veth address rather than
loopback (gloo falls back to 127.0.0.1 without GLOO_SOCKET_IFNAME). The short process-group
timeout turns a connection problem into an error within seconds instead of a 30-minute hang.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def source_address(host: str, port: int) -> str:
    """The local address the kernel picks to reach ``host``: the node's own interface address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP connect sends nothing, it only selects a route
        return str(s.getsockname()[0])


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, f"rank {rank}: all_reduce gave {t.item()}, expected {expected}"
    addr = source_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    gathered: list[str | None] = [None] * world
    dist.all_gather_object(gathered, addr)
    line = (
        f"ALLREDUCE_OK rank={rank} world={world} node={os.environ['GROUP_RANK']} addr={addr} "
        f"host={socket.gethostname()} sum={t.item():g} addrs={','.join(map(str, gathered))}\n"
    )
    # One write call: the ranks of a node share stdout, and print() may write the text and the
    # newline separately, so two ranks' lines could interleave.
    os.write(1, line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
