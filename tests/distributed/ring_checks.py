"""The messages a stage's executors really posted (nccl_scenarios.ring_messages) against the pure
descriptions the NCCL simulation checks (rollout/ring.py for the sampler ring, parallel/pipeline.py
for the training ring), in posting order. Used by the two- and four-rank tests."""

from __future__ import annotations

from rlt_mega.parallel.nccl_sim import posting_order, simulate_nccl
from rlt_mega.parallel.pipeline import ring_programs as training_programs
from rlt_mega.rollout.ring import row_ring_programs
from rlt_mega.schedule.rows import Check, Enter, Fork, RowPlan, record_from_json


def _expected(programs, stage: int, ahead: bool) -> list:
    return [[kind, m.src if kind == "recv" else m.dst, m.stream] for kind, m in posting_order(programs, stage, ahead)]


def check_ring_messages(r: dict) -> None:
    """Generate and replay post the messages of ``row_ring_steps`` for the recorded plans (the
    replay repeats the events, so the very same list), that program passes the NCCL simulation,
    and the training ring posts its description's."""
    records = [record_from_json(d) for d in r["records"]]
    if r["plan"] == "rows":
        assert any(isinstance(e, Fork) for rec in records for e in rec.log)
        assert any(isinstance(e, Enter) and e.step > 0 for rec in records for e in rec.log)  # a row took a freed slot
    else:  # a micro-batch stopped at a check, before its last possible step
        assert any(isinstance(e, Check) for rec in records for e in rec.log)

    def programs():
        return row_ring_programs(r["P"], r["check_every"], lambda s: [RowPlan(rec.layout, recorded=rec)
                                                                      for rec in records])

    expected = _expected(programs(), r["stage"], ahead=False)
    assert r["generate"] and r["generate"] == expected
    assert r["replay"] == expected
    simulate_nccl(programs(), "channels", ahead=False)
    if "train" in r:
        M, T = r["train_shape"]
        assert r["train"] and r["train"] == _expected(training_programs(r["P"], M, T, backward=True), r["stage"],
                                                      ahead=True)
