"""Data: the arithmetic generator, the byte tokenizer, tolerant loading, packing, exact resume."""

import json

import pytest
import torch

from helpers import gsm8k_dir
from rlt_mega.config import DataConfig, GeneratedDataConfig
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.datasets import (BatchIterator, DataError, DataStats, load_records, pack, pair_of, text_of,
                                    train_eval_records)
from rlt_mega.data.tokenizer import byte_level, load_tokenizer


def test_generator_is_seeded_and_answers_are_right():
    a = generate_problems(50, seed=3, min_ops=1, max_ops=3, max_value=30)
    assert a == generate_problems(50, seed=3, min_ops=1, max_ops=3, max_value=30)
    assert a != generate_problems(50, seed=4, min_ops=1, max_ops=3, max_value=30)
    for p in a:
        lines = p["answer"].split("\n")
        value = None
        for eq in lines[:-1]:  # every equation holds and chains into the next
            lhs, rhs = eq.split(" = ")
            assert eval(lhs) == int(rhs)
            if value is not None:
                assert int(lhs.split(" ")[0]) == value
            value = int(rhs)
        assert lines[-1] == f"#### {value}" and value >= 0
        assert 1 <= len(lines) - 1 <= 3


def test_difficulty_knobs():
    easy = generate_problems(100, 0, 1, 1, 5)
    hard = generate_problems(100, 0, 4, 4, 500)
    assert all(p["answer"].count("\n") == 1 for p in easy)
    assert all(p["answer"].count("\n") == 4 for p in hard)
    assert max(int(p["answer"].split("#### ")[1]) for p in hard) > 100


def test_byte_tokenizer_round_trips_utf8(tmp_path):
    tok = byte_level()
    text = "Mia has 7 apples. €100 — ünïcödé\n#### 9"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.vocab_size == 259 and {tok.pad_id, tok.eos_id, tok.bos_id} == {256, 257, 258}
    tok.save(tmp_path)
    again = load_tokenizer(str(tmp_path))
    assert again.encode(text) == ids and again.eos_id == tok.eos_id


def test_bad_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    good = {"question": "q1", "answer": "a #### 1"}
    with open(path, "wb") as f:
        f.write((json.dumps(good) + "\n").encode())
        f.write(b"{not json\n")
        f.write(b'{"question": "only"}\n')
        f.write(b"\n")
        f.write(b'{"question": "   ", "answer": "x"}\n')
        f.write(b'{"question": "bad \xff byte", "answer": "y"}\n')
        f.write(b'[1, 2]\n')
        f.write((json.dumps({"question": "q2", "answer": "b #### 2"}) + "\n").encode())
    stats = DataStats()
    ds = load_records(str(path), "train", DataConfig(train=str(path)), pair_of(), ["question", "answer"], stats)
    assert ds["question"] == ["q1", "q2"]
    assert stats.total == 5
    summary = stats.summary()
    for reason in ("malformed json line x2", "missing field 'answer' x1", "empty text x1", "invalid utf-8 x1"):
        assert reason in summary, summary


def test_empty_dataset_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="is empty"):
        load_records(str(path), "train", DataConfig(), text_of(None), ["text"], DataStats())
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n{\"x\": 1}\n")
    with pytest.raises(DataError, match="no usable records"):
        load_records(str(bad), "train", DataConfig(), text_of(None), ["text"], DataStats())
    with pytest.raises(DataError, match="does not exist"):
        load_records(str(tmp_path / "missing.jsonl"), "train", DataConfig(), text_of(None), ["text"], DataStats())


def test_gsm8k_directory_and_generated_eval_split():
    cfg = DataConfig(train=str(gsm8k_dir()), generated=GeneratedDataConfig(num_train=50, num_eval=10))
    train, evald = train_eval_records(cfg, pair_of(), ["question", "answer"], DataStats(), seed=0)
    assert len(train) > 0 and len(evald) > 0
    assert set(train["question"]).isdisjoint(evald["question"])


def test_packing_and_exact_resume_of_the_batch_order():
    cfg = DataConfig(generated=GeneratedDataConfig(num_train=200, num_eval=5))
    texts, _ = train_eval_records(cfg, text_of(None), ["text"], DataStats(), seed=0)
    tok = byte_level()
    packed = pack(texts, tok, seq_len=32)
    first = packed[0]
    assert first.shape == (33,)
    # windows are the token stream of the documents joined by end-of-text
    stream = [t for d in texts[:3]["text"] for t in tok.encode(d) + [tok.eos_id]]
    assert first.tolist() == stream[:33]

    it = BatchIterator(packed, batch_size=4, seed=1)
    seen = [next(it) for _ in range(len(packed) // 4 + 3)]  # crosses an epoch boundary
    it2 = BatchIterator(packed, batch_size=4, seed=1)
    for _ in range(5):
        next(it2)
    state = it2.state_dict()
    it3 = BatchIterator(packed, batch_size=4, seed=1)
    it3.load_state_dict(state)
    for expected in seen[5:]:
        assert torch.equal(next(it3), expected)


def test_data_parallel_ranks_take_disjoint_rows():
    texts = __import__("datasets").Dataset.from_list([{"text": "x" * 40} for _ in range(40)])
    packed = pack(texts, byte_level(), seq_len=8)
    ranks = [BatchIterator(packed, 2, seed=0, rank=r, world=2) for r in range(2)]
    single = BatchIterator(packed, 4, seed=0)
    a, b, both = next(ranks[0]), next(ranks[1]), next(single)
    assert torch.equal(torch.stack([a[0], b[0], a[1], b[1]]), both)
