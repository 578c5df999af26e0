"""Distributed checkpoints across layouts (tests/distributed/checkpoint_scenarios.py on gloo ranks):

* export from TP=2 x PP=2 (ZeRO-1) and from ZeRO-3 on DP=2, from the consolidated
  model.safetensors and from the per-rank shards alone: both agree tensor for tensor, agree with
  DeepSpeed's own utilities (zero_to_fp32; the universal-checkpoint converter's TP merge), and a
  single process loading the export reproduces the training model's logits;
* an export starts a TP=2 x PP=2 run (each rank reads its stage): its logits equal the single-
  process model's, and exporting it again gives identical tensors;
* a ZeRO-1 checkpoint of DP=2 resumes on DP=1 with its optimizer state (Adam moments and step,
  compared through DeepSpeed's converter, equal; the continued run equals the uninterrupted
  one bit for bit, while a weights-only restart does not); a TP change resumes too;
* inspect on a sharded checkpoint, and its errors for missing, truncated or mismatched shards.
"""

import json
import shutil

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from rlt_mega import cli
from rlt_mega.checkpoint import load_torch
from rlt_mega.checkpoint_tools import export_model, load_exported
from rlt_mega.checkpoint_tools.commands import export_path
from rlt_mega.checkpoint_tools.files import CheckpointFormatError
from rlt_mega.checkpoint_tools.inspect_ckpt import format_report, inspect_path
from rlt_mega.config import load_config
from rlt_mega.model.rlt import RLT, build_model
from rlt_mega.parallel.reshard import to_universal
from tests.distributed.checkpoint_scenarios import probe_tokens
from tests.distributed.launch import result, run_ranks
from tests.distributed.scenarios import make_cfg

