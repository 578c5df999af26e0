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
- Stopping: stop tokens and max_new_tokens end a row on the device; the batch stops at the
  first check (every ``check_every`` steps, executor.py) after its last row ended, so it may
  run up to check_every - 1 steps of pad past it. Stop strings are looked for at the checks,
  in the tokens drawn since the last one; a row ends at the token that completed one.

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
from rlt_mega.rollout.executor import DEFAULT_CHECK_EVERY, Executor, Plan, Result
from rlt_mega.rollout.processing import Processing, draw_uniforms, make_generators, sample
from rlt_mega.rollout.row_executor import RowExecutor
from rlt_mega.rollout.rows import RowRecord
from rlt_mega.rollout import row_sampling
from rlt_mega.rollout.row_sampling import LOCKSTEP, RowSwitches

@dataclass(frozen=True)
class SamplingParams:
    processing: Processing = field(default_factory=Processing)
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # needs a ``decode`` function in ``generate``
    # Per-row budgets (each in [1, max_new_tokens]; empty: max_new_tokens for every row): a row
    # ends ("length") on the device after its own budget, which the host learns at a check, as
    # it learns of a stop token (tools/bench/rollout_rows.py stands in for real stopping with it).
    row_budgets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if any(not 1 <= n <= self.max_new_tokens for n in self.row_budgets):
            raise ValueError(f"row_budgets {self.row_budgets}: each must be in [1, max_new_tokens="
                             f"{self.max_new_tokens}]")


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
    # The row schedule's record (rollout/rows.py: layout, the flags read at checks, the event
    # log) when the call ran it; None: the lockstep schedule. Then num_steps is the positions the
    # dense schedule needs (the longest prompt + completion - 1), encoder_calls the calls' ranges
    # in order, and rows.num_steps the call's sequential decoder steps.
    rows: Optional[RowRecord] = None


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


_REASONS = ("", "stop_token", "stop_string", "length")  # finish codes on the device: 0 while running


class _Draw:
    """The rollout's chooser: rows past their prompt draw x_{t+1} with their own random numbers,
    the others are forced (prompt tokens, or pad once finished); stop tokens and max_new_tokens
    end a row on the device, stop strings at the checks (``check``), in the newest text only.

    Stop strings are found up to check_every steps late: the tokens a row drew after its stop
    string are then replaced by pad in the record (its completion ends at the string), which
    changes no log-prob of the completion (positions are causal, rows independent)."""

    def __init__(self, tokens: torch.Tensor, prompt_lens: Sequence[int], params: SamplingParams,
                 generators: list, decode: Optional[Callable[[list[int]], str]], pad_id: int) -> None:
        device = tokens.device
        self.tokens, self.params, self.decode, self.pad_id = tokens, params, decode, pad_id
        self.prompt_lens = list(prompt_lens)
        self.prompt_t = torch.as_tensor(self.prompt_lens, dtype=torch.long, device=device)  # (B,)
        self.u = draw_uniforms(generators, params.max_new_tokens, device)  # (B, max_new_tokens)
        B = tokens.shape[0]
        self.num_new = torch.zeros(B, dtype=torch.long, device=device)  # tokens drawn per row
        self.reason = torch.zeros(B, dtype=torch.long, device=device)  # index into _REASONS
        self.stop_ids = torch.as_tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        budgets = list(params.row_budgets)
        budgets += [params.max_new_tokens] * (B - len(budgets))  # (the row schedule's entries: unused)
        self.budget = torch.as_tensor(budgets, dtype=torch.long, device=device)  # (B,)
        self._sampling: Optional[torch.Tensor] = None
        self.checked = [0] * B  # completion tokens already searched for stop strings (host)
        # A stop string of n bytes spans at most n tokens when every token decodes to at least
        # one byte (byte-level tokenizers); 3 more cover a character split at the window's start.
        self.lookback = max((len(x.encode("utf-8")) for x in params.stop_strings), default=0) + 3

    def choose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        sampling = (self.prompt_t <= t + 1) & (self.reason == 0)  # (B,): past the prompt, running
        draw_index = self.num_new.clamp(max=self.u.shape[1] - 1).unsqueeze(1)
        drawn = sample(logprobs, self.u.gather(1, draw_index).squeeze(1))
        self._sampling = sampling
        return torch.where(sampling, drawn, self.tokens[:, t + 1])

    def record(self, t: int, tokens: torch.Tensor) -> None:
        sampling = self._sampling
        self.num_new += sampling.long()
        running = self.reason == 0
        if len(self.stop_ids):
            stop = sampling & torch.isin(tokens, self.stop_ids)
            self.reason = torch.where(running & stop, 1, self.reason)
            running = self.reason == 0
        length = sampling & (self.num_new == self.budget)
        self.reason = torch.where(running & length, 3, self.reason)

    def finished(self) -> torch.Tensor:
        return self.reason != 0

    def check(self, t: int) -> None:
        """Stop strings in the tokens drawn since the last check (one read of the newest
        tokens): a row ends at the first token whose completion text contains one (a stop token
        at that same token takes precedence, as before; max_new_tokens does not)."""
        if not self.params.stop_strings:
            return
        num_new, reason = self.num_new.tolist(), self.reason.tolist()
        rows = [b for b in range(len(num_new)) if num_new[b] > self.checked[b]]
        if not rows:
            return
        starts = {b: self.prompt_lens[b] + max(0, self.checked[b] - self.lookback) for b in rows}
        lo = min(starts.values())
        window = self.tokens[:, lo:t + 2].tolist()
        for b in rows:
            P, start = self.prompt_lens[b], starts[b]
            ids = window[b][start - lo:P + num_new[b] - lo]
            first_new = P + self.checked[b] - start
            self.checked[b] = num_new[b]
            end = _first_stop(self.decode, ids, first_new, self.params.stop_strings)
            if end is None:
                continue
            length = start - P + end + 1  # the completion ends with the token that completed it
            if reason[b] == 1 and length == num_new[b]:
                continue
            self.num_new[b], self.reason[b], self.checked[b] = length, 2, length
            self.tokens[b, P + length:t + 2] = self.pad_id


