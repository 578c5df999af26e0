"""One figure, one source: the figures the docs generate from JSON or CSV (the performance page's
targets from docs/bench/*.json, the demo's accuracies from docs/demo/*.json, the scale-up points
from docs/scaleup/points.csv) are typed on no page, and no page or the README states a verdict or
a demo accuracy that contradicts them, where the text says which figure it means. (That the
generated tables themselves are current: tests/unit/test_performance_page.py and
tests/unit/test_docs.py, which renders the demo and scale-up tables at build time.)"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- BEGIN tables rendered", "<!-- END rendered tables -->"


def sources() -> dict[str, str]:
    """Every page's Markdown and the README, with the performance page's generated tables cut."""
    out = {f"docs/{p.relative_to(ROOT / 'docs')}": p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
    out["README.md"] = (ROOT / "README.md").read_text()
    perf = out["docs/performance.md"]
    out["docs/performance.md"] = perf[:perf.index(BEGIN)] + perf[perf.index(END):]
    return out


def blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows: the units a statement lives in."""
    return [b for b in re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\|))", text) if b.strip()]


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).lower()


def targets() -> dict[str, list[dict]]:
    """Each target the benchmarks' JSON judges, by its name (the text before ':' or ' P=')."""
    out: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        for t in json.loads(path.read_text())["tables"].get("targets", []):
            name = norm(re.split(r":| P=", t["what"])[0]).strip()
            out.setdefault(name, []).append({**t, "file": path.name})
    return out


def demo_runs() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((ROOT / "docs" / "demo").glob("*.json"))]


def verdict_faults(pages: dict[str, str], judged: dict[str, list[dict]]) -> list[str]:
    faults = []
    for page, text in pages.items():
        for block in blocks(text):
            said = norm(block)
            for name, ts in judged.items():
                if name not in said:
                    continue
                verdicts = {t["verdict"] for t in ts}
                for word in set(re.findall(r"\b(met|missed)\b", said)) - verdicts:
                    faults.append(f"{page}: says {name!r} was {word}; {ts[0]['file']} says "
                                  f"{' / '.join(sorted(verdicts))}: {block.strip()[:120]}")
                for t in ts:  # (the performance page's typed history may repeat a number by chance)
                    if page != "docs/performance.md" and re.search(rf"(?<![\d.]){re.escape(t['measured'].split(' ')[0])}(?![\d])", block):
                        faults.append(f"{page}: types {name!r} = {t['measured']} from {t['file']}: link to the "
                                      f"performance page's targets table instead: {block.strip()[:120]}")
    return faults


def demo_faults(pages: dict[str, str], runs: list[dict]) -> list[str]:
    faults = []
    after_sft = {f"{r['eval_accuracy'][0][1]:.3f}" for r in runs}
    final = {f"{r['eval_accuracy'][-1][1]:.3f}" for r in runs}
    for page, text in pages.items():
        for r in runs:
            grpo = " / ".join(f"{a:.3f}" for _, a in r["eval_accuracy"][1:])
            if grpo in text:
                faults.append(f"{page}: types the demo's {grpo} (docs/demo/, rendered on guide/demo.md): link to it")
        for value in re.findall(r"(\d\.\d{3}) after SFT", text):
            if value not in after_sft:
                faults.append(f"{page}: the demo's accuracy after SFT is {value}; docs/demo/ says {sorted(after_sft)}")
        for value in re.findall(r"(\d\.\d{3}) after 20 GRPO steps", text):
            if value not in final:
                faults.append(f"{page}: the demo's final accuracy is {value}; docs/demo/ says {sorted(final)}")
    return faults


def scaleup_faults(pages: dict[str, str]) -> list[str]:
    points = list(csv.DictReader((ROOT / "docs" / "scaleup" / "points.csv").open()))
    shown = [f"{float(p['eval_loss']):.3f} +- {float(p['eval_loss_std']):.3f}" for p in points]
    return [f"{page}: types the scale-up loss {s} (docs/scaleup/points.csv, rendered on scale_up.md)"
            for page, text in pages.items() for s in shown if s in text]


def test_no_page_contradicts_or_retypes_a_generated_figure():
    pages = sources()
    judged, runs = targets(), demo_runs()
    assert judged and runs
    faults = verdict_faults(pages, judged) + demo_faults(pages, runs) + scaleup_faults(pages)
    assert not faults, "\n".join(faults)


def test_the_checks_find_a_contradiction_and_a_copy():
    judged, runs = targets(), demo_runs()
    grpo = judged["whole grpo step"]
    other = "met" if grpo[0]["verdict"] == "missed" else "missed"
    page = {"docs/guide/x.md": f"Intro.\n\n- **whole GRPO step**: 2.8x, {other}.\n- the whole GRPO step is "
                         f"{grpo[0]['measured']}.\n\nThe demo reaches 0.111 after SFT and "
                         + " / ".join(f"{a:.3f}" for _, a in runs[0]["eval_accuracy"][1:]) + "."}
    found = "\n".join(verdict_faults(page, judged) + demo_faults(page, runs))
    assert f"was {other}" in found and "types 'whole grpo step'" in found
    assert "0.111" in found and "types the demo's" in found


@pytest.mark.parametrize("name", ["whole grpo step", "ring bubble", "sampler against hf generate()"])
def test_the_history_of_a_judged_target_defers_to_the_table(name):
    # the performance page's typed history names these targets: it links to the table for the verdict
    history = sources()["docs/performance.md"].split("## Recorded history", 1)[1]
    item = next(b for b in blocks(history) if norm(b).startswith(f"- **{name}"))
    assert "(#targets-as-last-measured)" in item and not re.search(r"\b(met|missed)\b", norm(item))
