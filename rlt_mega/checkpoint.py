"""Training checkpoints: atomic, verifiable, resumable bit for bit.

Layout under ``checkpoint.dir``::

    step_00000100/          one complete checkpoint
        model.safetensors   weights (single process; distributed engines write their shards)
        engine.pt           optimizer + LR schedule state
        trainer.pt          step, data position, counters, every RNG state
        config.yaml         the run's config
        manifest.json       size and sha256 of every file above, written last
    latest                  the name of the newest complete checkpoint, replaced atomically

A save writes into ``.tmp-step_N``, fsyncs every file, writes the manifest, renames the
directory (atomic on POSIX) and only then replaces ``latest``. A crash at any point leaves
the previous checkpoint and pointer intact; a directory without a valid manifest is never
loaded, and ``resolve`` skips a damaged one with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from rlt_mega.log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the path and the reason."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def verify(path: Path) -> dict:
    """Checks a checkpoint directory against its manifest; returns the manifest."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (an interrupted save?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt") from None
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != meta["size"]:
            raise CheckpointError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, "
                                  f"the manifest says {meta['size']} (truncated?)")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} does not match its checksum (corrupt)")
    return manifest


class CheckpointManager:
    """Atomic saves, the ``latest`` pointer, keeping the last K, and finding what to resume.

    Distributed engines call ``save`` on every rank with their ``rank`` and a ``barrier``:
    every rank writes its files into the same temporary directory, rank 0 finalises.
    """

    def __init__(self, root: str | Path, keep: int = 3, rank: int = 0,
                 barrier: Callable[[], None] = lambda: None) -> None:
        self.root, self.keep, self.rank, self.barrier = Path(root), keep, rank, barrier

    def save(self, step: int, write: Callable[[Path], None], meta: Optional[dict] = None) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # the remains of an earlier interrupted save of this step
            tmp.mkdir()
        self.barrier()
        write(tmp)
        self.barrier()
        if self.rank == 0:
            files = {}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                _fsync_file(f)
                files[str(f.relative_to(tmp))] = {"size": f.stat().st_size, "sha256": _sha256(f)}
            manifest = {"step": step, "time": time.time(), "files": files, **(meta or {})}
            _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _write_atomic(self.root / "latest", final.name)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        complete = self.list()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        """Checkpoint directories by step, oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(dirs, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Optional[Path]:
        """The newest checkpoint that verifies; damaged or partial ones are skipped with a warning."""
        candidates = self.list()
        pointer = self.root / "latest"
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if named in candidates:  # the pointer first, then anything newer or older
                candidates.remove(named)
                candidates.append(named)
                candidates.sort(key=lambda p: int(_STEP_DIR.match(p.name).group(1)))
        for path in reversed(candidates):
            try:
                verify(path)
                return path
            except CheckpointError as exc:
                log.warning("skipping damaged checkpoint: %s", exc)
        return None

    def resolve(self, resume: Optional[str]) -> Optional[Path]:
        """``train.resume``: None (fresh start), "auto" (latest valid, or fresh), or a path."""
        if resume is None:
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        verify(path)
        return path


# ---------------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
