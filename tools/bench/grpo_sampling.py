"""GRPO seconds per step with DAPO's dynamic sampling off and on (prints figures, asserts
nothing). Both trainers run the default GRPO step (the first minibatch's replay skipped,
grpo.skip_onpolicy_replay): exactness with dynamic sampling is tested in
tests/unit/test_grpo_options.py and tests/distributed/test_grpo_toolbox_parallel.py.

Two trainers on one process, the same model, data and seed; the reward (a digit-count rule on
the generated text, constant 1 for two prompts in three) makes most groups uninformative, as
an easy dataset does late in training. Off: every group is learned (the constant ones with
advantage 0). On: rounds of fresh prompts until prompts_per_step informative groups are
kept (at most --max-rounds), so a step samples more and learns from more signal. Each step of
each trainer is timed in interleaved rounds (tools/bench/harness.py: one thread, process CPU
time by default); the figure is the mean over the timed steps (steps differ in their rounds,
so a minimum would hide what dynamic sampling costs), with the rounds and the groups kept.

    PYTHONPATH=. python tools/bench/grpo_sampling.py             # 6 timed steps after 1 warm-up
    PYTHONPATH=. python tools/bench/grpo_sampling.py --steps 2   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (tools/bench is not a package: the scripts run as scripts)

from rlt_mega.config import from_dict  # noqa: E402
from rlt_mega.data.tokenizer import load_tokenizer  # noqa: E402
from rlt_mega.parallel.dims import ParallelDims  # noqa: E402
from rlt_mega.train.grpo import build_trainer, grpo_config  # noqa: E402


def reward(completion: str, answer) -> float:
    """Constant for two prompts in three; else the fraction of digits in the completion."""
    if int(str(answer).split()[-1]) % 3:
        return 1.0
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def trainer(dynamic: bool, max_rounds: int):
    cfg = grpo_config(from_dict({
        "model": {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "memory_block": 4, "max_seq_len": 64},
        "data": {"tokenizer": "byte", "seq_len": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"seed": 0, "steps": 100},
        "sampling": {"temperature": 1.0, "max_new_tokens": 16},
        "grpo": {"prompts_per_step": 8, "group_size": 8, "minibatches": 2, "eval_size": 0,
                 "dynamic_sampling": dynamic, "max_sampling_rounds": max_rounds},
        "logging": {"progress": False},
    }))
    records = [{"question": f"What is {i} + {i % 7}?", "answer": f"#### {i}"} for i in range(600)]
    return build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), reward, records, [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per trainer (after one warm-up step)")
    ap.add_argument("--max-rounds", type=int, default=4)
    harness.add_common_args(ap)
    harness.add_json_arg(ap)
    args = ap.parse_args()
    res = harness.Results("grpo_sampling", args)
    clock = harness.setup(args)
    jobs = {"off": trainer(False, args.max_rounds).job, "on": trainer(True, args.max_rounds).job}
    times = {k: [] for k in jobs}
    stats = {k: [] for k in jobs}
    for step in range(args.steps + 1):
        for name, job in jobs.items():
            t0 = clock()
            scalars = job.step(step)
            if step:  # step 0 warms up
                times[name].append(clock() - t0)
                stats[name].append(scalars)
    print(f"GRPO seconds per step, dynamic sampling off vs on ({harness.describe(args)}; "
          f"8 prompts x 8 completions, d=64, L=2, 16 new tokens)")
    for name in jobs:
        mean = sum(times[name]) / len(times[name])
        rounds = [s.get("sampling/rounds", 1.0) for s in stats[name]]
        learned = ("every group, informative or not" if name == "off" else
                   f"{sum(s['sampling/groups_kept'] for s in stats[name]) / len(stats[name]):.2f} informative groups")
        print(f"  {name:3s}: {mean:6.2f} s/step  (sampling rounds per step {sum(rounds) / len(rounds):.2f}; "
              f"learns from {learned})")
        res.row("GRPO seconds per step, dynamic sampling off and on", **{
            "dynamic sampling": name, "s/step": round(mean, 2),
            "sampling rounds per step": round(sum(rounds) / len(rounds), 2), "learns from": learned})
    ratio = (sum(times["on"]) / len(times["on"])) / (sum(times["off"]) / len(times["off"]))
    print(f"  on / off: {ratio:.2f}x")
    res.row("GRPO seconds per step, dynamic sampling off and on", **{"dynamic sampling": "on / off",
                                                                     "s/step": f"{ratio:.2f}x"})
    res.write()


if __name__ == "__main__":
    main()
