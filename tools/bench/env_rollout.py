"""What an environment costs a GRPO rollout and its replay on GSM8K-shaped rows (issue 28): the
same calls (GSM8K questions x G, completion budgets as long as real solutions) sampled and
replayed (a) without tools at the default check_every, (b) without tools with a check every step
(what an environment needs), (c) with a calculator episode per row that calls the tool as often
as GSM8K's solutions do (one ``<<expr=`` per ``--gap`` tokens, a real annotation evaluated by the
calculator, its ``value>>`` inserted), (d) the same calculator answering after ``--latency``
seconds (a remote tool: the calls run on their own threads while the other rows decode, their rows
out of the batch). Printed: seconds per call (generate + replay, the median of --repeats), the
ratios to (a), the insertions per row that the replay repeated and the rows that left their slot
during a call.

    PYTHONPATH=. python tools/bench/env_rollout.py --data DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from rollout_rows import gsm8k_call  # noqa: E402

from rlt_mega.config import ModelConfig  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.rollout import Processing, Sampler, SamplingParams  # noqa: E402
from rlt_mega.rollout.env.base import Call, Calls, Pending, Turn  # noqa: E402
from rlt_mega.rollout.env.calculator import evaluate, format_value  # noqa: E402
from rlt_mega.rollout.turns import Response  # noqa: E402


class PacedCalculator:
    """A row's calculator episode (rollout/turns.py ``Episode``) triggered every ``gap`` model
    tokens; each call evaluates one of GSM8K's annotations (after ``latency`` seconds) and
    inserts its ``value>>`` ids."""

    start_failed = False

    def __init__(self, gap: int, expressions: list[str], vocab: int, latency: float = 0.0) -> None:
        self.gap, self.expressions, self.vocab, self.calls, self.latency = gap, expressions, vocab, 0, latency
        self.threads = Calls(60.0)

    def triggered(self, ids, text) -> bool:
        return len(ids) >= self.gap

    def submit(self, ids, text) -> Pending:
        expression = self.expressions[self.calls % len(self.expressions)]
        self.calls += 1

        def call() -> Turn:
            time.sleep(self.latency)
            return Turn(observation=format_value(evaluate(expression)) + ">>", tool_call=True)

        def response(done: Call) -> Response:
            ids = tuple(10 + (ord(c) % (self.vocab - 10)) for c in done.turn().observation)
            return Response(ids=ids, tool_call=True)

        return Pending(self.threads.start(call), response)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/gsm8k", help="a directory holding GSM8K's train.jsonl")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--memory-block", type=int, default=8)
    ap.add_argument("--gap", type=int, default=0, help="model tokens between tool calls (0: GSM8K's own rate)")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds a call of arm (d) takes")
    ap.add_argument("--repeats", type=int, default=3)
    harness.add_json_arg(ap)
    args = ap.parse_args()
    res = harness.Results("env_rollout", args)
    prompts, budgets, stats = gsm8k_call(args.data, args.prompts, args.group, args.vocab, seed=0)
    with open(os.path.join(args.data, "train.jsonl")) as f:
        answers = [json.loads(line)["answer"] for line in f]
    annotations = [a for ans in answers for a in re.findall(r"<<([^<>=]*)=", ans)]
    per_solution = len(annotations) / len(answers)
    gap = args.gap or max(1, round(stats["completion_mean"] / (per_solution + 1)))
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                      memory_block=args.memory_block, max_seq_len=max(map(len, prompts)) + max(budgets) + 8)
    model = build_model(cfg, seed=0)
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max(budgets), row_budgets=tuple(budgets))
    seeds = list(range(len(prompts)))
    rng = random.Random(0)

    def arm(check_every: int, env: bool, latency: float = 0.0):
        sampler = Sampler(model, check_every=check_every)
        times, inserted, left = [], 0, 0
        for _ in range(args.repeats):
            episodes = None
            if env:
                episodes = [[PacedCalculator(gap, rng.sample(annotations, 8), args.vocab, latency) for _ in prompts]]
            t0 = time.perf_counter()
            ro = sampler.generate([prompts], params, [seeds], pad_id=0, decode=lambda ids: "", episodes=episodes)[0]
            replayed = sampler.replay([ro])[0]
            times.append(time.perf_counter() - t0)
            assert torch.equal(replayed, ro.mu)
            inserted = sum(len(v) for v in ro.schedule.rows.forces.values()) / len(prompts)
            left = sum(len(v) for v in ro.schedule.rows.away.values()) / len(prompts)
        return statistics.median(times), inserted, left

    print(f"# {args.prompts} GSM8K prompts x G={args.group} = {len(prompts)} rows, completions of "
          f"{stats['completion_mean']:.0f} tokens (mean), d={args.d_model}, {args.layers} layers, "
          f"C={args.memory_block}; "
          f"GSM8K: {per_solution:.2f} annotations per solution -> a tool call every {gap} tokens")
    base, _, _ = arm(8, False)
    every, _, _ = arm(1, False)
    tools, inserted, left = arm(1, True)
    slow, slow_inserted, slow_left = arm(1, True, args.latency)
    slow_name = f"calculator, {args.latency * 1000:.0f} ms a call"
    print(f"no tools, check_every 8   {base:8.3f} s/call  1.00x")
    print(f"no tools, check_every 1   {every:8.3f} s/call  {every / base:.2f}x")
    for name, s, n, out in (("calculator", tools, inserted, left), (slow_name, slow, slow_inserted, slow_left)):
        print(f"{name:25s} {s:8.3f} s/call  {s / base:.2f}x  ({n:.1f} insertions per row replayed, replay "
              f"torch.equal to mu; {out:.1f} slot departures per row during calls)")
    table = f"generate + replay per call, {len(prompts)} rows, a tool call every {gap} tokens"
    arms = (("no tools, check_every 8", base, "", ""), ("no tools, check_every 1", every, "", ""),
            ("calculator", tools, f"{inserted:.1f}", f"{left:.1f}"),
            (slow_name, slow, f"{slow_inserted:.1f}", f"{slow_left:.1f}"))
    for arm_name, s, extra, out in arms:
        res.row(table, arm=arm_name, **{"s/call": round(s, 3), "x no tools": round(s / base, 2),
                                        "insertions per row replayed": extra, "departures per row": out})
    res.write()


if __name__ == "__main__":
    main()
