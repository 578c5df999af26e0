"""A real sweep through the trainer: subprocesses, a few seconds of training each."""

import csv
from pathlib import Path

from rlt_mega.plan.sweep import load_sweep, main, run_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_a_real_sweep_through_the_trainer(tmp_path):
    """A three-step run of a very small model in a subprocess (the trainer's start-up costs
    most of the time): metrics, CSV, plot, and a second invocation that reuses the result
    instead of training again."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        f"base: {TINY}\nout: {tmp_path / 'out'}\n"
        "overrides: [train.steps=3, train.log_every=1, train.eval_every=0, train.micro_batch_size=2,\n"
        "            data.seq_len=8, model.d_model=32, model.n_heads=2, model.n_kv_heads=1, model.ffn_hidden=64,\n"
        "            data.generated.num_train=64, data.generated.num_eval=8, checkpoint.every=0]\n"
        "grid: {model.memory_block: [4]}\n"
        "env: {OMP_NUM_THREADS: '1'}\n")
    assert main([str(spec)]) == 0
    sweep = load_sweep(spec)
    with open(sweep.out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok"] and [r["steps"] for r in rows] == ["3"]
    assert all(float(r["final_loss"]) > 0 and float(r["peak_rss_mb"]) > 0 for r in rows)
    assert (sweep.out / "loss_vs_compute.png").stat().st_size > 0
    stamp = (run_dir(sweep, sweep.runs[0]) / "result.json").stat().st_mtime
    assert main([str(spec)]) == 0  # resumed: nothing reruns
    assert (run_dir(sweep, sweep.runs[0]) / "result.json").stat().st_mtime == stamp
