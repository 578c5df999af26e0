"""Sampler and learner roles (grpo.sampler_replicas, gloo) against the colocated run in this
process (tests/distributed/async_scenarios.py): with max_staleness 0 and two sampler replicas
(3 processes: data step j from sampler j mod 2) the final parameters (the last checkpoint's)
and every logged loss are torch.equal to the colocated run's; with one sampler, with
max_staleness 1 and partial rollouts (the same fixed pipeline, the sampler sampling the next
step while the learner learns, starting it under the version before and receiving the newer
weights at the switch) the roles' steps and their checkpoint, resumed colocated, give the
uninterrupted colocated run bit for bit (the learner drains the sampler's queued steps into the
checkpoint, with the previous version's parameters). Also the roles' metrics and the layouts
they refuse; a learner of dp=2 (ZeRO-1, ZeRO-3) fed by two samplers with dynamic sampling
(a 4-process launch). A 3-process and a 2-process launch."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlt_mega.config import ConfigError
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.grpo import build_trainer, run_roles
from tests.distributed.async_scenarios import BUCKET_MB, roles_config
from tests.distributed.grpo_scenarios import odd, records
from tests.distributed.launch import result, run_ranks


def colocated(grpo: dict, train: dict, out_dir) -> None:
    cfg = roles_config(grpo, {"resume": "auto", **train}, str(out_dir), 0)
    build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(24), []).run()


def final_params(out_dir) -> dict:
    ckpt = out_dir / "ckpt"
    return load_file(str(ckpt / (ckpt / "latest").read_text().strip() / "model.safetensors"))


def assert_same_optimizer(a_dir, b_dir) -> None:
    """The last checkpoints' optimizer states (engine.pt, and DeepSpeed's per-rank ZeRO shards
    where the engine is DeepSpeed's) are equal, tensor for tensor."""
    from rlt_mega.checkpoint import load_torch

    def assert_equal_tree(x, y, where):
        if torch.is_tensor(x):
            assert torch.equal(x, y), where
        elif isinstance(x, dict):
            assert x.keys() == y.keys(), where
            for k in x:
                assert_equal_tree(x[k], y[k], f"{where}/{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y)):
                assert_equal_tree(u, v, f"{where}/{i}")
        elif hasattr(x, "__dict__"):  # e.g. DeepSpeed's loss scaler, which has no __eq__
            assert type(x) is type(y), where
            assert_equal_tree(vars(x), vars(y), where)
        else:
            assert x == y, where

    def last(d):
        ckpt = d / "ckpt"
        return ckpt / (ckpt / "latest").read_text().strip()

    a, b = last(a_dir), last(b_dir)
    files = sorted(p.relative_to(a) for p in a.rglob("*.pt") if p.name == "engine.pt" or "optim" in p.name)
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.pt") if p.name == "engine.pt"
                                     or "optim" in p.name)
    for f in files:
        assert_equal_tree(load_torch(a / f, deepspeed=True), load_torch(b / f, deepspeed=True), str(f))


def logged(out_dir) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "log" / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]


def run_roles_job(tmp_path, grpo: dict, train: dict, name: str, samplers: int = 1, then: dict | None = None):
    """The roles' run; ``then``: a second run's train settings, in the same launch (a resume)."""
    out = tmp_path / name
    runs = [{"grpo": grpo, "train": t, "out_dir": str(out), "samplers": samplers} for t in [train, then] if t]
    res = run_ranks(1 + samplers, [("async_scenarios.roles_run", a) for a in runs], tmp_path / f"{name}_ranks",
                    timeout=300)
    for args in runs:
        assert all(result(res, "async_scenarios.roles_run", args, r)["role"] == "sampler"
                   for r in range(1, 1 + samplers))
    return out, [result(res, "async_scenarios.roles_run", args, 0) for args in runs][-1]


def check_metrics(lines: list[dict], s: int) -> None:
    """s: the largest lag (max_staleness, one more with partial rollouts)."""
    assert [x["async/staleness_max"] for x in lines] == [min(k, s) for k in range(len(lines))]
    for x in lines:
        assert 0.0 <= x["async/learner_idle_fraction"] <= 1.0 and 0.0 <= x["async/sampler_idle_fraction"] <= 1.0
        assert x["async/weight_sync_s"] >= 0.0


