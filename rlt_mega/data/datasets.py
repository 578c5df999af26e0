"""Datasets through HF ``datasets``: pretraining text (packed into fixed-length windows),
prompt/answer pairs (SFT, GRPO, eval), from generated problems, local files or the hub. This is
the in-memory path, for small local data; a large corpus is tokenized once by ``rlt-mega
preprocess`` and memory-mapped (``data/indexed.py``), or streamed (``data/streaming.py``).

Bad data never stops a run: malformed JSON lines, records missing a field, empty texts and
invalid UTF-8 are skipped and counted (``DataStats``), and the counts are logged. An empty
dataset is an error before training starts.

Local jsonl files are read with the ``text`` builder (one raw line per row, invalid UTF-8
replaced) and parsed in a ``map``, because the ``json`` builder aborts on the first bad line.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import datasets
import numpy as np
import torch

from rlt_mega.config import DataConfig, state_task
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.data.windows import TokenWindows, token_dtype
from rlt_mega.log import get_logger

log = get_logger(__name__)
datasets.disable_progress_bars()

_SPLIT_FILES = {"train": ("train",), "eval": ("test", "validation", "valid", "eval", "dev")}
BAD = "_bad"  # column holding the reason a record is skipped ("" for a good record)


class DataError(ValueError):
    """A dataset that cannot be used at all (missing, empty), with what to do about it."""


@dataclass
class DataStats:
    """Skipped records by reason, per source; logged and shown at the end of a run."""

    skipped: Counter = field(default_factory=Counter)

    def add(self, source: str, reasons: Counter) -> None:
        for reason, n in reasons.items():
            self.skipped[f"{source}: {reason}"] += n

    @property
    def total(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        if not self.skipped:
            return "no records skipped"
        return "skipped records: " + "; ".join(f"{k} x{v}" for k, v in sorted(self.skipped.items()))


# ------------------------------------------------------------------------------ extractors
Extract = Callable[[dict], dict]


class BadRecord(Exception):
    """Raised by an extractor for a record to skip; the message is the counted reason."""


def text_of(text_field: Optional[str]) -> Extract:
    """Pretraining text: ``text_field``, else ``text``, else GSM8K's question + answer."""

    def extract(rec: dict) -> dict:
        if text_field is not None:
            text = rec.get(text_field)
            if text is None:
                raise BadRecord(f"missing field '{text_field}'")
        elif "text" in rec:
            text = rec["text"]
        elif "question" in rec and "answer" in rec:
            text = f"{rec['question']}\n{rec['answer']}"
        else:
            raise BadRecord("missing field 'text' (or 'question' and 'answer')")
        if not isinstance(text, str):
            raise BadRecord("text field is not a string")
        return {"text": text}

    return extract


def pair_of(prompt_field: str = "question", answer_field: str = "answer") -> Extract:
    def extract(rec: dict) -> dict:
        for name in (prompt_field, answer_field):
            if not isinstance(rec.get(name), str):
                raise BadRecord(f"missing field '{name}'")
        return {"question": rec[prompt_field], "answer": rec[answer_field]}

    return extract


TURNS = "turns"  # a prompt record's scripted turns (rollout/env/chat.py), a list of strings


def prompt_record(prompt_field: str = "question", answer_field: str = "answer") -> Extract:
    """A GRPO / eval prompt record: the pair (``pair_of``) and its scripted turns, the record's
    ``turns`` (a list of non-empty strings; [] when absent), which reach the environment of the
    prompt's rows (grpo.env, e.g. ``chat``) with the rest of the record. Columns: ``PROMPT_COLUMNS``."""
    pair = pair_of(prompt_field, answer_field)

    def extract(rec: dict) -> dict:
        out = pair(rec)
        turns = rec.get(TURNS, [])
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise BadRecord(f"field '{TURNS}' is not a list of strings")
        return {**out, TURNS: list(turns)}

    return extract


PROMPT_COLUMNS = ["question", "answer", TURNS]
_EMPTY = {TURNS: []}  # a skipped record's placeholder in a list column
_FEATURES = {TURNS: datasets.Sequence(datasets.Value("string"))}  # the other columns are strings


def _check_record(out: dict) -> str:
    values = [v for v in out.values() if isinstance(v, str)]
    values += [t for v in out.values() if isinstance(v, list) for t in v]
    if any("\ufffd" in v for v in values):
        return "invalid utf-8"
    if not all(_encodable(v) for v in values):  # a JSON "\ud800" escape: Arrow cannot store it
        return "invalid unicode (lone surrogate)"
    if any(not v.strip() for v in values):
        return "empty text"
    return ""


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _apply(extract: Extract, columns: list[str]):
    """A batched map function: record dicts -> extracted columns + the skip reason."""

    def fn(batch: dict) -> dict:
        n = len(next(iter(batch.values())))
        out = {c: [] for c in columns + [BAD]}
        for i in range(n):
            rec = {k: v[i] for k, v in batch.items()}
            if "_line" in rec:  # a raw jsonl line
                line = rec["_line"]
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                    rec = None
                if not isinstance(rec, dict):
                    _append(out, columns, "invalid utf-8" if "\ufffd" in line else "malformed json line")
                    continue
            try:
                fields = extract(rec)
                reason = _check_record(fields)
            except BadRecord as exc:
                fields, reason = {}, str(exc)
            _append(out, columns, reason, fields)
        return out

    return fn


