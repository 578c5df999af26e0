"""Every command that writes a directory (or a prefix's files) and takes --overwrite never
destroys its input nor a folder of other files (checkpoint.check_output, the one guard):
`rlt-mega export` (plain, --merge, --adapters), `import`, `preprocess`, `tokenizer train` and the
sweeps. An output that is, contains or lies inside an input is refused (with or without
--overwrite); --overwrite replaces only an earlier output of the same command or an empty
directory. Each refusal is one line, and nothing is changed: every file under the temporary
directory (the inputs, a folder of notes) is still there, byte for byte."""

import json
import subprocess
import sys

import pytest

from rlt_mega.cli import main
from rlt_mega.cost import sweep as sweeps

from helpers import ROOT, TINY


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


SWEEP = """base: {base}
out: {out}
overrides: [train.steps=1, model.d_model=32, model.n_heads=2, model.n_kv_heads=1, model.ffn_hidden=64]
grid:
  model.n_layers: [2]
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    assert main(["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, "train.steps=1", "checkpoint.every=1",
                 f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp / 'tb'}"]) == 0
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("not an export")
    (tmp / "mine" / "plan.json").write_text('{"not": "a dataset"}')
    assert main(["export", str(tmp / "ckpt"), str(tmp / "exp")]) == 0
    # a run with adapters on the export (its base)
    assert main(["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, "train.steps=1", "checkpoint.every=1",
                 "model.lora.rank=2", f"train.init_from={tmp / 'exp'}", f"checkpoint.dir={tmp / 'lora'}",
                 f"logging.dir={tmp / 'tb_lora'}"]) == 0
    (tmp / "text").mkdir()  # a corpus: a directory with its train file, and a .json file
    lines = [json.dumps({"text": f"{i} plus {i} is {2 * i}"}) for i in range(40)]
    (tmp / "text" / "train.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "corpus.json").write_text("".join(json.dumps({"text": f"{i} times {i} is {i * i}"}) + "\n"
                                             for i in range(40)))
    (tmp / "sweep.yaml").write_text(SWEEP.format(base=ROOT / "configs" / "tiny_cpu.yaml", out=tmp / "sweep"))
    name = sweeps.load_sweep(tmp / "sweep.yaml").runs[0].name
    (tmp / "sweep" / name / "tb").mkdir(parents=True)  # a folder of notes that has a run's name
    (tmp / "sweep" / name / "tb" / "notes.txt").write_text("mine")
    return tmp


def cli(*args):
    return subprocess.run([sys.executable, "-m", "rlt_mega", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


INSIDE = "the output directory lies inside the input"
CASES = {  # the command (paths relative to the run's directory) -> what the one-line message says
    "export onto its source": ("export ckpt ckpt", "the output directory is the input"),
    "export onto the step": ("export ckpt/step_00000001 ckpt/step_00000001", "the output directory is the input"),
    "export onto a parent of the source": ("export ckpt/step_00000001 ckpt", "the output directory contains the input"),
    "export onto the grandparent": ("export ckpt/step_00000001 .", "the output directory contains the input"),
    "export inside the source": ("export ckpt ckpt/step_00000001/exp", INSIDE),
    "export onto a foreign directory": ("export ckpt mine", "is not an export (no rlt_export.json)"),
    "re-export onto itself": ("export exp exp", "the output directory is the input"),
    "merge onto its source": ("export lora lora --merge", "the output directory is the input"),
    "merge onto the root of its step": ("export lora/step_00000001 lora --merge", "the output directory contains"),
    "merge onto a foreign directory": ("export lora mine --merge", "is not an export (no rlt_export.json)"),
    "merge onto its base": ("export lora exp --merge", "the output directory is the input"),
    "adapters onto a foreign directory": ("export lora mine --adapters",
                                          "is not a peft adapter directory (no adapter_config.json)"),
    "adapters onto their source": ("export lora lora --adapters", "the output directory is the input"),
    "adapters onto the step": ("export lora/step_00000001 lora/step_00000001 --adapters",
                               "the output directory is the input"),
    "adapters onto the root of their step": ("export lora/step_00000001 lora --adapters",
                                             "the output directory contains"),
    "adapters inside their source": ("export lora lora/step_00000001/peft --adapters", INSIDE),
    "adapters onto their base": ("export lora exp --adapters", "the output directory is the input"),
    "import onto its source": ("import exp exp", "the output directory is the input"),
    "import inside its source": ("import exp exp/rlt", INSIDE),
    "import onto a foreign directory": ("import exp mine", "is not an export (no rlt_export.json)"),
    "preprocess onto its input file": ("preprocess --data corpus.json --out corpus",
                                       "corpus.json: the output file is the input"),
    "preprocess inside its input directory": ("preprocess --data text --out text/ids",
                                              "the output file lies inside the input"),
    "preprocess onto a foreign file": ("preprocess --data corpus.json --out mine/plan",
                                       "is not part of an indexed dataset (no"),
    "tokenizer onto a foreign directory": ("tokenizer train --data corpus.json --vocab-size 300 mine",
                                           "is not a tokenizer directory (no tokenizer.json)"),
    "tokenizer onto its data directory": ("tokenizer train --data text --vocab-size 300 text",
                                          "the output directory is the input"),
    "tokenizer onto the folder of its data": ("tokenizer train --data text/train.jsonl --vocab-size 300 text",
                                              "the output directory contains the input"),
    "sweep onto a folder with a run's name": ("sweep sweep.yaml", "is not a sweep run's directory (no output.log)"),
}


def command_line(case, run):
    words = CASES[case][0].split()
    paths = [w if w.startswith("-") or w.isdigit() or w in ("train", "export", "import", "preprocess", "tokenizer",
                                                             "sweep") else str(run / w) for w in words]
    return words[0], paths


@pytest.mark.parametrize("overwrite", [True, False], ids=["--overwrite", "plain"])
@pytest.mark.parametrize("case", CASES)
def test_a_refused_output_changes_nothing(run, case, overwrite, capsys):
    command, argv = command_line(case, run)
    message = CASES[case][1]
    if not overwrite and "foreign" in case:  # without --overwrite: any non-empty output is refused
        message = "pass --overwrite" if command != "preprocess" else "exist: pass --overwrite"
    before = snapshot(run)
    capsys.readouterr()
    if command == "sweep":
        status, prefix = sweeps.main(argv[1:] + (["--force"] if overwrite else [])), "sweep: error: "
    else:
        status, prefix = main(argv + (["--overwrite"] if overwrite else [])), f"rlt-mega {command}: error: "
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(prefix) and message in lines[0], lines
    assert snapshot(run) == before


def test_the_message_through_the_command_line(run):
    proc = cli("export", str(run / "ckpt" / "step_00000001"), str(run / "ckpt"), "--overwrite")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rlt-mega export: error: {run / 'ckpt'}: the output directory contains the input "
        f"{run / 'ckpt' / 'step_00000001'}; "
        "writing it would destroy what is read: choose an output directory outside the input"), proc.stderr[-3000:]


def test_overwrite_replaces_an_earlier_output(run, tmp_path):
    assert main(["export", str(run / "ckpt"), str(tmp_path / "exp")]) == 0
    assert main(["export", str(run / "ckpt"), str(tmp_path / "exp"), "--overwrite", "--dtype", "bf16"]) == 0
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run / "ckpt"), str(tmp_path / "empty")]) == 0
    for _ in range(2):  # a peft directory, then again over it
        assert main(["export", str(run / "lora"), str(tmp_path / "peft"), "--adapters", "--overwrite"]) == 0
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    for _ in range(2):
        assert main(["tokenizer", "train", "--data", str(run / "corpus.json"), "--vocab-size", "300",
                     str(tmp_path / "tok"), "--overwrite"]) == 0
    for _ in range(2):
        assert main(["preprocess", "--data", str(run / "corpus.json"), "--out", str(tmp_path / "ids"),
                     "--overwrite", "--no-progress"]) == 0
