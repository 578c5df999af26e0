"""`bash launch/demo.sh --tool` end to end at tiny sizes: the generated SFT data carries the
calculator's annotations, one GRPO step with the calculator environment logs env/tool_calls and
env/tool_errors with the on-policy replay exact, the curves' PNG lies beside the TensorBoard logs, and the final
model's held-out accuracy is printed with the tool and without it."""

import hashlib
import json
import os
import re
import subprocess
import sys

from rlt_mega.metrics import read_metrics

from helpers import ROOT

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64",
        "model.memory_block=3"]


def venv(tmp_path):
    """A virtual environment for launch/env.sh that is this interpreter (its stamp says installed)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, run in (("python", f'"{sys.executable}"'), ("rlt-mega", f'"{sys.executable}" -m rlt_mega')):
        (bin_dir / name).write_text(f"#!/bin/bash\nexec {run} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    stamp = hashlib.sha256((ROOT / "setup.py").read_bytes() + f"{ROOT}\n".encode()).hexdigest()
    (tmp_path / "venv" / ".rlt_mega_installed").write_text(stamp + "\n")
    return tmp_path / "venv"


def test_the_tool_demo_runs_and_uses_the_calculator(tmp_path):
    run = tmp_path / "demo_tool"
    env = {**os.environ, "RLT_VENV": str(venv(tmp_path)), "RUN": str(run), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT), "PROBLEMS": "--num-train 200 --num-test 4",
           "SFT_OVERRIDES": "train.steps=30 train.micro_batch_size=8 train.log_every=10 optim.lr=4e-3 "
                            "optim.warmup_steps=5 logging.progress=false",
           "GRPO_OVERRIDES": "train.steps=1 grpo.prompts_per_step=2 grpo.group_size=2 grpo.eval_every=1 "
                             "grpo.eval_size=4 optim.warmup_steps=0 logging.progress=false"}
    out = subprocess.run(["bash", "launch/demo.sh", "--tool", *TINY], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "data" / "train.jsonl").read_text().splitlines()]
    styles = {"tool": r"^<<\((\d{3})\*(\d{2})\)=(\d{5})>>\3 <<\3\+(\d)=(\d{5})>>\5\n#### \5$",
              "plain": r"^\((\d{3})\*(\d{2})\)=(\d{5}) \3\+(\d)=(\d{5})\n#### \5$"}
    for style, pattern in styles.items():
        steps = [re.findall(pattern, r["answer"]) for r in records]
        assert 0.2 < sum(map(bool, steps)) / len(records) < 0.8, style  # both styles (--plain 0.6)
        r, (a, b, x, c, total) = next((r, map(int, s[0])) for r, s in zip(records, steps) if s)
        assert r["question"] == f"What is ({a}*{b})+{c}?" and (a * b, x + c) == (x, total)
    rows = [r for r in read_metrics(run / "grpo" / "tb") if "reward/mean" in r]
    assert len(rows) == 1 and rows[0]["ratio/onpolicy_max_dev"] == 0.0
    assert rows[0]["env/tool_calls"] >= 0 and "env/tool_errors" in rows[0], rows[0]  # logged (a 30-step model rarely writes a whole <<expression=)
    assert (run / "grpo" / "curves.png").stat().st_size > 0 and "tool calls per completion: step 1" in out.stdout
    accuracies = re.findall(r"^(calculator|no tool): held-out greedy accuracy: ([\d.]+) \(\d+/4\)$", out.stdout,
                            re.MULTILINE)
    assert [name for name, _ in accuracies] == ["calculator", "no tool"], out.stdout[-2000:]
    with_tool = [json.loads(line)["completion"] for line in (run / "eval_calculator.jsonl").read_text().splitlines()]
    assert len(with_tool) == 4 and (run / "eval.jsonl").exists()
