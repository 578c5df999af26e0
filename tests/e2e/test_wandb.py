"""wandb beside TensorBoard (issue 14): an offline run receives the scalars metrics.jsonl
holds, read back from the run file wandb wrote (without wandb installed: tests/unit/test_wandb_config.py)."""

import json
import struct
import time
from pathlib import Path

import pytest

from rlt_mega import cli
from rlt_mega.metrics import read_metrics

TINY = ["model.vocab_size=260", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_hidden=64",
        "model.max_seq_len=32", "data.seq_len=16", "data.generated.num_train=64", "data.generated.num_eval=8",
        "train.micro_batch_size=4", "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
        "train.device=cpu", "logging.progress=false", "checkpoint.every=0"]

BLOCK = 32768  # wandb's run file is a LevelDB-format log: 32 KiB blocks of framed records
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The protobuf Records of a run-*.wandb file (wandb's own schema, wandb.proto): a 7-byte
    header (":W&B", magic, version), then records framed as LevelDB log records (crc32,
    length, type; a record that would cross a block boundary is split FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's trailer, too short for a record header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        parts = payload if kind in (FULL, FIRST) else parts + payload
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def finished_records(path: Path, timeout: float = 120.0) -> list:
    """The records once the run's exit record is on disk: run.finish() returns before wandb's
    service (a separate process) has written everything, and it writes on in the background."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def history(records) -> dict[int, dict]:
    """step -> {key: value} of every history record."""
    rows: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            step = items.pop("_step", r.history.step.num)
            rows.setdefault(int(step), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def test_offline_wandb_run_receives_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logs = tmp_path / "tb"
    assert cli.main(["pretrain", *TINY, f"checkpoint.dir={tmp_path / 'ck'}", f"logging.dir={logs}",
                     "logging.wandb.project=rlt-test", "logging.wandb.name=tiny", "logging.wandb.mode=offline"]) == 0
    files = list((logs / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = finished_records(files[0])
    logged = history(records)
    expected: dict[int, dict] = {}
    for row in read_metrics(logs):
        step = row.pop("step")
        expected.setdefault(step, {}).update({k: v for k, v in row.items() if v is not None})
    assert sorted(expected) == [1, 2, 3, 4] and "eval/loss" in expected[2] and "train/loss" in expected[1]
    assert logged == expected  # every scalar of every step, the same values
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "rlt-test" and run.display_name == "tiny"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["model"]["d_model"] == 32 and config["logging"]["wandb"]["mode"] == "offline"
