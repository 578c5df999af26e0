"""Tokenizers (issue 14): byte-level BPE trained with HF tokenizers, round trips; chat templates
rendered as transformers renders them and applied to SFT pairs (data.chat_template); an
export's own tokenizer kept (train.init_from with another one is an error). The commands end
to end (`rlt-mega tokenizer train` on GSM8K, SFT through a chat template):
tests/e2e/test_tokenizer_cli.py."""

import json

import pytest

from rlt_mega import cli
from rlt_mega.checkpoint_tools import export_model
from rlt_mega.config import ModelConfig
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.chat import CHATML
from rlt_mega.data.pairs import pair_ids, prompt_ids
from rlt_mega.data.tokenizer import TokenizerError, byte_level, check_same_tokenizer, load_tokenizer
from rlt_mega.data.tokenizer_train import save, train_bpe
from rlt_mega.model.rlt import build_model


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


@pytest.mark.parametrize("name", ["chatml", "qwen"])
def test_a_written_episode_through_the_chat_template(chat_tokenizers, name):
    """sft.env under data.chat_template: the template's text around the answer is the model's, the
    calculator's observations are tokenized alone and found in the answer's ids."""
    from rlt_mega.data.pairs import episode_pair_ids
    from rlt_mega.rollout.env import Calculator

    tok = load_tokenizer(str(chat_tokenizers[name]), chat_template=True)
    question, answer = "What is (50*7)+5?", "<<(50*7)=350>>350 <<350+5=355>>355\n#### 355"
    p, a, observed = episode_pair_ids(tok, question, answer, Calculator().pieces)
    whole_p, whole_a = pair_ids(tok, question, answer)
    assert p == whole_p and tok.decode(a) == tok.decode(whole_a) and a[-1] == whole_a[-1] == tok.turn_end_id
    assert tok.decode([a[i] for i in observed]) == "350>>355>>"
