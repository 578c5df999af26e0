"""Streaming pretraining data (data.streaming: true) from local files read exactly as a hub
dataset is (datasets streaming, split_dataset_by_node): data-parallel ranks get disjoint
documents that together are the whole stream, 2% are held out for evaluation, and a resumed
stream continues where it stopped, through the trainer's checkpoints too."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlt_mega import cli
from rlt_mega.config import ConfigError, DataConfig, from_dict
from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.streaming import is_heldout
from rlt_mega.data.tokenizer import byte_level

from helpers import docs_in, dp_layout

TOK = byte_level()


def documents(num):
    return [f"<{i}> " + "lorem ipsum " * (i % 5 + 1) for i in range(num)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(300)))
    return str(path)


@pytest.fixture
def parquet_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = documents(300)
    (tmp_path / "shards").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": texts[i * 150:(i + 1) * 150]}), tmp_path / "shards" / f"part{i}.parquet")
    return str(tmp_path / "shards")


def source(train, rank=0, world=1, **data):
    cfg = from_dict({"data": {"train": train, "streaming": True, "seq_len": 16, **data},
                     "train": {"micro_batch_size": 4, "grad_accum": 2, "seed": 3, "eval_batches": 2},
                     "model": {"max_seq_len": 64}})
    return pretraining_data(cfg, TOK, dp_layout(rank, world))


def rows_of(run, steps):
    return [torch.cat([mb["inputs"], mb["targets"][:, -1:]], dim=1) for _ in range(steps)
            for mb in run.batches.next_batches()]


@pytest.mark.parametrize("kind", ["jsonl", "parquet_shards"])
def test_two_ranks_read_disjoint_documents_that_make_up_the_stream(kind, request):
    train = request.getfixturevalue(kind)
    held_out = {t for t in documents(300) if is_heldout(t)}
    assert held_out  # the corpus holds out some documents: 1 in 50 by the CRC of their text
    per_rank = [set(docs_in(rows_of(source(train, rank, 2), 70))) for rank in range(2)]  # > one epoch each
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]
    assert per_rank[0] | per_rank[1] == set(documents(300)) - held_out
    evals = source(train).eval_windows
    assert evals.shape == (8, 17) and set(docs_in([evals])) <= held_out


@pytest.mark.parametrize("shuffle_buffer", [0, 8])
def test_a_resumed_stream_continues_where_it_stopped(jsonl, shuffle_buffer):
    full = rows_of(source(jsonl, 1, 2, shuffle_buffer=shuffle_buffer), 60)  # crosses an epoch boundary
    stopped = source(jsonl, 1, 2, shuffle_buffer=shuffle_buffer)
    rows_of(stopped, 9)
    stopped.batches.iterator.gather = lambda mine: [None, mine]  # the all-gather of rank 1 (real: tests/distributed)
    state = stopped.batches.state_dict()
    resumed = source(jsonl, 1, 2, shuffle_buffer=shuffle_buffer)
    resumed.batches.load_state_dict(state)
    for expected, got in zip(full[18:], rows_of(resumed, 51)):
        assert torch.equal(expected, got)
    if shuffle_buffer:  # the buffer reorders windows, but each is still a window of the stream
        plain = rows_of(source(jsonl, 1, 2), 40)
        assert not torch.equal(torch.stack(full[:8]), torch.stack(plain[:8]))
    with pytest.raises(ValueError, match="cannot be split again"):
        source(jsonl, 0, 1).batches.load_state_dict(state)


def test_streaming_config_is_validated():
    with pytest.raises(ConfigError, match="data.streaming=true streams data.train, which is 'generated'"):
        DataConfig(streaming=True)
    with pytest.raises(ConfigError, match="set only one of them"):
        DataConfig(streaming=True, blend=[1, "a"])
    with pytest.raises(ConfigError, match="data.shuffle_buffer=-1"):
        DataConfig(shuffle_buffer=-1)


def test_a_streamed_run_stopped_and_resumed_ends_as_if_uninterrupted(tmp_path, jsonl):
    tiny = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "model.n_layers=2",
            "model.memory_block=2", "data.seq_len=16", "train.micro_batch_size=2", "train.eval_every=4",
            "train.eval_batches=1", "logging.progress=false", "optim.warmup_steps=2", f"data.train={jsonl}",
            "data.streaming=true", "data.shuffle_buffer=4", "train.steps=8", "checkpoint.every=4"]

    def run(name, *extra):
        args = ["pretrain", "--config", "configs/tiny_cpu.yaml", *tiny, f"checkpoint.dir={tmp_path / name / 'ckpt'}",
                f"logging.dir={tmp_path / name / 'tb'}", *extra]
        assert cli.main(args) == 0

    run("full")
    run("split", "train.stop_after=5")  # checkpoints at 4 and 5; resume from 4
    ckpt = tmp_path / "split" / "ckpt"
    (ckpt / "latest").write_text("step_00000004")
    shutil.rmtree(ckpt / "step_00000005")
    run("split", "train.resume=auto")
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000008" / "model.safetensors")
    resumed = load_file(ckpt / "step_00000008" / "model.safetensors")
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