def _append(out: dict, columns: list[str], reason: str, fields: Optional[dict] = None) -> None:
    for c in columns:
        out[c].append((fields or {}).get(c, "") if not reason else _EMPTY.get(c, ""))
    out[BAD].append(reason)


# ------------------------------------------------------------------------------ sources
def _local_file(source: str, split: str) -> Optional[Path]:
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for stem in _SPLIT_FILES[split]:
            for ext in (".jsonl", ".json", ".txt"):
                if (path / f"{stem}{ext}").is_file():
                    return path / f"{stem}{ext}"
        raise DataError(f"data directory {path} has no {split} file (looked for "
                        f"{', '.join(s + '.jsonl' for s in _SPLIT_FILES[split])})")
    return None


def _has_split(source: str, split: str) -> bool:
    """Whether ``source`` is a directory holding a file of ``split``."""
    path = Path(source).expanduser()
    return path.is_dir() and any((path / f"{stem}{ext}").is_file() for stem in _SPLIT_FILES[split]
                                 for ext in (".jsonl", ".json", ".txt"))


def _raw(source: str, split: str, cfg: DataConfig) -> datasets.Dataset:
    """Rows of one source before extraction: generated problems, a local file, or the hub."""
    if state_task(source) is not None:
        raise DataError(f"data.train={source} is a state-tracking task of token sequences, not text or "
                        "prompt/answer pairs: train it with `rlt-mega pretrain`")
    if source == "generated":
        g = cfg.generated
        num, seed = (g.num_train, g.seed) if split == "train" else (g.num_eval, g.seed + 1_000_003)
        return datasets.Dataset.from_list(generate_problems(num, seed, g.min_ops, g.max_ops, g.max_value))
    path = _local_file(source, split)
    if path is not None:
        if path.stat().st_size == 0:  # the text builder fails on an empty file
            raise DataError(f"dataset {path} [{split}] is empty: check the path")
        try:
            raw = datasets.load_dataset("text", data_files=str(path), split="train", encoding_errors="replace")
        except Exception as exc:  # the builder wraps whatever went wrong in DatasetGenerationError
            cause = exc.__cause__ or exc
            raise DataError(f"cannot read {path}: {type(cause).__name__}: {cause}") from None
        if path.suffix == ".txt":
            return raw
        raw = raw.rename_column("text", "_line")
        return raw.filter(lambda line: bool(line.strip()), input_columns="_line")  # blank lines: not data
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".txt")):
        raise DataError(f"data file {source} does not exist")
    hub_split = "train" if split == "train" else "test"
    try:
        return datasets.load_dataset(source, cfg.hub_config, split=hub_split)
    except Exception as exc:  # network, unknown name, missing config: say which source failed
        raise DataError(f"cannot load '{source}' (split {hub_split}) from the hub: {exc}. "
                        "Use a local file or directory instead (e.g. data.train=data/gsm8k, holding "
                        "train.jsonl and test.jsonl)") from None


def load_records(source: str, split: str, cfg: DataConfig, extract: Extract, columns: list[str],
                 stats: DataStats) -> datasets.Dataset:
    """Good records of ``source`` as a Dataset with ``columns``; bad ones skipped and counted."""
    raw = _raw(source, split, cfg)
    if len(raw) == 0:
        raise DataError(f"dataset {source} [{split}] is empty: check the path")
    features = datasets.Features({c: _FEATURES.get(c, datasets.Value("string")) for c in columns + [BAD]})
    ds = raw.map(_apply(extract, columns), batched=True, remove_columns=raw.column_names, features=features)
    reasons = Counter(r for r in ds[BAD] if r)
    if reasons:
        stats.add(f"{source} [{split}]", reasons)
        log.warning("%s [%s]: skipped %d bad records (%s)", source, split, sum(reasons.values()),
                    ", ".join(f"{k} x{v}" for k, v in reasons.items()))
    ds = ds.filter(lambda r: not r, input_columns=BAD).remove_columns(BAD)
    if len(ds) == 0:
        raise DataError(f"dataset {source} [{split}] has no usable records"
                        + (f" ({stats.summary()})" if reasons else "") + ": check the path and the field names")
    return ds


