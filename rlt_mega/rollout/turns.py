"""Environment turns inside a rollout (docs/design.md, "Environments"): what the sampler needs of a
row's environment episode, and what it counts.

A row with an episode samples as usual until its newest model turn (its completion tokens since
the last observation) *triggers* the episode (a stop string or token the environment declares);
then, at the check right after the trigger was drawn, the row submits the episode's call and
leaves its slot (``Leave(why="env")``, its state parked), so that the call runs while the other
rows decode and a waiting row can take the slot; at the next check the sampler waits for the
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
