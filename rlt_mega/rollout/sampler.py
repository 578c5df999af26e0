"""The rollout and replay schedules (docs/design.md, "One transition, three schedules" and
"Exact log-probabilities").

Both run one executor (``executor.Executor``, the same program on one process and on every
stage of a tensor/pipeline-parallel replica), so that with unchanged parameters their logits
are equal bit for bit; they differ only in where the token after each step comes from (drawn,
or read from the recorded rollout).

The schedule, for a batch of B prompts of lengths P_b (left-aligned, right-padded):

- All rows advance in lockstep over positions t = 0, 1, ...: row b is forced through its
  prompt while t < P_b - 1 and samples x_{t+1} from step t on; a finished row is fed the
  pad token. So vis(t), the cache slots and every call's shape are shared by the batch
  (one GEMM per layer per step, whatever the prompt lengths).
- Encoder prefill: one call over positions [0, S0), S0 = C * floor(P_min / C), the memory
  blocks that lie inside every row's prompt. Deviation from "prefill the padded prompts
  [0, P_max)": every block starting at or after S0 is re-encoded for the whole batch when it
  completes (below), because some row still had pad there, so a prefill past S0 would be
  overwritten before it is ever read and is pure waste.
- Whenever a memory block [t+1-C, t+1) completes at step t and starts at or after S0, one
  encoder call over its C tokens (the encoder K/V cache holds every earlier position), then
  ``append_memory``. The call runs before decoder step t, which is the first to see the
  block (vis(t) = t + 1): visibility is a function of the position alone.
- Decoder: ``decoder_input`` + ``decoder_layers`` on x_t with a preallocated decoder K/V cache
  (the same function with fused kernels, ``model/fast_decode.py``, whenever every projection
  is a plain nn.Linear), then the head (fp32 logits; under tensor parallelism the vocab
  shards gathered) and ``process_logits`` on the whole (B, V) batch.

What the rollout records (``Schedule``) is enough to re-execute it: prompt lengths, the
number of steps, the encoder calls, the cache capacity, processing, dtype and which decoder
step ran (fused or the modules'; they round differently, so the replay takes the same one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlt_mega.model.rlt import RLT
from rlt_mega.precision import precision
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.executor import Executor, Plan, Result
from rlt_mega.rollout.processing import Processing, make_generators, sample

@dataclass(frozen=True)
class SamplingParams:
    processing: Processing = field(default_factory=Processing)
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # needs a ``decode`` function in ``generate``

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")


@dataclass
class Schedule:
    """Everything a replay needs to repeat a rollout call for call."""

    prompt_lens: list[int]
    memory_block: int
    capacity: int  # K/V and memory buffer length (positions); part of the cache layout
    num_steps: int  # decoder steps t = 0 .. num_steps - 1
    encoder_calls: list[tuple[int, int]]  # (start, end) position ranges in call order
    processing: Processing
    dtype: str  # "fp32" or "bf16"
    pad_id: int
    # The decoder ran model/fast_decode.py's fused step (it rounds differently from the
    # modules' path, so the replay must take the same one).
    fast_decode: bool = True


@dataclass
class Rollout:
    """A sampled batch. tokens (B, num_steps + 1): prompt, completion, then pad. mu (B, N),
    N = max completion length: mu[b, j] is the fp32 log-prob the completion's j-th token was
    drawn with (at position P_b + j, by step P_b + j - 1); 0 where mask (B, N) is False."""

    tokens: torch.Tensor
    mu: torch.Tensor
    mask: torch.Tensor
    completion_lens: list[int]
    finish_reasons: list[str]  # "stop_token", "stop_string" or "length"
    schedule: Schedule

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def completion(self, b: int) -> list[int]:
        start = self.schedule.prompt_lens[b]
        return self.tokens[b, start:start + self.completion_lens[b]].tolist()

    def prompt(self, b: int) -> list[int]:
        return self.tokens[b, :self.schedule.prompt_lens[b]].tolist()

    def num_completion_tokens(self) -> int:
        return int(sum(self.completion_lens))

    def to(self, device: torch.device | str) -> "Rollout":
        return dataclasses.replace(self, tokens=self.tokens.to(device), mu=self.mu.to(device),
                                   mask=self.mask.to(device))


def completion_positions(prompt_lens: Sequence[int], completion_lens: Sequence[int], device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps that produced each completion token, in the (B, N) completion layout:
    step (B, N) = P_b - 1 + j (clamped into range where masked), mask (B, N)."""
    N = max(completion_lens) if len(completion_lens) else 0
    j = torch.arange(N, device=device)
    P = torch.as_tensor(list(prompt_lens), device=device)
    n = torch.as_tensor(list(completion_lens), device=device)
    mask = j[None, :] < n[:, None]
    step = torch.where(mask, P[:, None] - 1 + j[None, :], torch.zeros_like(mask, dtype=torch.long))
    return step, mask


