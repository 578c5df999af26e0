"""Every pipeline program we run, replayed under NCCL's point-to-point rules (parallel/nccl_sim.py:
tags ignored, messages pair by order, one stream per communicator where a posted receive blocks
what follows it, rendezvous sends): the training ring and the sampler ring for P in {2, 3, 4},
M in {1, 2, 3, 4, 8} (the sampler also with C in {1, 2, 4}, ragged prompts and checks, the lockstep
plan and the row plan: shared prompts forked, rows waiting for slots) find no deadlock and no
mismatched pair; the schedules as they were before their channels, and deliberately reordered
programs, are caught. One process, no ranks."""

import pytest

from rlt_mega.parallel.nccl_sim import Deadlock, Mismatch, Msg, Step, check_pairs, simulate_nccl
from rlt_mega.parallel.p2p import pipeline_channels
from rlt_mega.parallel.pipeline import ring_programs, simulate
from rlt_mega.rollout.ring import row_ring_programs
from rlt_mega.schedule.rows import Enter, RowPlan, planned_record, row_layout

PS, MS = [2, 3, 4], [1, 2, 3, 4, 8]


def records(M: int, C: int, check_every: int, grouped: bool) -> list:
    """M calls: ragged prompts (shortest 2 + j tokens, so prefills differ, some empty) on the
    lockstep plan, rows finishing at assorted steps (some micro-batches stop early at a check);
    or, ``grouped``, shared prompts forked into their rows with slots < rows (rows wait and enter
    freed slots)."""
    out = []
    for j in range(M):
        if grouped:
            prompts = [[1] * (2 + j)] * 4 + [[2] * (5 + j)] + [[3] * (3 + 2 * j)] * 3
            layout = row_layout(prompts, 9, C, slots=4, share_prompts=True, compact=True, check_every=check_every)
        else:
            prompts = [[1] * (2 + j), [2] * (5 + 2 * j), [3] * (3 + j)]
            layout = row_layout(prompts, 9, C, slots=None, share_prompts=False, compact=False, check_every=check_every)
        out.append(planned_record(layout, lambda b: 3 + (5 * b + j) % 11 if (grouped or j % 2) else 10**9))
    return out


def sampler_programs(P: int, every: int, recs: list) -> list:
    return row_ring_programs(P, every, lambda s: [RowPlan(r.layout, recorded=r) for r in recs])


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_the_training_ring_runs_under_nccl_rules(P, M):
    for backward in (False, True):
        r = simulate(P, M, 3, backward=backward)
        if M >= P and not backward:  # and the ring stays full
            assert r["bubble"] == pytest.approx((P - 1) / (M * 3 + P - 1))


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
def test_the_training_ring_before_its_channels_deadlocks_under_nccl(P, M):
    # Both directions of a pair on one stream, the next op's receive posted before this op's
    # sends (what RingSchedule did): the receive blocks the send the peer waits for.
    for backward in (False, True):
        with pytest.raises(Deadlock):
            simulate(P, M, 3, backward=backward, streams="pair")


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("C", [1, 2, 4])
def test_the_sampler_ring_runs_under_nccl_rules(P, M, C):
    for check_every in (1, 4):
        for grouped in (False, True):
            recs = records(M, C, check_every, grouped)
            if grouped:
                assert any(isinstance(e, Enter) and e.step > 0 for rec in recs for e in rec.log)
            simulate_nccl(sampler_programs(P, check_every, recs), ahead=False)
            simulate_nccl(sampler_programs(P, check_every, recs), ahead=True)  # posting one step ahead is safe too


def test_the_sampler_ring_needs_its_memory_lane():
    # On one stream per direction, the last stage sends a block's memory in the middle of an
    # item and step t's control at its end, while stage 0 takes that control only at item
    # (t + 1, j): with two micro-batches the pair mispairs (the old executor's r_ctl-for-r_mem).
    with pytest.raises(Mismatch, match="r_ctl.*r_mem|r_mem.*r_ctl"):
        simulate_nccl(sampler_programs(2, 1, records(2, 2, 1, False)), streams="pair", ahead=False)


def test_a_reordered_program_is_caught():
    programs = ring_programs(2, 2, 3, backward=True)
    # stage 1 takes the encoder input of micro-batch 1 before that of micro-batch 0
    swapped = [list(p) for p in programs]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]
    with pytest.raises(Mismatch, match="stages 0 -> 1"):
        simulate_nccl(swapped)
    # stage 0 waits for micro-batch 0's memory before it has sent that micro-batch's encoder input
    early = [list(p) for p in programs]
    mem = next(k for k, s in enumerate(early[0]) if s.name.startswith("mem_fwd(j=0"))
    early[0].insert(0, early[0].pop(mem))
    with pytest.raises(Deadlock, match="stage 0 at step 0 mem_fwd"):
        simulate_nccl(early)
    # a message nobody receives
    extra = [list(p) for p in programs]
    extra[0].append(Step("stray", (), (Msg(0, 1, "dec", 9, 9),)))
    with pytest.raises(Mismatch, match="no partner"):
        check_pairs(extra)


def test_a_large_send_that_waits_for_its_receive_is_what_deadlocks():
    # Two ranks that both send first and receive second: fine if sends complete at once
    # (small, eager), a deadlock under rendezvous when both directions share a stream.
    programs = [[Step("a", (), (Msg(0, 1, "dec"),)), Step("b", (Msg(1, 0, "dec"),), ())],
                [Step("a", (), (Msg(1, 0, "dec"),)), Step("b", (Msg(0, 1, "dec"),), ())]]
    simulate_nccl(programs, streams="pair", ahead=False, eager=True)
    with pytest.raises(Deadlock):
        simulate_nccl(programs, streams="pair", ahead=False)
    simulate_nccl(programs, ahead=False)  # one channel per direction


@pytest.mark.parametrize("P", PS)
def test_every_channel_a_program_uses_exists(P):
    from rlt_mega.parallel.p2p import lane_of

    channels = set(pipeline_channels(P))
    for programs in (ring_programs(P, 3, 3, backward=True), sampler_programs(P, 4, records(3, 2, 4, True))):
        used = {(m.src, m.dst, lane_of(m.stream)) for prog in programs for step in prog for m in step.sends}
        assert used <= channels