def test_synchronous_roles_equal_the_colocated_run(tmp_path):
    """Two sampler replicas (3 processes): data steps 0 and 2 from rank 1, step 1 from rank 2."""
    roles, out = run_roles_job(tmp_path, {"max_staleness": 0}, {"steps": 3}, "roles", samplers=2)
    assert out["step"] == 3
    colocated({"max_staleness": 0}, {"steps": 3}, tmp_path / "colocated")
    a, b = final_params(roles), final_params(tmp_path / "colocated")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    lines, ref = logged(roles), logged(tmp_path / "colocated")
    assert [x["train/loss"] for x in lines] == [x["train/loss"] for x in ref] and len(lines) == 3
    assert [x["reward/mean"] for x in lines] == [x["reward/mean"] for x in ref]
    check_metrics(lines, 0)


def test_stale_roles_equal_the_colocated_run_and_resume_with_the_roles(tmp_path):
    """max_staleness 1 with partial rollouts: two steps with the roles (the sampler samples data
    step k + 1 while the learner learns k, from version k - 1, switching to version k at decode
    step 6 when it arrives), a checkpoint (train.stop_after), the last step resumed with the
    roles in the same launch (the learner restarts the sampler at data step 3 with its data order
    and versions 1 and 2): the uninterrupted colocated run's losses and parameters, bit for bit."""
    grpo = {"max_staleness": 1, "partial_rollouts": 5}
    cut, out = run_roles_job(tmp_path, grpo, {"steps": 3, "stop_after": 2, "resume": "auto"}, "cut",
                             then={"steps": 3, "resume": "auto"})
    assert out["step"] == 3
    check_metrics(logged(cut), 2)
    colocated(grpo, {"steps": 3}, tmp_path / "colocated")
    assert [x["async/staleness_max"] for x in logged(tmp_path / "colocated")] == [0.0, 1.0, 2.0]
    a, c = final_params(tmp_path / "colocated"), final_params(cut)
    assert all(torch.equal(a[n], c[n]) for n in a)
    assert [x["train/loss"] for x in logged(cut)] == [x["train/loss"] for x in logged(tmp_path / "colocated")]


@pytest.mark.parametrize("parallel,samplers", [({"tp": 2, "dp": 2, "zero_stage": 1}, 2),
                                               ({"pp": 2, "zero_stage": 1, "micro_batches": 2}, 1)],
                         ids=["tp2xdp2", "pp2"])
def test_roles_under_tensor_and_pipeline_parallelism(tmp_path, parallel, samplers):
    """Sampler replicas with the learner's tp x pp layout (rank for rank): a learner of tp=2 x
    dp=2 fed by two sampler replicas of tp=2 (8 processes), and a learner of pp=2 fed by one of
    pp=2 (4 processes). max_staleness 0 equals the colocated run of the layout bit for bit
    (parameters, losses); max_staleness 1 with token_tis, stopped after 2 steps and resumed with
    the roles, equals the colocated run: its first minibatch learns with ratio exactly 1 against
    the proximal replay (ratio/onpolicy_max_dev 0: a stale sample's replay on the layout is
    exact). The weights of each TP position travel in buckets gathered from both data-parallel
    ranks."""
    args = {"parallel": parallel, "out_dir": str(tmp_path / "out"), "samplers": samplers}
    n = parallel.get("tp", 1) * parallel.get("pp", 1)
    learners, world = n * parallel.get("dp", 1), n * (parallel.get("dp", 1) + samplers)
    res = run_ranks(world, [("async_scenarios.roles_layout", args)], tmp_path / "ranks", timeout=1200)
    roles = [result(res, "async_scenarios.roles_layout", args, r) for r in range(world)]
    assert [[x["role"] for x in r] for r in roles] == [["learner"] * 3] * learners + [["sampler"] * 3] * (world - learners)
    assert roles[0][1]["step"] == 2 and roles[0][2]["step"] == 3
    out = tmp_path / "out"
    for name, ref, steps in (("roles0", "colocated0", 2), ("roles1", "colocated1", 3)):
        a, b = final_params(out / name), final_params(out / ref)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        lines, want = logged(out / name), logged(out / ref)
        assert len(lines) == steps and [x["train/loss"] for x in lines] == [x["train/loss"] for x in want]
        assert [x["reward/mean"] for x in lines] == [x["reward/mean"] for x in want]
        assert all(x["ratio/onpolicy_max_dev"] == 0.0 for x in lines)
    assert [x["async/staleness_max"] for x in logged(out / "roles1")] == [0.0, 1.0, 1.0]


