"""Asynchronous GRPO benchmark (issue 29): the real GRPO job, sampler and learner roles
(grpo.sampler_replicas = 1: a learner and a sampler replica of --tp processes each, gloo) with
max_staleness 1 against max_staleness 0 on the same processes, max_staleness 1 with partial
rollouts (grpo.partial_rollouts: the sampler starts a data step under the version before and
takes the newer weights at decode step --partial; and at s = 0, where it is the only overlap),
and the colocated job beside them (today's GRPO, on --tp processes).
Prints steps per second and their ratio, the learner's and the sampler's idle fractions and
the weight-sync time per step (async/* in each run's metrics.jsonl), all over the steps after
the first (start-up and the pipeline's fill); asserts nothing.

Rows are GSM8K-shaped and long-tailed: --prompts questions x --group completions from the
byte tokenizer on generated arithmetic questions; the model is random, so a completion ends at
any of --stops stop strings (one byte each), which makes its length geometric (mean about
260 / stops tokens), cut at --max-new-tokens: most rows end early, a few hold the call to the
budget. Wall clock (the roles overlap in time): run it on a quiet machine, one thread a process.

    PYTHONPATH=. python tools/bench/async_grpo.py                   # the figures
    PYTHONPATH=. python tools/bench/async_grpo.py --quick           # tiny, 3 steps: a smoke test
    PYTHONPATH=. python tools/bench/async_grpo.py --tp 2            # every replica tensor-parallel:
                                                                    # 2 processes colocated, 4 with the roles
    PYTHONPATH=. python tools/bench/async_grpo.py --pool            # a learner of dp=2 colocated, and fed
                                                                    # by R=2 samplers (4 processes)
    PYTHONPATH=. python tools/bench/async_grpo.py --pool --zero 3 --bucket-mb 1
                                                                    # its learner under ZeRO-3, the weights
                                                                    # in 1 MiB buckets (the peak printed)

What a GPU cluster would see (the cost model, not measured here): with s = 1 a step takes
max(sample, learn + sync) instead of sample + learn, so the ratio is (sample + learn) /
max(sample, learn + sync): 2x when the two phases are equal, less as either dominates. Partial
rollouts help where the sampler waits for weights with work it could do: a sampler that
finished data step j waits for version j - s before starting j + 1 without them, and only before
its decode step --partial with them, so its idle time falls by up to the share of a rollout's
steps before the switch (while the learner is the slower role, the wait moves to the switch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from rlt_mega.config import from_dict, load_config, to_dict  # noqa: E402
from rlt_mega.parallel.dims import free_port  # noqa: E402


def job_config(args, out: Path, s: int, roles: int, partial: int = 0, dp: int = 1):
    """``roles``: the sampler replicas (0: colocated); ``dp``: the learner's data-parallel ranks."""
    base = to_dict(load_config(args.config))
    data = {
        "model": {**base["model"], "vocab_size": 260},  # the byte tokenizer
        "data": {"tokenizer": "byte", "seq_len": 64},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"seed": 0, "steps": args.steps, "log_every": 1},
        "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens,
                     "stop_strings": [chr(ord("a") + i) for i in range(args.stops)]},
        "grpo": {"prompts_per_step": args.prompts, "group_size": args.group, "eval_size": 0, "eval_every": 0,
                 "max_staleness": s, "sampler_replicas": int(roles), "partial_rollouts": partial,
                 "publish_bucket_mb": args.bucket_mb},
        "parallel": {"tp": args.tp, "dp": dp, "zero_stage": args.zero if dp > 1 else 0},
        "checkpoint": {"dir": str(out / "ckpt"), "every": 0},
        "logging": {"dir": str(out / "log"), "progress": False},
    }
    return from_dict(data)


def records(n: int) -> list[dict]:
    import random

    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        out.append({"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"})
    return out


def worker(args) -> None:
    """One process of one arm (RANK/WORLD_SIZE set by ``run_arm``)."""
    import torch

    torch.set_num_threads(1)
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.parallel.launch import launch
    from rlt_mega.rollout.rewards import resolve_reward
    from rlt_mega.train.grpo import GRPOJob, build_trainer, engine_config, grpo_config, run_roles

    ends, step = [], GRPOJob.step

    def timed(self, done):  # the learner's step ends, for steps per second in the steady state
        out = step(self, done)
        ends.append(time.perf_counter())
        return out

    GRPOJob.step = timed

    out = Path(args.out)
    cfg = grpo_config(job_config(args, out, args.s, args.roles, args.partial, args.dp))
    recs, tok, reward = records(4096), load_tokenizer("byte"), resolve_reward("gsm8k")
    if args.roles:
        run_roles(cfg, tok, reward, recs, [])
    else:
        with launch(cfg, engine_config(cfg)) as dims:
            build_trainer(cfg, dims, tok, reward, recs, []).run()
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "wall.json").write_text(json.dumps({"ends": ends}))


