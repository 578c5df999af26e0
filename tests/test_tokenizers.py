"""Tokenizers (issue 14): `rlt-mega tokenizer train` (byte-level BPE with HF tokenizers) on
GSM8K, round trips, what transformers' AutoTokenizer makes of the files; chat templates
rendered as transformers renders them and applied to SFT pairs (data.chat_template); an
export's own tokenizer kept (train.init_from with another one is an error)."""

import json
import re
from pathlib import Path

import pytest
import torch

from rlt_mega import cli
from rlt_mega.checkpoint_tools import export_model
from rlt_mega.config import ModelConfig
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.chat import CHATML
from rlt_mega.data.datasets import DataStats
from rlt_mega.data.pairs import pair_ids, prompt_ids, tokenize_pairs
from rlt_mega.data.tokenizer import TokenizerError, byte_level, check_same_tokenizer, load_tokenizer
from rlt_mega.data.tokenizer_train import save, train_bpe
from rlt_mega.model import build_model

GSM8K = Path("/work/shared/data/gsm8k")  # the local copy, when this machine has one


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.skipif(not (GSM8K / "train.jsonl").is_file(), reason="no local GSM8K copy")
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


def test_bpe_round_trips_any_text_and_rejects_tiny_vocabularies(tmp_path):
    texts = ["What is 12 + 30?\n12 + 30 = 42\n#### 42", "Ünïcödé ✓ 日本語 \t tabs", "  leading and trailing  "] * 20
    tok = train_bpe(texts, vocab_size=300)
    save(tok, tmp_path / "t")
    loaded = load_tokenizer(str(tmp_path / "t"))
    for text in texts + ["never seen: 🙂 \x00 \r\n ø", ""]:
        assert loaded.decode(loaded.encode(text)) == text
    assert len(loaded.encode("12 + 30 = 42")) < len("12 + 30 = 42")  # merges were learned
    with pytest.raises(TokenizerError, match="at least the 256 bytes and 3 special tokens"):
        train_bpe(texts, vocab_size=200)
    assert cli.main(["tokenizer", "train", "--data", "generated", "--vocab-size", "300", str(tmp_path / "t")]) == 2
    # (it exists: --overwrite replaces it)


QWEN_LIKE = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
             "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
             "{%- endif %}{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{% continue %}"
             "{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory):
    """BPE tokenizers on generated problems with ChatML and with a Qwen2-like template."""
    tmp = tmp_path_factory.mktemp("chat")
    data = tmp / "problems.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in generate_problems(300, 0, 1, 2, 20)))
    out = {}
    for name, template in (("chatml", CHATML), ("qwen", QWEN_LIKE)):
        assert cli.main(["tokenizer", "train", "--data", str(data), "--vocab-size", "400", "--chat-template",
                         "chatml", str(tmp / name)]) == 0
        if name == "qwen":  # the same tokens, another template
            config = json.loads((tmp / name / "tokenizer_config.json").read_text())
            (tmp / name / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        out[name] = tmp / name
    return out


@pytest.mark.parametrize("name", ["chatml", "qwen"])
def test_chat_template_renders_as_transformers(chat_tokenizers, name):
    from transformers import AutoTokenizer

    path = chat_tokenizers[name]
    hf = AutoTokenizer.from_pretrained(str(path))
    tok = load_tokenizer(str(path), chat_template=True)
    question, answer = "What is 2 + 3?  ", "2 + 3 = 5\n#### 5"
    user = [{"role": "user", "content": question}]
    prompt = hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = hf.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    assert tok.chat_prompt(question) == prompt
    p, a = pair_ids(tok, question, answer)
    im_end = tok.tok.token_to_id("<|im_end|>")
    assert p == prompt_ids(tok, question) == hf(prompt, add_special_tokens=False)["input_ids"]
    assert a[-1] == im_end and im_end not in a[:-1] and tok.stop_ids == (im_end, tok.eos_id)
    assert tok.decode(p + a) == tok.decode(hf(full, add_special_tokens=False)["input_ids"]).rstrip("\n")
    assert hf.decode(p + a).startswith(prompt) and hf.decode(p + a) == full.rstrip("\n")


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


def test_export_keeps_its_tokenizer(chat_tokenizers, tmp_path, capsys):
    """An export made with its own tokenizer (as `rlt-mega import` makes from a Llama/Qwen2
    directory) carries it to transformers, and train.init_from refuses another one."""
    path = chat_tokenizers["chatml"]
    model = build_model(ModelConfig(vocab_size=400, d_model=32, n_layers=1, n_heads=2, ffn_hidden=64, max_seq_len=64))
    export = export_model(model, None, tmp_path / "exp", tokenizer_dir=path)
    tok = load_tokenizer(str(export), chat_template=True)
    assert tok.chat_template == CHATML
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(tok.stop_ids)
    check_same_tokenizer(load_tokenizer(str(path)), export, "train.init_from")  # the same: fine
    with pytest.raises(TokenizerError, match=f"set data.tokenizer={export}"):
        check_same_tokenizer(byte_level(), export, "train.init_from")
    capsys.readouterr()
    assert cli.main(["sft", "model.vocab_size=400", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                     "model.ffn_hidden=64", "model.max_seq_len=64", "data.seq_len=64", f"train.init_from={export}",
                     f"checkpoint.dir={tmp_path / 'ck'}", f"logging.dir={tmp_path / 'tb'}"]) == 2
    assert f"data.tokenizer={export}" in capsys.readouterr().err
