"""`rlt-mega export` and `import` never destroy their inputs: an output that is, contains or
lies inside the source is refused (with or without --overwrite), and --overwrite replaces only
an earlier export or an empty directory, never a directory of other files. Nothing is deleted:
every file under the temporary directory is still there, byte for byte."""

import subprocess
import sys

import pytest

from rlt_mega.cli import main

from helpers import ROOT, TINY


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    assert main(["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, "train.steps=1", "checkpoint.every=1",
                 f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp / 'tb'}"]) == 0
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("not an export")
    assert main(["export", str(tmp / "ckpt"), str(tmp / "exp")]) == 0
    return tmp


def cli(*args):
    return subprocess.run([sys.executable, "-m", "rlt_mega", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


CASES = {  # (source, output) relative to the run's directory -> what the message says
    "export onto its source": ("ckpt", "ckpt", "the output directory is the input"),
    "export onto the step": ("ckpt/step_00000001", "ckpt/step_00000001", "the output directory is the input"),
    "export onto a parent of the source": ("ckpt/step_00000001", "ckpt", "the output directory contains the input"),
    "export onto the grandparent": ("ckpt/step_00000001", ".", "the output directory contains the input"),
    "export inside the source": ("ckpt", "ckpt/step_00000001/exp", "the output directory lies inside the input"),
    "export onto a foreign directory": ("ckpt", "mine", "is not an export (no rlt_export.json)"),
    "re-export onto itself": ("exp", "exp", "the output directory is the input"),
    "import onto its source": ("exp", "exp", "the output directory is the input"),
}


@pytest.mark.parametrize("case", CASES)
def test_overwrite_never_destroys_an_input(run, case, capsys):
    src, out, message = CASES[case]
    before = snapshot(run)
    command = "import" if case.startswith("import") else "export"
    capsys.readouterr()
    assert main([command, str(run / src), str(run / out), "--overwrite"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlt-mega {command}: error: ") and message in lines[0], lines
    assert snapshot(run) == before


def test_the_message_through_the_command_line(run):
    proc = cli("export", str(run / "ckpt" / "step_00000001"), str(run / "ckpt"), "--overwrite")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rlt-mega export: error: {run / 'ckpt'}: the output directory contains the input "
        f"{run / 'ckpt' / 'step_00000001'}; "
        "writing it would destroy what is read: choose an output directory outside the input"), proc.stderr[-3000:]


def test_overwrite_replaces_an_earlier_export(run, tmp_path):
    assert main(["export", str(run / "ckpt"), str(tmp_path / "exp")]) == 0
    assert main(["export", str(run / "ckpt"), str(tmp_path / "exp"), "--overwrite", "--dtype", "bf16"]) == 0
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run / "ckpt"), str(tmp_path / "empty")]) == 0
