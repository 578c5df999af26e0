"""Disk faults through `rlt-mega pretrain`: a disk that fills during a checkpoint save, and a
read-only checkpoint.dir or logging.dir, are one line naming the path, no traceback. The disk
is a real tmpfs (mounted in a user namespace, `unshare -rm`); where the machine does not allow
one, the same run in-process with the writer patched to fail as a full disk does."""

import errno
import shlex
import subprocess
import sys

import pytest
import torch

from rlt_mega.cli import main

from helpers import ROOT, TINY

NAMESPACES = subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def pretrain_args(tmp_path, *extra):
    return ["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'tb'}", *extra]


def in_namespace(mount: str, target, args):
    """``rlt-mega ARGS`` with a fresh tmpfs (mount options ``mount``) on ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    command = (f"mount -t tmpfs -o {mount} tmpfs {shlex.quote(str(target))} && "
               f"exec {shlex.quote(sys.executable)} -m rlt_mega {shlex.join(args)}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", command], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_a_full_disk_during_a_save(tmp_path, monkeypatch, capsys):
    args = pretrain_args(tmp_path, "train.steps=3", "checkpoint.every=1", "checkpoint.keep=5")
    if NAMESPACES:  # room for one checkpoint of this model (about 1.1 MB with its layout-free state), not two
        proc = in_namespace("size=1600k", tmp_path / "ckpt", args)
        code, err = proc.returncode, proc.stderr
    else:
        real_save = torch.save

        def save(obj, f, *a, **k):
            if "step_00000002" in str(f):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", save)
        code, err = main(args), capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("rlt-mega pretrain: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"rlt-mega pretrain: error: no space left on device while saving checkpoint "
                               f"{tmp_path / 'ckpt' / 'step_00000002'}"), lines[0]


@pytest.mark.parametrize("key", ["checkpoint.dir", "logging.dir"])
def test_a_read_only_directory_is_refused_before_the_first_step(tmp_path, key, monkeypatch, capsys):
    target = tmp_path / ("ckpt" if key == "checkpoint.dir" else "tb")
    args = pretrain_args(tmp_path, "train.steps=2")
    if NAMESPACES:
        proc = in_namespace("ro,size=64k", target, args)
        code, err = proc.returncode, proc.stderr
    else:
        target.mkdir()
        target.chmod(0o555)
        code, err = main(args), capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"rlt-mega pretrain: error: {key}={target} is not writable ("), err
    assert "Traceback" not in err and "step 1" not in err
