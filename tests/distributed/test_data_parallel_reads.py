"""Pretraining data on two gloo data-parallel ranks (the shared launch; data_scenarios.py):
each rank's rows of the indexed path and of a blend are exactly its strided share of the
single-process global batch (so the two are disjoint and together are that batch); streamed
ranks read disjoint documents, and each resumes its own stream from the gathered state, also
through the trainer: a streamed run stopped and resumed from a checkpoint ends as if
uninterrupted (every rank gathers its stream position into rank 0's trainer.pt at each save)."""

import pytest
import torch

from rlt_mega.data.pretraining import pretraining_data
from rlt_mega.data.tokenizer import byte_level
from tests.distributed.data_scenarios import config, rows

from helpers import docs_in, dp_layout

DATA = ("data_scenarios.data_paths", {"dir": "{shared}/data_paths"})
TRAINING = ("data_scenarios.streamed_training", {"dir": "{shared}/streamed_training"})
SCENARIOS = {2: [DATA, TRAINING]}


@pytest.fixture(scope="module")
def launched(ranks):
    results = ranks(2).each(*DATA)
    return results[0]["args"], results


@pytest.mark.parametrize("path", ["indexed", "blend"])
def test_each_rank_reads_its_strided_share_of_the_global_batch(launched, path):
    args, ranks = launched
    assert [r["dp_rank"] for r in ranks] == [0, 1] and ranks[0]["dp"] == 2
    # the same run on one process with a global micro-batch of both ranks' rows (4 x 2)
    single = config(train=args["prefix"]) if path == "indexed" else config(blend=args["blend"])
    single.train.micro_batch_size = 8
    reference = rows(pretraining_data(single, byte_level(), dp_layout()), 3)
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


def test_a_streamed_run_stopped_and_resumed_on_two_ranks_ends_as_if_uninterrupted(ranks):
    for r in ranks(2).each(*TRAINING):
        assert r["stream_ranks"] == 2  # both replicas' stream positions in the checkpoint
        assert r["same_keys"] and r["unequal"] == []
