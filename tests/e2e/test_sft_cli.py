"""SFT (loss on answer tokens only) and the inference commands (`eval`, `generate`) through the CLI."""

import io
import json

import pytest
import torch

from rlt_mega.checkpoint import load_torch
from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.memory_block=2", "model.max_seq_len=160",
        "data.seq_len=128", "logging.progress=false"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A short SFT run on generated problems; shared by the tests below."""
    root = tmp_path_factory.mktemp("sft")
    args = ["sft", *TINY, "data.generated.num_train=64", "data.generated.num_eval=8", "train.steps=12",
            "train.micro_batch_size=4", "train.eval_every=6", "train.log_every=3", "optim.warmup_steps=2",
            f"checkpoint.dir={root / 'ckpt'}", f"logging.dir={root / 'tb'}"]
    assert main(args) == 0
    return root


def test_sft_trains_and_checkpoints(sft_run):
    records = read_metrics(sft_run / "tb")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(losses) == 4 and len(evals) == 2
    assert losses[-1] < losses[0] and evals[-1] < evals[0]
    assert (sft_run / "ckpt" / "step_00000012" / "model.safetensors").is_file()


def test_eval_and_generate_from_the_sft_checkpoint(sft_run, tmp_path, capsys, monkeypatch):
    common = [*TINY, f"checkpoint.dir={sft_run / 'ckpt'}", "data.generated.num_eval=8",
              "sampling.max_new_tokens=12", "sampling.batch_size=3"]
    out = tmp_path / "eval.jsonl"
    assert main(["eval", *common, "--output", str(out)]) == 0
    assert "greedy accuracy:" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all("completion" in r for r in rows)

    monkeypatch.setattr("sys.stdin", io.StringIO("Mia has 3 apples.\n" + json.dumps({"question": "q?"}) + "\n"))
    assert main(["generate", *common, "sampling.temperature=0.8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["question"] for r in lines] == ["Mia has 3 apples.", "q?"]


def test_eval_from_an_export_equals_eval_from_the_checkpoint(sft_run, tmp_path, capsys):
    """SFT -> export -> train.init_from: the path the demo takes from SFT into GRPO."""
    assert main(["export", str(sft_run / "ckpt"), str(tmp_path / "export")]) == 0
    common = [*TINY, "data.generated.num_eval=8", "sampling.max_new_tokens=12"]
    assert main(["eval", *common, f"checkpoint.dir={sft_run / 'ckpt'}", "--limit", "4",
                 "--output", str(tmp_path / "a.jsonl")]) == 0
    assert main(["eval", *common, f"train.init_from={tmp_path / 'export'}", "--limit", "4",
                 "--output", str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    capsys.readouterr()
    assert main(["eval", *TINY, f"checkpoint.dir={tmp_path / 'nothing'}", "--limit", "2"]) == 2
    assert "no weights" in capsys.readouterr().err


def test_sft_from_a_local_jsonl(tmp_path):
    data = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"})
             for i in range(20)]
    data.write_text("\n".join(lines + ["not json", json.dumps({"question": "no answer"})]) + "\n")
    args = ["sft", *TINY, f"data.train={data}", "train.steps=2", "train.micro_batch_size=4", "train.eval_every=0",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]
    assert main(args) == 0
    assert load_torch(tmp_path / "ckpt" / "step_00000002" / "trainer.pt", deepspeed=True)["loop"]["step"] == 2
