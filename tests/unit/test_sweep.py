"""Sweeps: grid expansion, the CSV and the plot from run metrics (tests/e2e/test_sweep_cli.py
runs a real sweep through the trainer)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlt_mega.config import ConfigError
from rlt_mega.cost.sweep import command, expand, flops_per_token, plot, run_dir, run_sweep, write_csv

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_grid_is_the_cartesian_product_with_mapping_axes(tmp_path):
    sweep = expand({
        "base": TINY, "out": str(tmp_path), "overrides": ["train.steps=3"],
        "grid": {"model.memory_block": [1, 4, 16], "size": [{"name": "d64", "model.d_model": 64},
                                                            {"name": "d32", "model.d_model": 32,
                                                             "model.n_heads": 2}]},
        "label": "C={model.memory_block} {size}",
    })
    assert [r.name for r in sweep.runs] == [
        "memory_block=1__size=d64", "memory_block=1__size=d32", "memory_block=4__size=d64",
        "memory_block=4__size=d32", "memory_block=16__size=d64", "memory_block=16__size=d32"]
    run = sweep.runs[1]
    assert run.overrides == ["model.memory_block=1", "model.d_model=32", "model.n_heads=2"]
    assert run.label == "C=1 d32"
    assert run.config.model.d_model == 32 and run.config.train.steps == 3  # validated configs
    cmd = command(sweep, run)
    assert cmd[1:4] == ["-m", "rlt_mega", "pretrain"] and f"logging.dir={run_dir(sweep, run) / 'tb'}" in cmd


@pytest.mark.parametrize("spec,match", [
    ({"base": TINY, "grid": {"model.memory_blok": [1]}}, "run memory_blok=1.*did you mean 'memory_block'"),
    ({"base": TINY, "grid": {"model.n_heads": [3]}}, "n_heads=3"),
    ({"base": TINY, "grid": {"model.n_layers": []}}, "non-empty"),
    ({"base": TINY, "grid": {"model.n_layers": [2]}, "lable": "x"}, "unknown sweep key"),
    ({"grid": {"model.n_layers": [2]}}, "needs 'base'"),
    ({"base": TINY, "grid": {"model.n_layers": [2]}, "label": "{model.C}"}, "not a grid axis"),
    ({"base": TINY, "grid": {"model.n_layers": [2]}, "smooth": 0}, "positive integer"),
])
def test_bad_sweeps_fail_before_running(spec, match):
    with pytest.raises(ConfigError, match=match):
        expand(spec)


def _fake_metrics(sweep, run, losses, tokens_per_step=1000):
    tb = run_dir(sweep, run) / "tb"
    tb.mkdir(parents=True)
    with open(tb / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "train/loss": loss, "train/tokens": i * tokens_per_step,
                                "train/tokens_per_s": 100.0 * i}) + "\n")
        f.write(json.dumps({"step": len(losses), "eval/loss": losses[-1] + 0.1}) + "\n")
    (run_dir(sweep, run) / "result.json").write_text(json.dumps({"returncode": 0, "wall_s": 1.0,
                                                                  "peak_rss_mb": 321.0}))


def test_collect_writes_csv_and_plot(tmp_path):
    import matplotlib.image

    sweep = expand({"base": TINY, "out": str(tmp_path), "grid": {"model.n_layers": [2, 4]}, "smooth": 2})
    _fake_metrics(sweep, sweep.runs[0], [3.0, 2.5, 2.0])
    _fake_metrics(sweep, sweep.runs[1], [3.0, 2.4])
    rows = run_sweep(sweep, only_collect=True)
    assert [r["last_loss"] for r in rows] == [2.0, 2.4]
    assert [r["final_loss"] for r in rows] == [pytest.approx(2.25), pytest.approx(2.7)]  # smoothed
    assert rows[0]["eval_loss"] == pytest.approx(2.1)
    assert rows[0]["tokens_per_s"] == pytest.approx(250.0)  # the first window is warm-up
    assert rows[1]["compute_flops"] == pytest.approx(2000 * flops_per_token(sweep.runs[1].config))
    assert rows[1]["flops_per_token"] > rows[0]["flops_per_token"]  # L = 4 costs more per token
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["model.n_layers"] for t in table] == ["2", "4"] and table[0]["peak_rss_mb"] == "321.0"
    image = matplotlib.image.imread(tmp_path / "loss_vs_compute.png")
    assert image.shape[:2] == (400, 640)


def test_trailing_mean():
    from rlt_mega.cost.sweep import trailing_mean

    assert trailing_mean([4.0, 2.0, 0.0, 2.0], 2) == [4.0, 3.0, 1.0, 1.0]
    assert trailing_mean([1.0, 2.0], 1) == [1.0, 2.0]


def test_write_csv_unions_columns(tmp_path):
    write_csv([{"a": 1}, {"a": 2, "b": 3}], tmp_path / "x.csv")
    assert (tmp_path / "x.csv").read_text().splitlines() == ["a,b", "1,", "2,3"]


def test_plot_skips_runs_without_metrics(tmp_path):
    sweep = expand({"base": TINY, "out": str(tmp_path), "grid": {"model.n_layers": [2]}})
    plot(sweep, tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0


# ---------------------------------------------------------------- seeds, budgets, families, fits
def _families(tmp_path, **extra):
    return expand({"base": TINY, "out": str(tmp_path), "overrides": ["data.seq_len=32", "train.micro_batch_size=4"],
                   "grid": {"family": [{"name": "dense", "model.arch": "dense"},
                                       {"name": "looped", "model.arch": "looped", "model.loops": 2}]},
                   "family": "{family}", **extra})


def test_seeds_and_budgets_expand_into_iso_compute_runs(tmp_path):
    from rlt_mega.cost.sweep import steps_for_budget, tokens_per_step

    sweep = _families(tmp_path, seeds=[0, 1], budgets=["1.0e10", 2.0e10])  # YAML reads 1.0e10 as a string
    assert len(sweep.runs) == 8
    assert [r.name for r in sweep.runs[:3]] == ["family=dense__budget=1e_10__seed=0",
                                                "family=dense__budget=1e_10__seed=1",
                                                "family=dense__budget=2e_10__seed=0"]
    assert {r.point for r in sweep.runs} == {f"family={f}__budget={b}" for f in ("dense", "looped")
                                             for b in ("1e_10", "2e_10")}
    for run in sweep.runs:
        cfg = run.config
        assert cfg.train.seed == run.seed and run.family == cfg.model.arch
        assert cfg.train.steps == steps_for_budget(cfg, run.budget)
        per_step = tokens_per_step(cfg) * flops_per_token(cfg)
        assert cfg.train.steps > 3 and abs(cfg.train.steps * per_step - run.budget) <= per_step / 2  # whole steps
    dense, looped = sweep.runs[0].config, sweep.runs[4].config
    assert looped.train.steps < dense.train.steps  # the looped model costs more per token
    with pytest.raises(ConfigError, match="reserved"):
        expand({"base": TINY, "grid": {"seed": [1, 2]}})
    with pytest.raises(ConfigError, match="budgets"):
        _families(tmp_path, budgets=[0])
    with pytest.raises(ConfigError, match="seeds"):
        _families(tmp_path, seeds=[1, 1])


def test_two_families_two_seeds_give_means_spreads_fits_and_one_plot(tmp_path):
    """Losses made from known power laws (alpha 0.10 dense, 0.20 looped) times a seed factor:
    points.csv holds each point's mean and sample std over seeds, fits.json recovers the
    exponents, the report prints them, the plot has the families in one figure."""
    import matplotlib.image

    from rlt_mega.cost.sweep import report

    sweep = _families(tmp_path, seeds=[0, 1], budgets=[1.0e10, 4.0e10])
    alpha = {"dense": 0.10, "looped": 0.20}
    for run in sweep.runs:
        fpt = flops_per_token(run.config)
        steps = run.config.train.steps
        per_step = run.budget / steps / fpt
        factor = 1.02 if run.seed else 0.98
        losses = [factor * 50.0 * ((i + 1) * per_step * fpt) ** -alpha[run.family] for i in range(steps)]
        _fake_metrics(sweep, run, losses, tokens_per_step=per_step)
        eval_path = run_dir(sweep, run) / "tb" / "metrics.jsonl"
        lines = eval_path.read_text().splitlines()[:-1]  # eval loss equal to the last training loss
        lines.append(json.dumps({"step": steps, "eval/loss": losses[-1], "train/peak_memory_bytes": 2 ** 20}))
        eval_path.write_text("\n".join(lines) + "\n")
    rows = run_sweep(sweep, only_collect=True)
    with open(tmp_path / "points.csv") as f:
        points = list(csv.DictReader(f))
    assert len(points) == 4 and all(p["seeds"] == "2" for p in points)
    for p in points:
        runs = [r for r in rows if r["point"] == p["point"]]
        losses = [r["eval_loss"] for r in runs]
        assert float(p["eval_loss"]) == pytest.approx(sum(losses) / 2)
        assert float(p["eval_loss_std"]) == pytest.approx(abs(losses[0] - losses[1]) / 2 ** 0.5)
    fits = json.loads((tmp_path / "fits.json").read_text())
    assert fits["dense"]["metric"] == "eval_loss" and fits["dense"]["n"] == 4
    assert fits["dense"]["alpha"] == pytest.approx(0.10, abs=0.01)
    assert fits["looped"]["alpha"] == pytest.approx(0.20, abs=0.01)
    text = report(rows)
    assert "alpha 0.1" in text and "alpha 0.2" in text and "+-" in text
    image = matplotlib.image.imread(tmp_path / "loss_vs_compute.png")
    assert image.shape[:2] == (400, 640)


def test_power_law_fit_edge_cases():
    from rlt_mega.cost.sweep import power_law_fit

    exact = power_law_fit([1e9, 1e10, 1e11], [4.0, 2.0, 1.0])
    assert exact["alpha"] == pytest.approx(0.30103, rel=1e-4) and exact["r2"] == pytest.approx(1.0)
    same = power_law_fit([1e9, 1e9], [2.0, 2.1])  # one compute value: no exponent, said so by nan
    assert same["n"] == 2 and same["alpha"] != same["alpha"]
    assert power_law_fit([], [])["n"] == 0
