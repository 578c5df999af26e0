"""Whole-GRPO-step benchmark (issue 12): generate, replay, update as the trainer runs them against
the lockstep, padded arm, side by side in one run (prints figures; asserts nothing but
exactness: every replay of an unchanged model torch.equal to its rollout's mu).

A step is --minibatches calls of 64 rows (8 GSM8K train questions x G = 8, tokenised by a
byte-level BPE trained on the train split, rlt_mega/data/tokenizer_train.py, as
tools/bench/rollout_rows.py does; each row's completion length is its gold solution's token
length x U(0.6, 2), ``sampling.row_budgets``: the model is random, so stopping would not give
realistic lengths). small_cpu (d=256, L=4, C=8), random weights, fp32. Per minibatch: the
replay (the hybrid's value) with the current parameters, the dense schedule with autograd,
the clipped surrogate on random advantages (a random model's rewards are all 0: the compute is
the same), AdamW. Variants, each from the same initial weights, timed in interleaved rounds
(best of --repeats per phase, one thread, process CPU time by default, tools/bench/harness.py):

- off: the baseline arm: the lockstep plan for the rollout (schedule/rows.py LOCKSTEP), the first
  minibatch replayed (grpo.skip_onpolicy_replay false) and the learner's padded dense schedule
  (dense_logprobs with compaction and sharing off);
- on: what the trainer runs: shared prompts and compaction in the rollout, the replay and the
  learner's dense schedule (schedule/dense.py), the first minibatch's replay skipped (its value is mu);
- slots: on, with sampling.slots = rows / 4 (continuous batching): its sequential decoder
  steps per call against lockstep's with the same rows (what it trades on a bandwidth-bound GPU).

Learner tokens/s: the rows' prompt + completion tokens per second of replay + update (the same
numerator in every variant); learner row-steps: the decoder row-positions the dense schedule ran
per call (B x T padded).

    PYTHONPATH=. python tools/bench/grpo.py --data DIR             # the figures (one core)
    PYTHONPATH=. python tools/bench/grpo.py --data DIR --quick     # 2 prompts x 8, a smoke test
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from rollout_rows import gsm8k_args, gsm8k_call, parse_gsm8k_args  # noqa: E402

from rlt_mega.config import load_config  # noqa: E402
from rlt_mega.learner.grpo import grpo_loss  # noqa: E402
from rlt_mega.learner.logprob import dense_logprobs, dense_rows, hybrid_logprobs  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.schedule.dense import DensePlan  # noqa: E402
from rlt_mega.rollout import Processing, Sampler, SamplingParams  # noqa: E402
from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    rows: RowSwitches
    skip_onpolicy_replay: bool
    dense_compact: bool = True  # the learner's dense schedule follows the data (False: the padded arm)
    dense_share_prompts: bool = True


def grpo_step(model, variant: Variant, calls: list[tuple[list, SamplingParams, list]], check_every: int,
              clock, seed: int) -> tuple[dict[str, float], list]:
    """One GRPO step on ``model`` (updated in place) -> (phase times, the rollouts)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    sampler = Sampler(model, check_every=check_every, rows=variant.rows)
    times = {"generate": 0.0, "replay": 0.0, "update": 0.0}
    t0 = clock()
    with torch.no_grad():
        rollouts = [sampler.generate([p], params, [s], pad_id=0)[0] for p, params, s in calls]
    times["generate"] = clock() - t0
    gen = torch.Generator().manual_seed(seed)
    for k, ro in enumerate(rollouts):
        t0 = clock()
        if k == 0 and variant.skip_onpolicy_replay:
            value = ro.mu  # the rollout's own parameters: the replay would be mu bit for bit
        else:
            value = Sampler(model, check_every=check_every, rows=variant.rows).replay([ro])[0]
            if k == 0 and not torch.equal(value, ro.mu):
                raise SystemExit("the on-policy replay differs from mu")
        times["replay"] += clock() - t0
        t0 = clock()
        adv = torch.randn(ro.batch_size, generator=gen)
        logp = hybrid_logprobs(dense_logprobs(model, ro, variant.dense_compact, variant.dense_share_prompts), value)
        grpo_loss(logp, ro.mu, adv, ro.mask, 0.2, 0.28).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times["update"] += clock() - t0
    return times, rollouts


def learner_row_steps(rollouts: list, variant: Variant) -> float:
    """Decoder row-positions the learner's dense schedule runs per call."""
    total = 0
    for ro in rollouts:
        rows = dense_rows(ro, variant.dense_compact, variant.dense_share_prompts)
        T = ro.schedule.num_steps
        total += ro.batch_size * T if rows is None else DensePlan(rows, T, torch.device("cpu")).active
    return total / len(rollouts)


