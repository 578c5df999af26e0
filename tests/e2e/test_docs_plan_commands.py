"""The documentation's `rlt-mega plan` commands run as shown (they need no GPU) and print the
peak memory a reader is told to compare with the GPU's (tests/unit/test_docs_commands.py checks
every other command's flags, keys and layout)."""

import contextlib
import io
import shlex

import pytest

from rlt_mega import cli
from unit.test_docs_commands import COMMANDS, ROOT  # tests/ is on sys.path

PLANS = list(dict.fromkeys(c for _, c in COMMANDS if c.startswith("rlt-mega plan")))


def test_the_docs_show_plan_commands():
    assert any("--nodes" in c for c in PLANS) and any("--world-size" in c for c in PLANS)


@pytest.mark.parametrize("command", PLANS)
def test_a_documented_plan_command_runs(command):
    argv = [str(ROOT / w) if w.startswith("configs/") else w for w in shlex.split(command)[1:]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0, command
    assert "peak" in out.getvalue().lower(), command
