"""Prints the table of every pipeline program we run, replayed under NCCL's point-to-point rules
(rlt_mega/parallel/nccl_sim.py): the training ring (forward + backward, T=3) and the sampler ring
(C in {1, 2, 4}, ragged prompts, checks every 1 and 4 steps, some micro-batches stopping early)
as they run now, the sampler ring of the row schedule (shared prompts forked, rows leaving and
taking freed slots, rows finishing at assorted steps: rollout/rows.py), and both on one stream per pair of ranks (both directions on one communicator,
as unbatched NCCL operations are: the training ring's posting as it was before its channels). Pure computation, no ranks:

    python tools/nccl_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_mega.parallel.nccl_sim import Deadlock, Mismatch, simulate_nccl  # noqa: E402
from rlt_mega.parallel.pipeline import simulate  # noqa: E402
from rlt_mega.rollout.ring import MicroBatchMeta, is_check, ring_programs, row_ring_programs  # noqa: E402
from rlt_mega.rollout.rows import RowPlan, planned_record, row_layout  # noqa: E402


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Deadlock:
        return "deadlock"
    except Mismatch:
        return "mismatch"


def _sampler(P: int, M: int, streams: str = "channels") -> str:
    for C in (1, 2, 4):
        for every in (1, 4):
            metas, steps = [], []
            for j in range(M):
                meta = MicroBatchMeta(prefill_end=C * ((2 + j) // C), max_steps=5 + 2 * j + 8)
                early = next((t for t in range(5 + 2 * j, meta.max_steps) if is_check(t, every)), meta.max_steps)
                metas.append(meta)
                steps.append(early if j % 2 else meta.max_steps)
            result = _outcome(lambda: simulate_nccl(ring_programs(P, C, every, metas, steps), streams, ahead=False))
            if result != "ok":
                return f"{result} (C={C}, check_every={every})"
    return "ok"


def _row_sampler(P: int, M: int) -> str:
    for C in (1, 3):
        for every in (1, 4):
            records = []
            for j in range(M):
                prompts = [[1] * (2 + j)] * 4 + [[2] * (5 + j)] + [[3] * (3 + 2 * j)] * 3
                layout = row_layout(prompts, 9, C, slots=4, share_prompts=True, compact=True, check_every=every)
                records.append(planned_record(layout, lambda b: 3 + (5 * b + j) % 11))
            programs = row_ring_programs(P, every, lambda s: [RowPlan(r.layout, recorded=r) for r in records])
            result = _outcome(lambda: simulate_nccl(programs, "channels", ahead=False))
            if result != "ok":
                return f"{result} (C={C}, check_every={every})"
    return "ok"


def main() -> None:
    print("| P | M | training ring | sampler ring | row-schedule sampler ring | training ring, one stream per pair "
          "(before) | sampler ring, one stream per pair |")
    print("|---|---|---|---|---|---|---|")
    for P in (2, 3, 4):
        for M in (1, 2, 3, 4, 8):
            now = _outcome(lambda: (simulate(P, M, 3, backward=False), simulate(P, M, 3, backward=True)))
            before = _outcome(lambda: simulate(P, M, 3, backward=True, streams="pair"))
            print(f"| {P} | {M} | {now} | {_sampler(P, M)} | {_row_sampler(P, M)} | {before} | "
                  f"{_sampler(P, M, 'pair')} |")


if __name__ == "__main__":
    main()
