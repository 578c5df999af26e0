"""docs/costs_at_scale.md: its tables are tools/docs/costs_at_scale.py's output (the planner's
predictions), and each names what bounds the decoder tick."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("costs_at_scale", ROOT / "tools" / "docs" / "costs_at_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_the_generators():
    gen = _generator()
    page = gen.PAGE.read_text()
    assert gen.render(page) == page, "run PYTHONPATH=. python tools/docs/costs_at_scale.py"
    rows = [line for line in page.splitlines() if line.startswith("| ") and "tp=" in line]
    assert len(rows) == len(gen.SEQ_LENS) * len(gen.KV_HEADS) * len(gen.ROWS)
    bounds = {line.rstrip(" |").rsplit("| ", 1)[-1] for line in rows}
    assert bounds <= {"compute", "weight reads", "K/V reads", "TP latency", "launches"} and len(bounds) > 1
