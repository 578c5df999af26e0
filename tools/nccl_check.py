"""Prints the table of every pipeline program we run, replayed under NCCL's point-to-point rules
(rlt_mega/parallel/nccl_sim.py): the training ring (forward + backward, T=3) and the sampler ring
(C in {1, 2, 4}, ragged prompts, checks every 1 and 4 steps, some micro-batches stopping early)
as they run now, and both on one stream per pair of ranks (both directions on one communicator,
as unbatched NCCL operations are: the training ring's posting as it was before its channels). Pure computation, no ranks:

    python tools/nccl_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_mega.parallel.nccl_sim import Deadlock, Mismatch, simulate_nccl  # noqa: E402
from rlt_mega.parallel.pipeline import simulate  # noqa: E402
from rlt_mega.rollout.ring import MicroBatchMeta, is_check, ring_programs  # noqa: E402


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


def main() -> None:
    print("| P | M | training ring | sampler ring | training ring, one stream per pair (before) | "
          "sampler ring, one stream per pair |")
    print("|---|---|---|---|---|---|")
    for P in (2, 3, 4):
        for M in (1, 2, 3, 4, 8):
            now = _outcome(lambda: (simulate(P, M, 3, backward=False), simulate(P, M, 3, backward=True)))
            before = _outcome(lambda: simulate(P, M, 3, backward=True, streams="pair"))
            print(f"| {P} | {M} | {now} | {_sampler(P, M)} | {before} | {_sampler(P, M, 'pair')} |")


if __name__ == "__main__":
    main()