def _check_model_fits(model: RLT, capacity: int) -> None:
    if capacity > model.cfg.max_seq_len:
        raise ValueError(f"longest prompt + max_new_tokens = {capacity} positions exceeds "
                         f"model.max_seq_len={model.cfg.max_seq_len}: shorten the prompts, lower "
                         "max_new_tokens or raise model.max_seq_len")


class _Draw:
    """The rollout's chooser: rows past their prompt draw x_{t+1} from their own generator,
    the others are forced (prompt tokens, or pad once finished); stop tokens, stop strings and
    max_new_tokens end a row."""

    def __init__(self, tokens: torch.Tensor, prompt_lens: Sequence[int], params: SamplingParams,
                 generators: list, decode: Optional[Callable[[list[int]], str]]) -> None:
        self.tokens, self.prompt_lens, self.params, self.generators = tokens, list(prompt_lens), params, generators
        self.decode = decode
        B = tokens.shape[0]
        self.num_new = [0] * B
        self.finish: list[Optional[str]] = [None] * B
        self.stop_ids = torch.as_tensor(list(params.stop_token_ids), dtype=torch.long, device=tokens.device)
        self.rows: list[int] = []

    def propose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        self.rows = [b for b in range(len(self.finish)) if self.finish[b] is None and t >= self.prompt_lens[b] - 1]
        out = self.tokens[:, t + 1].clone()
        out[self.rows] = sample(logprobs, self.generators, self.rows)
        return out

    def accept(self, t: int, tokens: torch.Tensor) -> bool:
        drawn = tokens[self.rows]
        is_stop = torch.isin(drawn, self.stop_ids).tolist() if len(self.stop_ids) else [False] * len(self.rows)
        params = self.params
        for b, stop in zip(self.rows, is_stop):
            self.num_new[b] += 1
            if stop:
                self.finish[b] = "stop_token"
            elif params.stop_strings and _has_stop_string(self.decode, self.tokens[b, self.prompt_lens[b]:t + 2],
                                                          params.stop_strings):
                self.finish[b] = "stop_string"
            elif self.num_new[b] == params.max_new_tokens:
                self.finish[b] = "length"
        return any(f is None for f in self.finish)


