"""The map of rooms (docs/design.md, "The map"): every import of a module of rlt_mega, at the top
or inside a function, points to the left of

    config, log, loss, precision, determinism, checkpoint, metrics (leaves)
    -> model -> schedule -> parallel -> rollout -> learner -> data, checkpoint_tools, cost -> train -> cli

so a contract two layers share lives in a leaf they both import; ``model/`` knows nothing of
ranks nor of the row schedule (it is handed the schedule's layouts); no two modules import each
other, even through a package's ``__init__``; and the repository stands alone (nothing in the
package, the README or docs/ points to a ``../shared`` outside it). Imports under
``if TYPE_CHECKING:`` are annotations, not dependencies, and are not counted."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEAVES = {"config", "log", "loss", "precision", "determinism", "checkpoint", "metrics"}
ALLOWED = {
    "model": set(),
    "schedule": {"model"},
    "parallel": {"model", "schedule"},
    "rollout": {"model", "schedule", "parallel"},
    "learner": {"model", "schedule", "parallel", "rollout"},
    "data": set(),
    "checkpoint_tools": {"model", "parallel", "data"},
    "cost": {"model", "parallel"},
    "train": {"model", "schedule", "parallel", "rollout", "learner", "data", "checkpoint_tools"},
    "cli": {"model", "schedule", "parallel", "rollout", "learner", "data", "checkpoint_tools", "cost", "train"},
    "reference": {"model"},  # the executable reference of the decoder: tests and benchmarks only
}


def group(module: str) -> str:
    """rlt_mega.parallel.dims -> parallel; rlt_mega.cli, rlt_mega.__main__ -> cli."""
    parts = module.split(".")
    return "cli" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _type_checking_imports(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
            for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The modules an import statement names (``from a import b`` names a and a.b)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the package of this module
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


@functools.lru_cache(maxsize=1)
def imports() -> tuple[tuple[str, str, str], ...]:
    """(file, importing module, imported name) of every rlt_mega import in the package (parsed once
    per session: three tests read it)."""
    out = []
    for path in sorted((ROOT / "rlt_mega").rglob("*.py")):
        module, tree = _module_of(path), ast.parse(path.read_text())
        skip = _type_checking_imports(tree)
        for node in ast.walk(tree):
            if id(node) not in skip:
                out += [(str(path.relative_to(ROOT)), module, n)
                        for n in _imported(node, module, path.name == "__init__.py") if n.startswith("rlt_mega")]
    return tuple(out)


def test_every_import_points_to_the_left():
    found = imports()
    assert len(found) > 100
    wrong = []
    for file, module, imported in found:
        mine, theirs = group(module), group(imported)
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


def test_no_two_modules_import_each_other():
    """No import cycle between modules (function-local imports included): a cycle is a room that
    cannot be read, tested or moved without the other."""
    modules = {_module_of(p) for p in (ROOT / "rlt_mega").rglob("*.py")}

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for _, module, imported in imports():
        target = resolve(imported)
        if target and target != module:
            edges[module].add(target)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def cycle_from(m: str, stack: list[str]):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := cycle_from(n, stack)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(modules):
        if m not in state and (found := cycle_from(m, [])):
            raise AssertionError("import cycle: " + " -> ".join(found))


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
