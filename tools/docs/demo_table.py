"""A MkDocs hook (mkdocs.yml ``hooks:``): docs/guide/demo.md's table of held-out accuracies is
rendered at build time from the demo's own results (docs/demo/*.json, written by
``launch/demo_curves.py --json`` at the end of ``bash launch/demo.sh``), with the machine and the
date of each run, in place of the page's marker. Nothing is typed."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- demo table: rendered at build time from docs/demo/*.json -->"


def table(paths: list[Path]) -> str:
    runs = [json.loads(p.read_text()) for p in paths]
    if not runs:
        raise ValueError("docs/demo/ holds no results: run `bash launch/demo.sh` and copy "
                         "runs/demo/grpo/curves.json there")
    steps = [s for s, _ in runs[0]["eval_accuracy"]]
    names = ["after SFT" if s == 0 else f"step {s}" for s in steps]
    lines = ["| run | " + " | ".join(names) + " | best - final | measured on |",
             "|---" * (len(names) + 3) + "|"]
    for r in runs:
        acc = dict((s, a) for s, a in r["eval_accuracy"])
        final = r["eval_accuracy"][-1][1]
        m = r["machine"]
        lines.append(f"| `bash launch/demo.sh {r['run']}`".rstrip() + " | "
                     + " | ".join(f"{acc[s]:.3f}" if s in acc else "" for s in steps)
                     + f" | {max(acc.values()) - final:.3f} | {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
                       f"{m['date']} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "guide/demo.md":
        if markdown.count(MARKER) != 1:
            raise ValueError(f"docs/guide/demo.md: expected the marker {MARKER!r} once, where the table goes")
        markdown = markdown.replace(MARKER, table(sorted((ROOT / "docs" / "demo").glob("*.json"))))
    return markdown
