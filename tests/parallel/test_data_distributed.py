"""Pretraining data on two gloo data-parallel ranks (one launch; tests/parallel/data_scenarios.py):
each rank's rows of the indexed path and of a blend are exactly its strided share of the
single-process global batch (so the two are disjoint and together are that batch); streamed
ranks read disjoint documents, and each resumes its own stream from the gathered state."""

import pytest
import torch

from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level
from test_indexed_data import make_prefix
from test_streaming import docs_in
from tests.parallel.data_scenarios import config, rows
from tests.parallel.launch import result, run_ranks


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    prefix, corpus = make_prefix(tmp, "corpus", num_docs=300)
    other, _ = make_prefix(tmp, "other", num_docs=200, seed=3)
    args = {"prefix": prefix, "blend": [0.4, prefix, 0.6, other], "stream": str(corpus)}
    results = run_ranks(2, [("data_scenarios.data_paths", args)], tmp / "ranks")
    return args, [result(results, "data_scenarios.data_paths", args, rank) for rank in range(2)]


@pytest.mark.parametrize("path", ["indexed", "blend"])
def test_each_rank_reads_its_strided_share_of_the_global_batch(launched, path):
    args, ranks = launched
    assert [r["dp_rank"] for r in ranks] == [0, 1] and ranks[0]["dp"] == 2
    # the same run on one process with a global micro-batch of both ranks' rows (4 x 2)
    single = config(train=args["prefix"]) if path == "indexed" else config(blend=args["blend"])
    single.train.micro_batch_size = 8
    reference = rows(pretraining_data(single, byte_level()), 3)
    for step, global_rows in enumerate(reference):
        a, b = ranks[0][path][step], ranks[1][path][step]
        assert a == global_rows[0::2] and b == global_rows[1::2], step
        assert not {tuple(r) for r in a} & {tuple(r) for r in b}


def test_streamed_ranks_read_disjoint_documents_and_resume_their_own_streams(launched):
    _, ranks = launched
    docs = [set(docs_in([torch.tensor(mb) for mb in r["stream"] + r["stream_next"]])) for r in ranks]
    assert docs[0] and docs[1] and not docs[0] & docs[1]
    for r in ranks:
        assert r["stream_ranks"] == 2 and r["own_state_gathered"]
        assert r["stream_resumed"] == r["stream_next"]
    assert ranks[0]["eval_stream"] == ranks[1]["eval_stream"]  # every rank evaluates the same windows
