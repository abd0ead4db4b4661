"""One-file checkpoints that cannot be half-written, cannot lie, and load with ``weights_only``.

- **Atomic**: written to a temp file in the same folder, fsynced, renamed over the target, and
  the folder fsynced: a reader sees the old file or the new one, never a mix.
- **Checked on load**: ``torch.save`` writes a zip archive with a CRC-32 of every record
  (``torch.serialization.set_crc32_options``, on by default and forced on here), but
  ``torch.load`` never verifies them: flipped bytes load as wrong values. :func:`load_checkpoint`
  verifies every record first, and names the file and what is wrong with it.
- **Refused at save time** when the safe loader could not read it back (see ``loadable.py``).
- **No litter**: a save killed mid-write leaves its temp file; the next save to the same path
  removes the temp files of writers on this host that no longer run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import socket
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync.checkpoint.loadable import check_loadable
from gradsync.errors import CheckpointError

_TMP_SUFFIX = ".tmp"


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``obj`` to ``path`` atomically (temp file, fsync, rename), with record checksums.

    Raises :class:`~gradsync.errors.UsageError` naming the key, before writing anything, if
    ``obj`` holds something ``torch.load(path, weights_only=True)`` would refuse (a NumPy array,
    an ``argparse.Namespace``). Call it on one rank only.
    """
    path = Path(path)
    check_loadable(obj, f"save_checkpoint({str(path)!r})")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path)
    tmp = path.parent / f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp = tmp.with_name(tmp.name + _TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f, _crc32_on():
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint onto the CPU with ``weights_only=True``, after verifying it.

    Raises :class:`~gradsync.errors.CheckpointError` naming the file when it is truncated, is
    not a ``torch.save`` archive, or a record's checksum differs (corruption).
    """
    path = Path(path)
    verify_archive(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: holds objects that torch.load(..., weights_only=True) refuses to build "
            f"(it was not written by gradsync.checkpoint.save_checkpoint): {exc}"
        ) from exc


def verify_archive(path: Path) -> None:
    """Check that ``path`` is a whole ``torch.save`` zip archive whose records match their
    CRC-32s; reads the file once (about as fast as the disk or page cache delivers it)."""
    size = path.stat().st_size  # FileNotFoundError names the path already
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as exc:
        raise CheckpointError(
            f"{path}: not a complete torch.save archive ({size} bytes): the file is truncated, "
            f"corrupted, or was written with torch's legacy format ({exc})"
        ) from exc
    except (EOFError, OSError, zlib.error) as exc:  # a record cut short or undecodable
        raise CheckpointError(f"{path}: unreadable ({size} bytes): truncated? ({exc})") from exc
    if bad is not None:
        raise CheckpointError(
            f"{path}: record '{bad}' does not match its CRC-32 checksum: the file is corrupted; "
            "load an older checkpoint"
        )


def remove_stale_temp_files(path: Path) -> list[Path]:
    """Delete temp files of earlier saves to ``path`` whose writer ran on this host and has
    exited (killed mid-write); a temp file of a live writer, or another host's, is kept."""
    removed = []
    host = socket.gethostname()
    for tmp in path.parent.glob(f".{path.name}.*{_TMP_SUFFIX}"):
        parts = tmp.name[len(path.name) + 2 : -len(_TMP_SUFFIX)].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if not _pid_alive(int(parts[1])):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (a no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    serialization: Any = torch.serialization
    if not hasattr(serialization, "set_crc32_options"):  # older torch: its default, on
        yield
        return
    previous = serialization.get_crc32_options()
    serialization.set_crc32_options(True)
    try:
        yield
    finally:
        serialization.set_crc32_options(previous)
