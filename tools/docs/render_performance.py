"""Renders docs/performance.md's measured tables from the benchmarks' JSON results (each
benchmark's ``--json PATH``, written by tools/bench/harness.py ``Results``), with the machine
(CPU model, cores, torch version) and the date beside each table. The tables go between the
page's two markers; the rest of the page is prose and stays as written.

    python tools/bench/peer.py --quick --json docs/bench/peer.json     # measure (any benchmark)
    python tools/docs/render_performance.py                             # re-render docs/performance.md
    python tools/docs/render_performance.py --check                     # fails if the page is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "docs" / "bench"
BEGIN = "<!-- BEGIN tables rendered by tools/docs/render_performance.py from docs/bench/*.json: do not edit -->"
END = "<!-- END rendered tables -->"


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return out


def _machine(m: dict) -> str:
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}"


def render_tables(results: list[dict]) -> str:
    """The Markdown between the markers, from the benchmarks' results (sorted by name)."""
    results = sorted(results, key=lambda r: r["bench"])
    lines = [BEGIN, "", "### Targets, as last measured", ""]
    targets = [{"benchmark": r["bench"], **t, "machine, date": _machine(r["machine"])}
               for r in results for t in r["tables"].get("targets", [])]
    lines += _table(targets) if targets else ["(no results yet)"]
    for r in results:
        for title, rows in r["tables"].items():
            if title == "targets":
                continue
            lines += ["", f"### {r['bench']}: {title}", "",
                      f"Measured on {_machine(r['machine'])} by `{r['command']}`.", ""]
            lines += _table(rows)
    return "\n".join(lines + ["", END])


def load_results(paths: list[Path]) -> list[dict]:
    results = []
    for path in paths:
        data = json.loads(path.read_text())
        for key in ("bench", "command", "machine", "tables"):
            if key not in data:
                raise SystemExit(f"{path}: no '{key}': not a result of a benchmark's --json "
                                 "(tools/bench/harness.py Results); rerun the benchmark with --json")
        results.append(data)
    return results


def render_page(page: str, results: list[dict]) -> str:
    if page.count(BEGIN) != 1 or page.count(END) != 1:
        raise SystemExit(f"{PAGE}: expected the markers {BEGIN!r} and {END!r} once each; put them back "
                         "where the rendered tables go")
    head, rest = page.split(BEGIN)
    return head + render_tables(results) + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", type=Path, help="JSON results (default: docs/bench/*.json)")
    ap.add_argument("--check", action="store_true", help="only check that docs/performance.md is current")
    args = ap.parse_args(argv)
    page = PAGE.read_text()
    new = render_page(page, load_results(args.results or sorted(RESULTS.glob("*.json"))))
    if args.check:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/docs/render_performance.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"rendered {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
