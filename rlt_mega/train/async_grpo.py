"""Bounded staleness for GRPO (grpo.max_staleness = s), as a fixed pipeline.

Policy version v is the policy after v GRPO steps. The samples of data step j (its prompts,
seeds and order: exactly those synchronous GRPO draws at step j) are drawn by version
max(0, j - s), and learner step k learns from data step k. So step k's staleness is
min(k, s), fixed by k and s alone, never "whatever is ready": two runs are the same run, and
s = 0 is synchronous GRPO (sample step k, learn it) through the same code, bit for bit.

Colocated form (train/grpo.py): at the start of step k, with the parameters of version k, the
job samples every data step not yet queued up to k + s (steps 0..s at the first step, one
step after), then learns the queue's head, data step k. Between steps the queue holds data
steps k + 1 .. k + s, drawn by versions that no longer exist, so it cannot be regenerated: it
is part of every rank's checkpoint (``state_dict``: each rank keeps its own part of the
rollouts, the mu of its pipeline stage, its replica's prompts), and a resumed run learns
exactly what the uninterrupted one would have. A checkpoint resumes only under the layout
and the max_staleness it was written with when its queue is not empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from rlt_mega.config import ConfigError
from rlt_mega.train.grpo_rounds import Round


@dataclass
class Generated:
    """Data step ``step``'s rounds (one, or dynamic sampling's), sampled by policy ``version``."""

    step: int
    version: int
    rounds: list[Round]
    sampling: dict[str, float]  # dynamic sampling's counts

    def lag(self, learner_step: int) -> int:
        return learner_step - self.version


class StalenessPipeline:
    """The queue of sampled data steps; ``layout`` names the rank's place (a queue resumes
    only on the rank and layout that wrote it)."""

    def __init__(self, max_staleness: int, layout: tuple) -> None:
        self.max_staleness, self.layout = max_staleness, tuple(layout)
        self.queue: deque[Generated] = deque()

    def to_sample(self, done: int) -> range:
        """The data steps to sample at the start of step ``done`` (with version ``done``)."""
        start = self.queue[-1].step + 1 if self.queue else done
        return range(start, done + self.max_staleness + 1)

    def push(self, item: Generated) -> None:
        self.queue.append(item)

    def pop(self, done: int) -> Generated:
        item = self.queue.popleft()
        if item.step != done:  # the pipeline's invariant, not a user error
            raise RuntimeError(f"GRPO step {done}: the staleness queue's head is data step {item.step}")
        return item

    def state_dict(self) -> dict:
        return {"max_staleness": self.max_staleness, "layout": self.layout, "queue": list(self.queue)}

    def load_state_dict(self, state: Optional[dict], step: int) -> None:
        """``state`` None: the checkpoint has no queue for this rank (then none may be needed)."""
        queue = [] if state is None else state["queue"]
        if queue and (state["max_staleness"] != self.max_staleness or tuple(state["layout"]) != self.layout):
            raise ConfigError(
                f"the checkpoint at step {step} holds {len(queue)} sampled steps queued for grpo.max_staleness="
                f"{state['max_staleness']} on layout {tuple(state['layout'])}; this run has max_staleness="
                f"{self.max_staleness} on {self.layout}: resume with the checkpoint's, or start afresh")
        if not queue and step > 0 and self.max_staleness > 0:
            raise ConfigError(
                f"the checkpoint at step {step} holds no sampled steps for grpo.max_staleness={self.max_staleness} "
                "(it was written by a synchronous run, or this rank's file job_rank<r>.pt is missing): the queued "
                "samples of older policies cannot be regenerated; resume with grpo.max_staleness=0 or start afresh")
        if queue and queue[0].step != step:
            raise ConfigError(f"the checkpoint at step {step} queues data step {queue[0].step} first: it is damaged")
        self.queue = deque(queue)
