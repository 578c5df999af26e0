"""``rlt-mega preprocess``: tokenizes a corpus once into an indexed dataset (megatron-core's
``.bin``/``.idx``, ``data/indexed.py``), so that pretraining starts without tokenizing and every
rank memory-maps only what it reads.

    rlt-mega preprocess --data HuggingFaceFW/fineweb-edu --hub-config sample-10BT \\
        --tokenizer tokenizer.json --out data/fineweb_edu_10bt --workers 32

The source is read as a stream (``data/sources.py``: a local file, a directory of shards, or a
hub dataset, never downloaded in full) by this process, in chunks of documents that ``N``
worker processes extract and tokenize; the results are written back in the source's order, so
the dataset is the same for any number of workers. At most ``2 N`` chunks are in flight, which
bounds the memory whatever the corpus size. Bad records are skipped and counted as in the
in-memory path. Each worker runs the tokenizer on one core (``TOKENIZERS_PARALLELISM=false``):
``--workers`` is the number of cores used for tokenizing.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from rlt_mega.config import DataConfig
from rlt_mega.data.datasets import DataError
from rlt_mega.data.sources import row_bytes, stream_rows, texts_of
from rlt_mega.data.tokenizer import Tokenizer, load_tokenizer
from rlt_mega.data.windows import token_dtype
from rlt_mega.log import get_logger

log = get_logger(__name__)


@dataclass
class PreprocessResult:
    prefix: str
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0  # of the raw records read (lines, or string fields)
    seconds: float = 0.0
    workers: int = 1
    skipped: Counter = field(default_factory=Counter)
    main_cpu: float = 0.0  # CPU seconds of this process (reading, writing; and tokenizing with one worker)
    worker_cpu: dict = field(default_factory=dict)  # pid -> CPU seconds spent tokenizing

    @property
    def critical_cpu(self) -> float:
        """The busiest process's CPU seconds: about the wall time on a machine with a core for
        each process, whatever its neighbours do (the benchmark's robust figure)."""
        return max([self.main_cpu, *self.worker_cpu.values()])

    def summary(self) -> str:
        mb = self.text_bytes / 1e6
        skipped = (f"; skipped {sum(self.skipped.values())} records ("
                   + ", ".join(f"{k} x{v}" for k, v in sorted(self.skipped.items())) + ")") if self.skipped else ""
        return (f"wrote {self.prefix}.bin and {self.prefix}.idx: {self.documents:,} documents, {self.tokens:,} "
                f"tokens{skipped}\n"
                f"throughput: {mb:.1f} MB in {self.seconds:.1f} s with {self.workers} worker(s): "
                f"{mb / max(self.seconds, 1e-9):.2f} MB/s, {self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s\n"
                f"CPU: this process {self.main_cpu:.1f} s, tokenizing "
                + ", ".join(f"{c:.1f}" for c in sorted(self.worker_cpu.values(), reverse=True))
                + f" s; the busiest process {self.critical_cpu:.1f} s")


# ------------------------------------------------------------------------------ workers
_WORKER: dict = {}


def _init_worker(tokenizer_spec: str, text_field: Optional[str]) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers counts cores
    tokenizer = load_tokenizer(tokenizer_spec)
    _WORKER.update(tokenizer=tokenizer, text_field=text_field, dtype=token_dtype(tokenizer.vocab_size))


def tokenize_chunk(batch: dict) -> tuple[np.ndarray, np.ndarray, Counter, int, int, float]:
    """Raw rows -> (their documents' tokens back to back, each ending in end-of-text; (N,)
    lengths; the skipped records' reasons; the rows' bytes; this worker's pid and CPU seconds)."""
    cpu = time.process_time()
    tokenizer: Tokenizer = _WORKER["tokenizer"]
    texts, bad = texts_of(batch, _WORKER["text_field"])
    ids = tokenizer.encode_batch(texts) if texts else []
    dtype = _WORKER["dtype"]
    lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int32, count=len(ids))
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    at = 0
    for doc in ids:
        tokens[at:at + len(doc)] = doc
        tokens[at + len(doc)] = tokenizer.eos_id
        at += len(doc) + 1
    return tokens, lengths, Counter(bad), row_bytes(batch), os.getpid(), time.process_time() - cpu


class _Done:
    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


class _Inline:
    """The one-worker case: tokenize in this process, no pool (the Pool methods used here)."""

    def __init__(self, tokenizer_spec: str, text_field: Optional[str]) -> None:
        _init_worker(tokenizer_spec, text_field)

    def apply_async(self, fn, args) -> _Done:
        return _Done(fn(*args))

    def close(self) -> None:
        pass

    terminate = join = close