class _Force:
    """The replay's chooser: the recorded tokens, to the recorded number of steps."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def propose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        return self.tokens[:, t + 1]

    def accept(self, t: int, tokens: torch.Tensor) -> bool:
        return True


class Sampler:
    """Rollout and replay for one model replica: ``model`` is this rank's part of it (the whole
    model on one process; the pipeline stage with its TP shard under parallelism, every rank of
    the replica calling with the same arguments) and ``comms`` how the parts talk
    (rollout/comms.py). Several batches passed together run as micro-batches in flight in the
    pipeline ring; each remains its own batch (own caches, own schedule), so how batches are
    grouped never changes a value."""

    def __init__(self, model: RLT, comms: Optional[Comms] = None, layers: Optional[range] = None,
                 fast_decode: bool = True) -> None:
        """fast_decode: sample with the fused decoder step (model/fast_decode.py) where the
        projections allow it; it holds a copy of the decoder weights during a run (false: the
        modules' path, no copy). A replay always takes the path its rollout recorded."""
        self.model = model
        self.fast_decode = fast_decode
        self.device = next(model.parameters()).device
        self.comms = comms if comms is not None else Comms.local(self.device)
        self.executor = Executor(model, self.comms, layers)

    def generate(self, batches: Sequence[Sequence[Sequence[int]]], params: SamplingParams | Sequence[SamplingParams],
                 seeds: Sequence[Sequence[int]], pad_id: int, dtype: str = "fp32",
                 decode: Optional[Callable[[list[int]], str]] = None) -> list[Rollout]:
        """Samples one completion per prompt of each batch (the rollout schedule, module
        docstring). seeds: one per prompt; a request's draws come from its own generator, so they
        do not depend on its batch-mates. params: one for all batches or one per batch.
        decode: token ids -> text, needed for stop strings. Every stage returns the rollouts."""
        if isinstance(params, SamplingParams):
            params = [params] * len(batches)
        if not (len(batches) == len(params) == len(seeds)) or len(batches) == 0:
            raise ValueError(f"{len(batches)} batches, {len(params)} sampling params, {len(seeds)} seed lists: "
                             "give at least one batch and one of each per batch")
        plans, draws = [], []
        for prompts, p, batch_seeds in zip(batches, params, seeds):
            _check_request(prompts, p, batch_seeds, decode)
            prompt_lens = [len(x) for x in prompts]
            capacity = max(prompt_lens) + p.max_new_tokens
            _check_model_fits(self.model, capacity)
            tokens = torch.full((len(prompts), capacity), pad_id, dtype=torch.long, device=self.device)
            for b, x in enumerate(prompts):
                tokens[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
            draw = _Draw(tokens, prompt_lens, p, make_generators(batch_seeds, self.device), decode)
            plans.append(Plan(tokens, prompt_lens, capacity - 1, draw))
            draws.append(draw)
        if len({p.processing for p in params}) != 1:
            raise ValueError("batches sampled together must share one logits processing")
        with torch.no_grad(), precision(dtype, self.device):
            results = self.executor.run(plans, params[0].processing, self.fast_decode)
        rollouts = None
        if self.comms.is_last_stage:
            rollouts = [_rollout(res, plan, draw, p.processing, dtype, pad_id, self.model.cfg.memory_block)
                        for res, plan, draw, p in zip(results, plans, draws, params)]
            if self.comms.num_stages > 1:
                rollouts = [ro.to("cpu") for ro in rollouts]
        rollouts = self.comms.share_results(rollouts)
        return [ro.to(self.device) for ro in rollouts]

    def replay(self, rollouts: Sequence[Rollout]) -> list[Optional[torch.Tensor]]:
        """Re-executes each rollout's schedule with the model's current parameters, tokens
        forced, no grad, same batches, padding, cache capacity, processing and dtype -> log-probs
        (B, N) in the layout of ``rollout.mu`` (0 where masked) on the last stage, None on the
        others. With unchanged parameters they are torch.equal to ``rollout.mu``."""
        if len(rollouts) == 0:
            return []
        schedules = [ro.schedule for ro in rollouts]
        for s in schedules:
            if s.memory_block != self.model.cfg.memory_block:
                raise ValueError(f"the rollout was sampled with memory_block C={s.memory_block} but the model "
                                 f"has C={self.model.cfg.memory_block}")
        if len({(s.processing, s.dtype, s.fast_decode) for s in schedules}) != 1:
            raise ValueError("rollouts replayed together must share one processing, dtype and decoder path "
                             "(Schedule.fast_decode)")
        plans = []
        for ro, s in zip(rollouts, schedules):
            tokens = torch.full((ro.batch_size, s.capacity), s.pad_id, dtype=torch.long, device=self.device)
            tokens[:, :s.num_steps + 1] = ro.tokens
            plans.append(Plan(tokens, s.prompt_lens, s.num_steps, _Force(tokens)))
        with torch.no_grad(), precision(schedules[0].dtype, self.device):
            results = self.executor.run(plans, schedules[0].processing, schedules[0].fast_decode)
        out: list[Optional[torch.Tensor]] = []
        for ro, s, res in zip(rollouts, schedules, results):
            if res.fast_decode != s.fast_decode:
                raise RuntimeError(f"the rollout ran the {_path(s.fast_decode)} but this model runs the "
                                   f"{_path(res.fast_decode)} (its projections are {'' if res.fast_decode else 'not '}"
                                   "plain nn.Linear): replay on the layout the rollout was sampled with")
            if [tuple(c) for c in s.encoder_calls] != res.encoder_calls or res.num_steps != s.num_steps:
                raise RuntimeError(f"replay made encoder calls {res.encoder_calls} in {res.num_steps} steps but the "
                                   f"rollout recorded {list(s.encoder_calls)} in {s.num_steps}: the schedule "
                                   "(prompt lengths, C, steps) differs")
            if res.step_logprobs is None:
                out.append(None)
                continue
            step, mask = completion_positions(s.prompt_lens, ro.completion_lens, self.device)
            out.append(torch.where(mask, res.step_logprobs.gather(1, step), torch.zeros((), device=self.device)))
        return out


def _check_request(prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
                   decode: Optional[Callable]) -> None:
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: pass one seed per prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. a BOS token)")
    if params.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (token ids -> text)")


def _path(fast: bool) -> str:
    return "fused decoder step (model/fast_decode.py)" if fast else "modules' decoder step"


def _rollout(res: Result, plan: Plan, draw: _Draw, processing: Processing, dtype: str, pad_id: int,
             memory_block: int) -> Rollout:
    schedule = Schedule(prompt_lens=list(plan.prompt_lens), memory_block=memory_block,
                        capacity=plan.tokens.shape[1], num_steps=res.num_steps, encoder_calls=res.encoder_calls,
                        processing=processing, dtype=dtype, pad_id=pad_id, fast_decode=res.fast_decode)
    device = plan.tokens.device
    step, mask = completion_positions(plan.prompt_lens, draw.num_new, device)
    mu = torch.where(mask, res.step_logprobs.gather(1, step), torch.zeros((), device=device))
    return Rollout(tokens=plan.tokens[:, :res.num_steps + 1].clone(), mu=mu, mask=mask, completion_lens=draw.num_new,
                   finish_reasons=[str(f) for f in draw.finish], schedule=schedule)


def generate(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
             pad_id: int, dtype: str = "fp32", decode: Optional[Callable[[list[int]], str]] = None,
             device: torch.device | str | None = None, fast_decode: bool = True) -> Rollout:
    """One batch on one process (``Sampler`` for several, or under parallelism)."""
    if device is not None and torch.device(device) != next(model.parameters()).device:
        raise ValueError(f"generate on {device}: the model is on {next(model.parameters()).device}")
    return Sampler(model, fast_decode=fast_decode).generate([prompts], params, [seeds], pad_id, dtype, decode)[0]


def _has_stop_string(decode: Callable[[list[int]], str], completion: torch.Tensor,
                     stop_strings: Sequence[str]) -> bool:
    # The first occurrence ends the row, so only the newest token can have completed one; the
    # whole completion is decoded because a token may be part of a multi-token character.
    text = decode(completion.tolist())
    return any(s in text for s in stop_strings)


def replay(model: RLT, rollout: Rollout) -> torch.Tensor:
    """One rollout on one process (``Sampler.replay`` for several, or under parallelism)."""
    return Sampler(model).replay([rollout])[0]
