"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing page or
anchor, an API reference that does not resolve fails it), and its configuration reference,
generated from rlt_mega/config.py at build time, lists every key of the config."""

import html
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlt_mega.config import Config, to_dict

ROOT = Path(__file__).resolve().parents[2]


def dotted(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_site_builds_strict_with_every_page(site):
    nav_pages = [p for p in (ROOT / "docs").rglob("*.md")]
    for page in nav_pages:
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        built = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert built.is_file(), f"docs/{page.relative_to(ROOT / 'docs')} was not built"
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("RLT", "Sampler", "SamplingParams", "GRPOConfig", "resolve_reward", "export_model", "import_hf"):
        assert f'id="{name}"' in api or f".{name}\"" in api, f"the API reference does not render {name}"


def test_config_reference_lists_every_key(site):
    page = html.unescape((site / "reference" / "config" / "index.html").read_text()).replace("<wbr>", "")
    keys = dotted(to_dict(Config()))
    assert len(keys) > 100
    missing = [k for k in keys if f"<code>{k}</code>" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"
    # the words beside a field in config.py reach the page
    assert "C: memory is committed in blocks of C positions" in page


def test_scale_up_tables_are_rendered_from_the_sweep_results(site):
    import csv

    page = html.unescape((site / "scale_up" / "index.html").read_text())
    assert "<!-- scale-up tables" not in page
    points = list(csv.DictReader((ROOT / "docs" / "scaleup" / "points.csv").open()))
    assert points
    for p in points:  # every point of the sweep, with its mean held-out loss
        assert f"<td>{p['label']}</td>" in page, p["label"]
        assert f"{float(p['eval_loss']):.3f} +- {float(p['eval_loss_std']):.3f}" in page, p["label"]


def test_demo_table_is_rendered_from_the_demo_results(site):
    import json

    page = html.unescape((site / "guide" / "demo" / "index.html").read_text())
    assert "<!-- demo table" not in page
    runs = sorted((ROOT / "docs" / "demo").glob("*.json"))
    assert runs, "docs/demo/ holds no demo results"
    for path in runs:
        run = json.loads(path.read_text())
        row = " | ".join(f"{a:.3f}" for _, a in run["eval_accuracy"])
        assert "<td>" + row.replace(" | ", "</td>\n<td>") + "</td>" in page, path.name
        assert run["machine"]["cpu"] in page and run["machine"]["date"] in page
