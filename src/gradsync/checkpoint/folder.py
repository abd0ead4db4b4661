"""The checkpoint folder on disk: one sub-folder per step, committed by a rename, with checksums.

    runs/gpt/checkpoints/
      step_00000040/            committed: DCP's files plus manifest.json
        .metadata  __0_0.distcp  __1_0.distcp  manifest.json
      .step_00000050.partial/   a save in progress, or one killed mid-write
      .gradsync-owner           locked by the job using the folder (owner.py)

Every rank writes its DCP file into ``.step_N.partial``; then the ranks hash what was written,
rank 0 writes ``manifest.json`` (each file's size and SHA-256, the step, the world size) and
renames the folder to ``step_N``. The rename is the commit: a folder named ``step_N`` is whole,
and a killed save leaves only a ``.partial`` folder, which the next job removes. On load the
manifest is checked against the files, so a flipped byte, a truncated or missing file is named
instead of being loaded. Nothing here is collective; ``training.py`` decides who calls what.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.checkpoint.files import fsync_dir

MANIFEST = "manifest.json"
FORMAT = "gradsync.checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^\.step_(\d+)\.partial$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Entry:
    """One committed checkpoint folder."""

    step: int
    path: Path


class CheckpointFolder:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def partial_dir(self, step: int) -> Path:
        return self.root / f".step_{step:08d}.partial"

    def committed(self) -> list[Entry]:
        """Committed checkpoints, newest first (whether they verify is checked on load)."""
        if not self.root.is_dir():
            return []
        found = [
            Entry(int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        ]
        return sorted(found, key=lambda e: e.step, reverse=True)

    def remove_partials(self) -> list[Path]:
        """Delete the folders of saves that never committed (killed mid-write)."""
        if not self.root.is_dir():
            return []
        partial = [p for p in self.root.iterdir() if _PARTIAL_DIR.match(p.name)]
        for p in partial:
            shutil.rmtree(p, ignore_errors=True)
        return partial

    def commit(self, partial: Path, step: int, world_size: int, files: dict[str, Any]) -> Path:
        """Write the manifest into ``partial``, make it durable, rename it to ``step_N``."""
        manifest = {"format": FORMAT, "step": step, "world_size": world_size, "files": files}
        tmp = partial / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / MANIFEST)
        fsync_dir(partial)
        target = self.step_dir(step)
        if target.exists():  # saved again after resuming from an older step: keep the old one
            n = sum(1 for _ in self.root.glob(f"{target.name}.replaced-*"))
            os.replace(target, target.with_name(f"{target.name}.replaced-{n}"))
        os.replace(partial, target)
        fsync_dir(self.root)
        return target

    def rotate(self, keep: int | None) -> list[Path]:
        """Delete committed checkpoints beyond the newest ``keep`` (``None``: keep all), and
        earlier saves of a step that was saved again after resuming from an older one."""
        if keep is None:
            return []
        old = [e.path for e in self.committed()[keep:]]
        old += list(self.root.glob("step_*.replaced-*"))  # superseded by a newer commit
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        return old


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the committed checkpoint ``path``; raises ``ValueError`` saying why not."""
    file = path / MANIFEST
    if not file.exists():
        raise ValueError(f"{file} is missing: the save did not finish")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, OSError) as exc:
        raise ValueError(f"{file} is unreadable or corrupted ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file} is not a {FORMAT} manifest")
    return manifest


def digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of one file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def my_share(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files this rank hashes or verifies: every rank takes its share, in parallel."""
    return [n for i, n in enumerate(sorted(names)) if i % world_size == rank]


def check_files(path: Path, expected: dict[str, Any], names: list[str]) -> list[str]:
    """Problems of the files ``names`` of checkpoint ``path`` against the manifest."""
    problems = []
    for name in names:
        file, want = path / name, expected[name]
        if not file.exists():
            problems.append(f"{file}: missing (a shard of this checkpoint was deleted or lost)")
            continue
        size = file.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{file}: {size} bytes, the manifest says {want['bytes']}: truncated?")
        elif digest(file)["sha256"] != want["sha256"]:
            problems.append(f"{file}: SHA-256 differs from the manifest: the file is corrupted")
    return problems
