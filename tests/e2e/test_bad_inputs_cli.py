"""Bad inputs through ``rlt-mega pretrain``: a corrupted data file trains on its good records
and shows the skipped counts at the end; an unusable dataset is an error before training
starts; a checkpoint of another model shape, another layout, or with a corrupt file is one
line on stderr with exit status 2, never a traceback."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlt_mega.cli import main
from rlt_mega.config import DataConfig
from rlt_mega.data.datasets import DataError, DataStats, load_records, text_of

from helpers import TINY

GOOD = [json.dumps({"text": f"Mia has {i} apples and buys {i % 7} more. How many now? #### {i + i % 7}"})
        for i in range(120)]
BAD = {  # line -> the reason it is counted under
    b"{not json": "malformed json line",
    b"[" * 5000 + b"]" * 5000: "malformed json line",  # nested beyond Python's recursion limit
    b'"a string, not a record"': "malformed json line",
    b'{"title": "no text field"}': "missing field 'text' (or 'question' and 'answer')",
    b'{"text": 42}': "text field is not a string",
    b'{"text": "   "}': "empty text",
    b'{"text": "caf\xe9 in latin-1"}': "invalid utf-8",
    b'{"text": "lone \\ud800 surrogate"}': "invalid unicode (lone surrogate)",
}


def write_corrupted(path):
    lines = [g.encode() for g in GOOD]
    for i, bad in enumerate(BAD):
        lines.insert(10 * i + 5, bad)
    path.write_bytes(b"\n".join(lines) + b"\n\n\n")  # blank lines are not records


def run_cli(tmp_path, *overrides):
    return main(["pretrain", "--config", "configs/tiny_cpu.yaml", *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"logging.dir={tmp_path / 'tb'}", *overrides])


def one_line_error(capsys, fragment):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlt-mega pretrain: error: ")]
    assert len(lines) == 1 and fragment in lines[0], err[-2000:]
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------- data
def test_corrupted_jsonl_trains_and_reports_skipped_lines_at_the_end(tmp_path):
    data = tmp_path / "corrupted.jsonl"
    write_corrupted(data)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "rlt_mega", "pretrain", "--config", "configs/tiny_cpu.yaml", *TINY,
         f"data.train={data}", "train.steps=3", "checkpoint.every=0", f"checkpoint.dir={tmp_path / 'ckpt'}",
         f"logging.dir={tmp_path / 'tb'}"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tail = proc.stderr.strip().splitlines()[-2:]  # the last lines of the run: the summary, then the result
    assert "data: skipped records:" in tail[0] and f"'data/skipped': {len(BAD)}" in tail[1], tail
    expected = {}
    for reason in BAD.values():
        expected[reason] = expected.get(reason, 0) + 1
    for reason, count in expected.items():
        assert f"{data} [train]: {reason} x{count}" in tail[0], (reason, tail[0])
    assert (tmp_path / "ckpt" / "step_00000003").is_dir()


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.sampled_from(["text", "question", "answer", "x"]),
                                                                   inner, max_size=3)), max_leaves=5)
lines = st.one_of(st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
                  json_values.map(lambda v: json.dumps(v).encode()),
                  st.sampled_from(list(BAD)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.lists(lines, max_size=6))
def test_random_lines_are_loaded_or_skipped_never_a_crash(tmp_path, bad_lines):
    """Any bytes: good records are kept, the others are counted, or the whole file is a
    DataError; every line is accounted for."""
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join([GOOD[0].encode(), *bad_lines]) + b"\n")
    stats = DataStats()
    try:
        ds = load_records(str(path), "train", DataConfig(train=str(path)), text_of(None), ["text"], stats)
    except DataError:
        return
    # blank lines (any Unicode whitespace) are not records, neither kept nor counted
    non_blank = sum(1 for line in [GOOD[0].encode(), *bad_lines] if line.decode(errors="replace").strip())
    assert len(ds) + stats.total == non_blank
    assert all(isinstance(t, str) and t.strip() for t in ds["text"])


@pytest.mark.parametrize("content, fragment", [
    (b"", "is empty: check the path"),
    (b"\n\n", "is empty: check the path"),
    (b"{bad\n" + b'{"text": ""}\n' + b'{"other": "x"}\n', "has no usable records (skipped records: "),
    (b'{"text": "short"}\n' * 3, "fewer than data.seq_len + 1 = 25 tokens"),
])
def test_unusable_dataset_is_an_error_before_training(tmp_path, capsys, content, fragment):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    assert run_cli(tmp_path, f"data.train={data}", f"data.eval={data}") == 2
    one_line_error(capsys, fragment)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tb").exists()  # nothing started


def test_missing_data_file(tmp_path, capsys):
    assert run_cli(tmp_path, f"data.train={tmp_path / 'nope.jsonl'}") == 2
    one_line_error(capsys, "nope.jsonl does not exist")


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete 2-step checkpoint of the tiny model."""
    tmp = tmp_path_factory.mktemp("ckpt")
    assert run_cli(tmp, "train.steps=2", "checkpoint.every=0") == 0
    return tmp / "ckpt" / "step_00000002"


