"""What ``sampling.check_every`` costs the row schedule (issue 12): the decoder row-steps that
rows run past their end before a check reads their flag, against the host reads it saves.
Host-side only (schedule/rows.py's plan, no model): seconds.

The calls are tools/bench/rollout_rows.py's (8 GSM8K train questions x G = 8, completion
lengths as varied as real solutions): row b ends after its budget n_b, i.e. after the step at
which it draws its n_b-th token, and the plan learns it at the first check after that step,
as it learns of a stop token. Printed per check_every: the call's sequential decoder steps,
its row-steps, the row-steps spent on finished rows (against check_every 1, where a flag is
read after every step) and the host reads (one per check: a device-to-host copy of R flags,
on a GPU a synchronisation that drains the launch queue).

    PYTHONPATH=. python tools/bench/check_every.py --data DIR
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from rollout_rows import gsm8k_call  # noqa: E402

from rlt_mega.schedule.rows import RowPlan, row_layout  # noqa: E402


def plan_call(prompts: list, budgets: list[int], memory_block: int, slots, check_every: int) -> tuple[int, int, int]:
    """The plan of one call whose rows end after their budgets -> (sequential steps, row-steps,
    checks)."""
    layout = row_layout(prompts, max(budgets), memory_block, slots, True, True, check_every)
    R, P = layout.num_rows, layout.prompt_lens
    plan, done_after, k, checks = RowPlan(layout), {}, 0, 0
    while True:
        if k > 0 and k % check_every == 0 and plan.may_run(k):
            plan.set_flags(k, [done_after.get(b, k) < k for b in range(R)])
            checks += 1
        sp = plan.begin(k)
        if sp is None:
            record = plan.record()
            return record.num_steps, record.row_steps, checks
        for b, p in zip(sp.targets, sp.target_positions):
            if b < R and p >= P[b] + budgets[b] - 2:  # its last draw happened at this step
                done_after.setdefault(b, k)
        k += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/gsm8k", help="a directory holding GSM8K's train.jsonl")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--memory-block", type=int, default=8)
    ap.add_argument("--calls", type=int, default=4, help="calls (different questions) averaged")
    harness.add_json_arg(ap)
    args = ap.parse_args()
    res = harness.Results("check_every", args)
    table = f"row-steps and host reads per call, {args.prompts} x G={args.group} rows, C={args.memory_block}"
    calls = [gsm8k_call(args.data, args.prompts, args.group, args.vocab, seed=s)[:2] for s in range(args.calls)]
    rows = args.prompts * args.group
    print(f"# check_every: {args.calls} calls of {args.prompts} GSM8K prompts x G={args.group} = {rows} rows, "
          f"C={args.memory_block}; shared prompts + compaction; per call (mean over the calls)")
    print("| slots | check_every | sequential steps | row-steps | row-steps on finished rows | x row-steps of 1 | "
          "host reads |")
    print("|---|---|---|---|---|---|---|")
    for slots in (None, rows // 4):
        base = None
        for every in (1, 2, 4, 8, 16, 32):
            figs = [plan_call(p, b, args.memory_block, slots, every) for p, b in calls]
            steps, row_steps, checks = (sum(f[i] for f in figs) / len(figs) for i in range(3))
            base = row_steps if base is None else base
            print(f"| {slots or 'rows'} | {every} | {steps:.0f} | {row_steps:.0f} | {row_steps - base:.0f} | "
                  f"{row_steps / base:.3f} | {checks:.0f} |")
            res.row(table, slots=slots or "rows", check_every=every, **{
                "sequential steps": round(steps), "row-steps": round(row_steps),
                "row-steps on finished rows": round(row_steps - base), "x row-steps of 1": round(row_steps / base, 3),
                "host reads": round(checks)})
    res.write()


if __name__ == "__main__":
    main()
