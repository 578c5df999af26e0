"""Learner log-probabilities of sampled tokens (docs/design.md, "Exact log-probabilities"):
dense, replay, hybrid.

- ``dense_logprobs``: the dense schedule (``model.forward``, full BPTT) on the rollout's
  tokens, with grad, under the rollout's processing and dtype.
- ``replay_logprobs``: the rollout's own schedule re-executed with the current parameters,
  no grad (``rollout.sampler.replay``): bit-identical to the sampler's mu while the
  parameters are unchanged.
- ``hybrid_logprobs``: value = replay, gradient = d dense / d theta.

All three are (B, N) in the rollout's completion layout (``Rollout.mu``), 0 where masked.
A sampled token outside the current policy's top-k/top-p set has log-prob -inf: its ratio
is 0, it is counted (support misses), and nothing downstream may turn it into NaN.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlt_mega.loss import Logits
from rlt_mega.schedule.dense import DenseRows
from rlt_mega.model.rlt import RLT
from rlt_mega.precision import precision
from rlt_mega.rollout.processing import process_logits
from rlt_mega.rollout.sampler import Rollout, completion_positions, replay


def dense_logprobs(model: RLT, rollout: Rollout, compact: bool = True, share_prompts: bool = True) -> torch.Tensor:
    """The dense schedule's processed log-probs of the completion tokens, with autograd.

    Runs ``model.forward`` on the inputs of the rollout's steps, tokens (B, num_steps):
    right padding does not reach earlier positions (everything is causal), and positions are
    the rollout's own (prompts are left-aligned). -> (B, N) fp32. compact / share_prompts: the
    decoder runs only the rows and positions the completion tokens need (``dense_rows``; both off
    is the padded schedule, the tests' and benchmarks' reference arm).
    """
    rows = dense_rows(rollout, compact, share_prompts)
    with precision(rollout.schedule.dtype, rollout.tokens.device):
        logits = model(dense_inputs(rollout), rows=rows)  # (B, T, V) fp32
    return dense_logprobs_from_logits(logits, rollout)


def dense_rows(rollout: Rollout, compact: bool, share_prompts: bool) -> Optional[DenseRows]:
    """What the dense decoder needs of each row of the rollout (schedule/dense.py): row b's
    positions [0, P_b + n_b - 1) (the last one's logits score the last completion token), and
    with share_prompts its group, the rows whose prompts are the same tokens. None: both off."""
    if not (compact or share_prompts):
        return None
    prompt_lens, n = rollout.schedule.prompt_lens, rollout.completion_lens
    lengths = tuple(p + k - 1 if k > 0 else 0 for p, k in zip(prompt_lens, n))
    groups = None
    if share_prompts:
        ids: dict[tuple, int] = {}
        host = rollout.tokens.detach().cpu()
        groups = tuple(ids.setdefault((p, tuple(host[b, :p].tolist())), len(ids)) for b, p in enumerate(prompt_lens))
    return DenseRows(lengths, tuple(prompt_lens), groups, compact)


def dense_inputs(rollout: Rollout) -> torch.Tensor:
    """x_t of every step t of the rollout: (B, num_steps)."""
    return rollout.tokens[:, :rollout.schedule.num_steps]


def dense_logprobs_from_logits(logits: Logits | torch.Tensor, rollout: Rollout,
                               gather_vocab: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """logits (B, T, V_local) of the dense schedule on ``dense_inputs(rollout)`` (T >= num_steps:
    positions past the rollout's steps are never read; loss.Logits, or the tensor) -> processed
    log-probs (B, N) fp32 of the completion tokens, with autograd. Under tensor parallelism
    V_local = V / tp and ``gather_vocab`` (differentiable) makes the picked rows whole before the
    processing, which needs the whole distribution (top-k, top-p, the normalisation)."""
    return completion_values(logits, rollout, gather_vocab, with_entropy=False)[0]


def dense_logprobs_and_entropy(logits: Logits | torch.Tensor, rollout: Rollout,
                               gather_vocab: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                               with_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``dense_logprobs_from_logits`` and, with_entropy, the entropy (B, N) fp32 of the policy's
    processed distribution at each completion token (the one the rollout sampled from: its
    temperature, top-k and top-p), with autograd (GRPO's entropy bonus); 0 where masked."""
    return completion_values(logits, rollout, gather_vocab, with_entropy)[:2]


def dense_logprobs_at(logits: Logits | torch.Tensor, rollout: Rollout, ids: torch.Tensor,
                      gather_vocab: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """The processed log-probs of the tokens ``ids`` (B, N, k) at each completion token's step
    (the distribution that token was drawn from), as ``dense_logprobs_from_logits`` computes them,
    with autograd -> (B, N, k) fp32, 0 where masked (grpo.teacher_topk: the student's side of
    the forward-KL term, learner/distill.py)."""
    return completion_values(logits, rollout, gather_vocab, with_entropy=False, ids=ids)[2]


def completion_values(logits: Logits | torch.Tensor, rollout: Rollout,
                      gather_vocab: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                      with_entropy: bool = True, ids: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What the learner reads of the processed distribution at each completion token, in one pass
    over the logits (loss.Logits.map: under train.checkpointing.head_chunk a chunk of positions
    at a time): the sampled token's log-prob (B, N), with_entropy the entropy (B, N), with
    ``ids`` (B, N, k) their log-probs (B, N, k); fp32, with autograd, 0 where masked."""
    s = rollout.schedule
    device = rollout.tokens.device
    logits = Logits.of(logits)
    step, mask = completion_positions(s.prompt_lens, rollout.completion_lens, device)  # (B, N)
    mask = mask & rollout.mask.to(device).bool()  # the sampled tokens (an inserted observation has no value)
    rows = torch.arange(rollout.batch_size, device=device)[:, None].expand_as(step)
    index = rows[mask] * logits.shape[1] + step[mask]  # (M,) flat positions, M = number of completion tokens
    targets = rollout.tokens.gather(1, step + 1)[mask]  # (M,)
    picked_ids = () if ids is None else (ids.to(device)[mask],)  # (M, k)

    def read(picked: torch.Tensor, targets: torch.Tensor, *at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if gather_vocab is not None:
            picked = gather_vocab(picked)  # (n, V_local) -> (n, V)
        logprobs = process_logits(picked, s.processing)
        out = (logprobs.gather(1, targets[:, None]).squeeze(1),)  # (n,)
        if with_entropy:  # -sum p log p over the kept set: outside it p = 0 and log p = -inf, whose product is 0
            kept = torch.isfinite(logprobs)
            plogp = torch.where(kept, logprobs.exp() * torch.where(kept, logprobs, torch.zeros_like(logprobs)),
                                torch.zeros_like(logprobs))
            out += (-plogp.sum(dim=-1),)
        return out + tuple(logprobs.gather(1, a) for a in at)  # (n, k)

    got = list(logits.map(read, index, targets, *picked_ids))
    values = got.pop(0)
    out = torch.zeros(step.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)
    entropy = torch.zeros_like(out).masked_scatter(mask, got.pop(0)) if with_entropy else None
    at = None
    if ids is not None:
        at = torch.zeros(*step.shape, ids.shape[-1], dtype=values.dtype, device=device)
        at = at.masked_scatter(mask[..., None].expand_as(at), got.pop(0))
    return out, entropy, at


def replay_logprobs(model: RLT, rollout: Rollout) -> torch.Tensor:
    """The rollout schedule re-executed with current parameters (fresh caches), no grad."""
    return replay(model, rollout)


class HybridLogProb(torch.autograd.Function):
    """Forward returns the replay tensor itself (its value, bit for bit); backward hands the
    incoming gradient to the dense log-probs unchanged.

    Not ``dense + (replay - dense).detach()``: that sum is rounded in floating point and is
    not equal to the replay (so on-policy ratios would not be exactly 1).
    """

    @staticmethod
    def forward(ctx, dense: torch.Tensor, replay_values: torch.Tensor) -> torch.Tensor:
        if dense.shape != replay_values.shape:
            raise ValueError(f"dense log-probs {tuple(dense.shape)} and replay {tuple(replay_values.shape)} "
                             "must have the same (B, N) layout")
        return replay_values

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def hybrid_logprobs(dense: torch.Tensor, replay_values: torch.Tensor) -> torch.Tensor:
    """Value = replay_values (no grad needed on it), gradient = the dense graph's."""
    return HybridLogProb.apply(dense, replay_values.detach())


@torch.no_grad()
def mismatch_metrics(mu: torch.Tensor, dense: torch.Tensor, replay_values: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Training-inference mismatch over the completion tokens (mask (B, N)).

    - max/mean |dense - replay|: the rounding gap between the schedules (tokens where both
      are finite).
    - kl_mu_dense: KL(mu || dense) estimated on the sampled tokens (drawn from mu) with the
      non-negative, low-variance k3 estimator r - 1 - log r, r = dense/mu; tokens outside
      dense's support are excluded (counted in support_miss_dense).
    - support_miss: fraction of sampled tokens with replay log-prob -inf (ratio 0: outside
      the current policy's top-k/top-p set); support_miss_dense: the same under dense.
    """
    mask = mask.bool()
    num = max(int(mask.sum()), 1)
    miss_replay = mask & torch.isneginf(replay_values)
    miss_dense = mask & torch.isneginf(dense)
    both = mask & ~miss_replay & ~miss_dense
    gap = (dense.detach() - replay_values).abs()[both]
    log_r = (dense.detach() - mu)[mask & ~miss_dense]
    k3 = torch.expm1(log_r) - log_r
    return {
        "logprob_diff_max": float(gap.max()) if gap.numel() else 0.0,
        "logprob_diff_mean": float(gap.mean()) if gap.numel() else 0.0,
        "kl_mu_dense": float(k3.mean()) if k3.numel() else 0.0,
        "support_miss": float(miss_replay.sum()) / num,
        "support_miss_dense": float(miss_dense.sum()) / num,
        "num_support_miss": float(miss_replay.sum()),
    }
