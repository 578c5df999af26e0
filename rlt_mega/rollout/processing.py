"""Logits processing and sampling (docs/design.md, "Exact log-probabilities").

The behavior log-prob mu that the sampler records must be the log of the probability with
which a token was really drawn. So processing returns log-probs, not logits: temperature,
then top-k, then top-p, the kept set renormalised (``log_softmax`` over the logits with
``-inf`` outside the kept set), all in fp32. Sampling draws from ``exp`` of exactly those
log-probs by inverse CDF, so a token with probability zero can never be drawn, and the
learner's policy log-prob is the same function applied to its own logits. The prefix sums
(top-p's mass, the sampling CDF) run over fixed-point integers: exact, so deterministic on every
device and batch size.

Every operation is row-wise on a (B, V) batch; the sampler and the replay call
``process_logits`` on the same (B, V) shapes so their values are equal bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch


@dataclass(frozen=True)
class Processing:
    """How logits become the sampling distribution. ``temperature == 0`` is greedy (the
    distribution is one-hot on the first argmax); ``top_k == 0`` and ``top_p == 1`` disable
    those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 disables top-p)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Finish(IntEnum):
    """A row's finish code on the device (the rollout chooser's ``reason``, rollout/sampler.py); its ``label`` is the
    ``finish_reasons`` string. Distinct from the plan's ``Flag`` (schedule/rows.py)."""

    RUNNING = 0
    STOP_TOKEN = 1
    STOP_STRING = 2
    LENGTH = 3
    ENV = 4  # the environment ended the episode

    @property
    def label(self) -> str:
        return "length" if self is Finish.RUNNING else self.name.lower()  # still running at the end: length


# Probabilities become integers in units of 2^-PROB_BITS before any prefix sum: integer addition
# is associative, so a scan's result depends neither on the order a kernel adds in (a cumsum
# over one row on CUDA is a nondeterministic CUB scan, and torch refuses a floating-point
# cumsum on CUDA in deterministic mode) nor on the batch size or the device. p * 2^52 is exact
# for every fp32 probability >= 2^-29 and rounds smaller ones to the nearest unit; a row's sum
# stays below 2^53, exact in float64 and far inside int64.
PROB_BITS = 52


def fixed_point(probs: torch.Tensor) -> torch.Tensor:
    """probs (B, V) in [0, 1] -> (B, V) int64 in units of 2^-PROB_BITS."""
    return torch.round(probs.double() * float(2 ** PROB_BITS)).long()


def _top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest prefix of the tokens sorted by probability whose mass reaches top_p
    (a token is kept when the mass strictly before it is < top_p times the row's mass; the
    first always is), the masses summed exactly (``fixed_point``). logits: (B, V) fp32, already
    -inf outside earlier filters -> keep mask (B, V)."""
    # A stable sort makes the order among equal logits (and so the kept set) deterministic.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    units = fixed_point(torch.softmax(sorted_logits, dim=-1))  # (B, V) int64
    before = torch.cumsum(units, dim=-1) - units  # exclusive prefix sums, exact
    total = before[:, -1:] + units[:, -1:]  # (B, 1)
    keep_sorted = before.double() < top_p * total.double()
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def process_logits(logits: torch.Tensor, processing: Processing) -> torch.Tensor:
    """logits (B, V) -> processed log-probs (B, V) in fp32, ``-inf`` outside the kept set.

    The input is promoted to fp32 first (the model's head already returns fp32 logits).
    """
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if processing.greedy:
        # One-hot on the first argmax: log-prob 0 there, -inf elsewhere.
        best = logits.argmax(dim=-1, keepdim=True)
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, best, 0.0)
    scaled = logits / processing.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < processing.top_k < scaled.shape[-1]:
        # Ties at the k-th value are all kept: the kept set must not depend on sort order.
        kth = torch.topk(scaled, processing.top_k, dim=-1).values[:, -1:]
        keep &= scaled >= kth
    if processing.top_p < 1.0:
        keep &= _top_p_keep(scaled.masked_fill(~keep, float("-inf")), processing.top_p)
    return torch.log_softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)


def make_generators(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per request, so a request's draws do not depend on its batch-mates."""
    gens = []
    for seed in seeds:
        g = torch.Generator(device=device)
        g.manual_seed(int(seed))
        gens.append(g)
    return gens


def draw_uniforms(generators: Sequence[torch.Generator], n: int, device: torch.device | str) -> torch.Tensor:
    """Every random number a rollout may use, drawn once: (B, n) float64 in [0, 1), row b from
    its request's generator (one launch per request and rollout, none per step). Column i is
    the draw of the row's i-th sampled token."""
    rows = [torch.rand(n, generator=g, dtype=torch.float64, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


def sample(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draws one token per row from exp(logprobs) by inverse CDF, on the device, with no host
    synchronisation.

    logprobs: (B, V) processed (from ``process_logits``); u: (B,) float64 uniforms in [0, 1)
    -> tokens (B,). The CDF is a prefix sum of the probabilities in fixed point (``fixed_point``,
    exact and deterministic): row b draws token i with probability units_i / sum(units), which
    is exp(logprobs[b, i]) renormalised, to within 2^-53 absolute. A token whose probability
    rounds to zero (zero, or below 2^-53) is never drawn: ``searchsorted(cdf, r, right=True)``
    returns the first i with cdf[i] > r, and such a token has cdf[i] == cdf[i-1] <= r.
    """
    cdf = torch.cumsum(fixed_point(logprobs.exp()), dim=-1)  # (B, V) int64
    total = cdf[:, -1]
    r = torch.minimum((u.double() * total.double()).floor().long(), total - 1)  # uniform in [0, total)
    return torch.searchsorted(cdf, r.unsqueeze(-1), right=True).squeeze(-1)
