"""Export from a training checkpoint (single process) and the round trip through
train.init_from, driven through the ``rlt-mega`` CLI as a user would."""

import json

import pytest
import torch

from rlt_mega import cli
from rlt_mega.checkpoint_tools import export_model, load_exported
from rlt_mega.checkpoint_tools.inspect_ckpt import inspect_path
from rlt_mega.config import load_config
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.builders import build_engine

TINY = ["model.vocab_size=260", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=16",
        "model.tie_embeddings=true", "data.seq_len=12", "data.generated.num_train=40",
        "data.generated.num_eval=4", "train.micro_batch_size=2", "train.eval_every=0", "train.log_every=1",
        "train.device=cpu", "logging.progress=false", "optim.warmup_steps=0"]


def overrides(tmp_path, name, *extra):
    return TINY + [f"checkpoint.dir={tmp_path / name / 'ckpt'}", f"logging.dir={tmp_path / name / 'tb'}",
                   *extra]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two pretraining steps; returns (tmp dir, checkpoint root)."""
    tmp = tmp_path_factory.mktemp("run")
    assert cli.main(["pretrain", *overrides(tmp, "a", "train.steps=2")]) == 0
    return tmp, tmp / "a" / "ckpt"


def _model_from_checkpoint(tmp, step_dir):
    """The model exactly as the training engine restores it from its checkpoint."""
    cfg = load_config(None, overrides(tmp, "a", "train.steps=2"))
    engine = build_engine(cfg, ParallelDims.single(cfg.model, cfg.train.device))
    engine.load(step_dir)
    return engine.module


def test_export_training_checkpoint_logits_equal(trained, tmp_path):
    tmp, root = trained
    assert cli.main(["export", str(root), str(tmp_path / "exp")]) == 0  # the newest valid checkpoint
    cfg, sd = load_exported(tmp_path / "exp")
    manifest = json.loads((tmp_path / "exp" / "rlt_export.json").read_text())
    step_dir = root / "step_00000002"
    assert manifest["source"]["kind"] == "training_checkpoint" and manifest["source"]["step"] == 2
    assert manifest["source"]["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}
    assert manifest["tokenizer"] == "byte" and manifest["tied"] == {"lm_head.weight": "embed.weight"}
    trained_model = _model_from_checkpoint(tmp, step_dir)
    from rlt_mega.model.rlt import RLT
    loaded = RLT(cfg)
    loaded.load_state_dict(sd)
    tokens = torch.randint(0, 260, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), trained_model(tokens))


def test_round_trip_through_init_from(trained, tmp_path, capsys):
    tmp, root = trained
    assert cli.main(["export", str(root / "step_00000002"), str(tmp_path / "exp")]) == 0
    # a new run initialised from the export: its model is the export, and exports identically
    cfg = load_config(None, overrides(tmp_path, "b", "train.steps=1", f"train.init_from={tmp_path / 'exp'}",
                                      "train.seed=7"))
    model = build_engine(cfg, ParallelDims.single(cfg.model, cfg.train.device)).module
    export_model(model, None, tmp_path / "again")
    first = json.loads((tmp_path / "exp" / "rlt_export.json").read_text())["tensors"]
    again = json.loads((tmp_path / "again" / "rlt_export.json").read_text())["tensors"]
    assert first == again  # identical tensors: same names, shapes, dtypes and sha256
    # and the run trains from there through the CLI
    assert cli.main(["pretrain", *overrides(tmp_path, "b", "train.steps=1",
                                            f"train.init_from={tmp_path / 'exp'}")]) == 0
    assert (tmp_path / "b" / "ckpt" / "step_00000001" / "manifest.json").is_file()


def test_inspect_training_checkpoint(trained, capsys):
    _, root = trained
    report = inspect_path(root)
    assert report["kind"] == "training_checkpoint" and report["step"] == 2
    assert report["layout"]["tp"] == 1 and report["checks"]["shapes"] == "ok"
    assert report["checks"]["sha256"].startswith("ok")
    assert cli.main(["inspect", str(root / "step_00000002")]) == 0
    text = capsys.readouterr().out
    assert "training_checkpoint" in text and "step: 2" in text


def test_export_reads_distributed_layouts_and_refuses_damaged_checkpoints(trained, tmp_path, capsys):
    import shutil

    _, root = trained
    step = tmp_path / "step_00000002"
    shutil.copytree(root / "step_00000002", step)
    # A distributed engine's checkpoint holds a consolidated model.safetensors beside its shards:
    # export reads it whatever the layout.
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["layout"] = {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 0}
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["export", str(step), str(tmp_path / "exp_ok")]) == 0
    capsys.readouterr()
    (step / "model.safetensors").write_bytes((step / "model.safetensors").read_bytes()[:-10])
    assert cli.main(["export", str(step), str(tmp_path / "exp")]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()
