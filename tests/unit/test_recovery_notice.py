"""A lost peer is recognised by the type of what the step raised, and nothing else ends a step.

Each error is fed to a step's ``__exit__`` as the ``with`` block would hand it over: a lost
peer starts the recovery and is swallowed (the loop redoes the step); anything else goes on up.
The messages of the gloo errors are the ones torch 2.13 raised when a peer was SIGKILLed
([Note: what a lost peer raises] in ``recovery/notice.py``).
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.errors import CollectiveTimeoutError
from gradsync.recovery import Step
from gradsync.recovery.replicas import Replicas

CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:37250. This is typically caused by a remote worker crashing."
)
RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:38611: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)


class _Recovery:
    """What a step reads of its Recovery, and a record of the recoveries it was asked for;
    ``mesh``: a job on a device mesh, where a regroup has ``begun`` or not."""

    def __init__(self, mesh: bool = False, begun: bool = False) -> None:
        self.sampler = SimpleNamespace(epoch=0, step=0)
        self.recovered: list[BaseException] = []
        self.replicas = Replicas(SimpleNamespace(device_mesh=None), None)
        if mesh:
            self.replicas.root = object()  # type: ignore[assignment]  # all lost_inside reads
        self.window, self._begun = 0.05, begun

    def begun(self) -> bool:
        return self._begun

    def _recover(self, step: Step, exc: BaseException) -> None:
        self.recovered.append(exc)


def _ends_the_step(exc: BaseException, recovery: _Recovery | None = None) -> bool:
    """Whether a step whose block raised ``exc`` recovers (``True``) or lets it go on up."""
    recovery = recovery or _Recovery()
    swallowed = Step(recovery, 0).__exit__(type(exc), exc, None)  # type: ignore[arg-type]
    assert swallowed == (recovery.recovered == [exc])
    return swallowed


@pytest.mark.parametrize(
    "exc",
    [
        CollectiveTimeoutError("rank 1 lost a peer while waiting for bucket 0 (step 3)"),
        dist.DistError("a backend's typed error"),
        dist.DistBackendError("NCCL communicator was aborted on rank 1"),
        dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."),
        dist.DistStoreError("wait timeout after 1000ms, keys: /gradsync/recovery/s/begun"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_lost_peer_is_recognised_by_its_type(exc: BaseException) -> None:
    assert _ends_the_step(exc)


def test_a_store_timeout_as_torch_raises_it_is_a_lost_peer() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(milliseconds=10))
    with pytest.raises(dist.DistStoreError) as raised:
        store.get("never set")
    assert _ends_the_step(raised.value)


@pytest.mark.parametrize("text", [CLOSED, RESET], ids=["closed", "reset"])
def test_gloos_words_alone_are_not_a_lost_peer(text: str) -> None:
    # gloo's untyped errors are typed where gradsync waits on the backend (the deadline, and a
    # Checkpointer's write): one that reaches a step untyped came from somewhere else.
    assert not _ends_the_step(RuntimeError(text))


@pytest.mark.parametrize("text", [CLOSED, RESET], ids=["closed", "reset"])
def test_a_checkpoint_write_that_lost_a_peer_is_typed(text: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    error = Checkpointer._typed(SimpleNamespace(rank=1), RuntimeError(text), step=7)  # type: ignore[arg-type]
    assert isinstance(error, CollectiveTimeoutError) and "rank 1" in str(error)
    assert "step 7" in str(error) and isinstance(error.__cause__, RuntimeError)
    assert _ends_the_step(error)
    full = OSError(28, "No space left on device")
    assert Checkpointer._typed(SimpleNamespace(rank=1), full, step=7) is full  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"),
        RuntimeError("Connection refused"),  # words alone, not gloo's transport: not a peer
        RuntimeError("the gloo backend does not support this reduction op"),
        gradsync.NonFiniteGradientError(f"rank 0's gradient is NaN ({CLOSED})"),
        gradsync.ProtocolError("a backward without a forward through the wrapper"),
        gradsync.UsageError("timeout must be positive"),
        ValueError("bad value"),
        KeyboardInterrupt(),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:24]}",
)
def test_anything_else_goes_on_up(exc: BaseException) -> None:
    assert not _ends_the_step(exc)


@pytest.mark.parametrize("begun", [True, False])
def test_on_a_mesh_a_plain_runtime_error_is_a_lost_peer_once_a_regroup_has_begun(
    begun: bool,
) -> None:
    """A tensor-parallel collective (torch's, not gradsync's) ends with gloo's plain
    ``RuntimeError``: on a mesh it is a lost peer if a survivor begins to regroup within the
    window; other types never are."""
    assert _ends_the_step(RuntimeError(CLOSED), _Recovery(mesh=True, begun=begun)) is begun
    assert not _ends_the_step(ValueError("bad value"), _Recovery(mesh=True, begun=True))


def test_a_completed_step_recovers_nothing() -> None:
    recovery = _Recovery()
    completed: list[Step] = []
    recovery._completed = completed.append  # type: ignore[attr-defined]
    step = Step(recovery, 0)  # type: ignore[arg-type]
    assert step.__exit__(None, None, None) is False
    assert completed == [step] and step.completed and not recovery.recovered
