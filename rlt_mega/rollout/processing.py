"""Logits processing and sampling (docs/design.md, "Exact log-probabilities").

The behavior log-prob mu that the sampler records must be the log of the probability with
which a token was really drawn. So processing returns log-probs, not logits: temperature,
then top-k, then top-p, the kept set renormalised (``log_softmax`` over the logits with
``-inf`` outside the kept set), all in fp32. Sampling draws from ``exp`` of exactly those
log-probs by inverse CDF, so a token with probability zero can never be drawn, and the
learner's policy log-prob is the same function applied to its own logits.

Every operation is row-wise on a (B, V) batch; the sampler and the replay call
``process_logits`` on the same (B, V) shapes so their values are equal bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def _top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keeps the smallest prefix of the tokens sorted by probability whose mass reaches top_p
    (a token is kept when the mass strictly before it is < top_p; the first always is).
    logits: (B, V) fp32, already -inf outside earlier filters -> keep mask (B, V)."""
    # A stable sort makes the order among equal logits (and so the kept set) deterministic.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = mass_before < top_p
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


def sample(logprobs: torch.Tensor, generators: Sequence[torch.Generator], rows: Sequence[int]
           ) -> torch.Tensor:
    """Draws one token for each row in ``rows`` from exp(logprobs[row]) by inverse CDF.

    logprobs: (B, V) processed (from ``process_logits``); generators: one per row of the
    batch, each advanced by exactly one draw per token it samples -> tokens (len(rows),).

    ``searchsorted(cdf, u, right=True)`` returns the first i with cdf[i] > u; a token of
    probability zero has cdf[i] == cdf[i-1] <= u, so it is never returned.
    """
    if len(rows) == 0:
        return torch.empty(0, dtype=torch.long, device=logprobs.device)
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=logprobs.device)
    probs = logprobs.index_select(0, idx).exp()  # (n, V)
    cdf = torch.cumsum(probs, dim=-1)
    # u in [0, total): scaling by the row's total (not 1) absorbs the rounding of the sum.
    u = torch.cat([torch.rand(1, generator=generators[r], device=generators[r].device) for r in rows])
    u = u.to(logprobs.device, cdf.dtype) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    # u * total can round up to total itself; then take the last token of positive probability.
    last_positive = probs.shape[-1] - 1 - torch.flip(probs > 0, dims=[-1]).int().argmax(dim=-1)
    return torch.minimum(tokens, last_positive)
