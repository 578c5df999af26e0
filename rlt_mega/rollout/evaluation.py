"""Sampled evaluation of a policy on GSM8K-format problems: n completions per problem, scored by
the GSM8K rule (rollout/rewards.py), reported as

    pass@k   the probability that at least one of k samples is correct, by the unbiased
             estimator of Chen et al. (2021) from n >= k samples with c correct:
             1 - C(n - c, k) / C(n, k)
    maj@k    the accuracy of the majority answer of k samples (ties: the answer that came
             first; a sample without a number does not vote), its expectation over the
             k-subsets of the n samples (every subset while there are at most
             MAJ_EXACT_SUBSETS of them, else MAJ_DRAWN_SUBSETS drawn with a fixed seed)
    mean@n   the mean accuracy of a sample (the expectation of mean@k for every k)

each named by its k and n in the metrics: ``eval/pass@4_n8``, ``eval/maj@4_n8``, ``eval/mean@8``.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from fractions import Fraction
from typing import Optional, Sequence

MAJ_EXACT_SUBSETS = 5000
MAJ_DRAWN_SUBSETS = 2000


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as the product prod_{i=n-c+1}^{n} (1 - k / i) (Chen et al.'s
    numerically stable form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority(answers: Sequence[Optional[Fraction]]) -> Optional[Fraction]:
    """The most frequent answer (ties: the earliest of them); None when no sample has one."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)


def _subsets(n: int, k: int, seed: int) -> list[tuple[int, ...]]:
    if math.comb(n, k) <= MAJ_EXACT_SUBSETS:
        return list(itertools.combinations(range(n), k))
    rng = random.Random(seed)
    return [tuple(sorted(rng.sample(range(n), k))) for _ in range(MAJ_DRAWN_SUBSETS)]


def maj_at_k(answers: Sequence[Optional[Fraction]], gold: Fraction, k: int, seed: int = 0) -> float:
    """The expected correctness of the majority of k of the n samples (module docstring)."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (n={n}, k={k})")
    subsets = _subsets(n, k, seed)
    return sum(majority([answers[i] for i in s]) == gold for s in subsets) / len(subsets)


def metric_names(n: int, ks: Sequence[int]) -> list[str]:
    return ([f"eval/pass@{k}_n{n}" for k in ks] + [f"eval/maj@{k}_n{n}" for k in ks] + [f"eval/mean@{n}"])


def problem_scores(answers: Sequence[Optional[Fraction]], gold: Fraction, ks: Sequence[int],
                   seed: int = 0) -> dict[str, float]:
    """One problem's n samples (their extracted answers) -> each metric's value for it."""
    n = len(answers)
    c = sum(a is not None and a == gold for a in answers)
    out = {f"eval/pass@{k}_n{n}": pass_at_k(n, c, k) for k in ks}
    out.update({f"eval/maj@{k}_n{n}": maj_at_k(answers, gold, k, seed) for k in ks})
    out[f"eval/mean@{n}"] = c / n
    return out
