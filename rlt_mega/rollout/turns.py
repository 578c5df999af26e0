"""Environment turns inside a rollout (docs/design.md, "Environment turns"): what the sampler needs
of a row's environment episode, what it counts, and the turn itself (``Turns``), which the rollout
driver (rollout/executor.py ``check``) executes at each check, between decoder steps, after the
chooser's stop strings; the token chooser only chooses tokens.

A row with an episode samples as usual until its newest model turn (its completion tokens since
the last observation) *triggers* the episode (a stop string or token the environment declares);
then, at the check right after the trigger was drawn, the row submits the episode's call and
leaves its slot (``Leave(why="env")``, its state parked), so that the call runs while the other
rows decode and a waiting row can take the slot; at the next check the turn waits for the
answer (a fixed point, so a run does not depend on how long a call took): the episode ends (the
row finishes, reason ``env``) or an observation, already tokenized (token in, token out: the ids
are the episode's, nothing re-tokenizes a transcript), is written into the row's next positions
and the row waits for a slot to re-enter where it left. When no other row could run meanwhile
(every unfinished row has just triggered) the answers are waited for at once and the rows stay.
Those positions are *forced*, like prompt tokens: they run through the decoder and the encoder's
memory blocks, carry no mu and no loss (``Rollout.mask`` is False there), and the plan logs them
as ``Force`` events (schedule/rows.py) that the replay repeats. The environments themselves (the
triggers, the caps on turns and observation tokens, the time limit) are rollout/env/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from rlt_mega.rollout.processing import Finish
from rlt_mega.schedule.rows import Flag, RowPlan


@dataclass(frozen=True)
class Response:
    """An episode's answer to a trigger."""

    ids: tuple[int, ...] = ()  # the observation, tokenized once
    done: bool = False  # the episode ends at the trigger (no observation)
    tool_call: bool = False  # the turn was a tool call
    error: bool = False  # the tool call failed (the observation says why)
    truncated: bool = False  # a cap (turns, observation tokens) cut the episode
    fault: bool = False  # the environment's code failed (raised, or answered with the wrong type): counted


class Episode(Protocol):
    """One row's environment (rollout/env/ builds them from the prompt's record)."""

    start_failed: bool  # its start raised (a fault, counted once; the episode ends at its first trigger)

    def triggered(self, ids: Sequence[int], text: str) -> bool:
        """Whether the model's turn so far (its ids and their text) hands over to the environment."""

    def submit(self, ids: Sequence[int], text: str) -> "Answer":
        """Starts the environment's answer to a triggered turn (it runs while the sampler decodes
        the other rows; its time limit counts from here)."""


class Answer(Protocol):
    def result(self) -> Response:
        """The answer (waits for it)."""


@dataclass
class EpisodeStats:
    """One row's episode, as the metrics count it (``env/*``)."""

    turns: int = 0  # the environment's answers that continued the episode (an observation)
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0  # inserted (after every cap)
    departures: int = 0  # calls that ran while the row was out of the batch (the others decoding meanwhile)
    blocking_waits: int = 0  # calls waited for at once, the row in its slot: no other row could run meanwhile
    truncated: bool = False  # cut by a limit: max_turns, an observation cap, or the row's token budget
    faults: int = 0  # faults of the environment's code (rollout/env/base.py, EnvFaults): its start, its calls


def forced_mask(prompt_lens: Sequence[int], completion_lens: Sequence[int], forces, shape, device):
    """(B, N) bool: the completion slots [b, j] (position P_b + j) that an insertion forced."""
    out = torch.zeros(shape, dtype=torch.bool)
    for events in forces.values():
        for f in events:
            lo = f.start - prompt_lens[f.seq]
            hi = min(lo + len(f.ids), completion_lens[f.seq])
            if hi > lo:
                out[f.seq, lo:hi] = True
    return out.to(device)


