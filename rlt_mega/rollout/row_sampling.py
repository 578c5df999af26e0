"""Rollout and replay of the row schedule (rollout/rows.py) for ``Sampler``: the choosers (drawn
or forced, per target sequence), the per-sequence token buffers, and the rollout record.

A row draws its i-th completion token with its own i-th uniform (drawn once from its request's
generator, as in the lockstep schedule), so its draws do not depend on its batch-mates, where it
sits or when it entered; a forked row's first token is drawn from its entry's distribution.

The record (``Schedule.rows``) holds the layout, the finish flags each check read and the event
log; ``replay_rows`` runs the same plan from the recorded flags (tokens forced) and refuses a
replay whose events or encoder calls differ from the record's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from rlt_mega.rollout.processing import Processing, make_generators, sample
from rlt_mega.rollout.row_executor import RowExecutor, RowResult, RowWork
from rlt_mega.rollout.rows import RowLayout, RowPlan, RowRecord, row_layout


@dataclass(frozen=True)
class RowSwitches:
    """The parts of the row schedule (each can be turned off; all off: the lockstep schedule).
    slots: rows decoded at once per call, 0 for one per row and entry (no row waits)."""

    share_prompts: bool = True
    compact: bool = True
    slots: int = 0

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"sampling.slots={self.slots}: must be >= 0 (0: one slot per row, no waiting)")

    @property
    def enabled(self) -> bool:
        return self.share_prompts or self.compact or self.slots > 0


LOCKSTEP = RowSwitches(share_prompts=False, compact=False, slots=0)


def row_switches(sampling) -> RowSwitches:
    """From a ``config.SamplingConfig``."""
    return RowSwitches(sampling.share_prompts, sampling.compact, sampling.slots)


def _draw_class():
    from rlt_mega.rollout.sampler import _Draw  # the lockstep chooser: stop strings and flags alike

    class RowDraw(_Draw):
        """``_Draw`` over sequences (rows, then entries, which only ever force their prompt), the
        choice made per target of the step."""

        def __init__(self, *args, num_rows: int, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.num_rows = num_rows
            self.is_row = torch.arange(self.tokens.shape[0], device=self.tokens.device) < num_rows

        def choose_rows(self, targets, positions, logprobs):
            sampling = self.is_row[targets] & (self.prompt_t[targets] <= positions + 1) & (self.reason[targets] == 0)
            draw_index = self.num_new[targets].clamp(max=self.u.shape[1] - 1)
            drawn = sample(logprobs, self.u[targets, draw_index])
            self._sampling = sampling
            return torch.where(sampling, drawn, self.tokens[targets, positions + 1])

        def record_rows(self, targets, positions, tokens):
            sampling = self._sampling
            num_new = self.num_new[targets] + sampling.long()
            reason = self.reason[targets]
            running = reason == 0
            if len(self.stop_ids):
                stop = sampling & torch.isin(tokens, self.stop_ids)
                reason = torch.where(running & stop, 1, reason)
                running = reason == 0
            length = sampling & (num_new == self.budget[targets])
            self.reason[targets] = torch.where(running & length, 3, reason)
            self.num_new[targets] = num_new

        def finished_rows(self):
            return self.reason[:self.num_rows] != 0

    return RowDraw


class RowForce:
    """The replay's chooser: the recorded tokens."""

    def __init__(self, tokens: torch.Tensor, num_rows: int) -> None:
        self.tokens = tokens
        self.none = torch.zeros(num_rows, dtype=torch.bool, device=tokens.device)

    def choose_rows(self, targets, positions, logprobs):
        return self.tokens[targets, positions + 1]

    def record_rows(self, targets, positions, tokens) -> None:
        pass

    def finished_rows(self):
        return self.none

    def check(self, t: int) -> None:
        pass


def _seq_tokens(layout: RowLayout, rows: torch.Tensor, capacity: int, pad_id: int) -> torch.Tensor:
    """(S, capacity): the rows' tokens (R, n <= capacity), then each entry's prompt."""
    R, device = layout.num_rows, rows.device
    out = torch.full((layout.num_seqs, capacity), pad_id, dtype=torch.long, device=device)
    out[:R, :rows.shape[1]] = rows
    for u, members in enumerate(layout.entry_rows):
        P = layout.prompt_lens[members[0]]
        out[R + u, :P] = rows[members[0], :P]
    return out


