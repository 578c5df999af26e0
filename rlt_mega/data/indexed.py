"""Indexed datasets: megatron-core's ``.bin``/``.idx`` format, written once by ``rlt-mega
preprocess`` and memory-mapped by every rank.

``PREFIX.bin`` holds the token ids of all documents back to back, each document ending with
its end-of-text token; ``PREFIX.idx`` holds one entry (length, byte offset) per document, so
document boundaries survive for document-aware packing. Both are read and written with
megatron-core's own ``IndexedDataset`` and ``IndexedDatasetBuilder``, so datasets made by
Megatron-LM's ``preprocess_data.py`` load here and ours load there. ``PREFIX.json`` records
the tokenizer (and the source, counts), so that a run with another tokenizer is refused
instead of training on ids that mean something else.

Writes are atomic: everything goes to ``PREFIX.tmp<pid>.*`` and is renamed into place at the
end, the index last, so a crash never leaves files that look like a complete dataset. A
reader checks the files against each other before use (a truncated ``.bin``, a missing or
damaged ``.idx``), each with an error that names the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from rlt_mega.checkpoint import OutputKind, check_output
from rlt_mega.data.datasets import DataError
from rlt_mega.data.tokenizer import Tokenizer
from rlt_mega.data.windows import TokenWindows, token_dtype
from rlt_mega.log import get_logger

log = get_logger(__name__)

_HEADER = b"MMIDIDX\x00\x00"  # megatron-core's _INDEX_HEADER
_HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence count (8), document count (8)
_DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes
FORMAT = "rlt_mega indexed v1"
# what preprocess writes (PREFIX.bin/.idx/.json); --overwrite replaces only such a dataset
INDEXED = OutputKind("an indexed dataset", ".idx", (".bin", ".idx", ".json"))


def _megatron():
    """megatron-core's indexed_dataset module. Importing megatron.core warns that Transformer
    Engine and Apex are missing (irrelevant to reading files): those warnings are silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def paths(prefix: str) -> tuple[Path, Path, Path]:
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + ".json")


def is_indexed(source: str) -> bool:
    """Whether ``source`` names an indexed dataset (either of its files is there)."""
    bin_path, idx_path, _ = paths(os.path.expanduser(source))
    return bin_path.is_file() or idx_path.is_file()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.tok.to_str().encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------------------ reading
def check_files(prefix: str) -> None:
    """Raises a DataError naming the file when the pair is incomplete or inconsistent: a
    missing file, an index cut short or of another format, entries that contradict each other
    (_check_entries), a ``.bin`` of another length than its index says."""
    bin_path, idx_path, _ = paths(prefix)
    if not idx_path.is_file():
        if bin_path.is_file():
            raise DataError(f"{idx_path} is missing ({bin_path} is there): the index is written last, so "
                            "preprocessing did not finish or the file was not copied; run rlt-mega preprocess again")
        raise DataError(f"no indexed dataset at {prefix}: {idx_path} and {bin_path} do not exist")
    if not bin_path.is_file():
        raise DataError(f"{bin_path} is missing ({idx_path} is there): copy it beside the index or run rlt-mega "
                        "preprocess again")
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != _HEADER:
        what = "truncated" if len(head) < _HEADER_BYTES and _HEADER.startswith(head[:9]) else "not a megatron-core index"
        raise DataError(f"{idx_path} is {what} ({idx_size} bytes): run rlt-mega preprocess again")
    version, code = struct.unpack("<Q", head[9:17])[0], head[17]
    num_seqs, num_docs = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in _DTYPE_SIZES:
        raise DataError(f"{idx_path}: unsupported index (version {version}, dtype code {code})")
    expected_idx = _HEADER_BYTES + 12 * num_seqs + 8 * num_docs
    if idx_size < expected_idx:
        raise DataError(f"{idx_path} is truncated: {idx_size} bytes, its header announces {num_seqs} documents "
                        f"({expected_idx} bytes); copy it again or run rlt-mega preprocess again")
    if idx_size == expected_idx + num_seqs and num_seqs:
        raise DataError(f"{idx_path} is a multimodal index (with sequence modes): only text datasets are supported")
    if idx_size != expected_idx:
        raise DataError(f"{idx_path} is {idx_size} bytes, its header announces {expected_idx}: the file is damaged")
    expected_bin = 0
    if num_seqs:
        expected_bin = _check_entries(idx_path, num_seqs, num_docs, _DTYPE_SIZES[code])
    bin_size = bin_path.stat().st_size
    if bin_size < expected_bin:
        raise DataError(f"{bin_path} is truncated: {bin_size} bytes, {idx_path} expects {expected_bin}; copy it "
                        "again or run rlt-mega preprocess again")
    if bin_size > expected_bin:
        raise DataError(f"{bin_path} is {bin_size} bytes, {idx_path} expects {expected_bin}: the two files come from "
                        "different runs; run rlt-mega preprocess again")


