"""The GSM8K answer parser and reward, and failure handling in ``score``."""

import json
import logging
from fractions import Fraction

import pytest

from rlt_mega.rollout.rewards import extract_answer, gold_answer, gsm8k_reward, score

from helpers import gsm8k_dir

GSM8K_TEST = gsm8k_dir() / "test.jsonl"

CASES = [
    ("#### 72", Fraction(72)),
    ("She has 3 + 4 = 7 apples.\n#### 7", Fraction(7)),
    ("The answer is 42.", Fraction(42)),
    ("The answer is 42!", Fraction(42)),
    ("It costs $1,234.50 in total", Fraction("1234.5")),
    ("#### $18", Fraction(18)),
    ("#### 1,000,000", Fraction(1000000)),
    ("The change is -3 degrees", Fraction(-3)),
    ("temperature fell to \u22127", Fraction(-7)),
    ("a loss of -$5", Fraction(-5)),
    ("#### $-5.", Fraction(-5)),
    ("about 50% of them", Fraction(50)),
    ("x is .5", Fraction(1, 2)),
    ("3.50 dollars", Fraction(7, 2)),
    ("16 - 3 - 4 = <<16-3-4=9>>9 eggs", Fraction(9)),
    ("10-3=7", Fraction(7)),
    ("first 5 then 8, finally 13.", Fraction(13)),
    ("#### 12 and not 99", Fraction(12)),  # after ####: the first number, not the last
    ("I think 3 but #### no number here, 4 maybe", Fraction(4)),  # nothing after ####: last number
    ("no digits at all", None),
    ("", None),
    ("version2 x3", None),  # digits glued to a word are not numbers
    ("#### 0", Fraction(0)),
    ("#### 0.25", Fraction(1, 4)),
    ("The total is 1,234,567.", Fraction(1234567)),
]


@pytest.mark.parametrize("text,want", CASES)
def test_extract_answer_by_hand(text, want):
    assert extract_answer(text) == want


def test_gold_answers_of_gsm8k_test_parse():
    lines = GSM8K_TEST.read_text().splitlines()[:50]
    assert len(lines) == 50
    for line in lines:
        answer = json.loads(line)["answer"]
        gold = answer.split("####")[-1].strip()
        assert extract_answer(answer) == Fraction(gold.replace(",", "")), answer[-60:]
        assert gsm8k_reward(f"... so the result is {gold}.", answer) == 1.0


def test_reward_compares_numerically():
    assert gsm8k_reward("#### 72.0", "#### 72") == 1.0
    assert gsm8k_reward("the answer is $72.00", 72) == 1.0
    assert gsm8k_reward("#### 71", "#### 72") == 0.0
    assert gsm8k_reward("I do not know", "#### 72") == 0.0
    assert gold_answer(2.5) == Fraction(5, 2)
    with pytest.raises(ValueError, match="no number"):
        gold_answer("#### none")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_score_turns_a_failing_reward_into_zero():
    def flaky(completion, answer):
        if "boom" in completion:
            raise RuntimeError("parser exploded")
        return gsm8k_reward(completion, answer)

    collect = _Collect()
    logger = logging.getLogger("rlt_mega.rollout.rewards")
    logger.addHandler(collect)  # the package logger does not propagate to pytest's caplog
    try:
        rewards, failures, _ = score(["#### 3", "boom", "#### 4"], ["#### 3", "#### 3", "#### 5"],
                                  ["p0", "p1", "p2"], flaky)
    finally:
        logger.removeHandler(collect)
    assert any("p1" in m and "parser exploded" in m for m in collect.messages)
    assert rewards == [1.0, 0.0, 0.0] and failures == 1
    with pytest.raises(ValueError, match="same length"):
        score(["a"], [], ["p"])


def test_a_nonfinite_reward_is_a_counted_failure_never_a_success():
    values = iter([1.0, float("nan"), float("inf"), -float("inf")])
    rewards, failures, nonfinite = score(["a", "b", "c", "d"], ["#### 1"] * 4, ["p0", "p1", "p2", "p3"],
                                         lambda completion, answer: next(values))
    assert rewards == [1.0, 0.0, 0.0, 0.0] and failures == 3 and nonfinite == 3
