"""The smaller bad inputs through the CLI: eval.k without eval.samples, a missing
`generate --input`, GSPO with the dual clip; and an SFT directory with only train.jsonl
trains (its eval records held out like a single file's)."""

import json

import pytest

from rlt_mega.cli import main

from helpers import TINY

MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2", "data.seq_len=32",
         "logging.progress=false"]


@pytest.mark.parametrize("argv, message", [
    (["eval", *MODEL, "eval.k=[1,4]"], "eval.k=[1, 4] has no effect with eval.samples=0 (greedy accuracy only): "
                                       "set eval.samples to n >= every k for pass@k and maj@k, or leave eval.k out"),
    (["generate", *MODEL, "--input", "no/such/prompts.jsonl"],
     "--input no/such/prompts.jsonl: no such file; give a file of prompts (one per line, or jsonl with 'question'), "
     "or '-' for stdin"),
    (["grpo", *MODEL, "grpo.policy_loss=gspo", "grpo.clip_ratio_c=3"],
     "grpo.clip_ratio_c=3.0 is the dual clip of grpo.policy_loss=clip; GSPO (verl's included) has no dual clip: "
     "set grpo.clip_ratio_c=null with grpo.policy_loss=gspo"),
])
def test_one_line(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"rlt-mega {argv[0]}: error: {message}\n"


def test_sft_directory_with_only_a_train_file(tmp_path):
    data = tmp_path / "sft"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                                              for i in range(40)))
    assert main(["sft", "--config", "configs/tiny_cpu.yaml", *TINY, f"data.train={data}", "train.steps=1",
                 f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]) == 0
