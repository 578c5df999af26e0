"""CheckpointManager in one process: a save stopped between any two of its phases never
leaves a checkpoint that loads half-written; damaged checkpoints are skipped with a warning;
keep-K pruning; clear errors for shape mismatches and unreadable files.

The same crashes with a real SIGKILL of a training process are in test_crash_resume.py."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_model

from rlt_mega.checkpoint import (CheckpointError, CheckpointManager, MANIFEST, check_resume_config, check_weights,
                                 load_torch, verify)
from rlt_mega.config import Config, save_config


class Crash(Exception):
    """Stands for the process dying at this point: nothing after it runs."""


def writer(step):
    def write(tmp):
        (tmp / "weights.bin").write_bytes(bytes([step % 256]) * 1000)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "rank1.bin").write_bytes(b"x" * (10 + step))

    return write


@pytest.fixture
def warnings():
    """Warning lines of the rlt_mega logger (it does not propagate to the root logger)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("rlt_mega")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def names(root):
    return sorted(p.name for p in root.iterdir())


def test_save_layout_and_verify(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    path = mgr.save(3, writer(3), meta={"layout": {"tp": 1}})
    assert path.name == "step_00000003" and (tmp_path / "latest").read_text() == "step_00000003"
    manifest = verify(path)
    assert manifest["step"] == 3 and manifest["layout"] == {"tp": 1}
    assert set(manifest["files"]) == {"weights.bin", "sub/rank1.bin"}
    assert mgr.resolve("auto") == path and mgr.resolve(str(path)) == path
    assert mgr.resolve(str(tmp_path)) == path  # a checkpoint root: its latest


@pytest.mark.parametrize("phase", ["write", "_seal", "_publish", "_point", "_prune"])
def test_a_save_stopped_at_any_phase_leaves_a_loadable_checkpoint(tmp_path, phase, warnings, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep=2)
    mgr.save(2, writer(2))
    mgr.save(4, writer(4))

    def crash(*args, **kwargs):
        raise Crash

    if phase == "write":  # the files half written: one complete, one torn
        def torn(tmp):
            (tmp / "weights.bin").write_bytes(b"\x06" * 1000)
            (tmp / "sub").mkdir()
            (tmp / "sub" / "rank1.bin").write_bytes(b"x")
            raise Crash

        with pytest.raises(Crash):
            mgr.save(6, torn)
    else:
        monkeypatch.setattr(CheckpointManager, phase, crash)
        with pytest.raises(Crash):
            mgr.save(6, writer(6))
        monkeypatch.undo()
    found = mgr.resolve("auto")
    # before the rename the old pointer's checkpoint; after it, step 6 is complete but until
    # the pointer moves it names step 4, which is taken first (a resume from 4 re-saves 6)
    assert found.name == ("step_00000006" if phase == "_prune" else "step_00000004")
    verify(found)
    if phase in ("write", "_seal", "_publish"):
        assert any(".tmp-step_00000006" in w and "interrupted" in w for w in warnings), warnings
    # the run goes on: the next save clears the leftovers and keeps the newest two
    mgr.save(6, writer(6))
    mgr.save(8, writer(8))
    assert names(tmp_path) == ["latest", "step_00000006", "step_00000008"]
    assert (tmp_path / "step_00000006" / "weights.bin").read_bytes() == bytes([6]) * 1000


def test_tmp_dir_and_step_dir_without_manifest_never_load(tmp_path, warnings):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, writer(1))
    (tmp_path / ".tmp-step_00000009").mkdir()
    (tmp_path / ".tmp-step_00000009" / MANIFEST).write_text("{}")
    (tmp_path / "step_00000005").mkdir()
    (tmp_path / "step_00000005" / "weights.bin").write_bytes(b"\0" * 10)
    (tmp_path / "latest").write_text("step_00000005")
    assert mgr.resolve("auto").name == "step_00000001"
    assert any("step_00000005 is incomplete" in w for w in warnings)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        mgr.resolve(str(tmp_path / "step_00000005"))


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "weights.bin").write_bytes(b"\x01" * 500), "has 500 bytes, the manifest says 1000"),
    (lambda d: (d / "weights.bin").write_bytes(b"\x09" * 1000), "does not match its checksum"),
    (lambda d: (d / "sub" / "rank1.bin").unlink(), "sub/rank1.bin listed in the manifest is missing"),
    (lambda d: (d / MANIFEST).write_text('{"files": {"weights.bin": 3}}'), "manifest.json is corrupt"),
    (lambda d: (d / MANIFEST).write_bytes(b"\xff\xfe{"), "manifest.json is corrupt"),
])
def test_damaged_newest_is_skipped_with_a_warning(tmp_path, damage, message, warnings):
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save(1, writer(1))
    newest = mgr.save(2, writer(2))
    damage(newest)
    assert mgr.resolve("auto").name == "step_00000001"
    assert any("skipping damaged checkpoint" in w and message in w for w in warnings), warnings
    with pytest.raises(CheckpointError, match=message):
        mgr.resolve(str(newest))


