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
