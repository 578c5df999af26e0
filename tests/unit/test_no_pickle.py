"""Loading never runs code (docs/checkpoints.md): no file of the repository unpickles what it
reads. Every ``torch.load`` says ``weights_only=True`` (or goes through ``checkpoint.load_torch``,
weights-only with the allow-list), and no code calls ``pickle.load``/``loads``, an ``Unpickler``,
``numpy.load(allow_pickle=True)`` or a pickle-based loader (dill, cloudpickle, joblib), but for the
places listed below with their reasons (none today). A syntax-tree scan, so a comment or a string does not count."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("rlt_mega", "tools", "tests", "launch")
# file -> why it may unpickle: not a file read, and never data from outside the job (none: the
# roles' messages through the store are read weights-only too, parallel/roles.py RoleStore.take)
ALLOWED: dict[str, str] = {}
UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("dill", "load"),
              ("dill", "loads"), ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load")}


def pickle_loads(path: Path) -> list[str]:
    """The calls in ``path`` that may unpickle: 'line: what'."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)):
            continue
        owner, name = node.func.value.id, node.func.attr
        keywords = {k.arg: k.value for k in node.keywords}
        if (owner, name) == ("torch", "load"):
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{node.lineno}: torch.load without weights_only=True")
        elif (owner, name) in UNPICKLERS:
            found.append(f"{node.lineno}: {owner}.{name}")
        elif owner in ("np", "numpy") and name == "load":
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{node.lineno}: numpy.load with allow_pickle")
    return found


def test_no_file_unpickles_what_it_reads():
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100
    bad = {str(p.relative_to(ROOT)): found for p in files if (found := pickle_loads(p))}
    assert set(bad) <= set(ALLOWED), {k: v for k, v in bad.items() if k not in ALLOWED}
    assert set(ALLOWED) <= set(bad), "an allowed file no longer unpickles: remove it from ALLOWED"


def test_the_scan_finds_each_kind(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import pickle, torch, numpy as np\n"
                      "torch.load('a', weights_only=False)\ntorch.load('b')\ntorch.load('c', weights_only=True)\n"
                      "pickle.loads(b'')\nnp.load('d', allow_pickle=True)\nnp.load('e')\n"
                      "# torch.load('f', weights_only=False)\ns = \"pickle.load(f)\"\n")
    assert pickle_loads(source) == ["2: torch.load without weights_only=True", "3: torch.load without weights_only=True",
                                    "5: pickle.loads", "6: numpy.load with allow_pickle"]
