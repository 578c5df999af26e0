"""Rewards. GSM8K: the number after ``####``, else the last number in the completion,
compared numerically with the gold answer (exact rational comparison, so 72, 72.0 and
$72.00 are the same answer and 0.1 + 0.2 rounding never enters).

Numbers may carry thousands separators (1,234), a currency sign ($5, -$5, $-5), a percent
sign, decimals (3.50, .5), a sign (-3, unicode minus) and trailing sentence punctuation
("is 42." or "42!"). ``score`` runs any reward function over a batch and turns an exception
into reward 0, logged with the prompt id and counted, so one bad completion never stops a run.
"""

from __future__ import annotations

import importlib
import math
import re
from fractions import Fraction
from typing import Callable, Optional, Sequence

from rlt_mega.log import get_logger

log = get_logger(__name__)

# A sign, an optional currency sign (before or after the sign), digits with optional
# thousands groups and decimals (or a bare ".5"), an optional percent sign. The look-behind
# keeps a number from starting inside a word or another number ("x2", "3.4.5").
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign1>[-\u2212]?)\$?(?P<sign2>[-\u2212]?)"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?!\d)%?"
)


def _to_fraction(match: re.Match) -> Fraction:
    value = Fraction(match.group("num").replace(",", ""))
    negative = bool(match.group("sign1")) != bool(match.group("sign2"))
    return -value if negative else value


def extract_answer(text: str) -> Optional[Fraction]:
    """The first number after the first ``####``; if there is none, the last number of the
    text; None when the text has no number."""
    marker = text.find("####")
    if marker >= 0:
        after = _NUMBER.search(text, marker + 4)
        if after is not None:
            return _to_fraction(after)
    numbers = list(_NUMBER.finditer(text))
    return _to_fraction(numbers[-1]) if numbers else None


def gold_answer(answer: str | int | float) -> Fraction:
    """The gold number of a GSM8K answer field ("... #### 72") or a plain number."""
    if isinstance(answer, (int, float)):
        return Fraction(answer)
    value = extract_answer(answer)
    if value is None:
        raise ValueError(f"gold answer {answer[:80]!r} contains no number")
    return value


def gsm8k_reward(completion: str, answer: str | int | float) -> float:
    """1.0 when the completion's answer equals the gold answer numerically, else 0.0."""
    predicted = extract_answer(completion)
    return float(predicted is not None and predicted == gold_answer(answer))


RewardFn = Callable[[str, object], float]
REWARDS: dict[str, RewardFn] = {"gsm8k": gsm8k_reward}


def resolve_named(spec: str, registry: dict, what: str, form: str):
    """``spec``: a name in ``registry`` or "package.module:attribute" (``form`` says which kind of
    attribute), imported; ``what`` names the setting in every error."""
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected one of {sorted(registry)} or '{form}'")
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: cannot import it ({exc})") from None


def resolve_reward(spec: str) -> RewardFn:
    """A registered reward ("gsm8k") or "package.module:function", a callable taking
    (completion text, answer) and returning a float."""
    fn = resolve_named(spec, REWARDS, "reward", "package.module:function")
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


def score(completions: Sequence[str], answers: Sequence[object], prompt_ids: Sequence[object],
          reward_fn: RewardFn = gsm8k_reward) -> tuple[list[float], int, int]:
    """Applies reward_fn to every (completion, answer) -> (rewards, failures, non-finite).
    A reward function that raises, or returns NaN or an infinity, scores 0 for that completion
    (a failure, never a success); each is logged with the function's name and the prompt id, and
    counted (a non-finite value both as a failure and as non-finite)."""
    if not len(completions) == len(answers) == len(prompt_ids):
        raise ValueError(f"score: {len(completions)} completions, {len(answers)} answers and "
                         f"{len(prompt_ids)} prompt ids must have the same length")
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    rewards, failures, nonfinite = [], 0, 0
    for completion, answer, pid in zip(completions, answers, prompt_ids):
        try:
            value = float(reward_fn(completion, answer))
        except Exception as exc:  # a reward bug must not kill a long run; it is logged and counted
            failures += 1
            rewards.append(0.0)
            log.warning("reward function %s failed on prompt %s (%s: %s); scored 0", name, pid,
                        type(exc).__name__, exc)
            continue
        if not math.isfinite(value):
            failures += 1
            nonfinite += 1
            log.warning("reward function %s returned %s on prompt %s; scored 0 (a failure)", name, value, pid)
            value = 0.0
        rewards.append(value)
    return rewards, failures, nonfinite