def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path):
    mgr = CheckpointManager(tmp_path)
    (mgr.save(1, writer(1)) / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*Move the damaged"):
        mgr.resolve("auto")
    assert CheckpointManager(tmp_path / "empty").resolve("auto") is None  # nothing at all: fresh


def test_resolve_explicit_path_errors(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        mgr.resolve(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no manifest.json"):
        mgr.resolve(str(tmp_path))  # an empty directory is not a checkpoint


def test_keep_k_counts_complete_checkpoints_only(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        mgr.save(step, writer(step))
    assert names(tmp_path) == ["latest", "step_00000004", "step_00000005"]
    (tmp_path / "step_00000005" / MANIFEST).unlink()  # damaged: does not count as kept
    mgr.save(6, writer(6))
    assert names(tmp_path) == ["latest", "step_00000004", "step_00000006"]


def test_resume_from_an_older_checkpoint_keeps_the_pointer_lineage(tmp_path):
    """A run resumed from step 2 while steps 3..4 exist (say, after a divergence): its own
    saves are what resume=auto returns, and the later directories are replaced as it reaches
    them, never pruned ahead of its own newest checkpoint."""
    mgr = CheckpointManager(tmp_path, keep=1)
    for step in range(1, 5):
        mgr.save(step, writer(step))
    mgr = CheckpointManager(tmp_path, keep=1)
    (tmp_path / "latest").write_text("step_00000004")
    saved = mgr.save(2, writer(102))  # the resumed run re-saves step 2 differently
    assert mgr.resolve("auto") == saved and (saved / "weights.bin").read_bytes()[:1] == bytes([102])
    assert names(tmp_path) == ["latest", "step_00000002", "step_00000004"]
    mgr.save(4, writer(104))
    assert names(tmp_path) == ["latest", "step_00000004"]
    assert (tmp_path / "step_00000004" / "weights.bin").read_bytes()[:1] == bytes([104])


def test_resave_interrupted_between_the_renames_restores_the_old_copy(tmp_path, monkeypatch, warnings):
    mgr = CheckpointManager(tmp_path, keep=3)
    mgr.save(2, writer(2))
    real_replace = os.replace

    def replace(src, dst):  # the first rename (old copy aside) happens, then the process dies
        real_replace(src, dst)
        if str(src).endswith("step_00000002") and ".old-" in str(dst):
            raise Crash

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        mgr.save(2, writer(2))
    monkeypatch.undo()
    assert names(tmp_path) == [".old-step_00000002", ".tmp-step_00000002", "latest"]
    mgr.save(3, writer(3))
    assert any("restoring" in w for w in warnings)
    assert names(tmp_path) == ["latest", "step_00000002", "step_00000003"]
    verify(tmp_path / "step_00000002")


# ------------------------------------------------------------------------ loading errors
def test_check_weights_names_shape_mismatches_in_one_line(tmp_path):
    from rlt_mega.config import ModelConfig
    from rlt_mega.model.rlt import build_model

    small = ModelConfig(d_model=16, n_heads=2, n_layers=2, ffn_hidden=32, vocab_size=50)
    save_model(build_model(small, seed=0), str(tmp_path / "model.safetensors"))
    check_weights(tmp_path / "model.safetensors", build_model(small, seed=1))  # same shapes: fine
    wide = ModelConfig(d_model=32, n_heads=2, n_layers=2, ffn_hidden=32, vocab_size=50)
    with pytest.raises(CheckpointError) as err:
        check_weights(tmp_path / "model.safetensors", build_model(wide, seed=0))
    msg = str(err.value)
    assert "\n" not in msg and "embed.weight is [50, 16] in the checkpoint, [50, 32] in this model" in msg
    assert "more)" in msg
    deeper = ModelConfig(d_model=16, n_heads=2, n_layers=3, ffn_hidden=32, vocab_size=50)
    with pytest.raises(CheckpointError, match="missing blocks.2"):
        check_weights(tmp_path / "model.safetensors", build_model(deeper, seed=0))
    tied = ModelConfig(d_model=16, n_heads=2, n_layers=2, ffn_hidden=32, vocab_size=50, tie_embeddings=True)
    save_model(build_model(tied, seed=0), str(tmp_path / "model.safetensors"))
    check_weights(tmp_path / "model.safetensors", build_model(tied, seed=0))  # tied stored once: fine
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        check_weights(tmp_path / "model.safetensors", build_model(tied, seed=0))


def test_load_torch_wraps_unreadable_files(tmp_path):
    (tmp_path / "engine.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="engine.pt cannot be read"):
        load_torch(tmp_path / "engine.pt")
    with pytest.raises(CheckpointError, match="is missing"):
        load_torch(tmp_path / "nope.pt")


def test_resume_config_check(tmp_path, warnings):
    cfg = Config()
    save_config(cfg, tmp_path / "config.yaml")
    check_resume_config(tmp_path, cfg)
    other = Config()
    other.model.n_kv_heads = 2
    other.optim.lr = 5e-4
    with pytest.raises(CheckpointError, match=r"model.n_kv_heads=4 there, 2 here"):
        check_resume_config(tmp_path, other)
    other.model.n_kv_heads = 4
    other.train.log_every = 1  # expected to change: not reported
    check_resume_config(tmp_path, other)
    assert len(warnings) == 1 and "optim.lr: 0.001 -> 0.0005" in warnings[0] and "log_every" not in warnings[0]


# ------------------------------------------------------------------------ untrusted pickles
class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_deepspeed_own_loader_is_weights_only_inside_safe_unpickling(tmp_path):
    """DeepSpeed's checkpoint engine passes weights_only=False itself; inside safe_unpickling
    torch forces the weights-only unpickler anyway, and the allow-list still loads a real
    numpy RNG state."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from rlt_mega.checkpoint import rng_state, safe_unpickling

    marker = tmp_path / "marker"
    torch.save({"x": _Payload(marker)}, tmp_path / "bad.pt")
    torch.save(rng_state(), tmp_path / "rng.pt")
    with safe_unpickling(deepspeed=True):
        with pytest.raises(Exception, match="exec"):
            TorchCheckpointEngine().load(str(tmp_path / "bad.pt"))
        assert TorchCheckpointEngine().load(str(tmp_path / "rng.pt"))["numpy"][0] == "MT19937"
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


def test_load_torch_names_the_file_and_the_refused_type(tmp_path):
    from rlt_mega.checkpoint import UntrustedCheckpointError, load_torch

    marker = tmp_path / "marker"
    torch.save({"x": _Payload(marker)}, tmp_path / "bad.pt")
    with pytest.raises(UntrustedCheckpointError, match=f"checkpoint file {tmp_path / 'bad.pt'} holds exec"):
        load_torch(tmp_path / "bad.pt")
    assert not marker.exists()
