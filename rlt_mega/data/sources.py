"""Raw rows of a source as a ``datasets`` stream (an ``IterableDataset``): what ``rlt-mega
preprocess`` tokenizes and what ``data.streaming`` trains on. Nothing is downloaded or cached
in full: a hub dataset is read as it arrives, local files line by line.

The rows are those of the in-memory path (``datasets._raw``) for the same source: jsonl files
are read as raw lines by the ``text`` builder (invalid UTF-8 replaced, blank lines dropped) and
parsed by the same tolerant extractor, ``.txt`` files give one document per line. So the
documents that ``preprocess`` writes are exactly those that ``pack`` would have tokenized.
A directory is read as the in-memory path reads it (its train/test file) or, when it has none,
as a set of shards: every ``.parquet`` (or ``.jsonl``, ``.json``, ``.txt``) file below it, in
name order, one shard each (a downloaded hub dataset's layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import datasets

from rlt_mega.config import DataConfig
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.datasets import BAD, DataError, _apply, _SPLIT_FILES, text_of

_LINE_FORMATS = (".jsonl", ".json", ".txt")
_FORMATS = (".parquet",) + _LINE_FORMATS


def _split_file(path: Path, split: str) -> Optional[Path]:
    for stem in _SPLIT_FILES[split]:
        for ext in _LINE_FORMATS:
            if (path / f"{stem}{ext}").is_file():
                return path / f"{stem}{ext}"
    return None


def local_files(source: str, split: str = "train") -> Optional[list[Path]]:
    """The files a local source names (None: not a local path); all of one format."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        found = _split_file(path, split)
        if found is not None:
            files = [found]
        else:
            for ext in _FORMATS:  # shards: the first format present, every file of it
                files = sorted(p for p in path.rglob(f"*{ext}") if p.is_file())
                if files:
                    break
            else:
                raise DataError(f"data directory {path} has no {split} file and no data shards (looked for "
                                f"{', '.join(s + '.jsonl' for s in _SPLIT_FILES[split])} and *.parquet, *.jsonl, "
                                "*.json, *.txt files)")
    elif source.startswith((".", "/", "~")) or source.endswith(_FORMATS):
        raise DataError(f"data file {source} does not exist")
    else:
        return None
    if files[0].suffix not in _FORMATS:
        raise DataError(f"data file {files[0]}: expected a .jsonl, .json, .txt or .parquet file")
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        raise DataError(f"data file {empty[0]} is empty: check the path")
    return files


def stream_rows(source: str, cfg: DataConfig, split: str = "train",
                hub_split: Optional[str] = None) -> tuple[datasets.IterableDataset, Optional[int]]:
    """The raw rows of ``source`` as a stream, and the bytes it holds when that is known (local
    line files: the progress bar's total). ``split`` picks a local directory's file; a hub dataset
    reads ``hub_split`` (default: train, or test for the eval split)."""
    if source == "generated":
        g = cfg.generated
        num, seed = (g.num_train, g.seed) if split == "train" else (g.num_eval, g.seed + 1_000_003)
        rows = datasets.Dataset.from_list(generate_problems(num, seed, g.min_ops, g.max_ops, g.max_value))
        return rows.to_iterable_dataset(), None
    files = local_files(source, split)
    if files is not None:
        names = [str(f) for f in files]
        try:
            if files[0].suffix == ".parquet":
                return datasets.load_dataset("parquet", data_files=names, split="train", streaming=True), None
            rows = datasets.load_dataset("text", data_files=names, split="train", streaming=True,
                                         encoding_errors="replace")
        except Exception as exc:  # the builder wraps whatever went wrong
            cause = exc.__cause__ or exc
            raise DataError(f"cannot read {names[0]}: {type(cause).__name__}: {cause}") from None
        total = sum(f.stat().st_size for f in files)
        if files[0].suffix == ".txt":
            return rows, total
        rows = rows.rename_column("text", "_line")
        return rows.filter(lambda line: bool(line.strip()), input_columns="_line"), total  # blank lines: not data
    hub_split = hub_split or ("train" if split == "train" else "test")
    try:
        return datasets.load_dataset(source, cfg.hub_config, split=hub_split, streaming=True), None
    except Exception as exc:  # network, unknown name, missing config: say which source failed
        raise DataError(f"cannot stream '{source}' (config {cfg.hub_config}, split {hub_split}) from the hub: "
                        f"{exc}. Check the name, data.hub_config and the network, or use local files") from None


def texts_of(batch: dict, text_field: Optional[str]) -> tuple[list[str], list[str]]:
    """A batch of raw rows (a dict of columns) -> the good documents' texts, and the reasons the
    others are skipped (the in-memory path's extractor and checks)."""
    out = _apply(text_of(text_field), ["text"])(batch)
    texts = [t for t, bad in zip(out["text"], out[BAD]) if not bad]
    return texts, [bad for bad in out[BAD] if bad]


def row_bytes(batch: dict) -> int:
    """The size of a batch of raw rows, for the progress bar (UTF-8 bytes of its string fields,
    plus one newline per line)."""
    num = len(next(iter(batch.values()))) if batch else 0
    size = sum(len(v.encode("utf-8", "surrogatepass")) for column in batch.values() for v in column
               if isinstance(v, str))
    return size + (num if "_line" in batch or list(batch) == ["text"] else 0)
