"""A real sweep through the trainer: subprocesses, a few seconds of training each."""

import csv
import json
import math
from pathlib import Path

import pytest

from rlt_mega.cost.sweep import load_sweep, main, run_dir, tokens_per_step, flops_per_token

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_a_sweep_of_two_families_and_two_seeds_at_equal_compute(tmp_path, capsys):
    """Dense and looped (R = 2) models, two seeds each, trained to one compute budget (a few
    steps of a very small model in subprocesses; the trainer's start-up costs most of the
    time): every run's CSV row, each point's mean and spread over its seeds, the peak memory
    measured by the trainer, the fits, the plot, and a second invocation that reuses the
    results instead of training again."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        f"base: {TINY}\nout: {tmp_path / 'out'}\n"
        "overrides: [train.log_every=1, train.eval_every=1000, train.eval_batches=1, train.micro_batch_size=2,\n"
        "            data.seq_len=8, model.d_model=32, model.n_heads=2, model.n_kv_heads=1, model.ffn_hidden=64,\n"
        "            data.generated.num_train=64, data.generated.num_eval=8, checkpoint.every=0]\n"
        "grid:\n  family:\n    - {name: dense, model.arch: dense}\n"
        "    - {name: looped, model.arch: looped, model.loops: 2}\n"
        "seeds: [0, 1]\nbudgets: [2.0e+7]\nfamily: '{family}'\n"
        "env: {OMP_NUM_THREADS: '1'}\n")
    assert main([str(spec)]) == 0
    sweep = load_sweep(spec)
    steps = {r.family: r.config.train.steps for r in sweep.runs}
    assert steps["dense"] > steps["looped"] >= 2  # equal compute: the looped model trains fewer tokens
    with open(sweep.out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok"] * 4 and {r["seed"] for r in rows} == {"0", "1"}
    for r in rows:
        spent = float(r["compute_flops"])
        cfg = next(x.config for x in sweep.runs if x.name == r["run"])
        assert abs(spent - 2.0e7) <= tokens_per_step(cfg) * flops_per_token(cfg) / 2
        assert float(r["peak_memory_mb"]) > 0 and math.isfinite(float(r["eval_loss"]))
    with open(sweep.out / "points.csv") as f:
        points = list(csv.DictReader(f))
    assert [p["family"] for p in points] == ["dense", "looped"] and all(p["seeds"] == "2" for p in points)
    for p in points:
        losses = [float(r["eval_loss"]) for r in rows if r["point"] == p["point"]]
        assert float(p["eval_loss"]) == pytest.approx(sum(losses) / 2, rel=1e-6)
        assert float(p["eval_loss_std"]) == pytest.approx(abs(losses[0] - losses[1]) / 2 ** 0.5, rel=1e-6,
                                                          abs=1e-9)
    fits = json.loads((sweep.out / "fits.json").read_text())
    assert set(fits) == {"dense", "looped"} and fits["dense"]["n"] == 2  # one budget: no exponent to fit
    out = capsys.readouterr().out
    assert "power-law fits" in out and "+-" in out
    assert (sweep.out / "loss_vs_compute.png").stat().st_size > 0
    stamp = (run_dir(sweep, sweep.runs[0]) / "result.json").stat().st_mtime
    assert main([str(spec)]) == 0  # resumed: nothing reruns
    assert (run_dir(sweep, sweep.runs[0]) / "result.json").stat().st_mtime == stamp
