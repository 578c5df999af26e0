"""The messages a stage's executors really posted (nccl_scenarios.ring_messages) against the pure
descriptions the NCCL simulation checks (rollout/ring.py for the sampler ring, parallel/pipeline.py
for the training ring), in posting order. Used by the two- and four-rank tests."""

from __future__ import annotations

from rlt_mega.parallel.nccl_sim import posting_order
from rlt_mega.parallel.pipeline import ring_programs as training_programs
from rlt_mega.rollout.ring import MicroBatchMeta, ring_programs


def _expected(programs, stage: int, ahead: bool) -> list:
    return [[kind, m.src if kind == "recv" else m.dst, m.stream] for kind, m in posting_order(programs, stage, ahead)]


def check_ring_messages(r: dict) -> None:
    P, C, every, stage = r["P"], r["C"], r["check_every"], r["stage"]
    batches = r["batches"]
    steps = [b["num_steps"] for b in batches]
    # the run exercised a micro-batch stopping at a check, before its last possible step
    assert any(b["num_steps"] < b["capacity"] - 1 for b in batches), batches
    generate = ring_programs(P, C, every, [MicroBatchMeta(b["prefill_end"], b["capacity"] - 1) for b in batches], steps)
    assert r["generate"] and r["generate"] == _expected(generate, stage, ahead=False)
    replay = ring_programs(P, C, every, [MicroBatchMeta(b["prefill_end"], b["num_steps"]) for b in batches], steps)
    assert r["replay"] == _expected(replay, stage, ahead=False)
    M, T = r["train_shape"]
    assert r["train"] and r["train"] == _expected(training_programs(P, M, T, backward=True), stage, ahead=True)


def check_row_ring_messages(r: dict) -> None:
    """The row schedule: generate and replay post the messages of ``row_ring_steps`` for the
    recorded plans (the replay repeats the events, so the very same list), and that program
    passes the NCCL simulation."""
    from rlt_mega.parallel.nccl_sim import simulate_nccl
    from rlt_mega.rollout.ring import row_ring_programs
    from rlt_mega.rollout.rows import RowPlan, record_from_json

    records = [record_from_json(d) for d in r["records"]]
    assert any(e[0] == "fork" for rec in records for e in rec.log)
    assert any(e[0] == "enter" and e[1] > 0 for rec in records for e in rec.log)  # a row took a freed slot

    def programs():
        return row_ring_programs(r["P"], r["check_every"], lambda s: [RowPlan(rec.layout, recorded=rec)
                                                                      for rec in records])

    expected = _expected(programs(), r["stage"], ahead=False)
    assert r["generate"] and r["generate"] == expected
    assert r["replay"] == expected
    simulate_nccl(programs(), "channels", ahead=False)
