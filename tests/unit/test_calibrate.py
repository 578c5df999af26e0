"""tools/gpu/calibrate.py in its smoke form (tiny shapes on this CPU): the script end to end, its
JSON read back by the planner (planner.load_calibration), and the planner's decoder tick scaled
by the measured efficiency."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.planner import Hardware, load_calibration, step_time

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "calibrate.py"


def _script():
    spec = importlib.util.spec_from_file_location("calibrate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_form_writes_ratios_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "calibration.json"
    assert _script().main(["--smoke", "--out", str(out), "--repeats", "1"]) == 0
    data = json.loads(out.read_text())
    assert [(r["B"], r["n_kv_heads"]) for r in data["rows"]] == [(1, 4), (4, 4), (1, 2), (4, 2)]
    for r in data["rows"]:
        assert r["measured_fwd_ms"] > 0 and r["predicted_fwd_ms"] > 0
        assert r["ratio_fwd"] == pytest.approx(r["measured_fwd_ms"] / r["predicted_fwd_ms"])
    assert "predicted" in capsys.readouterr().out  # printed beside the measurement
    assert load_calibration(str(out)) == pytest.approx(data["decoder_efficiency"])


def test_the_measured_efficiency_scales_the_decoder_tick(tmp_path):
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, max_seq_len=256)
    layout = Layout(seq_len=256, micro_batch_size=8, checkpointing=CheckpointingConfig())
    base = step_time(cfg, layout, Hardware(nodes=1, gpus_per_node=1))
    slow = step_time(cfg, layout, Hardware(nodes=1, gpus_per_node=1, decoder_efficiency=3.0))
    assert slow["decoder_tick_fwd"] == pytest.approx(3 * base["decoder_tick_fwd"])
    assert slow["decoder"] > 2.9 * base["decoder"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match="calibrate.py"):
        load_calibration(str(bad))
