"""Training checkpoints: atomic, verifiable, resumable bit for bit.

Layout under ``checkpoint.dir``::

    step_00000100/          one complete checkpoint
        model.safetensors   weights (single process; distributed engines write their shards)
        engine.pt           optimizer + LR schedule state
        trainer.pt          the trainer loop's state (steps, the last checkpoint's step) and the
                            job's (counters, data position)
        rng_rank{r}.pt      every rank's RNG state
        job_rank{r}.pt      every rank's own job state (GRPO: its staleness queue, train/async_grpo.py)
        config.yaml         the run's config
        manifest.json       size and sha256 of every file above, written last
    latest                  the name of the newest complete checkpoint, replaced atomically

A save writes into ``.tmp-step_N``, fsyncs every file, writes the manifest, renames the
directory (atomic on POSIX) and only then replaces ``latest``. A crash at any point leaves
the previous checkpoint and pointer intact (tests/e2e/test_crash_resume.py kills a real run
between every two of these phases). A ``.tmp-*`` directory or a step directory without a
valid manifest is never loaded: resuming skips it with a warning and takes the checkpoint
``latest`` names, or else the newest one that verifies; the next save removes the leftovers.
Pruning keeps the newest ``keep`` complete checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
import yaml
from safetensors import safe_open

from rlt_mega.config import Config, to_dict
from rlt_mega.log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"  # a save in progress (or interrupted): never loaded
OLD_PREFIX = ".old-"  # a checkpoint being replaced by a re-save of its step
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


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new entry in ``path`` durable."""
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
    fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def verify(path: Path) -> dict:
    """Checks a checkpoint directory against its manifest; returns the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (an interrupted save?)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {str(name): (int(meta["size"]), str(meta["sha256"])) for name, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt") from None
    for name, (size, sha256) in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, "
                                  f"the manifest says {size} (truncated?)")
        if _sha256(f) != sha256:
            raise CheckpointError(f"checkpoint {path}: file {name} does not match its checksum (corrupt)")
    return manifest


def disk_full(exc: BaseException, path: Path) -> bool:
    """Whether a failed write into ``path`` ran out of space: ENOSPC (or EDQUOT), or torch.save's
    zip writer, which reports a short write as a RuntimeError ("unexpected pos" from
    inline_container, or "basic_ios::clear: iostream error" when the end of the file does not
    fit), on a device that is now full."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    try:
        short_write = "inline_container" in str(exc) or "iostream error" in str(exc)
        return short_write and shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


def require_writable(path: str | Path, key: str) -> None:
    """Creates ``path`` and writes a file in it, so that a directory a run cannot write is an
    error naming ``key`` at start-up, not at the first save after hours of steps."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"{key}={path} is not writable ({exc.strerror}): choose a directory this run "
                              f"can write") from None


@dataclass(frozen=True)
class OutputKind:
    """What a command writes with ``--overwrite``: ``name`` for the messages ("an export");
    ``marker``: the file only that command writes, by which an earlier output is known. With
    ``suffixes`` the output is a prefix whose files are ``prefix + suffix`` (an indexed
    dataset's .bin/.idx/.json) and ``marker`` is the suffix of the file that marks it."""
    name: str
    marker: str
    suffixes: tuple[str, ...] = ()


def check_output(out: str | Path, inputs: Iterable[str | Path] = (), overwrite: bool = False, *,
                 kind: OutputKind) -> None:
    """The one guard of every command that writes a directory (or a prefix's files) and may
    replace it with ``--overwrite`` (export, import, preprocess, tokenizer training, sweeps),
    called before any work is spent: the output must not be, contain or lie inside one of its
    ``inputs`` (replacing it would delete what it is read from); an existing output is replaced
    only with ``overwrite``, and only when it is an earlier output of the same kind (it holds
    ``kind.marker``) or an empty directory. Anything else is refused with one line, never deleted."""
    out = Path(out)
    targets = [Path(f"{out}{suffix}") for suffix in kind.suffixes] or [out]
    noun = "output file" if kind.suffixes else "output directory"
    for target in targets:
        here = target.resolve()
        for given in inputs:
            source = Path(given).resolve()
            relation = ("is" if here == source else "contains" if source.is_relative_to(here)
                        else "lies inside" if here.is_relative_to(source) else None)
            if relation:
                raise FileExistsError(f"{target}: the {noun} {relation} the input {given}; writing it would "
                                      f"destroy what is read: choose an {noun} outside the input")
    if kind.suffixes:
        existing = [t for t in targets if t.exists()]
        if not existing:
            return
        if not overwrite:
            raise FileExistsError(f"{' and '.join(map(str, existing))} exist: pass --overwrite to replace "
                                  f"{kind.name}, or choose another output")
        if any(t.is_dir() for t in existing) or not Path(f"{out}{kind.marker}").is_file():
            raise FileExistsError(f"{existing[0]}: exists and is not part of {kind.name} (no {out}{kind.marker}): "
                                  f"--overwrite replaces only {kind.name}; choose another output (or remove "
                                  "the file yourself)")
        return
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out}: exists and is not empty; choose another output directory "
                                  f"or pass --overwrite to replace {kind.name} there")
        if not (out / kind.marker).is_file():
            raise FileExistsError(f"{out}: exists and is not {kind.name} (no {kind.marker}): --overwrite "
                                  f"replaces only {kind.name} or an empty directory; choose another output "
                                  "directory (or remove this one yourself)")


