"""Reward shaping that depends on the completion's length, not its text (DAPO, Yu et al. 2025).

Soft overlong punishment: with budget L (sampling.max_new_tokens) and buffer B
(grpo.overlong_buffer), a completion of n tokens loses

    0                                  n <= L - B
    penalty * (n - (L - B)) / B        L - B < n <= L

so the penalty grows linearly over the last B tokens of the budget, up to ``penalty`` (verl's
``overlong_penalty_factor``) for a completion that ran out of budget.
"""

from __future__ import annotations

from typing import Sequence


def overlong_penalties(lengths: Sequence[int], max_new_tokens: int, buffer: int, penalty: float) -> list[float]:
    """lengths: completion tokens per row -> the (<= 0) reward each row adds."""
    if buffer <= 0:
        return [0.0] * len(lengths)
    if buffer > max_new_tokens:
        raise ValueError(f"grpo.overlong_buffer={buffer} exceeds sampling.max_new_tokens={max_new_tokens}: "
                         "the buffer is the last part of the budget")
    start = max_new_tokens - buffer
    return [min(-(n - start) / buffer * penalty, 0.0) for n in lengths]
