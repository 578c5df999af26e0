"""The sampler ring as a program: which steps every pipeline stage runs, in which order, and
which messages each receives and sends (DESIGN section 5). A pure description: the executor
(executor.py) runs the steps it yields, and the NCCL-rule simulation (parallel/nccl_sim.py)
replays the same steps for every stage, so the simulation checks what really runs (a test
records the executor's messages and compares them with this description).

Per micro-batch j (B_j rows, right-padded prompts, all rows advancing in lockstep):

    prefill(j)           encoder over [0, S0), S0 = C * floor(P_min / C), when S0 > 0
    in(t, j)             stage 0 (t >= 1): x_t and the row flags of step t-1 (``r_ctl``) and
                         z_{t-1} (``r_ring``); the middle stages: the flags, at checks only
    prefill_mem(j)       before item (0, j) on the stages < last: the prefill's memory
    enc(t, j), mem(t, j) block [t+1-C, t+1) completes at t (and starts at or after S0): one
                         encoder call, its memory fanned out from the last stage
    dec(t, j)            decoder step t; on the last stage the head, the processing, the
                         choice of x_{t+1} and (t + 1 < max_steps) the messages for step t+1

Steps walk the items (t, j) in t-major order on every stage, so each direction's messages are
received in the order they are sent (``r_mem`` travels on its own lane, ``parallel/p2p.py``:
the last stage sends a block's memory in the middle of an item and step t's ``r_ctl`` at its
end, while stage 0 takes step t's ``r_ctl`` only at item (t+1, j)).

Stopping without host synchronisation: the finish flags live on the device and travel in
``r_ctl`` (fixed shape (2, B): x_{t+1} and the flags). Only every ``check_every`` steps does a
stage read them (a check: one host read per micro-batch), at step t (t % check_every == 0) on
the stages < last when their ``in(t, j)`` arrives, and on the last stage at the end of
``dec(t-1, j)``; a micro-batch whose rows all finished stops there on every stage, so each
runs ``num_steps`` = a multiple of check_every (or max_steps) steps. The last stage sends the
messages of step t+1 whenever t + 1 < max_steps (the receivers post them before they know the
decision), so a stopping micro-batch leaves one ``r_ring`` unused.

The row schedule (rollout/rows.py: shared prompts forked into their rows, rows leaving and
entering slots, rows at their own positions) runs the same ring through ``row_ring_steps``: an
item (k, j) is decoder step k of micro-batch j, its encoder calls are the plan's (prefills of
entering sequences, per-row memory blocks, each with its own messages), and ``r_ctl`` carries
the step's chosen tokens (one per target: a forking entry has its G rows' first tokens) and the
finish flags of all R rows, (CTL_ROWS, targets + R): every stage applies the same events from
the same flags at a check, and shapes follow from the plan on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

from rlt_mega.parallel.nccl_sim import Msg
from rlt_mega.rollout.rows import RowPlan

CTL_ROWS = 2  # r_ctl: (CTL_ROWS, B) long; row 0: x_{t+1}, row 1: the rows' finish flags


@dataclass(frozen=True)
class MicroBatchMeta:
    prefill_end: int  # S0
    max_steps: int  # at most this many decoder steps


class RingStep(NamedTuple):
    name: str
    recvs: tuple  # Msg, received in this order before the step computes
    sends: tuple  # Msg, sent in this order after it
    cost: float
    kind: str  # prefill prefill_mem in enc mem dec
    j: int
    t: int  # -1 for the prefill
    block: Optional[tuple[int, int]]  # (start, end) of an encoder call (prefill, enc, their mem)


def encoder_block(meta: MicroBatchMeta, C: int, t: int) -> Optional[tuple[int, int]]:
    """The block [t+1-C, t+1) when it completes at step t and the prefill did not cover it."""
    start = t + 1 - C
    if (t + 1) % C == 0 and start >= meta.prefill_end:
        return (start, t + 1)
    return None


def is_check(t: int, check_every: int) -> bool:
    """Whether the stages read the finish flags before step t (t >= 1)."""
    return t % check_every == 0


def _encoder_messages(s: int, P: int, j: int, t: int) -> tuple[tuple, tuple]:
    recvs = (Msg(s - 1, s, "r_enc", j, t),) if s > 0 else ()
    if s < P - 1:
        return recvs, (Msg(s, s + 1, "r_enc", j, t),)
    return recvs, tuple(Msg(s, r, "r_mem", j, t) for r in range(P - 1))


def _dec_messages(s: int, P: int, meta: MicroBatchMeta, check_every: int, j: int, t: int) -> tuple[tuple, tuple]:
    recvs = (Msg(s - 1, s, "r_dec", j, t),) if s > 0 else ()
    if s < P - 1:
        return recvs, (Msg(s, s + 1, "r_dec", j, t),)
    sends = []
    if t + 1 < meta.max_steps:
        sends.append(Msg(s, 0, "r_ctl", j, t))
        if is_check(t + 1, check_every):
            sends += [Msg(s, r, "r_ctl", j, t) for r in range(1, P - 1)]
        sends.append(Msg(s, 0, "r_ring", j, t))
    return recvs, tuple(sends)


def ring_steps(stage: int, num_stages: int, memory_block: int, check_every: int, metas: Sequence[MicroBatchMeta],
               num_steps: Callable[[int], Optional[int]]) -> Iterator[RingStep]:
    """The steps of ``stage`` in order. ``num_steps(j)``: micro-batch j's number of decoder steps
    once a check decided it (None while it runs on); consulted only after the step that may
    decide it, so the executor passes what it knows so far and the simulation the final
    values. A message to oneself (one stage) is not listed."""
    s, P, C = stage, num_stages, memory_block
    last = P - 1

    def step(kind: str, j: int, t: int, recvs=(), sends=(), block=None, cost=0.0) -> RingStep:
        keep = lambda msgs: tuple(m for m in msgs if m.src != m.dst)  # noqa: E731
        return RingStep(f"{kind}(j={j}, t={t})", keep(recvs), keep(sends), cost, kind, j, t, block)

    def runs(j: int, t: int) -> bool:  # item (t, j) exists (as far as this stage knows now)
        n = num_steps(j)
        return t < metas[j].max_steps and (n is None or t < n)

    # ---- warm-up: every micro-batch's prefill
    for j, meta in enumerate(metas):
        if meta.prefill_end > 0:
            yield step("prefill", j, -1, *_encoder_messages(s, P, j, -1), block=(0, meta.prefill_end))
    # ---- the ring: items (t, j) in t-major order
    alive = [True] * len(metas)  # item (t - 1, j) ran (t = 0: every micro-batch starts)
    t = 0
    while any(alive):
        for j, meta in enumerate(metas):
            if not alive[j]:
                continue
            if t > 0 and t < meta.max_steps and s < last and (s == 0 or is_check(t, check_every)):
                recvs = (Msg(last, s, "r_ctl", j, t - 1),) + ((Msg(last, 0, "r_ring", j, t - 1),) if s == 0 else ())
                yield step("in", j, t, recvs)
            if not runs(j, t):
                alive[j] = False
                continue
            if t == 0 and meta.prefill_end > 0 and s < last:
                yield step("prefill_mem", j, -1, (Msg(last, s, "r_mem", j, -1),), block=(0, meta.prefill_end))
            block = encoder_block(meta, C, t)
            if block is not None:
                yield step("enc", j, t, *_encoder_messages(s, P, j, t), block=block)
                if s < last:
                    yield step("mem", j, t, (Msg(last, s, "r_mem", j, t),), block=block)
            yield step("dec", j, t, *_dec_messages(s, P, meta, check_every, j, t), cost=1.0)
        t += 1


def ring_programs(num_stages: int, memory_block: int, check_every: int, metas: Sequence[MicroBatchMeta],
                  num_steps: Sequence[int]) -> list[list[RingStep]]:
    """Every stage's whole program for micro-batches that ran ``num_steps[j]`` steps (each a
    multiple of check_every, or max_steps: where checks can stop a micro-batch)."""
    for j, (meta, n) in enumerate(zip(metas, num_steps)):
        if not (1 <= n <= meta.max_steps and (n == meta.max_steps or is_check(n, check_every))):
            raise ValueError(f"micro-batch {j}: {n} steps cannot happen with max_steps={meta.max_steps} and a check "
                             f"every {check_every} steps")
    return [list(ring_steps(s, num_stages, memory_block, check_every, metas, lambda j: num_steps[j]))
            for s in range(num_stages)]


def row_ring_steps(stage: int, num_stages: int, check_every: int, plans: Sequence[RowPlan]) -> Iterator[RingStep]:
    """The steps of ``stage`` for micro-batches run by row plans (rollout/rows.py), in order.
    The plans are consulted lazily: ``may_run(k)`` decides which messages of step k are posted
    (before a check's flags are known), then, once the executor has taken item k's control
    message (stages < last) or chosen step k - 1's tokens (the last stage), ``begin(k)`` says
    whether the step runs and which encoder calls precede it. The executor sets a check's flags
    on the plan before ``begin``; a recorded plan (replay, simulation) has them already.
    ``RingStep.block`` of an encoder step is (start, end, call index)."""
    s, P = stage, num_stages
    last = P - 1
    steps: list = [None] * len(plans)  # the StepPlan of the current item, per micro-batch

    def step(kind: str, j: int, k: int, recvs=(), sends=(), block=None, cost=0.0) -> RingStep:
        keep = lambda msgs: tuple(m for m in msgs if m.src != m.dst)  # noqa: E731
        return RingStep(f"{kind}(j={j}, k={k})", keep(recvs), keep(sends), cost, kind, j, k, block)

    alive = [True] * len(plans)
    k = 0
    while any(alive):
        for j, plan in enumerate(plans):
            if not alive[j]:
                continue
            if k > 0 and s < last and plan.may_run(k) and (s == 0 or is_check(k, check_every)):
                recvs = (Msg(last, s, "r_ctl", j, k - 1),) + ((Msg(last, 0, "r_ring", j, k - 1),) if s == 0 else ())
                yield step("in", j, k, recvs)
            sp = plan.begin(k)
            steps[j] = sp
            if sp is None:
                alive[j] = False
                continue
            for c, call in enumerate(sp.calls):
                block = (call.start, call.end, c)
                yield step("enc", j, k, *_encoder_messages(s, P, j, k), block=block)
                if s < last:
                    yield step("mem", j, k, (Msg(last, s, "r_mem", j, k),), block=block)
            recvs = (Msg(s - 1, s, "r_dec", j, k),) if s > 0 else ()
            if s < last:
                sends = (Msg(s, s + 1, "r_dec", j, k),)
            else:
                sends = []
                if plan.may_run(k + 1):
                    sends.append(Msg(s, 0, "r_ctl", j, k))
                    if is_check(k + 1, check_every):
                        sends += [Msg(s, r, "r_ctl", j, k) for r in range(1, P - 1)]
                    sends.append(Msg(s, 0, "r_ring", j, k))
                sends = tuple(sends)
            yield step("dec", j, k, recvs, sends, cost=1.0)
        k += 1


def row_ring_programs(num_stages: int, check_every: int, plans_for_stage) -> list[list[RingStep]]:
    """Every stage's whole program; ``plans_for_stage(s)``: fresh recorded RowPlans (one per
    micro-batch) for stage s, which replay the flags their record holds."""
    return [list(row_ring_steps(s, num_stages, check_every, plans_for_stage(s))) for s in range(num_stages)]
