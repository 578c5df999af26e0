"""A checkpoint from someone else runs no code: a pickle planted in any .pt file (with a
manifest recomputed to match, as anyone can) is refused by resume, inspect and export with
one line naming the file and the type, and the code it carries never runs (its marker file
never appears). The distributed case goes through DeepSpeed's shards: our reader, and
DeepSpeed's own load_checkpoint on a launched resume."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from rlt_mega.checkpoint import load_torch
from rlt_mega.cli import main

from helpers import DIST_TINY, ROOT, TINY, launched


class Payload:
    """Unpickling it would write ``marker`` (builtins.exec of one line)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def plant(file, marker):
    """Replaces ``file`` by a torch.save'd dict carrying the payload, keeping the rest of what
    it held, and rewrites the step's manifest to match."""
    state = load_torch(file, deepspeed=True)  # our own file, written by the run above
    state = {**state, "extra": Payload(marker)}
    torch.save(state, file)
    step_dir = next(p for p in file.parents if p.name.startswith("step_"))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"] = {str(p.relative_to(step_dir)): {"size": p.stat().st_size,
                                                       "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def one_line(err, command, file, launched=False):
    """One error line (a launched run: each rank's own, the same line; torchrun then prints
    its own traceback of the failed child, not ours)."""
    lines = {line for line in err.splitlines() if line.startswith(f"rlt-mega {command}: error: ")}
    assert len(lines) == 1, err[-3000:]
    (line,) = lines
    assert f"checkpoint file {file} holds exec" in line and "refused" in line, line
    assert launched or "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    args = ["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, "train.steps=2", "checkpoint.every=2",
            f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp / 'tb'}"]
    assert main(args) == 0
    return tmp, args


@pytest.mark.parametrize("name", ["trainer.pt", "engine.pt", "rng_rank0.pt"])
def test_resume_refuses_a_planted_pickle(single, tmp_path, capsys, name):
    tmp, args = single
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", ckpt)
    marker = tmp_path / "marker"
    plant(ckpt / "step_00000002" / name, marker)
    capsys.readouterr()
    assert main([*args, "train.steps=3", "train.resume=auto", f"checkpoint.dir={ckpt}"]) == 2
    one_line(capsys.readouterr().err, "pretrain", ckpt / "step_00000002" / name)
    assert not marker.exists()


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """Two launched ZeRO-1 steps without the consolidated file: export reads the shards."""
    tmp = tmp_path_factory.mktemp("dist")
    args = ["pretrain", "--config", "configs/tiny_cpu.yaml", *DIST_TINY, "parallel.zero_stage=1", "train.steps=2",
            "checkpoint.every=2", "checkpoint.consolidate=false", f"checkpoint.dir={tmp / 'ckpt'}",
            f"logging.dir={tmp / 'tb'}"]
    launched(2, args)
    marker = tmp / "marker"
    plant(tmp / "ckpt" / "step_00000002" / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)
    return tmp, args, marker


def cli(*args):
    return subprocess.run([sys.executable, "-m", "rlt_mega", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_inspect_and_export_refuse_a_planted_shard(distributed, tmp_path, command):
    tmp, _, marker = distributed
    step = tmp / "ckpt" / "step_00000002"
    extra = [str(tmp_path / "out"), "--weights", "shards"] if command == "export" else []
    proc = cli(command, str(step), *extra)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    one_line(proc.stderr, command, step / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_distributed_resume_refuses_a_planted_shard(distributed):
    tmp, args, marker = distributed
    proc = launched(2, [*args, "train.steps=3", "train.resume=auto"], check=False)
    assert proc.returncode != 0
    one_line(proc.stderr, "pretrain", tmp / "ckpt" / "step_00000002" / "deepspeed" /
             "zero_pp_rank_0_mp_rank_00_optim_states.pt", launched=True)
    assert not marker.exists()