def rank_files_layout(path: Path) -> Optional[dict]:
    """The layout whose ranks wrote a checkpoint's per-rank files (job_rank<r>.pt, rng_rank<r>.pt):
    the manifest's ``rank_files_layout`` (a reshard carries them as they are, checkpoint_tools/
    reshard_ckpt.py), else its ``layout``; None without either (a bare engine save)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
        return meta.get("rank_files_layout") or meta.get("layout")
    except (ValueError, AttributeError):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt") from None


def seal(directory: Path, step: int, meta: Optional[dict]) -> None:
    """fsync every file, then the manifest (size + sha256 of each), then the directory: a
    manifest on disk implies the files it lists are on disk."""
    files = {}
    for f in sorted(p for p in directory.rglob("*") if p.is_file()):
        _fsync_file(f)
        files[str(f.relative_to(directory))] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"step": step, "time": time.time(), "files": files, **(meta or {})}
    _write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1))
    fsync_dir(directory)


class CheckpointManager:
    """Atomic saves, the ``latest`` pointer, keeping the last K, and finding what to resume.

    Distributed engines call ``save`` on every rank with their ``rank`` and a ``barrier``:
    every rank writes its files into the same temporary directory, rank 0 finalises.

    A save goes through four phases, each a method so that the crash tests can stop a real
    process between any two of them (tests/crash_driver.py): ``write`` (every rank's files
    into ``.tmp-step_N``), ``_seal`` (fsync, manifest), ``_publish`` (rename to ``step_N``),
    ``_point`` (the ``latest`` pointer), then ``_prune``.
    """

    def __init__(self, root: str | Path, keep: int = 3, rank: int = 0,
                 barrier: Callable[[], None] = lambda: None) -> None:
        self.root, self.keep, self.rank, self.barrier = Path(root), keep, rank, barrier

    def save(self, step: int, write: Callable[[Path], None], meta: Optional[dict] = None) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()  # the remains of interrupted saves (no process writes them now)
            tmp.mkdir()
        self.barrier()
        try:
            write(tmp)
            self.barrier()
            if self.rank == 0:
                self._seal(tmp, step, meta)
                self._publish(tmp, final)
                self._point(final)
                self._prune(step)
        except (OSError, RuntimeError) as exc:
            if not disk_full(exc, tmp):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # gives the space back; the last checkpoint is untouched
            raise CheckpointError(f"no space left on device while saving checkpoint {final} (checkpoint.dir "
                                  f"{self.root}); the last complete checkpoint is intact: free space there, lower "
                                  "checkpoint.keep, or set checkpoint.dir to a larger disk, and resume") from None
        self.barrier()
        return final

    def _seal(self, tmp: Path, step: int, meta: Optional[dict]) -> None:
        seal(tmp, step, meta)

    def _publish(self, tmp: Path, final: Path) -> None:
        """Renames the sealed directory into place. Re-saving a step (after resuming from an
        older checkpoint) first renames the old one aside, so that at every instant the step
        exists complete under one of the two names, never half-deleted."""
        if final.exists():
            aside = self.root / f"{OLD_PREFIX}{final.name}"
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(final, aside)
            os.replace(tmp, final)
            fsync_dir(self.root)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, final)
            fsync_dir(self.root)

    def _point(self, final: Path) -> None:
        _write_atomic(self.root / LATEST, final.name)

    def _prune(self, step: int) -> None:
        """Keeps the newest ``keep`` checkpoints up to ``step``. Directories without a manifest
        (damaged) do not count as kept; directories of later steps belong to a run that was
        resumed from an older checkpoint and are left for the user (and replaced when this run
        reaches their step)."""
        kept = 0
        for path in reversed(self.list()):
            number = _step_of(path)
            if number > step:
                continue
            if kept < self.keep and (path / MANIFEST).is_file():
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        for path in sorted(self.root.iterdir()):
            if not (path.is_dir() and path.name.startswith((TMP_PREFIX, OLD_PREFIX))):
                continue
            original = self.root / path.name[len(OLD_PREFIX):]
            if path.name.startswith(OLD_PREFIX) and not original.exists():
                # stopped between the two renames of _publish: the old copy is complete
                log.warning("restoring %s from %s (a re-save of it was interrupted)", original, path)
                os.replace(path, original)
                continue
            log.warning("removing %s, left by an interrupted checkpoint save", path)
            shutil.rmtree(path, ignore_errors=True)

    def list(self) -> list[Path]:
        """Checkpoint directories by step, oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(dirs, key=_step_of)

    def latest(self) -> Optional[Path]:
        """The checkpoint ``latest`` names if it verifies, else the newest one that does;
        damaged or partial ones are skipped with a warning. None when there is no checkpoint
        at all; a CheckpointError when there are some but none is usable (starting afresh
        over them would silently throw the run away)."""
        for path in self.root.glob(f"{TMP_PREFIX}*"):
            log.warning("ignoring %s: a checkpoint save that was interrupted before it completed", path)
        candidates = list(reversed(self.list()))  # newest first
        pointer = self.root / LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text(errors="replace").strip()
            if named in candidates:
                candidates.remove(named)
                candidates.insert(0, named)
        reasons = []
        for path in candidates:
            try:
                verify(path)
                return path
            except CheckpointError as exc:
                log.warning("skipping damaged checkpoint: %s", exc)
                reasons.append(str(exc))
        if reasons:
            raise CheckpointError(f"no usable checkpoint in {self.root}: {'; '.join(reasons)}. Move the damaged "
                                  "directories away to start afresh, or set train.resume to a checkpoint elsewhere")
        return None

    def resolve(self, resume: Optional[str]) -> Optional[Path]:
        """``train.resume``: None (fresh start), "auto" (latest valid, or fresh), or a path:
        a step directory, or a checkpoint root (its latest valid checkpoint)."""
        if resume is None:
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"train.resume={resume}: no such checkpoint directory")
        if not (path / MANIFEST).is_file() and CheckpointManager(path).list():
            return CheckpointManager(path).latest()  # it holds step directories: a path, or it raises
        verify(path)
        return path