def generate_rows(executor: RowExecutor, batches, params, seeds, pad_id: int, decode, switches: RowSwitches,
                  device, check_model_fits) -> tuple[list, list]:
    """The row schedule's rollout of every batch -> (results, per batch (layout, work, chooser,
    capacity))."""
    RowDraw = _draw_class()
    works, extra = [], []
    for prompts, p, batch_seeds in zip(batches, params, seeds):
        layout = row_layout(prompts, p.max_new_tokens, executor.C, switches.slots or None, switches.share_prompts,
                            switches.compact, executor.check_every)
        capacity = max(layout.prompt_lens) + p.max_new_tokens
        check_model_fits(capacity)
        rows = torch.full((len(prompts), capacity), pad_id, dtype=torch.long, device=device)
        for b, x in enumerate(prompts):
            rows[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
        tokens = _seq_tokens(layout, rows, capacity, pad_id)
        seq_lens = [layout.seq_len(s) for s in range(layout.num_seqs)]
        gens = make_generators(list(batch_seeds) + [0] * (layout.num_seqs - layout.num_rows), device)
        chooser = RowDraw(tokens, seq_lens, p, gens, decode, pad_id, num_rows=layout.num_rows)
        works.append(RowWork(tokens, RowPlan(layout), chooser))
        extra.append(chooser)
    return works, extra


def row_rollout(res: RowResult, work: RowWork, chooser, processing: Processing, dtype: str, pad_id: int,
                memory_block: int, schedule_cls, rollout_cls, reasons):
    """The Rollout record of a row-schedule call (tokens (R, T), T = the longest prompt +
    completion; mu (R, N) from the per-sequence log-probs)."""
    plan, layout = work.plan, work.plan.layout
    R = layout.num_rows
    device = work.tokens.device
    completion_lens = chooser.num_new[:R].tolist()
    finish_reasons = [reasons[r] or "length" for r in chooser.reason[:R].tolist()]
    T = max(P + n for P, n in zip(layout.prompt_lens, completion_lens))
    mu = _completion_values(res.lp[:R], layout.prompt_lens, completion_lens)
    record = plan.record()
    schedule = schedule_cls(prompt_lens=list(layout.prompt_lens), memory_block=memory_block,
                            capacity=work.tokens.shape[1], num_steps=T - 1,
                            encoder_calls=[(c[1], c[2]) for c in res.encoder_calls], processing=processing,
                            dtype=dtype, pad_id=pad_id, fast_decode=res.fast_decode, rows=record)
    mask = mu[1]
    return rollout_cls(tokens=work.tokens[:R, :T].clone(), mu=mu[0], mask=mask, completion_lens=completion_lens,
                       finish_reasons=finish_reasons, schedule=schedule)


def _completion_values(lp: torch.Tensor, prompt_lens: Sequence[int], completion_lens: Sequence[int]):
    """lp (R, capacity) per position -> (values (R, N), mask (R, N)): the j-th completion token
    of row b sits at position P_b + j."""
    device = lp.device
    N = max(completion_lens) if len(completion_lens) else 0
    j = torch.arange(N, device=device)
    P = torch.as_tensor(list(prompt_lens), device=device)
    n = torch.as_tensor(list(completion_lens), device=device)
    mask = j[None, :] < n[:, None]
    pos = torch.where(mask, P[:, None] + j[None, :], torch.zeros_like(mask, dtype=torch.long))
    return torch.where(mask, lp.gather(1, pos), torch.zeros((), device=device)), mask


def replay_works(rollouts, device) -> list[RowWork]:
    works = []
    for ro in rollouts:
        s = ro.schedule
        record: RowRecord = s.rows
        rows = ro.tokens.to(device)
        tokens = _seq_tokens(record.layout, rows, s.capacity, s.pad_id)
        works.append(RowWork(tokens, RowPlan(record.layout, recorded=record), RowForce(tokens, record.layout.num_rows)))
    return works


def replay_values(ro, work: RowWork, res: RowResult) -> Optional[torch.Tensor]:
    """Checks the replay repeated the rollout's events -> log-probs (R, N) or None (not the last
    stage)."""
    s, record = ro.schedule, ro.schedule.rows
    if work.plan.log != record.log or work.plan.num_steps != record.num_steps:
        raise RuntimeError("the replay's row events differ from the rollout's record (forks, leaves, entries, "
                           "encoder calls): the schedule (prompt lengths, C, slots, check_every) differs")
    if [(c[1], c[2]) for c in res.encoder_calls] != [tuple(c) for c in s.encoder_calls]:
        raise RuntimeError(f"replay made encoder calls {res.encoder_calls} but the rollout recorded "
                           f"{list(s.encoder_calls)}")
    if res.lp is None:
        return None
    return _completion_values(res.lp[:record.layout.num_rows], s.prompt_lens, ro.completion_lens)[0]


def with_rows(schedule, rows: Optional[RowRecord]):
    return dataclasses.replace(schedule, rows=rows)
