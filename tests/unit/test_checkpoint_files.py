"""One-file checkpoints: atomic, checksummed, refused at save time when unloadable, no litter."""

from __future__ import annotations

import argparse
import collections
import io
import os
import signal
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from gradsync import CheckpointError, UsageError
from gradsync.checkpoint import load_checkpoint, save_checkpoint
from gradsync.checkpoint.loadable import _LEAVES

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None  # type: ignore[assignment]


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}


def _assert_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_equal(x, y)
    else:
        assert a == b


def test_round_trip_and_plain_torch_load(tmp_path: Path) -> None:
    state = _state()
    torch.serialization.set_crc32_options(False)  # a user's global setting cannot turn them off
    try:
        path = save_checkpoint(state, tmp_path / "ck.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    _assert_equal(load_checkpoint(path), state)
    _assert_equal(torch.load(path, weights_only=True), state)
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]


def test_flipped_bytes_are_named_not_loaded(tmp_path: Path) -> None:
    path = save_checkpoint(_state(), tmp_path / "ck.pt")
    with zipfile.ZipFile(path) as archive:  # flip two bytes inside the first tensor's record
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack(
        "<HH", data[info.header_offset + 26 : info.header_offset + 30]
    )
    at = info.header_offset + 30 + name_len + extra_len + 8  # 8 bytes into the tensor's data
    data[at] ^= 0xFF
    data[at + 1] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{path}: record '.*/data/0' .*CRC-32.*corrupted"):
        load_checkpoint(path)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = save_checkpoint(_state(), tmp_path / "ck.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{path}: not a complete .*truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "bad, key, hint",
    [
        ({"args": argparse.Namespace(lr=1)}, "['args']", "vars"),
        ({"c": collections.defaultdict(int)}, "['c']", "dict"),
        ({"rng": [1, frozenset()]}, "['rng'][1]", "set"),
        ({"rng": {"numpy": np.random.get_state()}} if np else None, "['numpy'][1]", "from_numpy"),
    ],
)
def test_unloadable_objects_are_refused_at_save_time(
    tmp_path: Path, bad: dict | None, key: str, hint: str
) -> None:
    if bad is None:
        pytest.skip("numpy is not installed")
    with pytest.raises(UsageError, match="weights_only=True") as info:
        save_checkpoint(bad, tmp_path / "ck.pt")
    assert key in str(info.value) and hint in str(info.value) and "ck.pt" in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written


def test_the_allowlist_matches_what_weights_only_loads() -> None:
    # Guards loadable.py: every leaf it lets through really loads with weights_only=True.
    leaves = [None, True, 1, 1.5, 1j, "s", b"b", bytearray(b"x"), torch.Size([2])]
    leaves += [torch.float16, torch.device("cpu"), torch.nn.Parameter(torch.ones(1))]
    assert {type(v) for v in leaves} >= set(_LEAVES)
    for value in [*leaves, {1: (2, [3])}, collections.OrderedDict(a=1), {1, 2}]:
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)


def test_a_save_killed_mid_write_leaves_the_old_file_and_its_temp_is_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ck.pt"
    save_checkpoint({"step": 1}, path)
    # A writer killed (SIGKILL) halfway through torch.save: its temp file stays behind.
    code = textwrap.dedent(f"""
        import os, signal, torch
        from gradsync.checkpoint import save_checkpoint
        def half_then_die(obj, f, *a, **k):
            f.write(b"x" * 4096); f.flush(); os.kill(os.getpid(), signal.SIGKILL)
        torch.save = half_then_die
        save_checkpoint({{"step": 2}}, {str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    temps = [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert len(temps) == 1, os.listdir(tmp_path)
    assert load_checkpoint(path) == {"step": 1}  # the old checkpoint is intact
    live = tmp_path / f".ck.pt.{os.uname().nodename}.{os.getpid()}.abcd.tmp"  # a live writer's
    live.write_bytes(b"")
    save_checkpoint({"step": 3}, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.pt", live.name])
    assert load_checkpoint(path) == {"step": 3}
