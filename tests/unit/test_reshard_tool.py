"""``rlt-mega reshard`` and ``rlt-mega reshard-cost`` on a one-process checkpoint (no DeepSpeed; the
4-rank cases are in tests/distributed/test_reshard_layouts.py): the output verifies against its
manifest, the input is untouched, the local engine resumes the output with the very same
parameters and Adam state; a layout the config forbids, an output inside the input and a damaged
input are refused with one line naming the key or the file."""

import hashlib
import shutil

import pytest
import torch

from rlt_mega import cli
from rlt_mega.checkpoint import CheckpointManager, verify
from rlt_mega.checkpoint_tools.export import load_exported
from rlt_mega.config import load_config, save_config
from rlt_mega.model.rlt import param_counts
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.reshard import KEYS, LayoutFreeState, reshard_cost
from rlt_mega.train.builders import build_engine
from tests.distributed.scenarios import local_batches, make_cfg

MODEL = {"n_layers": 4, "n_heads": 4, "n_kv_heads": 4}


def engine_of(cfg):
    return build_engine(cfg, ParallelDims.single(cfg.model, "cpu"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process run of 2 steps, saved as the trainer saves (manifest, config.yaml, trainer.pt)."""
    root = tmp_path_factory.mktemp("one")
    cfg = make_cfg(MODEL, optim={"lr": 1e-2})
    engine = engine_of(cfg)
    for step in range(2):
        engine.train_step(local_batches(cfg, step, engine.dims))

    def write(tmp):
        engine.save(tmp)
        save_config(cfg, tmp / "config.yaml")
        torch.save({"loop": {"step": 2}, "job": {}}, tmp / "trainer.pt")

    path = CheckpointManager(root / "ckpt").save(2, write, meta={"layout": engine.layout(), "job": "pretrain"})
    return path, engine


def tree_hash(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


def one_error_line(capsys, fragment):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlt-mega reshard: error: ")]
    assert len(lines) == 1 and fragment in lines[0], err
    return lines[0]


def test_a_reshard_verifies_leaves_its_input_alone_and_resumes_with_the_same_state(saved, tmp_path, capsys):
    src, engine = saved
    before = tree_hash(src)
    out = tmp_path / "tp2pp2"
    assert cli.main(["reshard", str(src), str(out), "--tp", "2", "--pp", "2", "--dp", "1", "--zero", "1"]) == 0
    said = capsys.readouterr().out
    assert "(tp 1->2, pp 1->2, zero_stage 0->1)" in said and f"train.resume={out}" in said
    assert tree_hash(src) == before  # the input, byte for byte
    manifest = verify(out)  # the sha256 of every file written
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 1, "zero_stage": 1, "pp_split": [2, 2]}
    assert manifest["resharded_from"]["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}
    assert set(manifest["files"]) >= {"config.yaml", "trainer.pt"}
    assert sorted({f.split("_")[0] for f in manifest["files"] if f.startswith("state/")}) == \
        ["state/mp000", "state/mp001", "state/mp002", "state/mp003"]
    cfg = load_config(out / "config.yaml")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero_stage) == (2, 2, 1)
    assert LayoutFreeState.open(out).tp == 2
    # resumed in one process from the cut for tp=2 x pp=2: the same parameters, moments and step
    resumed = engine_of(make_cfg(MODEL, optim={"lr": 1e-2}))
    resumed.load(out)
    assert resumed.scheduler.last_epoch == 2
    for (name, p), q in zip(engine.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
        a, b = engine.optimizer.state[p], resumed.optimizer.state[q]
        assert all(torch.equal(a[k], b[k]) for k in KEYS[1:]) and float(a["step"]) == float(b["step"]) == 2, name
    assert resumed.optimizer.param_groups[0]["lr"] == engine.optimizer.param_groups[0]["lr"]


def test_a_reshard_output_exports_the_very_weights_of_its_input(saved, tmp_path, capsys):
    """A reshard output holds the layout-free state only (no model.safetensors, no deepspeed/):
    export reads the weights from its fp32 masters."""
    src, _ = saved
    out = tmp_path / "tp2dp2"
    assert cli.main(["reshard", str(src), str(out), "--tp", "2", "--dp", "2", "--zero", "1"]) == 0
    assert not (out / "model.safetensors").exists() and not (out / "deepspeed").exists()
    assert cli.main(["export", str(out), str(tmp_path / "from_reshard")]) == 0
    assert "weights from the state" in capsys.readouterr().out
    assert cli.main(["inspect", str(out)]) == 0
    assert "resumes: with its optimizer state on any layout, from its layout-free state (state/: it holds no " \
           "engine files, as a reshard output; cut for {tp=2, pp=1, dp=2, zero_stage=1})" in capsys.readouterr().out
    assert cli.main(["export", str(src), str(tmp_path / "from_original")]) == 0
    _, resharded = load_exported(tmp_path / "from_reshard")
    _, original = load_exported(tmp_path / "from_original")
    assert resharded.keys() == original.keys()
    assert all(torch.equal(resharded[n], original[n]) for n in original)
    # asked for files it does not have: one line naming the way
    assert cli.main(["export", str(out), str(tmp_path / "x"), "--weights", "consolidated"]) == 2
    assert "read them from the layout-free state (--weights state)" in capsys.readouterr().err


def test_a_layout_the_config_forbids_is_refused_naming_the_keys(saved, tmp_path, capsys):
    src, _ = saved
    assert cli.main(["reshard", str(src), str(tmp_path / "o"), "--tp", "3"]) == 2
    one_error_line(capsys, "model.n_heads=4 is not divisible by parallel.tp=3")
    assert cli.main(["reshard", str(src), str(tmp_path / "o"), "--tp", "1", "--pp", "2", "--zero", "3"]) == 2
    one_error_line(capsys, "parallel.zero_stage=3 with parallel.pp > 1 is not supported")
    assert not (tmp_path / "o").exists()


def test_an_output_inside_the_input_is_refused(saved, capsys):
    src, _ = saved
    assert cli.main(["reshard", str(src), str(src / "inside"), "--tp", "2"]) == 2
    one_error_line(capsys, "the output directory lies inside the input")
    assert not (src / "inside").exists()


@pytest.mark.parametrize("damage,message", [("missing", "listed in the manifest is missing"),
                                            ("hash", "does not match its checksum")])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, capsys, damage, message):
    src = tmp_path / "copy"
    shutil.copytree(saved[0], src)
    victim = sorted((src / "state").iterdir())[0]
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 1
        victim.write_bytes(bytes(data))
    assert cli.main(["reshard", str(src), str(tmp_path / "o"), "--tp", "2"]) == 2
    line = one_error_line(capsys, message)
    assert f"state/{victim.name}" in line
    assert not (tmp_path / "o").exists()


def test_reshard_cost_counts_every_parameter_once_and_each_rank_its_slices(saved, capsys):
    cfg = make_cfg(MODEL).model
    total = sum(param_counts(cfg).values()) - param_counts(cfg).get("total", 0)
    cost = reshard_cost(cfg, {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}, {"tp": 2, "pp": 1, "dp": 2, "zero_stage": 1})
    assert cost["parameters"] == total and cost["offline"]["bytes_read"] == cost["offline"]["bytes_written"] == 12 * total
    # each TP rank needs its half of the sharded tensors and all of the replicated ones; its two
    # data-parallel ranks read about half of that each and all-gather the rest
    r = cost["resume"]
    assert total * 12 // 4 < r["most_per_rank"] < total * 12 // 2 < r["most_per_rank"] + r["gathered_per_rank"]
    assert total * 12 < r["bytes_read"] < total * 12 * 1.1  # the state once, the replicated tensors once per TP rank
    one = reshard_cost(cfg, {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}, {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0})
    assert one["resume"]["bytes_read"] == one["resume"]["most_per_rank"] == 12 * total
    assert one["resume"]["gathered_per_rank"] == 0
    src, _ = saved
    assert cli.main(["reshard-cost", str(src), "--tp", "2", "--dp", "2"]) == 0
    text = capsys.readouterr().out
    assert "reshard {tp=1, pp=1, dp=1, zero_stage=0} -> {tp=2, pp=1, dp=2, zero_stage=1}" in text
    assert "rlt-mega reshard (one process): reads" in text


def test_without_the_layout_free_state_a_checkpoint_is_12_bytes_a_parameter_smaller_and_stays_on_its_layout(
        saved, tmp_path, capsys):
    """checkpoint.layout_free=false: the optimizer state is stored once (the engine's files); the
    checkpoint resumes on its own layout with everything, and a move is refused naming the key."""
    src, engine = saved
    cfg = make_cfg(MODEL, optim={"lr": 1e-2})
    cfg.checkpoint.layout_free = False
    lean = engine_of(cfg)
    lean.load(src)  # the same state as the saved run
    def write(tmp):
        lean.save(tmp)
        save_config(cfg, tmp / "config.yaml")

    path = CheckpointManager(tmp_path / "lean").save(2, write, meta={"layout": lean.layout(), "job": "pretrain"})
    assert not (path / "state").exists()
    params = sum(p.numel() for p in engine.model.parameters())
    stored = sum(f.stat().st_size for f in (src / "state").iterdir())
    assert 12 * params <= stored < 12 * params + 64 * 1024  # what the switch saves: the tensors and their headers
    again = engine_of(cfg)
    again.load(path)  # its own layout: model.safetensors and engine.pt
    for (name, p), q in zip(engine.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), name
        assert all(torch.equal(engine.optimizer.state[p][k], again.optimizer.state[q][k]) for k in KEYS[1:]), name
    assert cli.main(["reshard", str(path), str(tmp_path / "o"), "--tp", "2"]) == 2
    one_error_line(capsys, "written with checkpoint.layout_free=false")
