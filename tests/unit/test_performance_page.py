"""docs/performance.md's tables are rendered from the benchmarks' JSON, never typed: the committed
page equals what tools/docs/render_performance.py renders from docs/bench/*.json, and a
benchmark's results (tools/bench/harness.py ``Results``) carry the machine and the date the
rendered table shows."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load("tools/docs/render_performance.py")
harness = load("tools/bench/harness.py")


def test_performance_page_is_current():
    assert render.main(["--check"]) == 0, "run python tools/docs/render_performance.py"


def test_results_json_renders_with_its_machine(tmp_path):
    parser = argparse.ArgumentParser()
    harness.add_json_arg(parser)
    args = parser.parse_args(["--json", str(tmp_path / "b.json")])
    res = harness.Results("toy", args)
    res.row("speeds", C=1, **{"tok/s": 10.5})
    res.row("speeds", C=16, **{"tok/s": 21.0})
    res.target("speed-up", ">= 1.8x", "2.00x", True)
    res.write()
    data = json.loads((tmp_path / "b.json").read_text())
    m = data["machine"]
    assert m["cores"] >= 1 and m["torch"] and m["cpu"] and m["date"].endswith("UTC")
    text = render.render_tables(render.load_results([tmp_path / "b.json"]))
    assert f"Measured on {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}" in text
    assert "| 16 | 21.0 |" in text and "| toy | speed-up | >= 1.8x | 2.00x | met |" in text


def test_a_file_that_is_not_a_result_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"tables": {}}))
    with pytest.raises(SystemExit, match="no 'bench'"):
        render.load_results([tmp_path / "x.json"])