def _first_stop(decode: Callable[[list[int]], str], ids: list[int], first_new: int,
                stop_strings: Sequence[str]) -> Optional[int]:
    """The first index i >= first_new such that decode(ids[:i + 1]) contains a stop string."""
    if not any(x in decode(ids) for x in stop_strings):
        return None
    for i in range(first_new, len(ids)):
        text = decode(ids[:i + 1])
        if any(x in text for x in stop_strings):
            return i
    return None


class _Force:
    """The replay's chooser: the recorded tokens, to the recorded number of steps."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self.none = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)

    def choose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        return self.tokens[:, t + 1]

    def record(self, t: int, tokens: torch.Tensor) -> None:
        pass

    def finished(self) -> torch.Tensor:
        return self.none

    def check(self, t: int) -> None:
        pass


class Sampler:
    """Rollout and replay for one model replica: ``model`` is this rank's part of it (the whole
    model on one process; the pipeline stage with its TP shard under parallelism, every rank of
    the replica calling with the same arguments) and ``comms`` how the parts talk
    (rollout/comms.py). Several batches passed together run as micro-batches in flight in the
    pipeline ring; each remains its own batch (own caches, own schedule), so how batches are
    grouped never changes a value."""

    def __init__(self, model: RLT, comms: Optional[Comms] = None, layers: Optional[range] = None,
                 fast_decode: bool = True, check_every: int = DEFAULT_CHECK_EVERY,
                 rows: RowSwitches = LOCKSTEP) -> None:
        """fast_decode: sample with the fused decoder step (model/fast_decode.py) where the
        projections allow it; it holds a copy of the decoder weights during a run (false: the
        modules' path, no copy). A replay always takes the path its rollout recorded.
        check_every: decoder steps between the host's reads of the finish flags (executor.py);
        a batch runs up to check_every - 1 steps past its last row's end.
        rows: the row schedule's switches (rollout/rows.py: shared prompts, compaction, slots);
        all off (the default here; the trainers' config turns them on) is the lockstep schedule.
        A replay always runs the schedule its rollout recorded."""
        self.model = model
        self.rows = rows
        self.fast_decode = fast_decode
        self.device = next(model.parameters()).device
        self.comms = comms if comms is not None else Comms.local(self.device)
        self.executor = Executor(model, self.comms, layers, check_every)
        self.row_executor = RowExecutor(model, self.comms, layers, check_every)

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
        for prompts, p, batch_seeds in zip(batches, params, seeds):
            _check_request(prompts, p, batch_seeds, decode)
        if len({p.processing for p in params}) != 1:
            raise ValueError("batches sampled together must share one logits processing")
        if self.rows.enabled:
            return self._generate_rows(batches, params, seeds, pad_id, dtype, decode)
        plans, draws = [], []
        for prompts, p, batch_seeds in zip(batches, params, seeds):
            prompt_lens = [len(x) for x in prompts]
            capacity = max(prompt_lens) + p.max_new_tokens
            _check_model_fits(self.model, capacity)
            tokens = torch.full((len(prompts), capacity), pad_id, dtype=torch.long, device=self.device)
            for b, x in enumerate(prompts):
                tokens[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
            draw = _Draw(tokens, prompt_lens, p, make_generators(batch_seeds, self.device), decode, pad_id)
            plans.append(Plan(tokens, prompt_lens, capacity - 1, draw))
            draws.append(draw)
        with torch.no_grad(), precision(dtype, self.device):
            results = self.executor.run(plans, params[0].processing, self.fast_decode)
        rollouts = None
        if self.comms.is_last_stage:
            for res, draw in zip(results, draws):
                draw.check(res.num_steps - 1)  # the tokens drawn after the last check
            rollouts = [_rollout(res, plan, draw, p.processing, dtype, pad_id, self.model.cfg.memory_block)
                        for res, plan, draw, p in zip(results, plans, draws, params)]
            if self.comms.num_stages > 1:
                rollouts = [ro.to("cpu") for ro in rollouts]
        rollouts = self.comms.share_results(rollouts)
        return [ro.to(self.device) for ro in rollouts]

    def _generate_rows(self, batches, params, seeds, pad_id: int, dtype: str, decode) -> list[Rollout]:
        works, choosers = row_sampling.generate_rows(
            self.row_executor, batches, params, seeds, pad_id, decode, self.rows, self.device,
            lambda capacity: _check_model_fits(self.model, capacity))
        with torch.no_grad(), precision(dtype, self.device):
            results = self.row_executor.run(works, params[0].processing, self.fast_decode)
        rollouts = None
        if self.comms.is_last_stage:
            rollouts = []
            for res, work, chooser, p in zip(results, works, choosers, params):
                chooser.check(work.plan.num_steps - 1)  # the tokens drawn after the last check
                rollouts.append(row_sampling.row_rollout(res, work, chooser, p.processing, dtype, pad_id,
                                                         self.model.cfg.memory_block, Schedule, Rollout, _REASONS))
            if self.comms.num_stages > 1:
                rollouts = [ro.to("cpu") for ro in rollouts]
        rollouts = self.comms.share_results(rollouts)
        return [ro.to(self.device) for ro in rollouts]

    def _replay_rows(self, rollouts: Sequence[Rollout]) -> list[Optional[torch.Tensor]]:
        works = row_sampling.replay_works(rollouts, self.device)
        s0 = rollouts[0].schedule
        with torch.no_grad(), precision(s0.dtype, self.device):
            results = self.row_executor.run(works, s0.processing, s0.fast_decode)
        out = []
        for ro, work, res in zip(rollouts, works, results):
            if res.fast_decode != ro.schedule.fast_decode:
                raise RuntimeError(f"the rollout ran the {_path(ro.schedule.fast_decode)} but this model runs the "
                                   f"{_path(res.fast_decode)}: replay on the layout the rollout was sampled with")
            out.append(row_sampling.replay_values(ro, work, res))
        return out

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
        if len({(s.processing, s.dtype, s.fast_decode, s.rows is None) for s in schedules}) != 1:
            raise ValueError("rollouts replayed together must share one processing, dtype, decoder path "
                             "(Schedule.fast_decode) and schedule (lockstep or rows)")
        if schedules[0].rows is not None:
            return self._replay_rows(rollouts)
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
    if params.row_budgets and len(params.row_budgets) != len(prompts):
        raise ValueError(f"{len(params.row_budgets)} row_budgets for {len(prompts)} prompts: give one per prompt")


def _path(fast: bool) -> str:
    return "fused decoder step (model/fast_decode.py)" if fast else "modules' decoder step"


def _rollout(res: Result, plan: Plan, draw: _Draw, processing: Processing, dtype: str, pad_id: int,
             memory_block: int) -> Rollout:
    schedule = Schedule(prompt_lens=list(plan.prompt_lens), memory_block=memory_block,
                        capacity=plan.tokens.shape[1], num_steps=res.num_steps, encoder_calls=res.encoder_calls,
                        processing=processing, dtype=dtype, pad_id=pad_id, fast_decode=res.fast_decode)
    device = plan.tokens.device
    completion_lens = draw.num_new.tolist()
    finish_reasons = [_REASONS[r] or "length" for r in draw.reason.tolist()]
    step, mask = completion_positions(plan.prompt_lens, completion_lens, device)
    mu = torch.where(mask, res.step_logprobs.gather(1, step), torch.zeros((), device=device))
    return Rollout(tokens=plan.tokens[:, :res.num_steps + 1].clone(), mu=mu, mask=mask,
                   completion_lens=completion_lens, finish_reasons=finish_reasons, schedule=schedule)


def generate(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
             pad_id: int, dtype: str = "fp32", decode: Optional[Callable[[list[int]], str]] = None,
             device: torch.device | str | None = None, fast_decode: bool = True,
             check_every: int = DEFAULT_CHECK_EVERY, rows: RowSwitches = LOCKSTEP) -> Rollout:
    """One batch on one process (``Sampler`` for several, or under parallelism)."""
    if device is not None and torch.device(device) != next(model.parameters()).device:
        raise ValueError(f"generate on {device}: the model is on {next(model.parameters()).device}")
    sampler = Sampler(model, fast_decode=fast_decode, check_every=check_every, rows=rows)
    return sampler.generate([prompts], params, [seeds], pad_id, dtype, decode)[0]


def replay(model: RLT, rollout: Rollout) -> torch.Tensor:
    """One rollout on one process (``Sampler.replay`` for several, or under parallelism)."""
    return Sampler(model).replay([rollout])[0]
