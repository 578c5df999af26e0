"""`rlt-mega pretrain` unchanged under torchrun and under the deepspeed launcher: a run stopped
and resumed on the same layout ends with the weights of an uninterrupted one (torch.equal), its
checkpoints export like single-process ones, a layout that does not fit stops the job at
start-up with `rlt-mega plan`'s message, and an uneven stage split the plan accepts runs."""

import json

import torch
from safetensors.torch import load_file

from rlt_mega import cli
from rlt_mega.metrics import read_metrics

from helpers import DIST_TINY, pretrain_launched


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
    message = "parallel.tp * parallel.pp = 3 * 1 = 3 does not divide the world size 2"
    assert f"rlt-mega pretrain: error: {message}" in proc.stderr, proc.stderr[-3000:]
    plan = ["plan", "--config", "configs/tiny_cpu.yaml", *DIST_TINY, "parallel.tp=3", "--world-size", "2"]
    assert cli.main(plan) == 2  # the same message (tests/unit/test_layout_rules.py compares them)
    assert "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "bad" / "ckpt").exists()


def test_an_uneven_stage_split_the_plan_accepts_runs_under_torchrun(tmp_path, capsys):
    """Three layers on two stages without parallel.pp_split: `rlt-mega plan` accepts it and costs
    stages [0, 1] and [2]; the trainer runs exactly that split (the checkpoint records it)."""
    layout = ["model.n_layers=3", "parallel.pp=2", "parallel.micro_batches=2", "train.steps=2", "checkpoint.every=0"]
    assert cli.main(["plan", "--config", "configs/tiny_cpu.yaml", *DIST_TINY, *layout, "--world-size", "2",
                     "--json"]) == 0
    assert [r["layers"] for r in json.loads(capsys.readouterr().out)["per_rank"]] == [[0, 1], [2]]
    launch(tmp_path, "uneven", 2, *layout)
    manifest = json.loads((tmp_path / "uneven" / "ckpt" / "step_00000002" / "manifest.json").read_text())
    assert manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1, "zero_stage": 0, "pp_split": [2, 1]}
    assert [r["step"] for r in read_metrics(tmp_path / "uneven" / "tb") if "train/loss" in r] == [1, 2]
