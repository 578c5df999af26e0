"""GRPO with sampler roles (grpo.sampler_replicas = R), run on 1 + R ranks by
tests/distributed/test_async_roles.py through ``launch.run_ranks``: rank 0 learns, ranks 1..R
sample. The run writes its checkpoints and metrics.jsonl under ``out_dir``; the test compares
them with a colocated run of the same config in the test's own process."""

from __future__ import annotations

import dataclasses

from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.train.grpo import grpo_config, run_roles
from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

LAYOUT = {"prompts_per_step": 2, "group_size": 2, "minibatches": 1, "verify_onpolicy": False}
LORA = {"rank": 4, "alpha": 8.0}
BUCKET_MB = 0.01  # 10 KiB: the weights of each position travel in many buckets (grpo.publish_bucket_mb)


def roles_config(grpo: dict, train: dict, out_dir: str, sampler_replicas: int, parallel: dict | None = None,
                 lora: dict | None = None):
    """``lora``: model.lora's settings (adapters on the learner and every sampler)."""
    cfg = grpo_cfg(parallel or {}, {"log_every": 1, **train}, {**LAYOUT, "sampler_replicas": sampler_replicas, **grpo})
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=f"{out_dir}/ckpt"),
                              logging=dataclasses.replace(cfg.logging, dir=f"{out_dir}/log"))
    if lora:
        from rlt_mega.config import LoraConfig

        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig(**lora)))
    return grpo_config(cfg)


def roles_run(grpo: dict, train: dict, out_dir: str, samplers: int = 1, parallel: dict | None = None,
              lora: dict | None = None) -> dict:
    cfg = roles_config(grpo, train, out_dir, samplers, parallel, lora)
    out = run_roles(cfg, load_tokenizer("byte"), odd, records(24), [])
    return {"step": out.get("step"), "role": out.get("role", "learner")}


def colocated_in_replica(parallel: dict, grpo: dict, train: dict, out_dir: str, lora: dict | None = None) -> None:
    """The colocated run of the roles' config on the first tp x pp x dp ranks of the launch (each
    replica a world of its own, as under the roles; the others wait)."""
    import torch.distributed as dist

    from rlt_mega.parallel.dims import ParallelDims, init_distributed, launcher_store
    from rlt_mega.train.grpo import build_trainer, engine_config

    cfg = roles_config(grpo, train, out_dir, 0, parallel, lora)
    n = cfg.parallel.tp * cfg.parallel.pp * (cfg.parallel.dp or 1)
    init_distributed(None, "cpu", replica_size=n)
    try:
        if launcher_store()[1] < n:
            dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
            try:
                build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(24), []).run()
            finally:
                dims.destroy()
    finally:
        dist.destroy_process_group()


def roles_layout(parallel: dict, out_dir: str, samplers: int = 1) -> list[dict]:
    """On tp x pp x (dp + samplers) ranks, ``samplers`` sampler replicas of tp x pp: the
    colocated run and the roles with max_staleness 0 (2 steps); the colocated run with
    max_staleness 1 and token_tis (3 steps), and the roles stopped after 2 steps
    (train.stop_after) and resumed with the roles."""
    sync = {"minibatches": 2, "verify_onpolicy": True, "publish_bucket_mb": BUCKET_MB}
    stale = {**sync, "max_staleness": 1, "is_correction": "token_tis"}
    colocated_in_replica(parallel, sync, {"steps": 2}, f"{out_dir}/colocated0")
    out = [roles_run(sync, {"steps": 2}, f"{out_dir}/roles0", samplers, parallel)]
    colocated_in_replica(parallel, stale, {"steps": 3}, f"{out_dir}/colocated1")
    out.append(roles_run(stale, {"steps": 3, "stop_after": 2, "resume": "auto"}, f"{out_dir}/roles1", samplers,
                         parallel))
    out.append(roles_run(stale, {"steps": 3, "resume": "auto"}, f"{out_dir}/roles1", samplers, parallel))
    return out


def data_parallel_roles(out_dir: str) -> list[dict]:
    """On 4 ranks: a learner of 2 data-parallel ranks (ZeRO-1, then ZeRO-3, then ZeRO-3 with
    low-rank adapters) fed by 2 sampler replicas, max_staleness 0 with dynamic sampling (2 rounds
    reserved a step), the weights published in buckets of BUCKET_MB, against the colocated dp=2
    run of the same config on the first 2 ranks; then ZeRO-1 with max_staleness 1, partial
    rollouts (the switch at decode step 3) and token_tis, 3 steps."""
    grpo = {"minibatches": 2, "verify_onpolicy": True, "dynamic_sampling": True, "max_sampling_rounds": 2,
            "publish_bucket_mb": BUCKET_MB}
    out = []
    for zero in (1, 3, "3_lora"):
        parallel, lora = {"dp": 2, "zero_stage": 3 if zero == "3_lora" else zero}, LORA if zero == "3_lora" else None
        colocated_in_replica(parallel, grpo, {"steps": 2}, f"{out_dir}/colocated_z{zero}", lora)
        out.append(roles_run(grpo, {"steps": 2}, f"{out_dir}/roles_z{zero}", samplers=2, parallel=parallel, lora=lora))
    partial = {"minibatches": 2, "verify_onpolicy": True, "max_staleness": 1, "partial_rollouts": 3,
               "is_correction": "token_tis", "publish_bucket_mb": BUCKET_MB}
    colocated_in_replica({"dp": 2, "zero_stage": 1}, partial, {"steps": 3}, f"{out_dir}/colocated_z1_partial")
    out.append(roles_run(partial, {"steps": 3}, f"{out_dir}/roles_z1_partial", samplers=2,
                         parallel={"dp": 2, "zero_stage": 1}))
    return out


