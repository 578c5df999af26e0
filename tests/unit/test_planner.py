"""The layout planner and ``rlt-mega plan``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rlt_mega.cli import main as rlt_main
from rlt_mega.config import load_config
from rlt_mega.model.rlt import param_counts
from rlt_mega.cost.cli import main as plan_main
from rlt_mega.cost.costmodel import estimate
from rlt_mega.cost.layout import Layout
from rlt_mega.config import ConfigError
from rlt_mega.cost.planner import Hardware, evaluate, explain, format_rows_curve, plan_layouts, rows_curve, step_time

ROOT = Path(__file__).resolve().parents[2]
RLT_48 = ROOT / "configs" / "rlt_48x48.yaml"


@pytest.fixture(scope="module")
def rlt48():
    return load_config(RLT_48, ["data.seq_len=2048"])


@pytest.mark.parametrize("nodes", [1, 8, 64])
def test_rlt_48x48_layouts_fit_and_are_ranked(rlt48, nodes):
    hw = Hardware(nodes=nodes, gpus_per_node=8, gpu_mem_gb=80)
    plans, considered = plan_layouts(rlt48.model, hw, 2048, global_batch=64 * nodes)
    assert 0 < len(plans) <= considered
    times = [p.step_time for p in plans]
    assert times == sorted(times)
    for p in plans:
        lay = p.layout
        assert lay.world_size == hw.world_size and p.peak_memory <= hw.capacity_bytes
        assert lay.sequences_per_step == 64 * nodes
        assert not (lay.zero_stage == 3 and lay.pp > 1) and not (lay.zero_stage and lay.dp == 1)
        assert 8 % lay.tp == 0 and 48 % lay.pp == 0
    # the cost model agrees with the planner about the winner's memory
    best = plans[0].layout
    assert estimate(rlt48.model, best)["peak_memory"] == pytest.approx(plans[0].peak_memory)
    text = explain(plans, rlt48.model, hw)
    assert text.startswith("Assumptions") and "Best: " in text and "best other tensor parallel" in text


def test_nothing_fits_a_tiny_gpu(rlt48):
    hw = Hardware(nodes=1, gpus_per_node=8, gpu_mem_gb=4)
    plans, considered = plan_layouts(rlt48.model, hw, 2048, global_batch=8)
    assert considered > 0 and plans == []
    assert "No layout fits" in explain(plans, rlt48.model, hw)


def test_step_time_follows_the_hardware(rlt48):
    lay = Layout(seq_len=2048, micro_batch_size=8, tp=8, dp=1, dtype="bf16")
    slow = step_time(rlt48.model, lay, Hardware(hbm_gbps=1000))
    fast = step_time(rlt48.model, lay, Hardware(hbm_gbps=4000))
    assert fast["decoder"] < slow["decoder"] and fast["encoder_head"] == slow["encoder_head"]
    eager = step_time(rlt48.model, lay, Hardware(launch_us=10))
    assert eager["decoder_tick_fwd"] >= 48 * 50 * 10e-6
    # a pipeline ring with too few micro-batches idles its stages
    ring = step_time(rlt48.model, lay.replace(pp=4, micro_batches=1), Hardware())
    full = step_time(rlt48.model, lay.replace(pp=4, micro_batches=4, micro_batch_size=2), Hardware())
    assert ring["ticks"] == 4 * 2048 and full["ticks"] == 4 * 2048 + 3


def test_plan_command_costs_a_config():
    out = io.StringIO()
    args = ["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--json", "train.micro_batch_size=4"]
    from rlt_mega.cost.cli import add_arguments, run_plan
    import argparse

    assert run_plan(add_arguments(argparse.ArgumentParser()).parse_args(args), out=out) == 0
    rep = json.loads(out.getvalue())
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml")
    assert rep["params"] == param_counts(cfg.model)
    assert rep["layout"]["micro_batch_size"] == 4


def test_rlt_mega_plan_subcommand(capsys):
    assert rlt_main(["plan", "--config", str(ROOT / "configs" / "tiny_cpu.yaml")]) == 0
    text = capsys.readouterr().out
    assert "FLOPs per token" in text and "Peak memory per rank" in text
    assert rlt_main(["plan", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "--nodes", "1",
                     "--gpus-per-node", "2", "--gpu-mem-gb", "1", "--global-batch", "8", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "layouts fit" in text and "Best:" in text


def test_plan_errors_are_one_line(capsys):
    assert plan_main(["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "parallel.tp=3"]) == 2
    assert "parallel" not in capsys.readouterr().out
    assert plan_main(["--config", str(ROOT / "configs" / "tiny_cpu.yaml"), "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'steps'" in err


def test_rows_per_decoder_step_are_searched_past_the_batch_up_to_the_memory_limit(rlt48):
    hw = Hardware(nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    plans, _ = plan_layouts(rlt48.model, hw, 2048, global_batch=8, max_global_batch=256)
    assert any(p.layout.sequences_per_step > 8 for p in plans)  # more rows per step than the batch gives
    assert all(8 <= p.layout.sequences_per_step <= 256 for p in plans)
    speeds = [p.tokens_per_s for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    curve = rows_curve(plans)
    rows = [r["rows"] for r in curve]
    assert rows == sorted(rows) and rows[0] == 1 and len(rows) > 3
    assert not any(p.layout.micro_batch_size > rows[-1] for p in plans)  # the curve ends at the memory limit
    assert "fits no layout: the memory limit" in format_rows_curve(curve)
    with pytest.raises(ConfigError, match="--max-global-batch 4 is below --global-batch 8"):
        plan_layouts(rlt48.model, hw, 2048, global_batch=8, max_global_batch=4)


def test_rlt_48x48_ships_the_planners_first_choice_for_its_cluster():
    """The cluster the file names (8 x 8 H100 80 GB, the planner's default hardware, its default
    batch range); the file's layout is the first plan's, and costs what the plan says."""
    cfg = load_config(RLT_48)
    assert "--nodes 8 --gpus-per-node 8 --gpu-mem-gb 80" in RLT_48.read_text()
    hw = Hardware(nodes=8, gpus_per_node=8, gpu_mem_gb=80)
    plans, _ = plan_layouts(cfg.model, hw, cfg.data.seq_len, 512, dtype=cfg.train.dtype, max_global_batch=4096)
    shipped = evaluate(cfg.model, Layout.from_config(cfg, world_size=64), hw)
    assert shipped.describe() == plans[0].describe()  # decoder_k aside, which ckpt=none does not use
    assert shipped.tokens_per_s == pytest.approx(plans[0].tokens_per_s)
    assert shipped.peak_memory == pytest.approx(plans[0].peak_memory)
