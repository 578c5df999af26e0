"""The sampler ring as a program: which steps every pipeline stage runs, in which order, and
which messages each receives and sends (DESIGN section 5). A pure description: the executor
(executor.py) runs the steps it yields, and the NCCL-rule simulation (parallel/nccl_sim.py)
replays the same steps for every stage, so the simulation checks what really runs (a test
records the executor's messages and compares them with this description).

Per micro-batch j, an item (k, j) is decoder step k of its plan (schedule/rows.py), in k-major
order on every stage:

    in(k, j)             stage 0 (k >= 1): the tokens chosen at step k-1 and the rows' finish flags
                         (``r_ctl``) and z of step k-1 (``r_ring``); the middle stages: the
                         flags, at checks only
    enc(k, j), mem(k, j) the plan's encoder calls before step k (prefills of sequences entering,
                         completed memory blocks: one call per distinct block start), each with its
                         messages; the memory fanned out from the last stage (``r_mem``)
    dec(k, j)            decoder step k; on the last stage the head, the processing, the choice of
                         the targets' next tokens and (if step k + 1 may run) the messages for it

Each direction's messages are received in the order they are sent (``r_mem`` travels on its own
lane, ``parallel/p2p.py``: the last stage sends a block's memory in the middle of an item and
step k's ``r_ctl`` at its end, while stage 0 takes that ``r_ctl`` only at item (k+1, j)).

Stopping without host synchronisation: the finish flags live on the device and travel in
``r_ctl`` ((CTL_ROWS, targets + R): the step's chosen tokens, one per target (a forking entry has
its G rows' first tokens), then the flags of all R rows). Only every ``check_every`` steps does a
stage read them (a check: one host read per micro-batch), on the stages < last when their
``in(k, j)`` arrives and on the last stage at the end of ``dec(k-1, j)``; every stage applies the
same events from the same flags at a check, and shapes follow from the plan on both sides. The
last stage sends the messages of step k+1 whenever the plan says it may run (the receivers post
them before they know the decision), so a stopping micro-batch leaves one ``r_ring`` unused.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

from rlt_mega.parallel.nccl_sim import Msg
from rlt_mega.schedule.rows import RowPlan

CTL_ROWS = 2  # r_ctl: (CTL_ROWS, B) long; row 0: x_{t+1}, row 1: the rows' finish flags


class RingStep(NamedTuple):
    name: str
    recvs: tuple  # Msg, received in this order before the step computes
    sends: tuple  # Msg, sent in this order after it
    cost: float
    kind: str  # in enc mem dec
    j: int
    t: int  # the step k
    block: Optional[tuple[int, int, int]]  # (start, end, call index) of an encoder call (enc, its mem)


def is_check(t: int, check_every: int) -> bool:
    """Whether the stages read the finish flags before step t (t >= 1)."""
    return t % check_every == 0


def _encoder_messages(s: int, P: int, j: int, t: int) -> tuple[tuple, tuple]:
    recvs = (Msg(s - 1, s, "r_enc", j, t),) if s > 0 else ()
    if s < P - 1:
        return recvs, (Msg(s, s + 1, "r_enc", j, t),)
    return recvs, tuple(Msg(s, r, "r_mem", j, t) for r in range(P - 1))


def row_ring_steps(stage: int, num_stages: int, check_every: int, plans: Sequence[RowPlan]) -> Iterator[RingStep]:
    """The steps of ``stage`` for micro-batches run by row plans (schedule/rows.py), in order.
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