def copy_of(checkpoint, tmp_path):
    dst = tmp_path / "copy" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    return dst


def rehash(step_dir):
    """Rewrites the manifest for the files as they are: a checkpoint consistent with itself but
    wrong (written by another tool or another version), which only the loaders can catch."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"] = {str(p.relative_to(step_dir)): {"size": p.stat().st_size,
                                                        "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def resume(tmp_path, path, *overrides):
    return run_cli(tmp_path, "train.steps=4", f"train.resume={path}", *overrides)


def test_resume_with_another_model_shape(tmp_path, capsys, checkpoint):
    assert resume(tmp_path, checkpoint, "model.d_model=64", "model.n_kv_heads=2") == 2
    line = one_line_error(capsys, "was written for another model")
    assert "model.d_model=32 there, 64 here" in line and "model.n_kv_heads=1 there, 2 here" in line


def test_resume_with_another_shape_and_no_config_in_the_checkpoint(tmp_path, capsys, checkpoint):
    step_dir = copy_of(checkpoint, tmp_path)
    (step_dir / "config.yaml").unlink()
    rehash(step_dir)
    assert resume(tmp_path, step_dir, "model.ffn_hidden=96") == 2
    one_line_error(capsys, "mlp.gate.weight is [64, 32] in the checkpoint, [96, 32] in this model")


def test_resume_on_another_layout_without_the_layout_free_state(tmp_path, capsys, checkpoint):
    # a checkpoint of an older version (no state/) claimed by another layout: it moves only
    # through an export
    step_dir = copy_of(checkpoint, tmp_path)
    shutil.rmtree(step_dir / "state")
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["layout"] = {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 0}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    rehash(step_dir)
    assert resume(tmp_path, step_dir) == 2
    line = one_line_error(capsys, "has no layout-free state (state/)")
    assert "rlt-mega export" in line and "train.init_from" in line


@pytest.mark.parametrize("target, auto", [("model.safetensors", False), ("engine.pt", False),
                                          ("model.safetensors", True)])
def test_resume_from_a_corrupt_file(tmp_path, capsys, checkpoint, target, auto):
    step_dir = copy_of(checkpoint, tmp_path)
    data = bytearray((step_dir / target).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (step_dir / target).write_bytes(bytes(data))
    if auto:  # the only checkpoint of the directory is damaged: an error, not a fresh start
        assert run_cli(tmp_path, "train.steps=4", "train.resume=auto", f"checkpoint.dir={step_dir.parent}") == 2
        one_line_error(capsys, f"no usable checkpoint in {step_dir.parent}")
    else:
        assert resume(tmp_path, step_dir) == 2
        one_line_error(capsys, f"file {target} does not match its checksum (corrupt)")


@pytest.mark.parametrize("target, fragment", [
    ("engine.pt", "engine.pt cannot be read"),
    ("trainer.pt", "trainer.pt cannot be read"),
    ("model.safetensors", "model.safetensors cannot be read as safetensors"),
])
def test_resume_from_garbage_with_a_matching_manifest(tmp_path, capsys, checkpoint, target, fragment):
    step_dir = copy_of(checkpoint, tmp_path)
    (step_dir / target).write_bytes(b"\x00garbage" * 10)
    rehash(step_dir)
    assert resume(tmp_path, step_dir) == 2
    one_line_error(capsys, fragment)


def test_resume_from_a_missing_path(tmp_path, capsys):
    assert resume(tmp_path, tmp_path / "nope") == 2
    one_line_error(capsys, "no such checkpoint directory")
