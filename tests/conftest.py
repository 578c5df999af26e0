import json
import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ on the path for the shared helpers (reference.py, helpers.py); one thread per test
# process keeps the suite predictable on a 2-core machine.
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
torch.set_num_threads(int(os.environ.get("RLT_TEST_THREADS", "1")))
os.chdir(TESTS.parent)  # configs/ paths relative to the repo root
# The suite runs with deterministic kernels on (train.deterministic's default, warn_only=False),
# so an op we run that has no deterministic CPU kernel fails a test instead of going unnoticed.
torch.use_deterministic_algorithms(True)

TIERS = ("unit", "distributed", "e2e")  # the folders, and their markers (pytest.ini)


# Under pytest-xdist (`--dist loadgroup`, launch/test.sh) a group runs whole on one worker: a test
# file is a group (its module fixtures are built once), and the distributed files that declare
# SCENARIOS are one group (they share one launch per rank count, tests/distributed/conftest.py);
# a distributed file that launches its own ranks is a group of its own, free to run beside them.
# tryfirst: xdist reads the groups in its own collection hook.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        shares = parts and parts[0] == "distributed" and hasattr(getattr(item, "module", None), "SCENARIOS")
        item.add_marker(pytest.mark.xdist_group("distributed" if shares else "/".join(parts)))


# A launch of gloo ranks is one test's setup in --durations: what it spent where is in its rank
# files (tests/distributed/worker.py records each scenario's seconds). Listed after the slowest
# tests, the slowest scenarios of the launches this session ran (the workers' folders included).
@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or config.getoption("collectonly"):
        return
    try:
        base = factory.getbasetemp()
    except OSError:
        return
    seconds = []  # (a launch's folder is at most three below a worker's: no walk of the whole tree)
    # (each once: pytest's "<name>current" links lead to the same files)
    for path in {p.resolve() for depth in range(1, 5) for p in base.glob("*/" * depth + "rank0.json")}:
        try:
            seconds += [(s, name, path.parent.name) for name, s in json.loads(path.read_text()).get(
                "_seconds", {}).items()]
        except (OSError, ValueError, AttributeError):
            continue
    if seconds:
        terminalreporter.write_sep("=", "slowest 10 scenarios of the rank launches (rank 0)")
        for s, name, launch in sorted(seconds, reverse=True)[:10]:
            terminalreporter.write_line(f"{s:8.2f}s {launch}: {name[:150]}")