def test_data_parallel_learners_fed_by_two_samplers_equal_the_colocated_run(tmp_path):
    """One launch of 4 processes: a learner of dp=2 under ZeRO-1, under ZeRO-3 and under ZeRO-3
    with low-rank adapters (model.lora), two sampler replicas (each sampling both data-parallel
    ranks' shares of its data steps), dynamic sampling (its prompts reserved per step, so the
    data does not depend on which sampler ran it), staleness 0: the colocated dp=2 run's
    parameters, optimizer state, losses, rewards and rounds, bit for bit; and ZeRO-1 at
    max_staleness 1 with partial rollouts and token_tis (each share of a data step starts under
    the older version again, kept by the sampler): the same, with ratio exactly 1 against the
    sampling version at every step. The weights travel in buckets of 10 KiB (many per version):
    the learner's publishing rank never held more than one bucket of gathered weights at once
    (async/weight_peak_bytes, the bytes of its gathered buffers alive at once, measured), far
    less than a version."""
    args = {"out_dir": str(tmp_path / "out")}
    res = run_ranks(4, [("async_scenarios.data_parallel_roles", args)], tmp_path / "ranks", timeout=1800)
    roles = [result(res, "async_scenarios.data_parallel_roles", args, r) for r in range(4)]
    assert [[x["role"] for x in r] for r in roles] == [["learner"] * 4] * 2 + [["sampler"] * 4] * 2
    out, bucket = tmp_path / "out", int(BUCKET_MB * (1 << 20))
    for zero in (1, 3, "3_lora", "1_partial"):
        if zero != "3_lora":  # under adapters DeepSpeed's shards alone hold them (their fp32 masters, compared next)
            a, b = final_params(out / f"roles_z{zero}"), final_params(out / f"colocated_z{zero}")
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        assert_same_optimizer(out / f"roles_z{zero}", out / f"colocated_z{zero}")
        lines, want = logged(out / f"roles_z{zero}"), logged(out / f"colocated_z{zero}")
        assert len(lines) == (3 if zero == "1_partial" else 2)
        dynamic = ("sampling/rounds", "sampling/groups_kept") if zero != "1_partial" else ()
        for key in ("train/loss", "reward/mean", "async/staleness_max", *dynamic):
            assert [x[key] for x in lines] == [x[key] for x in want], key
        assert all(x["ratio/onpolicy_max_dev"] == 0.0 for x in lines)
        for x in lines[:-1]:  # the last step publishes nothing
            peak, version = x["async/weight_peak_bytes"], x["async/weight_bytes"] / x["async/samplers_alive"]
            assert 0 < peak <= bucket and version > 4 * bucket, (zero, peak, version)


def test_roles_refuse_what_they_cannot_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = roles_config({}, {"steps": 1}, str(tmp_path), 1)
    with pytest.raises(ConfigError, match=r"runs on 2 processes .*but the launcher started 3"):
        run_roles(cfg, load_tokenizer("byte"), odd, records(24), [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    import dataclasses

    tp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=2))
    with pytest.raises(ConfigError, match=r"parallel\.tp=2, pp=1, dp=1 runs on 4 processes"):
        run_roles(tp, load_tokenizer("byte"), odd, records(24), [])
    dp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=2))
    with pytest.raises(ConfigError, match=r"dp=2 runs on 3 processes \(the learner's tp x pp x dp = 2, then 1 sampler"):
        run_roles(dp, load_tokenizer("byte"), odd, records(24), [])
    monkeypatch.setenv("WORLD_SIZE", "3")
    join = roles_config({"samplers_join": True}, {}, str(tmp_path), 2, {"dp": 2})
    with pytest.raises(ConfigError, match=r"grpo\.samplers_join with parallel\.tp=1, pp=1, dp=2: the job is the "
                                          r"learner's tp x pp x dp = 2 processes .*but the launcher started 3"):
        run_roles(join, load_tokenizer("byte"), odd, records(24), [])