def _check_entries(idx_path: Path, num_seqs: int, num_docs: int, itemsize: int) -> int:
    """Checks the index entries against each other, vectorised (a few seconds for a 10B-token
    index): lengths >= 0; documents back to back from byte 0 (pointer i+1 = pointer i + length i
    x itemsize, as megatron-core's builder writes them); document indices from 0 to the
    sequence count, non-decreasing. Returns the ``.bin`` size the entries imply."""
    index = np.memmap(idx_path, mode="r", dtype=np.uint8)
    at = _HEADER_BYTES
    lengths = index[at:at + 4 * num_seqs].view(np.int32)
    at += 4 * num_seqs
    pointers = index[at:at + 8 * num_seqs].view(np.int64)
    at += 8 * num_seqs
    documents = index[at:at + 8 * num_docs].view(np.int64)
    damaged = f"{idx_path} is damaged (its header is intact)"
    fix = "copy it again or run rlt-mega preprocess again"
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        raise DataError(f"{damaged}: entry {bad[0]} has length {lengths[bad[0]]}; {fix}")
    ends = pointers + lengths.astype(np.int64) * itemsize  # (S,) byte after each sequence
    if pointers[0] != 0:
        raise DataError(f"{damaged}: the first entry starts at byte {pointers[0]}, not 0; {fix}")
    bad = np.flatnonzero(pointers[1:] != ends[:-1])
    if bad.size:
        i = int(bad[0]) + 1
        raise DataError(f"{damaged}: entry {i} starts at byte {pointers[i]}, entry {i - 1} ends at byte "
                        f"{ends[i - 1]} (pointers and lengths disagree); {fix}")
    if num_docs and (documents[0] != 0 or documents[-1] != num_seqs or np.any(np.diff(documents) < 0)):
        raise DataError(f"{damaged}: its document indices are not a non-decreasing run from 0 to {num_seqs}; {fix}")
    return int(ends[-1])


class IndexedTokens:
    """An indexed dataset, memory-mapped through megatron-core's ``IndexedDataset``.

    ``stream`` is a zero-copy view of the whole ``.bin`` (documents back to back); a document
    is ``document(i)``; ``windows`` cuts the stream of a range of documents into training
    windows. Opening reads only the index (tens of MB for billions of tokens).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = os.path.expanduser(prefix)
        check_files(self.prefix)
        try:
            self.dataset = _megatron().IndexedDataset(self.prefix, multimodal=False, mmap=True)
        except (AssertionError, ValueError, OSError) as exc:
            raise DataError(f"{self.prefix}.idx cannot be read by megatron-core ({type(exc).__name__}: {exc})") from None
        index = self.dataset.index
        self.dtype = index.dtype
        self.doc_lengths = index.sequence_lengths  # (D,) int32
        self.doc_starts = index.sequence_pointers // np.dtype(self.dtype).itemsize  # (D,) int64, in tokens
        self.num_docs = len(self.doc_lengths)
        self.num_tokens = int(self.doc_starts[-1] + self.doc_lengths[-1]) if self.num_docs else 0
        # (num_tokens,) a view of the memory map: nothing is read until a window is
        self.stream = self.dataset.bin_reader.read(dtype=self.dtype, count=self.num_tokens, offset=0)
        meta_path = paths(self.prefix)[2]
        self.meta: Optional[dict] = json.loads(meta_path.read_text()) if meta_path.is_file() else None

    def document(self, i: int) -> np.ndarray:
        return self.dataset[i]  # (doc_lengths[i],), ending in end-of-text

    def token_offset(self, doc: int) -> int:
        """The stream position where document ``doc`` starts (num_tokens for doc == num_docs)."""
        return self.num_tokens if doc >= self.num_docs else int(self.doc_starts[doc])

    def windows(self, seq_len: int, first_doc: int = 0, end_doc: Optional[int] = None,
                name: Optional[str] = None) -> TokenWindows:
        """The training windows of documents [first_doc, end_doc), memory-mapped."""
        end_doc = self.num_docs if end_doc is None else end_doc
        stream = self.stream[self.token_offset(first_doc):self.token_offset(end_doc)]
        windows = TokenWindows(stream, seq_len, name or self.prefix, owner=self)
        if len(windows) == 0:
            raise DataError(f"{windows.name} holds {len(stream)} tokens, fewer than data.seq_len + 1 = {seq_len + 1}: "
                            "lower data.seq_len or preprocess more data")
        return windows

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """The run's tokenizer must be the one the dataset was written with (ids mean tokens)."""
        if self.meta is None:
            log.warning("%s has no %s.json (not written by rlt-mega preprocess): cannot check that it was tokenized "
                        "with data.tokenizer=%s", self.prefix, self.prefix, tokenizer.name)
            return
        want = self.meta.get("tokenizer", {})
        if want.get("fingerprint") != tokenizer_fingerprint(tokenizer):
            raise DataError(f"{self.prefix} was tokenized with {want.get('name')} ({want.get('vocab_size')} tokens), "
                            f"but data.tokenizer={tokenizer.name} ({tokenizer.vocab_size} tokens) is another "
                            f"tokenizer: set data.tokenizer to the dataset's, or preprocess again with --tokenizer "
                            f"{tokenizer.name}")


