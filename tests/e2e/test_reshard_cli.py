"""`rlt-mega pretrain` under torchrun, as a user changes the data-parallel size of a job: a ZeRO-1
run on two processes that saves shards only (checkpoint.consolidate=false) is continued on one
process with train.resume=auto (and twice the gradient accumulation, so the global batch stays),
keeping its optimizer state; its checkpoints export from the shards and inspect shows them."""

import json

from rlt_mega import cli

from helpers import pretrain_launched as launch

COMMON = ["parallel.zero_stage=1", "train.steps=4", "checkpoint.every=2", "checkpoint.consolidate=false"]


def test_pretrain_resumes_on_another_data_parallel_size_and_exports_from_shards(tmp_path, capsys):
    launch(tmp_path, "job", 2, *COMMON, "train.stop_after=2")
    step2 = tmp_path / "job" / "ckpt" / "step_00000002"
    assert (step2 / "deepspeed").is_dir() and not (step2 / "model.safetensors").exists()
    proc = launch(tmp_path, "job", 1, *COMMON, "train.grad_accum=2", "train.resume=auto")
    assert "layout {tp=1, pp=1, dp=2, zero_stage=1}, on {tp=1, pp=1, dp=1, zero_stage=1} (dp 2->1): fp32 masters, " \
           "Adam moments and step of 36 parameters resharded from its layout-free state" in proc.stderr, \
        proc.stderr[-3000:]
    step4 = tmp_path / "job" / "ckpt" / "step_00000004"
    assert json.loads((step4 / "manifest.json").read_text())["layout"]["dp"] == 1
    assert not list((tmp_path / "job" / "ckpt").glob(".universal-*"))  # the scratch conversion is gone
    assert cli.main(["export", str(tmp_path / "job" / "ckpt"), str(tmp_path / "export")]) == 0
    assert "weights from the shards" in capsys.readouterr().out
    assert cli.main(["inspect", str(step2)]) == 0
    text = capsys.readouterr().out
    assert "mp 0 (tp 0, pp 0, layers 0..1)" in text and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in text