def stale_layout(parallel: dict, grpo: dict, out_dir: str) -> dict:
    """Bounded staleness on this layout (colocated, every rank): 2 steps uninterrupted; 1 step,
    a checkpoint (its queue holds step 2's stale sample) and the last step resumed in a new
    trainer; and the one-process run of the same config. Returns rank 0's logged losses, staleness and on-policy deviations of each run, and
    every rank's digest of its parameters."""
    import hashlib
    import json
    from pathlib import Path

    import torch

    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.grpo import build_trainer, engine_config

    def config(name: str, stop_after=None, distributed: bool = True):
        train = {"steps": 2, "resume": "auto", **({"stop_after": stop_after} if stop_after else {})}
        cfg = roles_config(grpo, train, f"{out_dir}/{name}", 0)
        if distributed:
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
        return cfg

    def run(name: str, stop_after=None) -> dict:
        cfg = config(name, stop_after)
        dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
        try:
            trainer = build_trainer(cfg, dims, load_tokenizer("byte"), odd, records(24), [])
            trainer.run()
            digest = hashlib.sha256()
            for _, p in trainer.engine.sampling_module().named_parameters():
                digest.update(p.detach().float().contiguous().numpy().tobytes())
        finally:
            dims.destroy()
        return {"digest": digest.hexdigest()}

    def logged(name: str) -> list[dict]:
        path = Path(out_dir) / name / "log" / "metrics.jsonl"
        keys = ("train/loss", "async/staleness_max", "ratio/onpolicy_max_dev", "reward/mean")
        return [{k: x[k] for k in keys} for x in map(json.loads, path.read_text().splitlines()) if "train/loss" in x]

    whole = run("whole")
    run("cut", stop_after=1)
    resumed = run("cut")
    out = {"whole": whole["digest"], "resumed": resumed["digest"]}
    if torch.distributed.get_rank() == 0:
        cfg = config("single", distributed=False)
        build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records(24), []).run()
        out.update({"logged_whole": logged("whole"), "logged_cut": logged("cut"), "logged_single": logged("single")})
    return out


def pool_run(grpo: dict, train: dict, out_dir: str, samplers: int, kill_replica: int, kill_at: int,
             signal_name: str = "SIGKILL", joiner: bool = False) -> dict:
    """The roles (a learner of one process, ``samplers`` replicas of one process each) where
    sampler replica ``kill_replica`` dies (SIGKILL, no clean-up) when it is about to sample a data
    step >= ``kill_at``: it dies holding a claimed data step, which the others redo (``signal_name``
    SIGSTOP: it hangs instead, heartbeat and all, and the test kills it at the end); replica 0
    waits at data step >= kill_at until the victim holds one to die or hang with (else it may
    claim them all). ``joiner``: a replacement replica (number ``samplers``) joins (the test starts
    it once the victim is dead, RLT_ROLES_JOIN), and replica 0 makes room for it: before a data
    step > kill_at + 1 it waits until the replacement owns a data step, or a data step before this
    one has no owner (given back by the learner: replica 0 may have to redo it), 240 s at most.
    Every wait is bounded and none can hold up the step the learner waits for: the replacement
    receives every version from the oldest a data step still to be learned needs, so it can take
    any step (parallel/roles.py)."""
    import os
    import signal
    import time

    from rlt_mega.train.grpo_sample import SamplePhase

    rank, sample = int(os.environ["RANK"]), SamplePhase.sample
    if rank == 1 + kill_replica and not os.environ.get("RLT_ROLES_JOIN"):
        def dying(self, sampler, data_step, holder):
            if data_step >= kill_at:
                os.kill(os.getpid(), getattr(signal, signal_name))
            return sample(self, sampler, data_step, holder)

        SamplePhase.sample = dying
    if rank == 1 and not os.environ.get("RLT_ROLES_JOIN"):
        from rlt_mega.parallel.roles import RoleStore

        def yielding(self, sampler, data_step, holder):  # until the victim holds a step to hang with
            store, victim = RoleStore(), str(kill_replica)
            while data_step >= kill_at and not store.has(f"lost/{victim}") and not any(
                    store.get(f"owner/{j}") == victim for j in range(kill_at, kill_at + 3)):
                time.sleep(0.05)
            return sample(self, sampler, data_step, holder)

        SamplePhase.sample = yielding
        if joiner:
            end = train["steps"] + grpo.get("max_staleness", 0)

            def making_room(self, sampler, data_step, holder):
                store, new, t0 = RoleStore(), str(samplers), time.monotonic()
                while (data_step > kill_at + 1 and time.monotonic() - t0 < 240
                       and not any(store.get(f"owner/{j}") == new for j in range(kill_at, end))
                       and not any(store.get(f"owner/{j}") == "" for j in range(kill_at, data_step))):
                    time.sleep(0.05)
                return yielding(self, sampler, data_step, holder)

            SamplePhase.sample = making_room
    return roles_run(grpo, train, out_dir, samplers)
