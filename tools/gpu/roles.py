"""The sampler and learner roles of tools/gpu_check_multi.sh (grpo.sampler_replicas = 1), on
every rank of ``torchrun --nproc_per_node 2``: rank 0 learns, rank 1 samples, the weights sent
over an NCCL group of two (gloo on the CPU with --smoke) and received on the sampler's own
thread, the rollouts through the launcher's store (parallel/roles.py). Each arm runs the
colocated job on rank 0 alone first, then the roles on both ranks, and asks for the colocated
run's parameters (the last checkpoint's) and logged losses bit for bit:

- s=0: grpo.max_staleness 0, three steps;
- s=1 partial: max_staleness 1, partial rollouts (the sampler starts a data step under the
  version before and receives the newer weights at decode step 6), token_tis; step k's largest
  lag is min(k, 2), and every step's first minibatch learns with ratio exactly 1 against its
  proximal replay (ratio/onpolicy_max_dev 0: a stale sample's replay is exact across the ranks).

    torchrun --nproc_per_node 2 tools/gpu/roles.py --out result.json [--smoke]

``--pool`` (``torchrun --nproc_per_node 4``): the pool form, a learner of dp=2 under ZeRO-3 (ranks
0 and 1) fed by two sampler replicas (ranks 2 and 3), the weights gathered from the ZeRO-3
partitions and sent in buckets of POOL_BUCKET_MB over NCCL (parallel/publication.py), against the
colocated dp=2 run on ranks 0 and 1: the same arms, bit for bit (parameters, losses), and the
learner's measured peak of gathered weights at most one bucket (async/weight_peak_bytes).

Rank 0 writes {"status": "ok" | "fail: ...", "layout": "roles", "ranks": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# name -> (grpo settings, the largest lag of a learned token: s, one more under partial rollouts)
ARMS = {"s=0": ({"max_staleness": 0}, 0),
        "s=1 partial": ({"max_staleness": 1, "partial_rollouts": 5, "is_correction": "token_tis"}, 2)}
POOL_BUCKET_MB = 0.05  # a position's weights (~0.4 MiB in fp32) travel in about 8 buckets


def odd_length(completion: str, answer) -> float:
    """A reward that differs between completions, so that every step moves the parameters."""
    return float(len(completion) % 2)


def config(device: str, grpo: dict, out: Path, sampler_replicas: int, parallel: dict | None = None):
    from rlt_mega.config import from_dict
    from rlt_mega.train.grpo import grpo_config

    return grpo_config(from_dict({
        "parallel": parallel or {},
        "model": {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "memory_block": 2, "max_seq_len": 64},
        "data": {"tokenizer": "byte", "seq_len": 32},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"seed": 3, "steps": 3, "log_every": 1, "device": device, "deterministic": True},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "grpo": {"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "eval_size": 0, "eval_every": 0,
                 "verify_onpolicy": True, "sampler_replicas": sampler_replicas, **grpo},
        "checkpoint": {"dir": str(out / "ckpt")},
        "logging": {"dir": str(out / "log"), "progress": False}}))


def final(out: Path) -> tuple[dict, list[dict]]:
    """(the last checkpoint's parameters, the logged steps) of a run in ``out``."""
    from safetensors.torch import load_file

    ckpt = out / "ckpt"
    params = load_file(str(ckpt / (ckpt / "latest").read_text().strip() / "model.safetensors"))
    lines = [json.loads(x) for x in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    return params, [x for x in lines if "train/loss" in x]


def colocated_pool(cfg, tok, records) -> None:
    """The colocated dp=2 run of ``cfg`` on ranks 0 and 1 of the launch (a world of their own, as
    the learner's under the roles); ranks 2 and 3 wait."""
    import torch.distributed as dist

    from rlt_mega.parallel.dims import ParallelDims, init_distributed, launcher_store
    from rlt_mega.train.grpo import build_trainer, engine_config

    init_distributed(cfg.parallel.backend, cfg.train.device, deterministic=True, replica_size=2)
    try:
        if launcher_store()[1] < 2:
            dims = ParallelDims.build(cfg.parallel, cfg.model, cfg.train.device, engine_config(cfg), True)
            try:
                build_trainer(cfg, dims, tok, odd_length, records, []).run()
            finally:
                dims.destroy()
    finally:
        dist.destroy_process_group()


def check(base: Path, rank: int, device: str, tok, records, pool: bool = False) -> tuple[list[str], dict]:
    """Every arm in ``base`` -> (the problems found, what rank 0 measured per arm); ``pool``: the
    pool form (module docstring)."""
    import torch

    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.grpo import build_trainer, run_roles

    problems, out = [], {}
    parallel = {"dp": 2, "zero_stage": 3} if pool else None
    for name, (grpo, lag) in ARMS.items():
        arm = base / name.replace(" ", "_").replace("=", "")
        if pool:
            grpo = {**grpo, "publish_bucket_mb": POOL_BUCKET_MB}
            colocated_pool(config(device, grpo, arm / "colocated", 0, parallel), tok, records)
        elif rank == 0:  # the colocated job on this rank alone, while the sampler's rank waits in the roles' start
            cfg = config(device, grpo, arm / "colocated", 0)
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else "cpu"
            build_trainer(cfg, ParallelDims.single(cfg.model, dev), tok, odd_length, records, []).run()
        result = run_roles(config(device, grpo, arm / "roles", 2 if pool else 1, parallel), tok, odd_length, records,
                           [])
        if rank != 0:
            out[name] = {"role": result.get("role")}
            continue
        (ref, ref_steps), (got, steps) = final(arm / "colocated"), final(arm / "roles")
        equal = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
        losses = len(steps) == 3 and [x["train/loss"] for x in steps] == [x["train/loss"] for x in ref_steps]
        onpolicy = [x.get("ratio/onpolicy_max_dev") for x in steps]
        out[name] = {"parameters_equal": equal, "losses_equal": losses, "onpolicy_max_dev": onpolicy,
                     "staleness_max": [x.get("async/staleness_max") for x in steps],
                     "weight_sync_s": [x.get("async/weight_sync_s") for x in steps],
                     "weight_bytes": [x.get("async/weight_bytes") for x in steps],
                     "weight_peak_bytes": [x.get("async/weight_peak_bytes") for x in steps]}
        bucket = int(POOL_BUCKET_MB * (1 << 20))
        if pool and not all(0 < (p or 0) <= bucket for p in out[name]["weight_peak_bytes"][:-1]):
            problems.append(f"{name}: the learner held {out[name]['weight_peak_bytes']} bytes of gathered weights at "
                            f"once, more than one bucket ({bucket})")
        if not (equal and losses):
            problems.append(f"{name}: the roles' {'parameters' if not equal else 'losses'} differ from the colocated "
                            "run's")
        if any(v != 0.0 for v in onpolicy):
            problems.append(f"{name}: ratio/onpolicy_max_dev {onpolicy}, not 0")
        lags = out[name]["staleness_max"]
        if lags != [min(k, lag) for k in range(3)]:
            problems.append(f"{name}: async/staleness_max {lags}, not the fixed pipeline's")
    return problems, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="the CPU with gloo")
    ap.add_argument("--pool", action="store_true",
                    help="the pool form: a dp=2 ZeRO-3 learner and two sampler replicas (4 ranks)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != (4 if args.pool else 2):
        ap.error(f"WORLD_SIZE={world}: run under torchrun --nproc_per_node {4 if args.pool else 2}"
                 + (" (--pool: a learner of 2 ranks, 2 samplers)" if args.pool else ""))
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.determinism import configure

    rank = int(os.environ["RANK"])
    device = "cpu" if args.smoke else "cuda"
    configure(True)
    tok, records = load_tokenizer("byte"), [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(24)]
    with tempfile.TemporaryDirectory(prefix=f"roles_check_rank{rank}_") as tmp:
        problems, out = check(Path(tmp), rank, device, tok, records, args.pool)
    if rank == 0:
        layout = "roles_pool" if args.pool else "roles"
        status = "ok" if not problems else "fail: " + "; ".join(problems)
        args.out.write_text(json.dumps({"status": status, "layout": layout, "ranks": [{"rank": 0, "status": status,
                                                                                    **out}]}, default=str))
        print(f"{layout}: {'passed' if not problems else 'failed (' + '; '.join(problems) + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
