"""`bash launch/demo.sh --async` end to end at tiny sizes: the SFT stage, then GRPO under torchrun
with a sampler role (two processes, rank 1 sampling while rank 0 learns): step 1 learns on-policy
samples and the later ones samples one policy version old, corrected by token_tis (its pi_old / mu
logged), the replay of each step's first minibatch under the version that sampled it is exact, the curves' JSON is written and the
async summary (staleness, idle fractions) is printed."""

import json
import os
import re
import subprocess
import sys

from rlt_mega.metrics import read_metrics

from helpers import ROOT
from test_demo_tool import TINY, venv


def test_the_async_demo_samples_on_its_own_rank_one_version_behind(tmp_path):
    bin_dir = venv(tmp_path) / "bin"
    (bin_dir / "torchrun").write_text(f'#!/bin/bash\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    run = tmp_path / "demo_async"
    env = {**os.environ, "RLT_VENV": str(bin_dir.parent), "RUN": str(run), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "RLT_LOG_LEVEL": "WARNING", "PROBLEMS": "--num-train 100 --num-test 4",
           "SFT_OVERRIDES": "train.steps=2 train.micro_batch_size=8 train.eval_every=0 logging.progress=false",
           "GRPO_OVERRIDES": "train.steps=3 grpo.prompts_per_step=2 grpo.group_size=2 grpo.eval_every=3 "
                             "grpo.eval_size=4 optim.warmup_steps=0 logging.progress=false "
                             # (a reward that tells the completions of a 2-step SFT model apart: rows are learned)
                             "grpo.reward=tests.distributed.grpo_scenarios:odd"}
    out = subprocess.run(["bash", "launch/demo.sh", "--async", *TINY], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-12000:]
    rows = [r for r in read_metrics(run / "grpo" / "tb") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [(r["async/staleness_mean"], r["async/staleness_max"]) for r in rows] == [(0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
    for r in rows:
        assert r["ratio/onpolicy_max_dev"] == 0.0  # minibatch 0 replayed under the version that sampled it
        assert 0.0 <= r["async/learner_idle_fraction"] <= 1.0 and 0.0 <= r["async/sampler_idle_fraction"] <= 1.0
    for r in rows[1:]:  # the stale steps: weighted by min(pi_old / mu, 2), the policy moved since they were drawn
        assert 0.0 < r["is/rho_min"] < 1.0 < r["is/rho_max"] and 0.0 < r["is/weight_mean"] <= 2.0, r
        assert r["ratio/policy_change_max_dev"] == max(1.0 - r["is/rho_min"], r["is/rho_max"] - 1.0)
    curves = json.loads((run / "grpo" / "curves.json").read_text())
    assert [s for s, _ in curves["eval_accuracy"]] == [0, 3] and curves["run"].startswith("--async model.d_model=32")
    assert "|ratio-1| vs sampling version  policy change" in out.stdout, out.stdout[-2000:]
    assert re.search(r"^async: staleness mean 0\.67 \(max 1\), learner idle [\d.]+% and sampler idle [\d.]+% of a "
                     r"step \(mean of 3 steps\); pi_old / mu from [\d.]+ to [\d.]+$", out.stdout, re.MULTILINE), \
        out.stdout[-2000:]