def train_eval_records(cfg: DataConfig, extract: Extract, columns: list[str], stats: DataStats,
                       seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The train records and the eval records: ``data.eval`` when set; else the generator's
    own held-out set, a directory's test file, or a seeded 2% split of the train file."""
    if cfg.train is None:
        raise DataError("data.train is null: data.blend is for pretraining only; set data.train to this job's data")
    train = load_records(cfg.train, "train", cfg, extract, columns, stats)
    if cfg.eval is not None:
        return train, load_records(cfg.eval, "eval", cfg, extract, columns, stats)
    if cfg.train == "generated" or _has_split(cfg.train, "eval"):
        return train, load_records(cfg.train, "eval", cfg, extract, columns, stats)
    if Path(cfg.train).expanduser().is_dir():  # a directory with only a train file: held out like a file's
        log.info("data.train=%s has no %s file: holding out a seeded 2%% of its train records for evaluation "
                 "(set data.eval to choose the eval data)", cfg.train, " or ".join(_SPLIT_FILES["eval"]))
    if len(train) < 2:
        raise DataError(f"{cfg.train}: too few records to hold out an eval split; set data.eval")
    parts = train.train_test_split(test_size=max(1, len(train) // 50), seed=seed)
    return parts["train"], parts["test"]


# ------------------------------------------------------------------------------ packing
def token_stream(texts: list[str], tokenizer: Tokenizer, chunk: int = 256) -> np.ndarray:
    """Documents -> one flat stream of their tokens, each document followed by end-of-text.
    Tokenized ``chunk`` documents at a time: the tokenizer returns Python lists (~36 bytes a
    token), so larger chunks cost memory (+1.6 GiB peak at 2000 documents of ~5 KB, 0.4 GiB at
    256, measured on a 40 MB corpus) and no speed."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts = [np.asarray(ids + [tokenizer.eos_id], dtype=dtype)
             for start in range(0, len(texts), chunk) for ids in tokenizer.encode_batch(texts[start:start + chunk])]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def pack(texts: datasets.Dataset, tokenizer: Tokenizer, seq_len: int, name: str = "the data") -> TokenWindows:
    """Tokenizes documents, joins them with end-of-text tokens and cuts windows of seq_len + 1
    tokens (inputs and shifted targets) from the whole stream, as HF's run_clm ``group_texts``
    does; the indexed path (``rlt-mega preprocess``) cuts the same windows from its ``.bin``."""
    windows = TokenWindows(token_stream(texts["text"], tokenizer), seq_len, name)
    if len(windows) == 0:
        raise DataError(f"{name} holds fewer than data.seq_len + 1 = {seq_len + 1} tokens: lower data.seq_len "
                        "or add data")
    return windows


class RecordOrder:
    """Endless indices into ``num`` records in a seeded order, reshuffled each epoch;
    ``state_dict`` (epoch, cursor) makes a resumed run draw the same records."""

    def __init__(self, num: int, seed: int, shuffle: bool = True) -> None:
        if num < 1:
            raise ValueError("RecordOrder needs at least one record")
        self.num, self.seed, self.shuffle = num, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num, generator=g)

    def take(self, n: int, rank: int = 0, world: int = 1) -> list[int]:
        """This rank's n of the next n * world indices (data-parallel replicas take disjoint
        strided rows of one global batch); an epoch boundary reshuffles, and a global batch
        never straddles it."""
        step = n * world
        if step > self.num:
            raise ValueError(f"a batch of {n} x {world} ranks from a dataset of {self.num} records: "
                             "lower the batch size or add data")
        if self.cursor + step > self.num:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation()
        out = self._order[self.cursor:self.cursor + step][rank::world].tolist()
        self.cursor += step
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation()


class BatchIterator:
    """Endless batches of packed windows in a seeded order, reshuffled each epoch (``RecordOrder``).

    ``state_dict`` holds the epoch and the cursor (the sample index), so a resumed run sees
    exactly the batches the uninterrupted run would have seen. Data-parallel ranks take disjoint
    strided rows of each global batch (``rank`` of ``world``); a global batch never straddles an
    epoch (the last partial one is dropped). The windows may be in memory or memory-mapped.
    """

    def __init__(self, data: TokenWindows, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world: int = 1) -> None:
        if len(data) < batch_size * world:
            raise DataError(f"{len(data)} packed windows cannot fill one global batch of "
                            f"{batch_size} x {world} ranks: lower train.micro_batch_size or data.seq_len, or add data")
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world
        self.order = RecordOrder(len(data), seed, shuffle)

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        # (batch_size, seq_len + 1): only this rank's rows are read
        return self.data.read(self.order.take(self.batch_size, self.rank, self.world))

    def state_dict(self) -> dict:
        return {**self.order.state_dict(), "windows": len(self.data)}

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state)
        if state.get("windows", len(self.data)) != len(self.data):  # a deliberate change of data is allowed
            log.warning("the checkpoint's data had %d windows, %s has %d: the data changed, so from here on the "
                        "order is not the one the uninterrupted run would have seen", state["windows"],
                        self.data.name, len(self.data))
