"""The rollout and replay schedules (DESIGN sections 2 and 3).

Both run one executor, ``_execute``, so that with unchanged parameters their logits are
equal bit for bit; they differ only in where the token after each step comes from (drawn,
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
- Decoder: ``decoder_step`` on x_t with a preallocated decoder K/V cache, then the head
  (fp32 logits) and ``process_logits`` on the whole (B, V) batch.

What the rollout records (``Schedule``) is enough to re-execute it: prompt lengths, the
number of steps, the encoder calls, the cache capacity, processing and dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlt_mega.model.cache import KVCache
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout.processing import Processing, make_generators, process_logits, sample

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision(dtype: str, device: torch.device | str):
    """The context the model calls run under: nothing for fp32, autocast for bf16 (the
    head's logits are fp32 either way)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[dtype])


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


def _encode_block(model: RLT, tokens: torch.Tensor, start: int, end: int, enc: KVCache, mem) -> None:
    """Encoder over positions [start, end) of every row (attending to the cached prefix),
    then its memory committed. tokens: (B, >= end)."""
    h = model.encode(model.embed(tokens[:, start:end]), start=start, cache=enc)
    model.append_memory(mem, model.memory_norm(h), start)


def _execute(model: RLT, tokens: torch.Tensor, prompt_lens: Sequence[int], capacity: int,
             processing: Processing, dtype: str, max_steps: int,
             choose: Callable[[int, torch.Tensor], bool],
             encoder_calls: Optional[Sequence[tuple[int, int]]] = None
             ) -> tuple[torch.Tensor, list[tuple[int, int]], int]:
    """Runs the schedule. tokens: (B, capacity) long, written by ``choose`` as it goes.

    After decoder step t, ``choose(t, logprobs (B, V))`` must make tokens[:, t + 1] final and
    return False to stop. ``encoder_calls``, when given (replay), must be the calls this
    schedule makes; they are checked, never trusted blindly.
    Returns (the log-prob of tokens[:, t + 1] under step t's processed distribution, for every
    row and step: (B, num_steps) fp32), the encoder calls made, num_steps.
    """
    B = tokens.shape[0]
    C = model.cfg.memory_block
    L = model.cfg.n_layers
    prefill_end = C * (min(prompt_lens) // C)
    calls: list[tuple[int, int]] = []
    step_logprobs = []
    with torch.no_grad(), precision(dtype, tokens.device):
        # Fresh preallocated caches on every call: nothing computed under other parameters
        # is ever reused.
        enc, dec = KVCache(L, capacity), KVCache(L, capacity)
        mem = model.init_memory(B, capacity)
        if prefill_end > 0:
            _encode_block(model, tokens, 0, prefill_end, enc, mem)
            calls.append((0, prefill_end))
        z = model.initial_state(B)
        num_steps = 0
        for t in range(max_steps):
            start = t + 1 - C
            if (t + 1) % C == 0 and start >= prefill_end:
                _encode_block(model, tokens, start, t + 1, enc, mem)
                calls.append((start, t + 1))
            z = model.decoder_step(model.embed(tokens[:, t]), z, t, dec, mem)  # (B, d)
            logprobs = process_logits(model.head(z), processing)  # (B, V) fp32
            go_on = choose(t, logprobs)
            step_logprobs.append(logprobs.gather(1, tokens[:, t + 1:t + 2]))  # (B, 1)
            num_steps = t + 1
            if not go_on:
                break
    if encoder_calls is not None and [tuple(c) for c in encoder_calls] != calls:
        raise RuntimeError(f"replay made encoder calls {calls} but the rollout recorded "
                           f"{list(encoder_calls)}: the schedule (prompt lengths, C, steps) differs")
    return torch.cat(step_logprobs, dim=1), calls, num_steps


def _check_model_fits(model: RLT, capacity: int) -> None:
    if capacity > model.cfg.max_seq_len:
        raise ValueError(f"longest prompt + max_new_tokens = {capacity} positions exceeds "
                         f"model.max_seq_len={model.cfg.max_seq_len}: shorten the prompts, lower "
                         "max_new_tokens or raise model.max_seq_len")


def generate(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
             pad_id: int, dtype: str = "fp32", decode: Optional[Callable[[list[int]], str]] = None,
             device: torch.device | str | None = None) -> Rollout:
    """Samples one completion per prompt (the rollout schedule, module docstring).

    seeds: one per prompt; a request's draws come from its own generator, so they do not
    depend on its batch-mates. decode: token ids -> text, needed for stop strings.
    """
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: pass one seed per prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. a BOS token)")
    if params.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (token ids -> text)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    B = len(prompts)
    prompt_lens = [len(p) for p in prompts]
    capacity = max(prompt_lens) + params.max_new_tokens
    _check_model_fits(model, capacity)
    tokens = torch.full((B, capacity), pad_id, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    generators = make_generators(seeds, device)
    num_new = [0] * B
    finish: list[Optional[str]] = [None] * B
    stop_ids = torch.as_tensor(list(params.stop_token_ids), dtype=torch.long, device=device)

    def choose(t: int, logprobs: torch.Tensor) -> bool:
        rows = [b for b in range(B) if finish[b] is None and t >= prompt_lens[b] - 1]
        drawn = sample(logprobs, generators, rows)
        tokens[rows, t + 1] = drawn
        is_stop = torch.isin(drawn, stop_ids).tolist() if len(stop_ids) else [False] * len(rows)
        for b, stop in zip(rows, is_stop):
            num_new[b] += 1
            if stop:
                finish[b] = "stop_token"
            elif params.stop_strings and _has_stop_string(decode, tokens[b, prompt_lens[b]:t + 2],
                                                          params.stop_strings):
                finish[b] = "stop_string"
            elif num_new[b] == params.max_new_tokens:
                finish[b] = "length"
        return any(f is None for f in finish)

    step_logprobs, calls, num_steps = _execute(model, tokens, prompt_lens, capacity, params.processing,
                                               dtype, capacity - 1, choose)
    schedule = Schedule(prompt_lens=prompt_lens, memory_block=model.cfg.memory_block, capacity=capacity,
                        num_steps=num_steps, encoder_calls=calls, processing=params.processing,
                        dtype=dtype, pad_id=pad_id)
    step, mask = completion_positions(prompt_lens, num_new, device)
    mu = torch.where(mask, step_logprobs.gather(1, step), torch.zeros((), device=device))
    return Rollout(tokens=tokens[:, :num_steps + 1].clone(), mu=mu, mask=mask, completion_lens=num_new,
                   finish_reasons=[str(f) for f in finish], schedule=schedule)


def _has_stop_string(decode: Callable[[list[int]], str], completion: torch.Tensor,
                     stop_strings: Sequence[str]) -> bool:
    # The first occurrence ends the row, so only the newest token can have completed one; the
    # whole completion is decoded because a token may be part of a multi-token character.
    text = decode(completion.tolist())
    return any(s in text for s in stop_strings)


def replay(model: RLT, rollout: Rollout) -> torch.Tensor:
    """Re-executes the rollout's schedule with the model's current parameters, tokens forced,
    no grad, same batch, padding, cache capacity, processing and dtype -> log-probs (B, N) in
    the layout of ``rollout.mu`` (0 where masked). With unchanged parameters it is
    torch.equal to ``rollout.mu``."""
    s = rollout.schedule
    if s.memory_block != model.cfg.memory_block:
        raise ValueError(f"the rollout was sampled with memory_block C={s.memory_block} but the model "
                         f"has C={model.cfg.memory_block}")
    B = rollout.batch_size
    tokens = torch.full((B, s.capacity), s.pad_id, dtype=torch.long, device=rollout.tokens.device)
    tokens[:, :s.num_steps + 1] = rollout.tokens
    step_logprobs, _, num_steps = _execute(model, tokens, s.prompt_lens, s.capacity, s.processing, s.dtype,
                                           s.num_steps, lambda t, lp: True, encoder_calls=s.encoder_calls)
    step, mask = completion_positions(s.prompt_lens, rollout.completion_lens, tokens.device)
    return torch.where(mask, step_logprobs.gather(1, step), torch.zeros((), device=tokens.device))