def main() -> None:
    ap = gsm8k_args(__doc__, repeats=1)
    ap.add_argument("--minibatches", type=int, default=2, help="calls (= learner minibatches) per GRPO step")
    ap.add_argument("--check-every", type=int, default=8)
    args = parse_gsm8k_args(ap)
    res = harness.Results("grpo", args)
    clock = harness.setup(args)
    prompts, budgets, stats = gsm8k_call(args.data, args.prompts * args.minibatches, args.group, args.vocab, seed=0)
    rows = args.prompts * args.group
    calls = []
    for k in range(args.minibatches):
        p, b = prompts[k * rows:(k + 1) * rows], budgets[k * rows:(k + 1) * rows]
        params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max(b), row_budgets=tuple(b))
        calls.append((p, params, list(range(k * rows, (k + 1) * rows))))
    cfg = load_config(args.config)
    base = build_model(dataclasses.replace(cfg.model, vocab_size=args.vocab), "cpu", seed=0)
    variants = {"off": Variant(LOCKSTEP, False, False, False), "on": Variant(RowSwitches(), True),
                "slots": Variant(RowSwitches(slots=rows // 4), True)}
    best = {k: {} for k in variants}
    outs = {}
    for _ in range(args.repeats):
        for k, v in variants.items():
            times, outs[k] = grpo_step(copy.deepcopy(base), v, calls, args.check_every, clock, seed=1)
            times["step"] = sum(times.values())
            best[k] = {p: min(t, best[k].get(p, float("inf"))) for p, t in times.items()}
    for k, ros in outs.items():
        assert [n for ro in ros for n in ro.completion_lens] == budgets, k  # no stop token: every row its budget
    completion = sum(budgets)
    data_tokens = completion + sum(map(len, prompts))
    print(f"# grpo: {args.config} (vocab {args.vocab}), {args.minibatches} minibatches x {args.prompts} GSM8K "
          f"prompts x G={args.group} = {rows} rows per call, check_every {args.check_every}; {harness.describe(args)}")
    print(f"# BPE {stats['bytes_per_token']:.2f} bytes/token; prompt tokens mean {stats['prompt_len_mean']:.1f} "
          f"max {stats['prompt_len_max']}; completion tokens mean {stats['completion_mean']:.1f} "
          f"max {stats['completion_max']}")
    print("| variant | step s | step x off | generate s | completion tokens/s | x off | replay s | update s | "
          "learner tokens/s | x off | learner row-steps/call | x off | sequential steps/call | steps x lockstep |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref = best["off"]
    lockstep_steps = sum(ro.schedule.num_steps for ro in outs["off"]) / len(outs["off"])
    variant_rows = {k: learner_row_steps(outs[k], v) for k, v in variants.items()}
    for k, t in best.items():
        ros = outs[k]
        steps = sum(ro.schedule.num_steps if ro.schedule.rows is None else ro.schedule.rows.num_steps
                    for ro in ros) / len(ros)
        learn, learn_ref = t["replay"] + t["update"], ref["replay"] + ref["update"]
        print(f"| {k} | {t['step']:.2f} | {ref['step'] / t['step']:.2f} | {t['generate']:.2f} | "
              f"{completion / t['generate']:.1f} | {ref['generate'] / t['generate']:.2f} | {t['replay']:.2f} | "
              f"{t['update']:.2f} | {data_tokens / learn:.1f} | {learn_ref / learn:.2f} | {variant_rows[k]:.0f} | "
              f"{variant_rows['off'] / variant_rows[k]:.2f} | {steps:.0f} | "
              f"{steps / lockstep_steps:.2f} |")
        res.row(f"whole GRPO step, {rows} rows per call", variant=k, **{
            "step s": round(t['step'], 2), "step x off": round(ref['step'] / t['step'], 2),
            "completion tokens/s": round(completion / t['generate'], 1),
            "rollout x off": round(ref['generate'] / t['generate'], 2), "learner tokens/s": round(data_tokens / learn, 1),
            "learner x off": round(learn_ref / learn, 2), "sequential steps/call": round(steps)})
    on = best["on"]
    step_x, roll_x = ref["step"] / on["step"], ref["generate"] / on["generate"]
    learn_x = (ref["replay"] + ref["update"]) / (on["replay"] + on["update"])
    res.target("whole GRPO step", "step >= 2.5x every switch off", f"{step_x:.2f}x", step_x >= 2.5)
    res.target("whole GRPO step: rollout", "completion tokens/s >= 3x", f"{roll_x:.2f}x", roll_x >= 3)
    res.target("whole GRPO step: learner", "learner tokens/s >= 2x", f"{learn_x:.2f}x", learn_x >= 2)
    res.write()


if __name__ == "__main__":
    main()
