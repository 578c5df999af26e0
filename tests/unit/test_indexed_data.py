"""Indexed pretraining data: `rlt-mega preprocess` writes megatron-core's .bin/.idx (read back
here with megatron-core's own IndexedDataset, document for document); the indexed path's
batches equal the in-memory path's; blends draw in proportion; damaged files are clear errors."""

import contextlib
import logging
import math
import os

import numpy as np
import pytest
import torch

from rlt_mega import cli
from rlt_mega.config import ConfigError, DataConfig, from_dict
from rlt_mega.data.datasets import DataError, DataStats, load_records, text_of
from rlt_mega.data.indexed import IndexedTokens
from rlt_mega.data.preprocess import preprocess
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level, load_tokenizer

from helpers import dp_layout as dims
from helpers import make_prefix, write_corpus


def cfg_for(**data):
    return from_dict({"data": {"seq_len": 16, "shuffle": True, **data},
                      "train": {"micro_batch_size": 4, "grad_accum": 2, "steps": 50, "seed": 7, "eval_batches": 2},
                      "model": {"max_seq_len": 64}})


@contextlib.contextmanager
def logged(name):
    """The messages the logger ``name`` emits inside the block (ours do not propagate to pytest's)."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_round_trip_every_document_token_for_token(tmp_path):
    prefix, corpus = make_prefix(tmp_path, "corpus", workers=2)
    tok = byte_level()
    records = load_records(str(corpus), "train", DataConfig(), text_of(None), ["text"], DataStats())
    data = IndexedTokens(prefix)
    assert data.num_docs == len(records) == 300  # the bad lines were skipped, as the in-memory path skips them
    for i, text in enumerate(records["text"]):  # megatron-core's IndexedDataset reads each document back
        assert data.document(i).tolist() == tok.encode(text) + [tok.eos_id], i
    assert data.dtype == np.uint16 and data.meta["skipped"] == {"malformed json line": 3}
    # one worker writes the same files
    preprocess(str(corpus), "byte", str(tmp_path / "one"), workers=1, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == open(prefix + suffix, "rb").read()
    with pytest.raises(FileExistsError, match="exist: pass --overwrite"):
        preprocess(str(corpus), "byte", str(tmp_path / "one"), progress=False)


def test_a_directory_of_parquet_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"shard text {i} " * (i % 7 + 1) for i in range(40)]
    (tmp_path / "shards" / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": texts[:25]}), tmp_path / "shards" / "a.parquet")
    pq.write_table(pa.table({"text": texts[25:]}), tmp_path / "shards" / "sub" / "b.parquet")
    result = preprocess(str(tmp_path / "shards"), "byte", str(tmp_path / "p"), workers=2, chunk=6, progress=False)
    assert result.documents == 40 and "MB/s" in result.summary()
    data = IndexedTokens(str(tmp_path / "p"))
    tok = byte_level()
    assert [data.document(i).tolist() for i in range(40)] == [tok.encode(t) + [tok.eos_id] for t in texts]


def test_indexed_batches_equal_the_in_memory_batches(tmp_path):
    prefix, corpus = make_prefix(tmp_path, "corpus", num_docs=400)
    eval_corpus = write_corpus(tmp_path / "eval.jsonl", 40, seed=1)
    tok = byte_level()
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        memory = pretraining_data(cfg_for(train=str(corpus), eval=str(eval_corpus)), tok, dims(rank, world))
        indexed = pretraining_data(cfg_for(train=prefix, eval=str(eval_corpus)), tok, dims(rank, world))
        assert (memory.path, indexed.path) == ("in memory", "indexed")
        assert torch.equal(memory.eval_windows, indexed.eval_windows)
        windows = len(indexed.batches.iterator.data)
        for _ in range(2 * windows // (4 * 2 * world) + 3):  # past two epoch boundaries
            a, b = memory.batches.next_batches(), indexed.batches.next_batches()
            for x, y in zip(a, b):
                assert torch.equal(x["inputs"], y["inputs"]) and torch.equal(x["targets"], y["targets"])
        assert memory.batches.state_dict() == indexed.batches.state_dict()


def test_resume_by_sample_index_and_held_out_documents(tmp_path):
    prefix, _ = make_prefix(tmp_path, "corpus", num_docs=400)
    tok = byte_level()
    run = pretraining_data(cfg_for(train=prefix), tok, dims())
    data = IndexedTokens(prefix)
    first_eval = data.num_docs - data.num_docs // 50
    stream = np.asarray(data.stream[:data.token_offset(first_eval)], dtype=np.int64)
    windows = {tuple(w) for w in stream[:len(stream) // 17 * 17].reshape(-1, 17).tolist()}
    seen = [run.batches.next_batches() for _ in range(12)]
    for step in seen:  # every row is a window of the training documents' stream (stride 17)
        for mb in step:
            for row in torch.cat([mb["inputs"], mb["targets"][:, -1:]], dim=1).tolist():
                assert tuple(row) in windows
    held_out = np.asarray(data.stream[data.token_offset(first_eval):]).tolist()
    assert run.eval_windows[0].tolist() == held_out[:17]
    again = pretraining_data(cfg_for(train=prefix), tok, dims())
    for _ in range(5):
        again.batches.next_batches()
    resumed = pretraining_data(cfg_for(train=prefix), tok, dims())
    state = again.batches.state_dict()
    assert state == {"epoch": 0, "cursor": 40, "windows": len(resumed.batches.iterator.data)}  # 5 steps of 2 x 4
    resumed.batches.load_state_dict(state)
    for expected in seen[5:]:
        got = resumed.batches.next_batches()
        assert all(torch.equal(x["inputs"], y["inputs"]) for x, y in zip(expected, got))
    with logged("rlt_mega.data.datasets") as records:  # other data under the same checkpoint: said so
        resumed.batches.load_state_dict({**state, "windows": state["windows"] + 1})
    assert "the data changed" in records[0]


def test_a_blend_draws_in_its_weights_proportions(tmp_path):
    a, _ = make_prefix(tmp_path, "a", num_docs=200, letter="a")
    b, _ = make_prefix(tmp_path, "b", num_docs=200, letter="b", seed=1)
    tok = byte_level()
    cfg = cfg_for(blend=[0.25, a, 0.75, b])
    run = pretraining_data(cfg, tok, dims())
    assert run.path == "blend"
    id_a, id_b = tok.encode("a")[0], tok.encode("b")[0]
    rows = torch.cat([mb["inputs"] for _ in range(250) for mb in run.batches.next_batches()])  # 2000 samples
    from_a = int((rows == id_a).any(dim=1).sum())
    assert not ((rows == id_a).any(dim=1) & (rows == id_b).any(dim=1)).any()  # one dataset per window
    n, p = len(rows), 0.25
    assert abs(from_a - n * p) <= 4 * math.sqrt(n * p * (1 - p)), from_a  # a binomial bound (4 sigma)
    eval_a = int((run.eval_windows == id_a).any(dim=1).sum())
    assert eval_a == 2 and len(run.eval_windows) == 8  # the eval windows follow the weights too
    # data-parallel ranks: disjoint samples that make up the single rank's global batch, exactly
    single = pretraining_data(cfg_for(blend=[0.25, a, 0.75, b]), tok, dims())
    ranks = [pretraining_data(cfg, tok, dims(r, 2)) for r in range(2)]
    for _ in range(6):
        rows = [torch.cat([mb["inputs"] for mb in src.batches.next_batches()]) for src in ranks]
        ids = [src.batches.iterator.window_ids(range(src.batches.iterator.sample - 16 + r, src.batches.iterator.sample, 2))
               for r, src in enumerate(ranks)]  # the (dataset, window) of each rank's samples of the step
        assert not set(ids[0]) & set(ids[1])
        both = torch.cat([mb["inputs"] for _ in range(2) for mb in single.batches.next_batches()])
        assert sorted(map(tuple, torch.cat(rows).tolist())) == sorted(map(tuple, both.tolist()))
    # resume by the sample index
    state = ranks[1].batches.state_dict()
    resumed = pretraining_data(cfg, tok, dims(1, 2))
    resumed.batches.load_state_dict(state)
    for x, y in zip(ranks[1].batches.next_batches(), resumed.batches.next_batches()):
        assert torch.equal(x["inputs"], y["inputs"])
    other = pretraining_data(cfg_for(blend=[0.5, a, 0.5, b]), tok, dims())  # a new mixture from here on: said so
    with logged("rlt_mega.data.blend") as records:
        other.batches.load_state_dict(state)
    assert "not the ones the uninterrupted run would have seen" in records[0] and other.batches.iterator.sample == 96


def test_blend_config_is_validated():
    with pytest.raises(ConfigError, match="expected weight, prefix pairs"):
        DataConfig(blend=[0.5, "a", 0.5])
    with pytest.raises(ConfigError, match="weight 'x' must be a positive number"):
        DataConfig(blend=["x", "a"])
    with pytest.raises(ConfigError, match="a blend replaces data.train"):
        DataConfig(blend=[1, "a"], train="b")
    with pytest.raises(ConfigError, match="data.train is null"):
        DataConfig(train=None)
    assert DataConfig(blend=["1e-1", "a", 2, "b"]).blend == [0.1, "a", 2.0, "b"]
    assert DataConfig(blend=[1, "a"], train=None).train is None


def test_damaged_files_are_clear_errors_naming_the_file(tmp_path, capsys):
    prefix, _ = make_prefix(tmp_path, "corpus")
    bin_bytes = open(prefix + ".bin", "rb").read()
    with open(prefix + ".bin", "wb") as f:
        f.write(bin_bytes[:-10])
    with pytest.raises(DataError, match=f"{prefix}.bin is truncated: {len(bin_bytes) - 10} bytes"):
        IndexedTokens(prefix)
    with open(prefix + ".bin", "wb") as f:
        f.write(bin_bytes)
    idx_bytes = open(prefix + ".idx", "rb").read()
    with open(prefix + ".idx", "wb") as f:
        f.write(idx_bytes[:len(idx_bytes) // 2])
    with pytest.raises(DataError, match=f"{prefix}.idx is truncated"):
        IndexedTokens(prefix)
    os.remove(prefix + ".idx")
    with pytest.raises(DataError, match=f"{prefix}.idx is missing"):
        IndexedTokens(prefix)
    # through the trainer's command line: one line, exit status 2
    code = cli.main(["pretrain", "--config", "configs/tiny_cpu.yaml", f"data.train={prefix}", "train.steps=1",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {prefix}.idx is missing" in err and "Traceback" not in err
    with open(prefix + ".idx", "wb") as f:
        f.write(idx_bytes)
    other = tmp_path / "tokenizer"
    other.mkdir()
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(models.WordLevel({"a": 0, "<|eos|>": 1}, unk_token="a"))
    hf.save(str(other / "tokenizer.json"))
    with pytest.raises(DataError, match="is an indexed dataset: it is memory-mapped, not streamed"):
        pretraining_data(cfg_for(train=prefix, streaming=True), byte_level(), dims())
    with pytest.raises(DataError, match="was tokenized with byte .* is another tokenizer"):
        pretraining_data(cfg_for(train=prefix, tokenizer=str(other)), load_tokenizer(str(other)), dims())
