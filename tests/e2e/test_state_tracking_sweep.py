"""The state-tracking study's machinery end to end: a sweep of two families on a generated task,
evaluated at two lengths, through the trainer in subprocesses (tiny models, a few steps)."""

import csv
from pathlib import Path

from rlt_mega.cost.sweep import load_sweep, main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_a_two_family_two_length_sweep_on_parity(tmp_path, capsys):
    """An RLT and a dense model trained on running parity at 8 positions, evaluated at 8 and 24:
    every run's row has both accuracies at both lengths, the points their spread, the plot is
    written, and --dry-run prints the estimate of each run with the --set overrides and the --budgets applied."""
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        f"base: {TINY}\nout: {tmp_path / 'out'}\n"
        "overrides: [data.train=generated:parity, data.seq_len=8, 'eval.lengths=[8, 24]', model.max_seq_len=24,\n"
        "            data.task.num_eval=8, train.log_every=1, train.eval_every=1000, train.micro_batch_size=2,\n"
        "            train.steps=2, model.d_model=32, model.n_heads=2, model.n_kv_heads=1, model.ffn_hidden=64,\n"
        "            checkpoint.every=0]\n"
        "grid:\n  family:\n    - {name: rlt, model.arch: rlt}\n    - {name: dense, model.arch: dense}\n"
        "family: '{family}'\nenv: {OMP_NUM_THREADS: '1'}\n")
    assert main([str(spec)]) == 0
    sweep = load_sweep(spec)
    with open(sweep.out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["family"] for r in rows] == ["rlt", "dense"] and all(r["status"] == "ok" for r in rows)
    for r in rows:
        for column in ("token_acc@8", "seq_acc@8", "token_acc@24", "seq_acc@24"):
            assert 0.0 <= float(r[column]) <= 1.0, (r["run"], column, r[column])
        assert float(r["seq_acc@24"]) <= float(r["token_acc@24"])
    with open(sweep.out / "points.csv") as f:
        assert "token_acc@24_std" in next(csv.DictReader(f))
    assert (sweep.out / "accuracy_vs_length.png").stat().st_size > 0
    assert "token acc @24" in capsys.readouterr().out
    assert main([str(spec), "--dry-run", "--set", "model.d_model=64", "--set", "model.n_heads=4",
                 "--budgets", "5e8", "--out", str(tmp_path / "scaled")]) == 0
    out = capsys.readouterr().out
    assert out.count("model.d_model=64") == 2 and out.count(str(tmp_path / "scaled")) >= 2  # both commands
    assert "# family=rlt__budget=5e_08:" in out and "# family=dense__budget=5e_08:" in out  # both estimates
    assert "planner:" in out and "ms/step" in out  # the RLT's step time
    assert "no step-time model for arch=dense" in out