# ------------------------------------------------------------------------------ writing
class IndexedWriter:
    """Writes one indexed dataset with megatron-core's builder, atomically.

    Chunks of documents are appended as they come; ``commit`` writes the index and renames the
    three files into place (the metadata, the data, the index last); ``abort`` removes them.
    """

    def __init__(self, prefix: str, tokenizer: Tokenizer, overwrite: bool = False,
                 inputs: Iterable[str | Path] = ()) -> None:
        self.prefix = os.path.expanduser(prefix)
        self.tokenizer = tokenizer
        bin_path, idx_path, meta_path = paths(self.prefix)
        check_output(self.prefix, inputs, overwrite, kind=INDEXED)
        bin_path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_parts(self.prefix)
        self.tmp = f"{self.prefix}.tmp{os.getpid()}"
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.builder = _megatron().IndexedDatasetBuilder(self.tmp + ".bin", dtype=self.dtype)
        self.num_docs = self.num_tokens = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """A chunk of documents: their tokens back to back (each ending in end-of-text), (N,)
        lengths. Appended in bulk through the builder's file and lists: its per-document
        ``add_item`` costs ~14 us a document, which with many workers bounds the whole job."""
        self.builder.data_file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.builder.sequence_lengths.extend(lengths.tolist())
        # one sequence per document: document i ends at sequence i + 1
        self.builder.document_indices.extend(range(self.num_docs + 1, self.num_docs + len(lengths) + 1))
        self.num_docs += len(lengths)
        self.num_tokens += int(tokens.size)

    def commit(self, meta: dict) -> None:
        bin_path, idx_path, meta_path = paths(self.prefix)
        self.builder.finalize(self.tmp + ".idx")
        tok = self.tokenizer
        meta = {"format": FORMAT, "documents": self.num_docs, "tokens": self.num_tokens,
                "dtype": np.dtype(self.dtype).name,
                "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                              "fingerprint": tokenizer_fingerprint(tok)}, **meta}
        Path(self.tmp + ".json").write_text(json.dumps(meta, indent=2) + "\n")
        for suffix in (".bin", ".idx", ".json"):
            _fsync(self.tmp + suffix)
        idx_path.unlink(missing_ok=True)  # an old index must never pair with the new data
        os.replace(self.tmp + ".json", meta_path)
        os.replace(self.tmp + ".bin", bin_path)
        os.replace(self.tmp + ".idx", idx_path)
        _fsync(str(bin_path.parent))

    def abort(self) -> None:
        if not self.builder.data_file.closed:
            self.builder.data_file.close()
        for suffix in (".bin", ".idx", ".json"):
            Path(self.tmp + suffix).unlink(missing_ok=True)


def remove_stale_parts(prefix: str) -> None:
    """Deletes the partial files of earlier preprocess runs of ``prefix`` that died (their
    process is gone); a live one's are left alone."""
    for part in glob.glob(glob.escape(prefix) + ".tmp*.*"):
        pid = Path(part).name[len(Path(prefix).name) + 4:].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            log.warning("removing %s, left by a preprocess run that did not finish", part)
            Path(part).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