def _pool(workers: int, tokenizer_spec: str, text_field: Optional[str]):
    if workers == 1:
        return _Inline(tokenizer_spec, text_field)
    # fork where there is one: workers start in milliseconds and inherit the imported modules;
    # this process has not run the tokenizer yet, so no tokenizer thread pool is forked
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_spec, text_field))


def _tokenize_all(pool, rows, chunk: int, workers: int, writer, result: PreprocessResult, bar) -> None:
    """Chunks of ``rows`` tokenized by the pool and written in order, at most 2 x workers in
    flight (the reader never runs ahead of the writer)."""

    def write(done) -> None:
        tokens, lengths, bad, size, pid, cpu = done.get()
        result.worker_cpu[pid] = result.worker_cpu.get(pid, 0.0) + cpu
        writer.add(tokens, lengths)
        result.skipped.update(bad)
        result.text_bytes += size
        bar.update(size)
        bar.set_postfix(docs=f"{writer.num_docs:,}", tok=f"{writer.num_tokens:,}", refresh=False)

    in_flight: deque = deque()
    for batch in rows.iter(batch_size=chunk):
        in_flight.append(pool.apply_async(tokenize_chunk, (batch,)))
        if len(in_flight) >= 2 * workers:
            write(in_flight.popleft())
    while in_flight:
        write(in_flight.popleft())


# ------------------------------------------------------------------------------ the job
def preprocess(source: str, tokenizer: str, out: str, workers: int = 1, text_field: Optional[str] = None,
               hub_config: Optional[str] = None, split: str = "train", overwrite: bool = False,
               chunk: int = 256, progress: bool = True) -> PreprocessResult:
    """Tokenizes ``source`` into the indexed dataset ``out`` (``out.bin``, ``out.idx``, ``out.json``)."""
    from rlt_mega.data.indexed import IndexedWriter

    if workers < 1:
        raise DataError(f"--workers {workers}: must be >= 1")
    if chunk < 1:
        raise DataError(f"--chunk {chunk}: must be >= 1")
    inputs = [p for p in (source, tokenizer) if Path(p).exists()]  # local files: never written over
    writer = IndexedWriter(out, load_tokenizer(tokenizer), overwrite=overwrite, inputs=inputs)
    cfg = DataConfig(hub_config=hub_config, text_field=text_field)
    result = PreprocessResult(prefix=writer.prefix, workers=workers)
    start, start_cpu = time.perf_counter(), time.process_time()
    pool, bar = None, None
    try:
        # the workers first: forked before a hub stream starts its I/O threads
        pool = _pool(workers, tokenizer, text_field)
        rows, total = stream_rows(source, cfg, "train" if split == "train" else "eval", hub_split=split)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"preprocess {os.path.basename(out)}",
                   disable=not progress, dynamic_ncols=True)

        _tokenize_all(pool, rows, chunk, workers, writer, result, bar)
        result.documents, result.tokens = writer.num_docs, writer.num_tokens
        if result.documents == 0:
            raise DataError(f"{source} has no usable documents"
                            + (f" (skipped: {dict(result.skipped)})" if result.skipped else "")
                            + ": check the path and --text-field")
        writer.commit({"source": source, "split": split, "hub_config": hub_config, "text_field": text_field,
                       "text_bytes": result.text_bytes, "skipped": dict(result.skipped)})
        pool.close()
    except BaseException:
        if pool is not None:
            pool.terminate()
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.join()
    result.seconds, result.main_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    if result.skipped:
        log.warning("%s: skipped %d bad records (%s)", source, sum(result.skipped.values()),
                    ", ".join(f"{k} x{v}" for k, v in result.skipped.items()))
    return result


# ------------------------------------------------------------------------------ the command
HELP = "tokenize a corpus once into an indexed dataset (PREFIX.bin/.idx) for pretraining"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="a local .jsonl/.json/.txt/.parquet file, a directory (its train "
                   "file, or every shard in it), a hub dataset name, or 'generated'")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizers tokenizer.json (default: byte)")
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    p.add_argument("--text-field", help="the record field holding the text (default: 'text', else GSM8K's "
                   "question + answer)")
    p.add_argument("--hub-config", help="the hub dataset's config, e.g. sample-10BT")
    p.add_argument("--split", default="train", help="the hub split (default: train); a directory's test file "
                   "for any other value")
    p.add_argument("--chunk", type=int, default=256, help="documents per worker task (default: 256; the "
                   "tokenizer's Python lists cost ~36 bytes a token, so larger chunks cost memory)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier indexed dataset at --out (never the input, nor other files)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> str:
    result = preprocess(args.data, args.tokenizer, args.out, workers=args.workers, text_field=args.text_field,
                        hub_config=args.hub_config, split=args.split, overwrite=args.overwrite, chunk=args.chunk,
                        progress=not args.no_progress)
    return result.summary()
