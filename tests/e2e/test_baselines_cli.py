"""The dense and looped baselines through the trainer (model.arch): SFT and pretraining in one
process with checkpoints, resume and a Llama export that transformers generates from;
tensor parallelism with ZeRO under torchrun against the single-process run; and the commands
that refuse them (pipeline parallelism, GRPO, generate), each naming model.arch."""

import pytest
import torch
from safetensors.torch import load_file

from rlt_mega.cli import main
from rlt_mega.metrics import read_metrics

from helpers import DIST_TINY, pretrain_launched

transformers = pytest.importorskip("transformers")


def _losses(tb):
    return [r["train/loss"] for r in read_metrics(tb) if "train/loss" in r]


def test_sft_of_a_looped_model_resumes_exactly_and_a_dense_one_exports_to_transformers(tmp_path):
    common = ["--config", "configs/tiny_cpu.yaml", *DIST_TINY, "data.seq_len=128", "train.steps=4",
              "checkpoint.every=2", "train.eval_every=4", "train.eval_batches=1"]
    looped = [*common, "model.arch=looped", "model.loops=2"]
    assert main(["sft", *looped, f"checkpoint.dir={tmp_path / 'a'}", f"logging.dir={tmp_path / 'a_tb'}"]) == 0
    assert main(["sft", *looped, "train.stop_after=2", f"checkpoint.dir={tmp_path / 'b'}",
                 f"logging.dir={tmp_path / 'b_tb'}"]) == 0
    assert main(["sft", *looped, "train.resume=auto", f"checkpoint.dir={tmp_path / 'b'}",
                 f"logging.dir={tmp_path / 'b_tb'}"]) == 0
    full = load_file(tmp_path / "a" / "step_00000004" / "model.safetensors")
    resumed = load_file(tmp_path / "b" / "step_00000004" / "model.safetensors")
    assert set(full) == set(resumed) and all(torch.equal(full[k], resumed[k]) for k in full)
    assert not any(k.startswith(("cross.", "recur_", "null_memory", "z_init")) for k in full)
    peaks = [r["train/peak_memory_bytes"] for r in read_metrics(tmp_path / "a_tb") if "train/loss" in r]
    assert peaks and all(p > 0 for p in peaks)  # measured (the sweep's peak_memory_mb)

    dense = [*common, "model.arch=dense", f"checkpoint.dir={tmp_path / 'd'}", f"logging.dir={tmp_path / 'd_tb'}"]
    assert main(["pretrain", *dense]) == 0
    assert main(["export", str(tmp_path / "d"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = tok("12 + 7 =", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_tensor_parallel_zero_run_of_a_dense_model_equals_the_single_process_run(tmp_path):
    steps = ["model.arch=dense", "train.steps=3", "checkpoint.every=0", "model.n_kv_heads=2"]
    pretrain_launched(tmp_path, "tp", 2, *steps, "parallel.tp=2", "parallel.zero_stage=1")
    assert main(["pretrain", "--config", "configs/tiny_cpu.yaml", *DIST_TINY, *steps,  # one process, in this one
                 f"checkpoint.dir={tmp_path / 'one' / 'ckpt'}", f"logging.dir={tmp_path / 'one' / 'tb'}"]) == 0
    tp, one = _losses(tmp_path / "tp" / "tb"), _losses(tmp_path / "one" / "tb")
    assert len(tp) == 3 and tp == pytest.approx(one, rel=1e-5, abs=1e-6)
    a = load_file(tmp_path / "tp" / "ckpt" / "step_00000003" / "model.safetensors")
    b = load_file(tmp_path / "one" / "ckpt" / "step_00000003" / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)  # 3 Adam steps over rounding-level gaps


@pytest.mark.parametrize("command,overrides,message", [
    ("plan", ["parallel.pp=2", "--world-size", "2"], "parallel.pp=2 with model.arch=dense"),
    ("grpo", [], "GRPO runs the RLT sampler"),
    ("generate", ["--input", "{prompts}"], "rlt-mega generate/eval runs the RLT sampler"),
])
def test_commands_that_need_an_rlt_refuse_the_baselines(command, overrides, message, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is 2 plus 2?\n")
    overrides = [o.format(prompts=prompts) for o in overrides]
    assert main([command, "--config", "configs/tiny_cpu.yaml", "model.arch=dense", *overrides]) == 2
    assert message in capsys.readouterr().err
