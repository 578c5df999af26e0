"""GRPO with a sampler role (grpo.sampler_replicas = 1), run on two ranks by
tests/distributed/test_async_roles.py through ``launch.run_ranks``: rank 0 learns, rank 1
samples. The run writes its checkpoints and metrics.jsonl under ``out_dir``; the test compares
them with a colocated run of the same config in the test's own process."""

from __future__ import annotations

import dataclasses

from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.train.grpo import grpo_config, run_roles
from tests.distributed.grpo_scenarios import grpo_cfg, odd, records

LAYOUT = {"prompts_per_step": 2, "group_size": 2, "minibatches": 1, "verify_onpolicy": False}


def roles_config(grpo: dict, train: dict, out_dir: str, sampler_replicas: int):
    cfg = grpo_cfg({}, {"log_every": 1, **train}, {**LAYOUT, "sampler_replicas": sampler_replicas, **grpo})
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=f"{out_dir}/ckpt"),
                              logging=dataclasses.replace(cfg.logging, dir=f"{out_dir}/log"))
    return grpo_config(cfg)


def roles_run(grpo: dict, train: dict, out_dir: str) -> dict:
    out = run_roles(roles_config(grpo, train, out_dir, 1), load_tokenizer("byte"), odd, records(24), [])
    return {"step": out.get("step"), "role": out.get("role", "learner")}
