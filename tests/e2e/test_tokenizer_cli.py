"""The tokenizer commands end to end (issue 14): `rlt-mega tokenizer train` on the whole GSM8K
train split, read back by rlt_mega and by transformers' AutoTokenizer; SFT with
data.chat_template=true. The tokenizers themselves: tests/unit/test_tokenizers.py."""

import json
import re
from pathlib import Path

import pytest

from rlt_mega import cli
from rlt_mega.data.datasets import DataStats
from rlt_mega.data.pairs import tokenize_pairs
from rlt_mega.data.tokenizer import load_tokenizer

from helpers import gsm8k_dir
from unit.test_tokenizers import chat_tokenizers  # noqa: F401 (a fixture; tests/ is on sys.path)

GSM8K = gsm8k_dir()  # tests/data/gsm8k


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_bpe_trained_on_gsm8k_round_trips_every_test_question(tmp_path, capsys):
    """The CLI on the whole GSM8K train split (vocabulary 1024); every test question round-trips
    exactly through rlt_mega's tokenizer and through transformers' AutoTokenizer, and the
    tokens per byte (printed by the command) are well under the byte tokenizer's 1.0."""
    out = tmp_path / "bpe"
    capsys.readouterr()
    assert cli.main(["tokenizer", "train", "--data", str(GSM8K), "--vocab-size", "1024", str(out)]) == 0
    report = capsys.readouterr().out
    per_byte = {split: float(v) for v, split in re.findall(r"tokens per byte: ([\d.]+) on \S+ \[(\w+)\]", report)}
    print(report)
    assert set(per_byte) == {"train", "eval"} and 0.2 < per_byte["eval"] < 0.5
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 1024 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    questions = [r["question"] for r in read_jsonl(GSM8K / "test.jsonl")]
    encoded = tok.encode_batch(questions)
    assert all(tok.decode(ids) == q for ids, q in zip(encoded, questions))
    num_bytes = sum(len(q.encode()) for q in questions)
    print(f"GSM8K test questions: {sum(map(len, encoded)) / num_bytes:.4f} tokens per byte ({len(questions)} questions)")

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out))
    sample = questions[::20]
    assert [hf(q, add_special_tokens=False)["input_ids"] for q in sample] == [tok.encode(q) for q in sample]
    assert [hf.decode(tok.encode(q)) for q in sample] == sample
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)


def test_sft_with_chat_template(chat_tokenizers, tmp_path):
    """data.chat_template=true end to end: SFT pairs laid out by the template, two steps run;
    without a template it is a clear error."""
    path = chat_tokenizers["chatml"]
    tok = load_tokenizer(str(path), chat_template=True)
    import datasets

    records = datasets.Dataset.from_list([{"question": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3"}])
    row = tokenize_pairs(records, tok, 64, DataStats())[0]
    assert tok.decode(row["ids"][:row["num_prompt"]]) == tok.decode(tok.encode(tok.chat_prompt("What is 1 + 2?")))
    assert row["ids"][-1] == tok.tok.token_to_id("<|im_end|>")
    run = ["model.vocab_size=400", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=64",
           "model.max_seq_len=96", "data.seq_len=96", f"data.tokenizer={path}", "data.chat_template=true",
           "data.generated.num_train=32", "data.generated.num_eval=4", "train.steps=2", "train.micro_batch_size=4",
           "train.eval_every=0", "train.device=cpu", "logging.progress=false", f"checkpoint.dir={tmp_path / 'ck'}",
           f"logging.dir={tmp_path / 'tb'}"]
    assert cli.main(["sft", *run]) == 0
    assert cli.main(["sft", *run, "data.tokenizer=byte", "model.vocab_size=260"]) == 2
