"""`bash launch/demo.sh --distill` end to end at tiny sizes: the teacher (the demo's SFT then
GRPO), the smaller student's SFT, its GRPO alone and with the teacher, the teacher's held-out
accuracy, and $RUN/distill.json with both arms' accuracy by step; then TEACHER=<that export>
reuses the teacher (no teacher stages run), with its top-k forward KL in the distilled arm
(DISTILL_OVERRIDES)."""

import json
import os
import subprocess

from rlt_mega.metrics import read_metrics

from helpers import ROOT
from test_demo_tool import TINY, venv

SFT = "train.steps=4 train.micro_batch_size=8 train.eval_every=0 logging.progress=false"
GRPO = ("train.steps=2 grpo.prompts_per_step=2 grpo.group_size=2 grpo.eval_every=1 grpo.eval_size=4 "
        "optim.warmup_steps=0 logging.progress=false")


def _demo(tmp_path, run, **env):
    if not (tmp_path / "venv").is_dir():
        venv(tmp_path)
    env = {**os.environ, "RLT_VENV": str(tmp_path / "venv"), "RUN": str(run), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "PROBLEMS": "--num-train 200 --num-test 4", "SFT_OVERRIDES": SFT,
           "GRPO_OVERRIDES": GRPO, **env}
    out = subprocess.run(["bash", "launch/demo.sh", "--distill", *TINY], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_the_distillation_demo_runs_both_arms_and_reuses_a_teacher(tmp_path):
    run = tmp_path / "distill"
    out = _demo(tmp_path, run)
    assert "== 2. the teacher" in out and (run / "teacher" / "export").is_dir()
    curves = json.loads((run / "distill.json").read_text())
    assert 0 <= curves["teacher_accuracy"] <= 1
    for arm in ("grpo", "distill"):
        assert [s for s, _ in curves[arm]["eval_accuracy"]] == [0, 1, 2], curves[arm]
        rows = [r for r in read_metrics(run / arm / "tb") if "reward/mean" in r]
        assert len(rows) == 2 and all(r["ratio/onpolicy_max_dev"] == 0.0 for r in rows)
    assert curves["distill"]["reverse_kl"] and not curves["grpo"]["reverse_kl"]  # only that arm has the teacher
    again = tmp_path / "reused"
    out = _demo(tmp_path, again, TEACHER=str(run / "teacher" / "export"),
                DISTILL_OVERRIDES="grpo.teacher_topk=4")
    assert "== 2. the teacher" not in out and not (again / "teacher").exists()
    rows = [r for r in read_metrics(again / "distill" / "tb") if "reward/mean" in r]
    assert all("distill/forward_kl_topk" in r for r in rows) and "distill/forward_kl_topk" not in str(
        read_metrics(again / "grpo" / "tb"))
