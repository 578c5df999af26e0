"""A MkDocs hook (mkdocs.yml ``hooks:``): the scale-up study's tables in docs/scale_up.md are
rendered at build time from the sweep's own results (docs/scaleup/results.csv, written by
``tools/sweep.py ... --combined docs/scaleup``) by the sweep's Markdown renderer
(rlt_mega/cost/sweep_stats.py ``markdown``), in place of the page's marker. Rerunning the sweep
updates the page; nothing is typed."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- scale-up tables: rendered at build time from docs/scaleup/results.csv -->"
TEXT_FIELDS = ("run", "label", "point", "family", "arch", "status")


def read_results(path: Path) -> list[dict]:
    """results.csv's rows with their measured fields as numbers (csv keeps text only)."""
    return [{k: v if k in TEXT_FIELDS or v == "" else float(v) for k, v in row.items()}
            for row in csv.DictReader(path.open())]


def tables() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rlt_mega.cost.sweep_stats import markdown

    return markdown(read_results(ROOT / "docs" / "scaleup" / "results.csv"))


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "scale_up.md":
        if markdown.count(MARKER) != 1:
            raise ValueError(f"docs/scale_up.md: expected the marker {MARKER!r} once, where the tables go")
        markdown = markdown.replace(MARKER, tables())
    return markdown
