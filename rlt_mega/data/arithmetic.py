"""Seeded arithmetic word problems in GSM8K format: ``question``, ``answer`` ending in ``#### N``.

The embedded data of the demo and the tests. Difficulty knobs: the number of operations per
problem and the magnitude of the numbers. The answer shows one equation per operation, as
GSM8K's worked answers do, so a small model can learn the procedure, not only the result.

    question: Mia has 7 marbles. She buys 5 more marbles. Then she gives away 3 marbles.
              How many marbles does Mia have now?
    answer:   7 + 5 = 12
              12 - 3 = 9
              #### 9
"""

from __future__ import annotations

import random

_PEOPLE = [("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
           ("Ivy", "She"), ("Max", "He"), ("Ada", "She"), ("Ben", "He")]
_THINGS = ["apples", "marbles", "books", "coins", "stickers", "pencils", "cards", "shells"]
_ADD = ["buys {n} more {thing}", "finds {n} more {thing}", "gets {n} more {thing} as a gift"]
_SUB = ["gives away {n} {thing}", "loses {n} {thing}", "sells {n} {thing}"]
_MUL = {2: "doubles the number of {thing}", 3: "triples the number of {thing}"}


def _problem(rng: random.Random, num_ops: int, max_value: int) -> dict:
    name, pronoun = rng.choice(_PEOPLE)
    thing = rng.choice(_THINGS)
    value = rng.randint(1, max_value)
    sentences = [f"{name} has {value} {thing}."]
    steps = []
    for k in range(num_ops):
        kinds = ["add", "sub"] + (["mul"] if value * 2 <= 4 * max_value else [])
        kind = rng.choice(kinds if value > 0 else ["add"])
        if kind == "add":
            n = rng.randint(1, max_value)
            new, text, eq = value + n, rng.choice(_ADD), f"{value} + {n} = {value + n}"
        elif kind == "sub":
            n = rng.randint(1, value)
            new, text, eq = value - n, rng.choice(_SUB), f"{value} - {n} = {value - n}"
        else:
            n = rng.choice([m for m in _MUL if value * m <= 4 * max_value] or [2])
            new, text, eq = value * n, _MUL[n], f"{value} * {n} = {value * n}"
        lead = pronoun if k == 0 else f"Then {pronoun.lower()}"
        sentences.append(f"{lead} {text.format(n=n, thing=thing)}.")
        steps.append(eq)
        value = new
    sentences.append(f"How many {thing} does {name} have now?")
    return {"question": " ".join(sentences), "answer": "\n".join(steps) + f"\n#### {value}"}


def generate_problems(num: int, seed: int, min_ops: int = 1, max_ops: int = 2, max_value: int = 20) -> list[dict]:
    """``num`` problems, reproducible from ``seed``; operations per problem uniform in
    [min_ops, max_ops], starting values and operands in [1, max_value]."""
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops ({min_ops}) <= max_ops ({max_ops})")
    rng = random.Random(seed)
    return [_problem(rng, rng.randint(min_ops, max_ops), max_value) for _ in range(num)]
