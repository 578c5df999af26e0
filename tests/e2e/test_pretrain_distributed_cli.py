"""`rlt-mega pretrain` unchanged under torchrun and under the deepspeed launcher: a run stopped
and resumed on the same layout ends with the weights of an uninterrupted one (torch.equal), its
checkpoints export like single-process ones, and a layout that does not fit stops the job at
start-up with the message."""

import torch
from safetensors.torch import load_file

from rlt_mega import cli
from rlt_mega.metrics import read_metrics

from helpers import pretrain_launched

def launch(tmp_path, name, nproc, *overrides, launcher="torchrun", check=True):
    return pretrain_launched(tmp_path, name, nproc, *overrides, launcher=launcher, check=check)


def test_pipeline_run_under_torchrun_resumes_exactly_and_exports(tmp_path):
    layout = ["parallel.pp=2", "parallel.micro_batches=2", "parallel.zero_stage=1", "train.steps=6",
              "checkpoint.every=3"]
    launch(tmp_path, "full", 2, *layout)
    launch(tmp_path, "split", 2, *layout, "train.stop_after=3")
    assert (tmp_path / "split" / "ckpt" / "latest").read_text() == "step_00000003"
    launch(tmp_path, "split", 2, *layout, "train.resume=auto")
    full = load_file(tmp_path / "full" / "ckpt" / "step_00000006" / "model.safetensors")
    resumed = load_file(tmp_path / "split" / "ckpt" / "step_00000006" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "full" / "tb") if "train/loss" in r]
    assert len(losses) == 6 and all(l == l for l in losses)
    # The consolidated weights make the checkpoint exportable like a single-process one.
    assert cli.main(["export", str(tmp_path / "full" / "ckpt"), str(tmp_path / "export")]) == 0
    assert cli.main(["inspect", str(tmp_path / "export")]) == 0


def test_tensor_parallel_zero_run_under_the_deepspeed_launcher(tmp_path):
    launch(tmp_path, "ds", 2, "parallel.tp=2", "parallel.zero_stage=2", "train.steps=2", "checkpoint.every=0",
           launcher="deepspeed")
    step = tmp_path / "ds" / "ckpt" / "step_00000002"
    assert (step / "model.safetensors").is_file() and (step / "deepspeed").is_dir()
    assert '"tp": 2' in (step / "manifest.json").read_text()


def test_a_layout_that_does_not_fit_stops_the_job_at_start_up(tmp_path):
    # Every rank raises the same ConfigError before any collective (the 2-rank scenarios check
    # each rank's message); torchrun stops the job at the first rank that exits, so here we see
    # at least one rank's message and its exit status 2, and no hang (the subprocess timeout).
    proc = launch(tmp_path, "bad", 2, "parallel.tp=3", "train.steps=2", check=False)
    assert proc.returncode != 0
    message = "rlt-mega pretrain: error: parallel.tp * parallel.pp = 3 * 1 = 3 does not divide the world size 2"
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "bad" / "ckpt").exists()
