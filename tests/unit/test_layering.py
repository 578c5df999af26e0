"""The package reads one way (docs/design.md, "The runtime"): every import of a module of
rlt_mega, at the top or inside a function, points to the left of

    config, log, loss, precision, determinism, checkpoint, metrics (leaves)
    -> model -> parallel -> rollout -> learner -> data, checkpoint_tools, plan -> train -> cli

so a contract two layers share lives in a leaf they both import; ``model/`` knows nothing of
ranks; and the repository stands alone (nothing in the package, the README or docs/ points to
a ``../shared`` outside it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEAVES = {"config", "log", "loss", "precision", "determinism", "checkpoint", "metrics"}
ALLOWED = {
    "model": set(),
    "parallel": {"model"},
    "rollout": {"model", "parallel"},
    "learner": {"model", "parallel", "rollout"},
    "data": set(),
    "checkpoint_tools": {"model", "parallel", "data"},
    "plan": {"model", "parallel"},
    "train": {"model", "parallel", "rollout", "learner", "data", "checkpoint_tools"},
    "cli": {"model", "parallel", "rollout", "learner", "data", "checkpoint_tools", "plan", "train"},
    "reference": {"model"},  # the executable reference of the decoder: tests and benchmarks only
}


def group(module: str) -> str:
    """rlt_mega.parallel.dims -> parallel; rlt_mega.cli, rlt_mega.__main__ -> cli."""
    parts = module.split(".")
    return "cli" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def imports() -> list[tuple[str, str, str]]:
    """(file, importing group, imported module) of every rlt_mega import in the package."""
    out = []
    for path in sorted((ROOT / "rlt_mega").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            out += [(str(path.relative_to(ROOT)), group(module), n) for n in names if n.startswith("rlt_mega")]
    return out


def test_every_import_points_to_the_left():
    found = imports()
    assert len(found) > 100
    wrong = []
    for file, mine, imported in found:
        theirs = group(imported)
        if theirs == mine:
            continue
        if mine in LEAVES:
            ok = theirs in {"config", "log"}
        else:
            ok = theirs in LEAVES or theirs in ALLOWED[mine]
        if not ok:
            wrong.append(f"{file} ({mine}) imports {imported} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_nothing_in_the_package_runs_the_reference():
    """rlt_mega/reference.py (the decoder written plainly) is for tests and benchmarks: no training,
    sampling or evaluation path imports it."""
    users = sorted({file for file, _, imported in imports() if imported.startswith("rlt_mega.reference")})
    assert not users, users


def test_the_model_knows_nothing_of_ranks():
    for path in (ROOT / "rlt_mega" / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("torch.distributed", "megatron", "deepspeed")), f"{path} imports {name}"


def test_the_model_speaks_of_rows_positions_and_layouts():
    """model/ is the layer below training: it names no trainer (GRPO), no parallel scheme (tensor
    parallelism) and no capture mechanism (CUDA graphs), in code or in prose."""
    words = re.compile(r"grpo|prompt group|tensor.parallel|cuda.graph|parallel/tp\.py|\btp\b", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in (ROOT / "rlt_mega" / "model").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if words.search(line)]
    assert not hits, "\n".join(hits)


def test_the_repository_stands_alone():
    paths = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "rlt_mega").rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if "../shared" in line]
    assert not hits, hits