# ---------------------------------------------------------------------------- loading
# A checkpoint may come from anyone (a download, a shared directory), and a pickle can run any
# code when it is read. So every .pt file rlt_mega reads is unpickled with torch's weights-only
# unpickler, which builds tensors, plain containers and numbers, and beyond them only the types
# listed here: what our own files and DeepSpeed's shards hold. Anything else is refused before it
# is built (UntrustedCheckpointError). docs/checkpoints.md says what is trusted.
def _numpy_globals() -> list:
    """numpy's RNG state in rng_rank*.pt: (name, uint32 array, pos, has_gauss, gauss)."""
    reconstruct = np.zeros(1).__reduce__()[0]  # numpy's _reconstruct (numpy.core or numpy._core by version)
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _deepspeed_globals() -> list:
    """The classes DeepSpeed pickles into its ZeRO optimizer shards (plain records: an enum, the
    loss scaler's settings, a fragment's offset and size)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def trusted_globals(deepspeed: bool = False, allow: Sequence = ()) -> list:
    """The allow-list: numpy's RNG state, DeepSpeed's records with ``deepspeed``, and the plain
    record types ``allow`` a caller names for a file of its own (a job's job_rank*.pt)."""
    return _numpy_globals() + (_deepspeed_globals() if deepspeed else []) + list(allow)


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file that holds a type outside the allow-list: it is not unpickled."""


# What torch's weights-only unpickler says when a file asks for something outside the list
# (a GLOBAL, or an object to create, call or build); any other unpickling error is damage.
_REFUSED = (re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)"),
            re.compile(r"unrecognized function (.+?)(?: which belongs|$)", re.M),
            re.compile(r"add_safe_globals`,? but got (.+)$", re.M))


def refused_type(message: str) -> Optional[str]:
    """The type or function a weights-only unpickling error refused, if that is the error."""
    for pattern in _REFUSED:
        found = pattern.search(message)
        if found:
            return found.group(1).strip()
    return None


@contextlib.contextmanager
def safe_unpickling(deepspeed: bool = False, allow: Sequence = ()):
    """Every torch.load inside the block, ours or a library's (DeepSpeed's load_checkpoint,
    ds_to_universal, zero_to_fp32 pass weights_only=False themselves), runs weights-only with
    the allow-list: torch reads TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call and it overrides an
    explicit weights_only=False. Worker processes the block starts inherit both."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(trusted_globals(deepspeed, allow)):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def untrusted(path: Path, kind: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"checkpoint file {path} holds {kind}, which no rlt_mega or DeepSpeed checkpoint contains: refused, not "
        "unpickled (a pickle can run code); use checkpoints only from sources you trust (docs/checkpoints.md)")