S = "checkpoint_scenarios."
TP2PP2 = {"tp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 1}
TIED = {"tie_embeddings": True, "qkv_bias": True}
ZERO1 = {"zero_stage": 1}


def tensors_of(export_dir):
    return json.loads((export_dir / "rlt_export.json").read_text())["tensors"]


def logits_of(export_dir, run_cfg):
    cfg, sd = load_exported(export_dir)
    model = RLT(cfg)
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(probe_tokens(run_cfg)[0])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def source_export(root):
    """A single-process model (seed 11, not the runs' seed) exported: what the runs start from."""
    cfg = make_cfg(TIED).model
    return export_model(build_model(cfg, "cpu", seed=11), cfg, root / "source_export")


@pytest.fixture(scope="module")
def four(root, source_export):
    scenarios = [(S + "train_and_save", {"root": str(root / "tp2pp2"), "model": TIED, "parallel": TP2PP2}),
                 (S + "init_from_export", {"root": str(root / "init"), "export": str(source_export),
                                           "model": TIED, "parallel": TP2PP2})]
    results = run_ranks(4, scenarios, root / "four", timeout=600)
    return [result(results, name, args, 0) for name, args in scenarios]


@pytest.fixture(scope="module")
def two(root):
    dp = root / "dp"
    scenarios = [(S + "train_and_save", {"root": str(root / "zero3"), "parallel": {"zero_stage": 3}}),
                 (S + "resume_save", {"root": str(dp), "parallel": ZERO1}),
                 (S + "resume_refused", {"root": str(dp), "checkpoint": str(dp / "saved" / "step_00000002"),
                                         "parallel": {"tp": 2, "zero_stage": 1}}),
                 (S + "train_and_save", {"root": str(root / "bf16"), "parallel": {"zero_stage": 0},
                                         "train": {"dtype": "bf16"}})]
    results = run_ranks(2, scenarios, root / "two", timeout=600)
    return [result(results, name, args, 0) for name, args in scenarios]


@pytest.fixture(scope="module")
def one(root, two):
    """DP=2 -> DP=1: the same global batch as grad_accum=2 micro-batches on one rank."""
    checkpoint = two[1]["checkpoint"]
    weights = export_path(checkpoint, root / "dp" / "weights_only")
    scenarios = [(S + "resume_load", {"root": str(root / "dp"), "checkpoint": checkpoint, "parallel": ZERO1,
                                      "train": {"grad_accum": 2}}),
                 (S + "resume_load", {"root": str(root / "dp"), "checkpoint": checkpoint, "parallel": ZERO1,
                                      "train": {"grad_accum": 2}, "weights_only_export": str(weights),
                                      "tag": "weights_only"})]
    results = run_ranks(1, scenarios, root / "one", timeout=600)
    return [result(results, name, args, 0) for name, args in scenarios]


# ------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------

def test_export_from_tp2_pp2_shards_equals_consolidated_deepspeed_and_the_training_logits(four, root, tmp_path):
    saved = four[0]
    assert saved["layout"] == {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 1, "pp_split": [1, 1]}
    shards_step = root / "tp2pp2" / "shards" / "step_00000002"
    assert not (shards_step / "model.safetensors").exists()  # checkpoint.consolidate=false
    export_path(saved["consolidated"], tmp_path / "consolidated")
    export_path(shards_step, tmp_path / "shards")  # the only source it has
    assert tensors_of(tmp_path / "consolidated") == tensors_of(tmp_path / "shards")  # names, shapes, sha256
    # DeepSpeed's own merge of the same shards (universal checkpoint: TP slices joined by the
    # patterns we declare, pipeline stages by name) holds exactly our tensors.
    to_universal(shards_step / "deepspeed", tmp_path / "universal" / "deepspeed")
    _, ours = load_exported(tmp_path / "shards")
    zero = tmp_path / "universal" / "deepspeed" / "zero"
    merged = {p.name: load_torch(p / "fp32.pt", deepspeed=True)["param"] for p in zero.iterdir() if p.is_dir()}
    assert set(merged) == set(ours)  # lm_head.weight: the last stage's tied copy
    for name, tensor in merged.items():
        assert torch.equal(tensor, ours[name]), name
    run_cfg = load_config(shards_step / "config.yaml")
    trained = torch.load(root / "tp2pp2" / "logits.pt", weights_only=True)
    assert trained.shape == (4, 8, 32)
    assert float((logits_of(tmp_path / "shards", run_cfg) - trained).abs().max()) < 1e-6


def test_export_from_zero3_shards_equals_consolidated_and_deepspeed_zero_to_fp32(two, root, tmp_path):
    saved = two[0]
    assert saved["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 3}
    shards_step = root / "zero3" / "shards" / "step_00000002"
    assert cli.main(["export", saved["consolidated"], str(tmp_path / "consolidated")]) == 0
    assert cli.main(["export", str(shards_step), str(tmp_path / "shards")]) == 0
    assert tensors_of(tmp_path / "consolidated") == tensors_of(tmp_path / "shards")
    # DeepSpeed's zero_to_fp32, called directly on the step's DeepSpeed directory (one model-parallel rank)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(shards_step), tag="deepspeed")
    _, ours = load_exported(tmp_path / "shards")
    assert set(reference) == set(ours)
    for name, tensor in reference.items():
        assert torch.equal(tensor, ours[name]), name
    run_cfg = load_config(shards_step / "config.yaml")
    trained = torch.load(root / "zero3" / "logits.pt", weights_only=True)
    assert float((logits_of(tmp_path / "shards", run_cfg) - trained).abs().max()) < 1e-6


def test_bf16_without_zero_exports_its_fp32_masters_from_either_source(two, root, tmp_path):
    # DeepSpeed's FP16_UnfusedOptimizer keeps full fp32 masters in unnamed lists; the engine
    # saves their names (rlt_master_groups) so the shards export like the consolidated file.
    saved = two[3]
    export_path(saved["consolidated"], tmp_path / "consolidated")
    export_path(root / "bf16" / "shards" / "step_00000002", tmp_path / "shards")
    assert tensors_of(tmp_path / "consolidated") == tensors_of(tmp_path / "shards")
    _, sd = load_exported(tmp_path / "shards")
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in sd.values())  # masters, not bf16 weights


def test_export_can_be_forced_to_read_the_shards_and_says_it_is_weights_only(two, root, tmp_path, capsys):
    consolidated = two[0]["consolidated"]
    assert cli.main(["export", consolidated, str(tmp_path / "e"), "--weights", "shards"]) == 0
    out = capsys.readouterr().out
    assert "weights from the shards" in out and "weights only: the optimizer state stays in the checkpoint" in out
    assert cli.main(["export", str(root / "zero3" / "shards" / "step_00000002"), str(tmp_path / "f"),
                     "--weights", "consolidated"]) == 2
    assert "model.safetensors: missing; read the weights from the shards instead" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Load and reshard
# ------------------------------------------------------------------------------------------

def test_a_tp2_pp2_run_from_an_export_has_its_logits_and_exports_back_identically(four, root, source_export,
                                                                                 tmp_path):
    started = four[1]
    run_cfg = make_cfg(TIED, TP2PP2)
    logits = torch.load(root / "init" / "logits.pt", weights_only=True)
    assert float((logits - logits_of(source_export, run_cfg)).abs().max()) < 1e-6
    # again from the engine's gathered weights, and from its shards-only checkpoint
    export_model(torch.load(root / "init" / "again.pt", weights_only=True), run_cfg.model, tmp_path / "gathered")
    export_path(started["shards"], tmp_path / "from_shards")
    assert tensors_of(tmp_path / "gathered") == tensors_of(source_export)
    assert tensors_of(tmp_path / "from_shards") == tensors_of(source_export)


def test_a_dp_change_resumes_with_the_optimizer_state(two, one, root, tmp_path):
    resumed, weights_only = one
    assert resumed["steps_taken"] == 2 and weights_only["steps_taken"] == 2
    # The optimizer state after the DP=2 -> DP=1 load, saved again at once, holds the same fp32
    # masters, Adam moments and step for every parameter (read by DeepSpeed's converter).
    saved, reloaded = tmp_path / "saved", tmp_path / "reloaded"
    to_universal(root / "dp" / "saved" / "step_00000002" / "deepspeed", saved / "deepspeed")
    to_universal(root / "dp" / "resumed" / "step_00000002" / "deepspeed", reloaded / "deepspeed")
    names = [p.name for p in (saved / "deepspeed" / "zero").iterdir() if p.is_dir()]
    assert len(names) == len(list(build_model(make_cfg().model, "meta").parameters()))
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq", "step"):
            a, b = (load_torch(d / "deepspeed" / "zero" / name / f"{state}.pt", deepspeed=True)
                    for d in (saved, reloaded))
            a, b = (x["param"] if isinstance(x, dict) else x for x in (a, b))
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (name, state)
            if state == "exp_avg_sq":
                assert float(torch.as_tensor(a).abs().max()) > 0  # moments after 2 steps, not zeros
    # Two more steps on DP=1 continue the DP=2 run; a weights-only restart (fresh Adam) does not.
    uninterrupted = torch.load(root / "dp" / "uninterrupted.pt", weights_only=True)
    diffs = {tag: max(float((torch.load(root / "dp" / f"{tag}.pt", weights_only=True)[k] - v).abs().max()) for k, v in
                      uninterrupted.items()) for tag in ("resumed", "weights_only")}
    assert diffs["resumed"] == 0.0, diffs  # a dp-only change, the same global batch: bit for bit
    assert diffs["weights_only"] > 1e-4, diffs


def test_a_tensor_parallel_change_resumes_from_the_layout_free_state(two):
    attempt = two[2]  # dp=2 -> tp=2 (tests/distributed/test_reshard_layouts.py compares the tensors)
    assert not attempt["raised"], attempt["message"]


# ------------------------------------------------------------------------------------------
# Inspect
# ------------------------------------------------------------------------------------------

def test_inspect_lists_the_shards_per_rank_and_verifies_them(four, root, capsys):
    step = root / "tp2pp2" / "shards" / "step_00000002"
    report = inspect_path(step)
    assert set(report["shards"]) == {"0", "1", "2", "3"}
    assert report["shards"]["3"]["tp_rank"] == 1 and report["shards"]["3"]["pp_rank"] == 1
    assert report["checks"]["shards"].startswith("ok (8 files: 4 model-parallel x 1 data-parallel")
    assert report["checks"]["sha256"].startswith("ok")
    assert cli.main(["inspect", str(step)]) == 0
    text = capsys.readouterr().out
    assert "mp 3 (tp 1, pp 1, layers 1..1)" in text and "zero_pp_rank_0_mp_rank_03_optim_states.pt" in text
    assert "resumes: with its optimizer state on any layout: on {tp=2, pp=2, dp=1, zero_stage=1" in text
    assert format_report(report).count("\n  mp ") == 4


def _copy(step, tmp_path):
    dst = tmp_path / step.name
    shutil.copytree(step, dst)
    return dst


def _forget(step, name):
    """Removes ``name`` from the manifest (as if it had never been written)."""
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["files"][name]
    (step / "manifest.json").write_text(json.dumps(manifest))


def test_inspect_and_export_name_the_shard_that_is_missing_truncated_or_of_another_model(four, root, tmp_path,
                                                                                         capsys):
    source = root / "tp2pp2" / "shards" / "step_00000002"
    # missing, and the manifest says so
    step = _copy(source, tmp_path / "missing")
    (step / "deepspeed" / "zero_pp_rank_0_mp_rank_02_optim_states.pt").unlink()
    assert cli.main(["inspect", str(step)]) == 2
    assert "deepspeed/zero_pp_rank_0_mp_rank_02_optim_states.pt listed in the manifest is missing" in \
        capsys.readouterr().err
    # missing without a trace in the manifest: found by the layout
    _forget(step, "deepspeed/zero_pp_rank_0_mp_rank_02_optim_states.pt")
    with pytest.raises(CheckpointFormatError, match=r"zero_pp_rank_0_mp_rank_02_optim_states.pt: missing .*"
                                                    r"one per \(data-parallel, model-parallel\) rank"):
        inspect_path(step)
    # truncated: the checksum (with verification) or the reader (without) names the file
    step = _copy(source, tmp_path / "truncated")
    shard = step / "deepspeed" / "mp_rank_01_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert cli.main(["export", str(step), str(tmp_path / "out")]) == 2
    assert "mp_rank_01_model_states.pt has" in capsys.readouterr().err
    with pytest.raises(CheckpointFormatError, match="mp_rank_01_model_states.pt cannot be read"):
        inspect_path(step, verify=False)
    # shards of another model: config.yaml says d_ffn 128
    step = _copy(source, tmp_path / "other")
    (step / "config.yaml").write_text((step / "config.yaml").read_text().replace("ffn_hidden: 64", "ffn_hidden: 128"))
    _forget(step, "config.yaml")
    with pytest.raises(CheckpointFormatError, match=r"mp_rank_00_model_states.pt: parameter 'blocks.0.mlp.gate.weight' "
                                                    r"has shape \(32, 32\), but the config with tp=2 needs \(64, 32\)"):
        inspect_path(step)