def run_arm(args, name: str, s: int, roles: int, base: Path, partial: int = 0, dp: int = 1) -> dict:
    """``roles``: the sampler replicas (0: colocated); ``dp``: the learner's data-parallel ranks."""
    out = base / name
    out.mkdir(parents=True)
    nprocs = args.tp * (dp + int(roles))
    port = free_port()
    cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--s", str(s), "--partial", str(partial),
           "--roles", str(int(roles)), "--dp", str(dp)]
    cmd += ["--config", args.config, "--tp", str(args.tp), "--steps", str(args.steps), "--prompts", str(args.prompts),
            "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens), "--stops", str(args.stops),
            "--zero", str(args.zero), "--bucket-mb", str(args.bucket_mb)]
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT), RLT_LOG_LEVEL="WARNING")
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"arm {name} failed")
    lines = [json.loads(x) for x in (out / "log" / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]
    after_first = lines[1:] or lines

    def mean(key: str) -> float:
        return statistics.mean(x[key] for x in after_first)

    ends = json.loads((out / "wall.json").read_text())["ends"]
    # after the first step (start-up, and the first s + 1 data steps sampled before it learns)
    return {"seconds": ends[-1] - ends[0], "steps": len(ends) - 1,
            "learner_idle": mean("async/learner_idle_fraction"), "sampler_idle": mean("async/sampler_idle_fraction"),
            "sync_s": mean("async/weight_sync_s"), "length": mean("completion/length_mean"),
            "weight_bytes": mean("async/weight_bytes") if roles else 0.0,
            "weight_peak": max(x["async/weight_peak_bytes"] for x in lines) if roles else 0.0,
            "replicas": sorted({int(x["async/sampler_replica"]) for x in lines}) if roles else [],
            "stopped": mean("completion/stopped_fraction")}


def report(res: harness.Results, args, arms: dict[str, dict]) -> None:
    """Prints each arm's figures (``run_arm``'s dicts) and the s=1 / s=0 ratio, and records them in ``res``."""
    n = args.tp
    print(f"{args.config}, tp {n}: the colocated job on {n} process(es), the roles on {2 * n} (a learner and a "
          f"sampler replica of tp {n}); {args.prompts} x {args.group} rows a step, {args.steps} steps, "
          f"max_new_tokens {args.max_new_tokens}, {args.stops} stop bytes, partial rollouts switch at decode step "
          f"{args.partial}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    table = f"asynchronous GRPO, {args.config}, tp {n}, {args.prompts} x {args.group} rows, {args.steps} steps"

    def speed(name: str) -> float:
        return arms[name]["steps"] / arms[name]["seconds"]

    for name, r in arms.items():
        print(f"{name:24s} {speed(name):.3f} steps/s  learner idle {r['learner_idle']:.1%}  "
              f"sampler idle {r['sampler_idle']:.1%}  weight sync {r['sync_s'] * 1e3:.1f} ms/step  "
              f"completion mean {r['length']:.1f} tokens, {r['stopped']:.0%} stopped")
        res.row(table, arm=name, **{
            "steps/s": round(speed(name), 3), "learner idle": f"{r['learner_idle']:.1%}",
            "sampler idle": f"{r['sampler_idle']:.1%}", "weight sync ms/step": round(r["sync_s"] * 1e3, 1),
            "completion mean": round(r["length"], 1), "stopped": f"{r['stopped']:.0%}"})

    rc = arms["colocated s=0"]
    for name in ("roles s=1 partial", "roles s=1", "roles s=0 partial", "roles s=0"):
        r = arms[name]
        print(f"idle fractions, {name} / colocated: learner {r['learner_idle'] / max(rc['learner_idle'], 1e-9):.2f}x, "
              f"sampler {r['sampler_idle'] / max(rc['sampler_idle'], 1e-9):.2f}x")
    rp = arms["roles s=1 partial"]
    res.target(f"learner idle fraction, s=1 with partial rollouts, tp {n}",
               f"<= 15% (colocated: {rc['learner_idle']:.1%})", f"{rp['learner_idle']:.1%}", rp["learner_idle"] <= 0.15)
    for a, b in (("roles s=1", "roles s=0"), ("roles s=1 partial", "roles s=1")):
        ratio = speed(a) / speed(b)
        print(f"steps/s ratio, {a} / {b} ({2 * n} processes): {ratio:.2f}x")
        res.row(table, arm=f"{a} / {b}", **{"steps/s": f"{ratio:.2f}x"})


def report_pool(res: harness.Results, args, arms: dict[str, dict]) -> None:
    """The pool's arms: a learner of dp=2 colocated (2 x tp processes) and fed by two sampler
    replicas (4 x tp processes), with the replicas that sampled, the weights' bytes a step and
    the learner's idle fraction at s=1 against the 15% target."""
    n = args.tp
    print(f"{args.config}, tp {n}: a learner of dp=2 (ZeRO-{args.zero}) colocated on {2 * n} processes, and fed by 2 "
          f"sampler replicas on {4 * n}; {args.prompts} x {args.group} rows a step and data-parallel rank, "
          f"{args.steps} steps; weights in buckets of {args.bucket_mb:g} MiB; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    table = (f"asynchronous GRPO pool, {args.config}, tp {n}, dp 2, {args.prompts} x {args.group} rows, "
             f"{args.steps} steps")
    for name, r in arms.items():
        speed = r["steps"] / r["seconds"]
        print(f"{name:22s} {speed:.3f} steps/s  learner idle {r['learner_idle']:.1%}  sampler idle "
              f"{r['sampler_idle']:.1%}  weight sync {r['sync_s'] * 1e3:.1f} ms/step, "
              f"{r['weight_bytes'] / 2**20:.2f} MiB/step, peak gathered {r['weight_peak'] / 2**20:.3f} MiB  "
              f"replicas {r['replicas']}")
        res.row(table, arm=name, **{"steps/s": round(speed, 3), "learner idle": f"{r['learner_idle']:.1%}",
                                    "sampler idle": f"{r['sampler_idle']:.1%}",
                                    "weight sync ms/step": round(r["sync_s"] * 1e3, 1),
                                    "weight MiB/step": round(r["weight_bytes"] / 2**20, 2),
                                    "peak gathered MiB": round(r["weight_peak"] / 2**20, 3)})
    r1 = arms["roles dp=2 R=2 s=1"]
    res.target("learner idle fraction, dp=2, R=2, s=1", "<= 15%", f"{r1['learner_idle']:.1%}",
               r1["learner_idle"] <= 0.15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/small_cpu.yaml")
    ap.add_argument("--tp", type=int, default=1, help="parallel.tp of every replica (the colocated job's too)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--stops", type=int, default=4, help="one-byte stop strings (the tail's rate)")
    ap.add_argument("--partial", type=int, default=0,
                    help="grpo.partial_rollouts of the partial arm (default: half of --max-new-tokens)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--roles", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pool", action="store_true",
                    help="the pool's arms only: a learner of dp=2 (ZeRO-1) colocated and fed by R=2 samplers")
    ap.add_argument("--zero", type=int, default=1, choices=(0, 1, 2, 3), help="--pool: the learner's ZeRO stage")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="grpo.publish_bucket_mb of the roles")
    ap.add_argument("--s", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    harness.add_json_arg(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.config, args.steps, args.prompts, args.group, args.max_new_tokens = "configs/tiny_cpu.yaml", 3, 2, 2, 32
    args.partial = args.partial or max(1, args.max_new_tokens // 2)
    if args.pool:
        with tempfile.TemporaryDirectory() as tmp:
            arms = {"colocated dp=2 s=0": run_arm(args, "colocated_dp2", 0, 0, Path(tmp), dp=2),
                    "roles dp=2 R=2 s=0": run_arm(args, "pool0", 0, 2, Path(tmp), dp=2),
                    "roles dp=2 R=2 s=1": run_arm(args, "pool1", 1, 2, Path(tmp), dp=2)}
        res = harness.Results("async_grpo_pool", args)
        report_pool(res, args, arms)
        res.write()
        return
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"colocated s=0": run_arm(args, "colocated", 0, False, Path(tmp)),
                "roles s=0": run_arm(args, "roles0", 0, 1, Path(tmp)),
                "roles s=1": run_arm(args, "roles1", 1, 1, Path(tmp)),
                "roles s=1 partial": run_arm(args, "roles1p", 1, 1, Path(tmp), args.partial),
                "roles s=0 partial": run_arm(args, "roles0p", 0, 1, Path(tmp), args.partial)}
    res = harness.Results("async_grpo", args)
    report(res, args, arms)
    res.write()


if __name__ == "__main__":
    main()
