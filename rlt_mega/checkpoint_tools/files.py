"""Files on disk: safetensors directories (one file, or shards with an index, the Hugging Face
layout), JSON documents, per-tensor checksums and atomic directory writes.

Everything that can be wrong with a file is a :class:`CheckpointFormatError` whose message
starts with the file's path and says what is wrong with it, so that a user who sees it knows
which file to look at and what to do.

Sharding is done by ``huggingface_hub.save_torch_state_dict`` (the same splitter as
``PreTrainedModel.save_pretrained``), so the directories we write load in any tool that reads
Hugging Face checkpoints, and directories written by those tools load here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from rlt_mega.checkpoint import OutputKind, check_output, fsync_dir

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
EXPORT_MANIFEST = "rlt_export.json"  # what makes a directory an export (export.py writes it)

# safetensors dtype names (as in a file header) -> torch dtypes
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointFormatError(ValueError):
    """A checkpoint or export directory that cannot be used, with the file and the problem."""


def read_json(path: Path, what: str) -> dict:
    """Reads a JSON object; ``what`` says what the file is for (used in the error messages)."""
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: missing; {what}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({exc}); {what}") from None
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object, got {type(data).__name__}; {what}")
    return data


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes as stored (C order, its own dtype). Independent of how a
    directory is sharded, so two exports of the same weights can be compared tensor by tensor."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------

class SafetensorsDir:
    """Lazy read access to the tensors of a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` + shards. Headers are read on opening (names, shapes,
    dtypes); tensor data only on :meth:`get`. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointFormatError(f"{self.path}: not a directory (expected a directory holding "
                                        f"{WEIGHTS_NAME} or {INDEX_NAME})")
        self._handles: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}  # tensor name -> the file that holds it
        index = self.path / INDEX_NAME
        single = self.path / WEIGHTS_NAME
        if index.is_file():
            weight_map = read_json(index, "the index of a sharded safetensors checkpoint").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointFormatError(f"{index}: no 'weight_map' (tensor name -> shard file)")
            for name, fname in weight_map.items():
                self.file_of[name] = self.path / fname
            for file in sorted(set(self.file_of.values())):
                if not file.is_file():
                    raise CheckpointFormatError(f"{file}: missing; {index.name} lists it as a shard: "
                                                "the checkpoint is incomplete (copy the missing shard)")
                keys = set(self._open(file).keys())
                listed = {n for n, f in self.file_of.items() if f == file}
                if listed - keys:
                    raise CheckpointFormatError(
                        f"{file}: does not hold {sorted(listed - keys)[:5]} although {index.name} says it "
                        "does: the shard and the index come from different saves")
        elif single.is_file():
            for name in self._open(single).keys():
                self.file_of[name] = single
        else:
            found = sorted(p.name for p in self.path.iterdir())
            hint = (" (only PyTorch .bin weights: convert them to safetensors first, e.g. load with "
                    "transformers and save_pretrained(safe_serialization=True))"
                    if any(n.endswith(".bin") for n in found) else "")
            raise CheckpointFormatError(f"{self.path}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found{hint}; "
                                        f"the directory holds {found[:10]}")

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except SafetensorError as exc:
                raise CheckpointFormatError(
                    f"{file}: not a readable safetensors file ({exc}); it is probably truncated or "
                    "damaged (an interrupted copy or download): copy or export it again") from None
            except OSError as exc:
                raise CheckpointFormatError(f"{file}: cannot be read ({exc})") from None
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.file_of[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        st = self._open(self.file_of[name]).get_slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointFormatError(f"{self.file_of[name]}: tensor '{name}' has dtype {st}, "
                                        "which is not supported (quantized checkpoints cannot be loaded)")
        return _ST_DTYPES[st]

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        file = self.file_of[name]
        try:
            t = self._open(file).get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointFormatError(f"{file}: tensor '{name}' cannot be read ({exc}); the file "
                                        "is probably damaged: copy or export it again") from None
        return t.to(device)

    def files(self) -> list[Path]:
        return sorted(set(self.file_of.values()))

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------

def save_safetensors(state_dict: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | str) -> list[str]:
    """Writes ``model.safetensors``, or shards + ``model.safetensors.index.json`` when the
    tensors exceed ``max_shard_size`` (bytes, or a string such as "5GB"); returns the file
    names written. Tensors must not share storage (tied weights are stored once by the caller)."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(state_dict, out_dir, max_shard_size=max_shard_size)
    return sorted(p.name for p in Path(out_dir).glob("model*.safetensors*"))


EXPORT = OutputKind("an export", EXPORT_MANIFEST)  # what `rlt-mega export` and `import` write


@contextmanager
def atomic_directory(out_dir: str | Path, overwrite: bool = False, inputs: Iterable[str | Path] = (),
                     kind: OutputKind = EXPORT) -> Iterator[Path]:
    """Yields a fresh sibling directory to write into; on success it replaces ``out_dir`` by a
    rename, so a crash while writing never leaves a half-written export where a reader looks
    (and never damages an existing one). What may be replaced: checkpoint.check_output."""
    out = Path(out_dir)
    check_output(out, inputs, overwrite, kind=kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for file in (f for f in tmp.rglob("*") if f.is_file()):  # data on disk before the rename makes it visible
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)  # the rename itself on disk


def copy_files(src_dir: Path, names: list[str], out_dir: Path) -> list[str]:
    """Copies those of ``names`` that exist in src_dir; returns the names copied."""
    copied = []
    for name in names:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, out_dir / name)
            copied.append(name)
    return copied
