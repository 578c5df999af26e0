"""Row-schedule benchmark (issue 12, the rollout side): shared prompts, compaction and continuous
batching against the lockstep schedule, on GRPO-shaped calls (prints figures; asserts nothing but
exactness: every replay torch.equal to its rollout's mu).

One call = 64 rows: 8 GSM8K train questions x G = 8, tokenised by a byte-level BPE trained with
HF tokenizers on the train split (so prompt lengths are realistic, about 4 bytes a token); each
row's completion length is its gold solution's token length times U(0.6, 2) (``row_budgets``:
the row ends there on the device and the host learns it at a check, as it learns of a stop
token; the model is random, so real stopping would not give realistic lengths). small_cpu (d=256,
L=4, C=8), random weights, fp32, check_every 8. Variants, timed side by side in interleaved
rounds (tools/bench/harness.py: best of --repeats, one thread, process CPU time by default):

- lockstep: the plan with sharing and compaction off, one slot a row (schedule/rows.py LOCKSTEP);
- share: shared prompts only; compact: compaction only; all: both (the default);
- slots: all, with sampling.slots = rows / 4 (continuous batching).

Printed per variant: rollout time, completion tokens/s and its ratio to lockstep, sequential
decoder steps per call and decoder row-steps per call (sum over steps of the batch size: the
work), and the replay time. With slots = rows / 4 the sequential steps grow while the row-steps
stay low: on a bandwidth-bound GPU a step's cost hardly depends on the batch, so the steps are
what continuous batching trades for memory (fewer K/V caches live at once).

    PYTHONPATH=. python tools/bench/rollout_rows.py --data DIR             # the figures (~5 min, one core)
    PYTHONPATH=. python tools/bench/rollout_rows.py --data DIR --quick     # 2 prompts x 8, a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from rlt_mega.config import load_config  # noqa: E402
from rlt_mega.data.tokenizer_train import train_bpe  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.rollout import Processing, Sampler, SamplingParams, replay  # noqa: E402
from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches  # noqa: E402

def gsm8k_call(data: str, num_prompts: int, group: int, vocab: int, seed: int) -> tuple[list, list, dict]:
    """(prompts (rows), per-row budgets, stats) from GSM8K's train split (``data``/train.jsonl)."""
    path = os.path.join(data, "train.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: pass --data, a directory with GSM8K's train.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    tok = train_bpe((r["question"] + "\n" + r["answer"] for r in records), vocab)
    rng = random.Random(seed)
    chosen = rng.sample(records, num_prompts)
    prompts, budgets = [], []
    for r in chosen:
        q = tok.encode(r["question"]).ids
        gold = len(tok.encode(r["answer"]).ids)
        for _ in range(group):
            prompts.append(q)
            budgets.append(max(1, round(gold * rng.uniform(0.6, 2.0))))
    text_bytes = sum(len((r["question"] + r["answer"]).encode()) for r in records[:2000])
    text_tokens = sum(len(tok.encode(r["question"]).ids) + len(tok.encode(r["answer"]).ids) for r in records[:2000])
    stats = {"bytes_per_token": text_bytes / text_tokens, "prompt_len_mean": sum(map(len, prompts)) / len(prompts),
             "prompt_len_max": max(map(len, prompts)), "completion_mean": sum(budgets) / len(budgets),
             "completion_max": max(budgets)}
    return prompts, budgets, stats


def gsm8k_args(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments every GSM8K-shaped row benchmark takes (this one, learner_rows.py, grpo.py,
    rollout_parallel.py), --json PATH included."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", default="configs/small_cpu.yaml")
    ap.add_argument("--data", default="data/gsm8k", help="a directory holding GSM8K's train.jsonl")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per call (x --group rows)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--quick", action="store_true", help="2 prompts per call, one repeat")
    harness.add_common_args(ap)
    harness.add_json_arg(ap)
    return ap


def parse_gsm8k_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.repeats = 2, 1
    return args


def main() -> None:
    ap = gsm8k_args(__doc__, repeats=2)
    ap.add_argument("--check-every", type=int, default=8)
    args = parse_gsm8k_args(ap)
    res = harness.Results("rollout_rows", args)
    clock = harness.setup(args)
    prompts, budgets, stats = gsm8k_call(args.data, args.prompts, args.group, args.vocab, seed=0)
    cfg = load_config(args.config)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=args.vocab)
    model = build_model(model_cfg, "cpu", seed=0)
    rows = len(prompts)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max(budgets), row_budgets=tuple(budgets))
    seeds = list(range(rows))
    variants = {"lockstep": LOCKSTEP, "share": RowSwitches(compact=False), "compact": RowSwitches(share_prompts=False),
                "all": RowSwitches(), "slots": RowSwitches(slots=rows // 4)}
    samplers = {k: Sampler(model, check_every=args.check_every, rows=sw) for k, sw in variants.items()}

    def rollout(k):
        with torch.no_grad():
            return samplers[k].generate([prompts], params, [seeds], pad_id=0)[0]

    times, outs = harness.best_of_rounds({k: (lambda k=k: rollout(k)) for k in variants}, args.repeats, clock)
    replay_times, replays = harness.best_of_rounds({k: (lambda k=k: replay(model, outs[k])) for k in variants},
                                                   1, clock)
    print(f"# rollout_rows: {args.config} (vocab {args.vocab}), {args.prompts} GSM8K prompts x G={args.group} = "
          f"{rows} rows per call, check_every {args.check_every}; {harness.describe(args)}")
    print(f"# BPE {stats['bytes_per_token']:.2f} bytes/token; prompt tokens mean {stats['prompt_len_mean']:.1f} "
          f"max {stats['prompt_len_max']}; completion tokens mean {stats['completion_mean']:.1f} "
          f"max {stats['completion_max']}")
    distinct = {tuple(p) for p in prompts}
    need = sum(map(len, distinct)) + sum(budgets) - rows  # each prompt's P positions once, then each row's n - 1
    lockstep_steps = rows * (max(map(len, prompts)) + max(budgets) - 1)
    print(f"# the data's row-steps: {need} per call (each distinct prompt's decoder positions once, each row's "
          f"completion positions); lockstep runs {lockstep_steps / need:.2f}x that: the bound of the row-step "
          "saving, and of the tokens/s ratio where a step's cost does not fall faster than its rows")
    print("| variant | rollout s | completion tokens/s | x lockstep | sequential steps/call | row-steps/call | "
          "row-steps x lockstep | replay s | replay == mu |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for k in variants:
        ro = outs[k]
        tps = ro.num_completion_tokens() / times[k]
        if ro.schedule.rows is None:
            steps, row_steps = ro.schedule.num_steps, ro.batch_size * ro.schedule.num_steps
        else:
            steps, row_steps = ro.schedule.rows.num_steps, ro.schedule.rows.row_steps
        exact = bool(torch.equal(replays[k], ro.mu))
        if base is None:
            base = (tps, row_steps)
        print(f"| {k} | {times[k]:.2f} | {tps:.1f} | {tps / base[0]:.2f} | {steps} | {row_steps} | "
              f"{base[1] / row_steps:.2f} | {replay_times[k]:.2f} | {exact} |")
        res.row(f"row schedule against lockstep, {rows} rows per call", variant=k, **{
            "rollout s": round(times[k], 2), "completion tokens/s": round(tps, 1), "x lockstep": round(tps / base[0], 2),
            "sequential steps/call": steps, "row-steps/call": row_steps,
            "row-steps x lockstep": round(base[1] / row_steps, 2), "replay s": round(replay_times[k], 2),
            "replay == mu": exact})
        if not exact:
            raise SystemExit(f"{k}: replay differs from mu")
        assert ro.completion_lens == budgets, k  # random weights: no stop token, every row runs its budget
    res.write()


if __name__ == "__main__":
    main()