def load_torch(path: Path, map_location=None, mmap: bool = False, deepspeed: bool = False, allow: Sequence = ()):
    """torch.load of a checkpoint file, weights-only with the allow-list above (plus ``allow``);
    a one-line CheckpointError for a missing, damaged or untrusted file."""
    try:
        with safe_unpickling(deepspeed, allow):
            return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # unpickling raises anything from a damaged file
        kind = refused_type(str(exc))
        if kind is not None:
            raise untrusted(path, kind) from None
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: {exc})") from None


def check_weights(path: Path, model: torch.nn.Module) -> None:
    """Raises a one-line CheckpointError naming the first parameters whose names or shapes
    in the safetensors file ``path`` differ from ``model``'s. Tied parameters are stored once
    (safetensors' save_model), so a name missing from the file is fine when it shares its
    tensor with one that is there."""
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as exc:  # SafetensorError, OSError: a damaged header
        raise CheckpointError(f"checkpoint file {path} cannot be read as safetensors ({exc})") from None
    state = model.state_dict()
    names_of: dict[int, set] = {}
    for name, t in state.items():
        names_of.setdefault(t.data_ptr(), set()).add(name)
    shapes = [f"{n} is {saved[n]} in the checkpoint, {list(t.shape)} in this model"
              for n, t in state.items() if n in saved and saved[n] != list(t.shape)]
    missing = [n for n, t in state.items() if n not in saved and not (names_of[t.data_ptr()] & saved.keys())]
    unexpected = [n for n in saved if n not in state]
    problems = shapes + [f"missing {n}" for n in missing] + [f"unexpected {n}" for n in unexpected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {path.parent}: its weights do not fit this model (another model "
                              f"shape?): {'; '.join(problems[:3])}{more}")


# Model settings that change parameter shapes or what a parameter means: a checkpoint that
# differs in one of them cannot be resumed. Any other difference is reported as a warning.
SHAPE_KEYS = tuple(f"model.{k}" for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                          "ffn_hidden", "share_weights", "tie_embeddings", "qkv_bias"))
# Settings a resumed run is expected to change: no warning.
FREE_KEYS = ("train.resume", "train.stop_after", "train.init_from", "train.device", "train.eval_every",
             "train.eval_batches", "train.log_every", "checkpoint.", "logging.")


def _flatten(data: Any, prefix: str = "") -> dict:
    if not isinstance(data, dict):
        return {prefix: data}
    out = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_resume_config(path: Path, cfg: Config) -> None:
    """Compares the config a checkpoint was written with to this run's: a CheckpointError
    naming the model settings that differ in shape, a warning for other differences."""
    saved_file = Path(path) / "config.yaml"
    if not saved_file.is_file():
        return  # written by a tool that stores no config; check_weights still compares shapes
    try:
        saved = _flatten(yaml.safe_load(saved_file.read_text()))
    except yaml.YAMLError as exc:
        raise CheckpointError(f"checkpoint {path}: config.yaml cannot be read ({exc.__class__.__name__})") from None
    current = _flatten(to_dict(cfg))
    differ = [k for k in current if k in saved and saved[k] != current[k]]
    shape = [f"{k}={saved[k]!r} there, {current[k]!r} here" for k in differ if k in SHAPE_KEYS]
    if shape:
        raise CheckpointError(f"checkpoint {path} was written for another model: {'; '.join(shape)}. Resume with "
                              "the checkpoint's model settings, or start a new run in another checkpoint.dir")
    other = [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in differ
             if k not in SHAPE_KEYS and not k.startswith(FREE_KEYS)]
    if other:
        log.warning("resuming from %s with settings that differ from the checkpoint's: %s", path, "; ".join(other))


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
