"""Prints the table of every pipeline program we run, replayed under NCCL's point-to-point rules
(rlt_mega/parallel/nccl_sim.py): the training ring (forward + backward, T=3) and the sampler ring
with the lockstep plan (C in {1, 2, 4}, ragged prompts, checks every 1 and 4 steps, some
micro-batches stopping early) and with the row plan (shared prompts forked, rows leaving and taking
freed slots, rows finishing at assorted steps: schedule/rows.py), as they run now, and on one stream
per pair of ranks (both directions on one communicator, as unbatched NCCL operations are: the
training ring's posting as it was before its channels). Pure computation, no ranks:

    python tools/nccl_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_mega.parallel.nccl_sim import Deadlock, Mismatch, simulate_nccl  # noqa: E402
from rlt_mega.parallel.pipeline import simulate  # noqa: E402
from rlt_mega.rollout.ring import row_ring_programs  # noqa: E402
from rlt_mega.schedule.rows import RowPlan, planned_record, row_layout  # noqa: E402


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Deadlock:
        return "deadlock"
    except Mismatch:
        return "mismatch"


def _records(M: int, C: int, every: int, grouped: bool) -> list:
    records = []
    for j in range(M):
        if grouped:
            prompts = [[1] * (2 + j)] * 4 + [[2] * (5 + j)] + [[3] * (3 + 2 * j)] * 3
            layout = row_layout(prompts, 9, C, slots=4, share_prompts=True, compact=True, check_every=every)
        else:  # the lockstep plan: ragged prompts, odd micro-batches stopping early at a check
            prompts = [[1] * (2 + j), [2] * (5 + 2 * j), [3] * (3 + j)]
            layout = row_layout(prompts, 9, C, slots=None, share_prompts=False, compact=False, check_every=every)
        records.append(planned_record(layout, lambda b: 3 + (5 * b + j) % 11 if (grouped or j % 2) else 10**9))
    return records


def _sampler(P: int, M: int, grouped: bool, streams: str = "channels") -> str:
    for C in ((1, 3) if grouped else (1, 2, 4)):
        for every in (1, 4):
            records = _records(M, C, every, grouped)
            programs = row_ring_programs(P, every, lambda s: [RowPlan(r.layout, recorded=r) for r in records])
            result = _outcome(lambda: simulate_nccl(programs, streams, ahead=False))
            if result != "ok":
                return f"{result} (C={C}, check_every={every})"
    return "ok"


def main() -> None:
    print("| P | M | training ring | sampler ring, lockstep plan | sampler ring, row plan | training ring, one stream "
          "per pair (before) | sampler ring, one stream per pair |")
    print("|---|---|---|---|---|---|---|")
    for P in (2, 3, 4):
        for M in (1, 2, 3, 4, 8):
            now = _outcome(lambda: (simulate(P, M, 3, backward=False), simulate(P, M, 3, backward=True)))
            before = _outcome(lambda: simulate(P, M, 3, backward=True, streams="pair"))
            print(f"| {P} | {M} | {now} | {_sampler(P, M, False)} | {_sampler(P, M, True)} | {before} | "
                  f"{_sampler(P, M, False, 'pair')} |")


if __name__ == "__main__":
    main()