class Turns:
    """The environment's turns of one rollout call (one episode per row): at check k (the step
    after the draws it reads: check_every = 1) first the answers to the calls of the rows that
    left at the last check (waited for here); then the rows whose model turn triggered their
    episode submit its call (started once, on TP rank 0: ``once``) and leave their slot
    (``codes``: ``Flag.AWAY``) while it runs, unless no other row could run meanwhile: then their
    answers are waited for now and they stay. ``rows``: the rollout's chooser (rollout/sampler.py
    ``_Draw``), whose row state an answer changes (an observation inserted, a row finished)."""

    def __init__(self, episodes: Sequence[Episode], decode, once, num_rows: int, device) -> None:
        self.episodes, self.decode, self.once = episodes, decode, once
        self.stats = [EpisodeStats(faults=int(e.start_failed)) for e in episodes]
        self.turn_seen = [0] * num_rows  # completion tokens already offered to the episode
        self.calls: dict = {}  # row -> its episode's answer under way (TP rank 0 only)
        self.away: list[int] = []  # rows out of the batch while their call runs (every rank)
        self.away_t = torch.zeros(num_rows, dtype=torch.bool, device=device)

    def codes(self, finished: torch.Tensor) -> torch.Tensor:
        """The chooser's finish flags (R,) with the rows leaving for a call at this check."""
        return finished if not self.away else torch.where(self.away_t, int(Flag.AWAY), finished)

    def at_check(self, k: int, rows, plan: RowPlan) -> None:
        R = len(self.episodes)
        if self.away:
            back, self.away = self.away, []
            self.away_t[back] = False
            self._answer(k, back, rows, plan)
        num_new, reason = rows.num_new[:R].tolist(), rows.reason[:R].tolist()
        ready = [b for b in range(R) if reason[b] == Finish.RUNNING and num_new[b] > self.turn_seen[b]]
        if not ready:
            return
        P = rows.prompt_lens
        lo = min(P[b] + rows.text_start[b] for b in ready)
        window = rows.tokens[:R, lo:max(P[b] + num_new[b] for b in ready)].tolist()
        asked = []
        for b in ready:
            ids = window[b][P[b] + rows.text_start[b] - lo:P[b] + num_new[b] - lo]
            self.turn_seen[b] = num_new[b]
            text = self.decode(ids)
            if self.episodes[b].triggered(ids, text):
                asked.append((b, ids, text))
        if not asked:
            return

        def submit() -> None:
            for b, ids, text in asked:
                self.calls[b] = self.episodes[b].submit(ids, text)

        self.once(submit)
        leaving = [b for b, _, _ in asked]
        if any(reason[b] == Finish.RUNNING for b in sorted(set(range(R)) - set(leaving))):
            self.away = leaving
            self.away_t[leaving] = True
            for b in leaving:
                self.stats[b].departures += 1
        else:
            for b in leaving:
                self.stats[b].blocking_waits += 1
            self._answer(k, leaving, rows, plan)

    def _answer(self, k: int, back: list[int], rows, plan: RowPlan) -> None:
        """The answers to ``back``'s calls at check k (waited for on TP rank 0, shared): the
        episode ends, or the observation is written into the row's next positions and forced (a
        ``Force`` event of the plan), trimmed to the row's token budget less one sampled token."""
        responses = self.once(lambda: [self.calls.pop(b).result() for b in back])
        R = len(self.episodes)
        num_new, budget = rows.num_new[:R].tolist(), rows.budget[:R].tolist()
        for b, r in zip(back, responses):
            st = self.stats[b]
            st.turns += int(not r.done)
            st.tool_calls += int(r.tool_call)
            st.tool_errors += int(r.error)
            st.faults += int(r.fault)
            st.truncated |= r.truncated
            if r.done:
                rows.finish(b, Finish.ENV)
                continue
            room = budget[b] - num_new[b] - 1  # positions left for the observation, one draw after it
            ids = list(r.ids[:max(room, 0)])
            st.truncated |= len(ids) < len(r.ids)
            if room <= 0:
                rows.finish(b, Finish.LENGTH)
            elif not ids:  # an empty answer: the next model turn starts here (the call is never asked again)
                rows.text_start[b] = self.turn_seen[b] = num_new[b]
            else:
                plan.force(k, b, rows.insert(b, ids), ids)
                self.turn_seen[b] = num_new[b] + len(ids)
                st.observation_tokens += len(ids)
