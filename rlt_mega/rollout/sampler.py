"""The rollout and replay schedules (docs/design.md, "One transition, three schedules" and
"Exact log-probabilities").

Both run one executor (``executor.RowExecutor``, the same program on one process and on every
stage of a tensor/pipeline-parallel replica) with the same plan (schedule/rows.py), so that with
unchanged parameters their logits are equal bit for bit; they differ only in where the token after
each step comes from (drawn, or read from the recorded rollout).

The schedule of a batch of R prompts (schedule/rows.py): a prompt held by several rows (a GRPO
group) runs once and forks into its rows at its last prompt position; a finished row leaves the
batch at the next check; with ``slots`` below the rows a row waits for a freed slot. Every row is
at its own position (its RoPE position, keys and vis(t)), and a memory block completes with one
encoder call per distinct block start (the prompts' complete blocks in one prefill when a sequence
starts). Sharing and compaction off and one slot a row is the lockstep schedule (every row at t,
a finished row fed pad until the batch stops): a plan, not another executor.

A row draws its i-th completion token with its own i-th uniform (drawn once from its request's
generator), so its draws do not depend on its batch-mates, where it sits or when it entered; a
forked row's first token is drawn from its entry's distribution. Stopping: stop tokens and
``max_new_tokens`` (or a row's own budget) end a row on the device; the host reads the flags only
at a check (every ``check_every`` steps), where it also looks for stop strings in the tokens drawn
since the last one; a row ends at the token that completed one.

What the rollout records (``Schedule``, with ``Schedule.rows`` the plan's record: layout, the
flags each check read, the event log) is enough to re-execute it: the replay derives the same
plan from the recorded flags (tokens forced) and refuses a replay whose events or encoder calls
differ from the record's.

Partial rollouts: a call may start under one policy version and switch to another before a fixed
step (``generate(version=, switch=(step, version), load=)``, schedule/rows.py ``Switch``); each
token's version is recorded (``Rollout.version``). A replay given the same ``load`` repeats the
switch and equals mu bit for bit; without it the whole call runs under the current parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlt_mega.model.layout import to_device
from rlt_mega.model.rlt import RLT
from rlt_mega.precision import precision
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.executor import RowExecutor, RowResult, RowWork, check
from rlt_mega.rollout.processing import Finish, Processing, draw_uniforms, make_generators, sample
from rlt_mega.rollout.turns import Episode, EpisodeStats, Turns, forced_mask
from rlt_mega.schedule.rows import RowLayout, RowPlan, RowRecord, RowSwitches, row_layout

DEFAULT_CHECK_EVERY = 8


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
    num_steps: int  # the positions the dense schedule needs: the longest prompt + completion - 1
    encoder_calls: list[tuple[int, int]]  # (start, end) position ranges in call order
    processing: Processing
    dtype: str  # "fp32" or "bf16"
    pad_id: int
    rows: RowRecord  # the plan's record (schedule/rows.py): layout, the flags read at checks, the event log
    decoder: str = "fused"  # the decoder step that ran (the model's; "reference": rlt_mega/reference.py)


@dataclass
class Rollout:
    """A sampled batch. tokens (B, num_steps + 1): prompt, completion, then pad. mu (B, N),
    N = max completion length: mu[b, j] is the fp32 log-prob the completion's j-th token was
    drawn with (at position P_b + j, by step P_b + j - 1); 0 where mask (B, N) is False. mask: the
    sampled tokens (an environment's observations inside a completion are not: rollout/turns.py);
    episodes: each row's environment episode, with an environment (else None). version (B, N)
    long: the policy version whose parameters drew each token (partial rollouts switch inside a
    call), 0 where mask is False (the sampler always records it)."""

    tokens: torch.Tensor
    mu: torch.Tensor
    mask: torch.Tensor
    completion_lens: list[int]
    finish_reasons: list[str]  # "stop_token", "stop_string", "length" or "env" (the episode ended)
    schedule: Schedule
    episodes: Optional[list[EpisodeStats]] = None
    version: Optional[torch.Tensor] = None

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
                                   mask=self.mask.to(device),
                                   version=None if self.version is None else self.version.to(device))


def completion_positions(prompt_lens: Sequence[int], completion_lens: Sequence[int], device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps that produced each completion token, in the (B, N) completion layout:
    step (B, N) = P_b - 1 + j (clamped into range where masked), mask (B, N)."""
    N = max(completion_lens) if len(completion_lens) else 0
    j = torch.arange(N, device=device)
    P = to_device(list(prompt_lens), device)
    n = to_device(list(completion_lens), device)
    mask = j[None, :] < n[:, None]
    step = torch.where(mask, P[:, None] - 1 + j[None, :], torch.zeros_like(mask, dtype=torch.long))
    return step, mask


def _sampled_mask(prompt_lens: Sequence[int], completion_lens: Sequence[int], record: RowRecord, device):
    """(R, N) bool: the completion tokens that were drawn (not an inserted observation's)."""
    step, mask = completion_positions(prompt_lens, completion_lens, device)
    if not record.forces:
        return mask
    return mask & ~forced_mask(prompt_lens, completion_lens, record.forces, mask.shape, device)


def _completion_values(lp: torch.Tensor, prompt_lens: Sequence[int], completion_lens: Sequence[int],
                       mask: torch.Tensor) -> torch.Tensor:
    """lp (R, capacity) per position -> values (R, N), 0 where not ``mask``: the j-th completion
    token of row b sits at position P_b + j."""
    step, _ = completion_positions(prompt_lens, completion_lens, lp.device)
    return torch.where(mask, lp.gather(1, step + 1), torch.zeros((), device=lp.device))


class _Draw:
    """The rollout's chooser over sequences (rows, then entries, which only ever force their
    prompt), the choice made per target of the step: rows past their prompt draw x_{t+1} with their
    own random numbers, the others are forced (prompt tokens, and observations an environment's
    turn inserted: ``insert``); stop tokens and budgets end a row on the device, stop strings at
    the checks (``check``), in the newest text only (from ``text_start``: never in an observation).

    Stop strings are found up to check_every steps late: the tokens a row drew after its stop
    string are then replaced by pad in the record (its completion ends at the string), which
    changes no log-prob of the completion (positions are causal, rows independent)."""

    def __init__(self, tokens: torch.Tensor, seq_lens: Sequence[int], params: SamplingParams, generators: list,
                 decode: Optional[Callable[[list[int]], str]], pad_id: int, num_rows: int) -> None:
        device = tokens.device
        self.tokens, self.params, self.decode, self.pad_id = tokens, params, decode, pad_id
        self.prompt_lens = list(seq_lens)
        self.prompt_t = to_device(self.prompt_lens, device)  # (S,)
        # Positions < forced_end are forced (the prompt, then each observation inserted so far).
        self.forced_end = self.prompt_t.clone()  # (S,)
        self.text_start = [0] * num_rows  # completion index where each row's searched text (its model turn) begins
        self.u = draw_uniforms(generators, params.max_new_tokens, device)  # (S, max_new_tokens)
        S = tokens.shape[0]
        self.num_rows = num_rows
        self.is_row = torch.arange(S, device=device) < num_rows
        self.num_new = torch.zeros(S, dtype=torch.long, device=device)  # tokens per row (drawn and inserted)
        self.reason = torch.zeros(S, dtype=torch.long, device=device)  # a Finish per row
        self.stop_ids = to_device(list(params.stop_token_ids), device)
        budgets = list(params.row_budgets)
        budgets += [params.max_new_tokens] * (S - len(budgets))  # (the entries': unused)
        self.budget = to_device(budgets, device)  # (S,)
        self._sampling: Optional[torch.Tensor] = None
        self.checked = [0] * S  # completion tokens already searched for stop strings (host)
        # A stop string of n bytes spans at most n tokens when every token decodes to at least
        # one byte (byte-level tokenizers); 3 more cover a character split at the window's start.
        self.lookback = max((len(x.encode("utf-8")) for x in params.stop_strings), default=0) + 3

    def choose_rows(self, targets, positions, logprobs):
        sampling = self.is_row[targets] & (self.forced_end[targets] <= positions + 1) & (self.reason[targets] == Finish.RUNNING)
        draw_index = self.num_new[targets].clamp(max=self.u.shape[1] - 1)
        drawn = sample(logprobs, self.u[targets, draw_index])
        self._sampling = sampling
        return torch.where(sampling, drawn, self.tokens[targets, positions + 1])

    def record_rows(self, targets, positions, tokens):
        sampling = self._sampling
        num_new = self.num_new[targets] + sampling.long()
        reason = self.reason[targets]
        running = reason == Finish.RUNNING
        if len(self.stop_ids):
            stop = sampling & torch.isin(tokens, self.stop_ids)
            reason = torch.where(running & stop, Finish.STOP_TOKEN, reason)
            running = reason == Finish.RUNNING
        length = sampling & (num_new == self.budget[targets])
        self.reason[targets] = torch.where(running & length, Finish.LENGTH, reason)
        self.num_new[targets] = num_new

    def flag_codes(self):
        """(R,) long: 1 finished, else 0 (``Flag``; an environment's turn adds its departures)."""
        return (self.reason[:self.num_rows] != Finish.RUNNING).long()

    def check(self, t: int) -> None:
        """Stop strings in the tokens drawn since the last check (one read of the newest
        tokens): a row ends at the first token whose completion text contains one (a stop token
        at that same token takes precedence; a budget does not)."""
        if not self.params.stop_strings:
            return
        num_new, reason = self.num_new[:self.num_rows].tolist(), self.reason[:self.num_rows].tolist()
        rows = [b for b in range(len(num_new)) if num_new[b] > self.checked[b]]
        if not rows:
            return
        starts = {b: self.prompt_lens[b] + max(0, self.checked[b] - self.lookback, self.text_start[b]) for b in rows}
        lo = min(starts.values())
        hi = max(self.prompt_lens[b] + num_new[b] for b in rows)
        window = self.tokens[:self.num_rows, lo:hi].tolist()
        for b in rows:
            P, start = self.prompt_lens[b], starts[b]
            ids = window[b][start - lo:P + num_new[b] - lo]
            first_new = P + self.checked[b] - start
            self.checked[b] = num_new[b]
            end = _first_stop(self.decode, ids, first_new, self.params.stop_strings)
            if end is None:
                continue
            length = start - P + end + 1  # the completion ends with the token that completed it
            if reason[b] == Finish.STOP_TOKEN and length == num_new[b]:
                continue
            self.num_new[b], self.reason[b], self.checked[b] = length, Finish.STOP_STRING, length
            self.tokens[b, P + length:] = self.pad_id

    # ------------------------------------------------------------------ what an environment's turn changes
    def finish(self, b: int, reason: Finish) -> None:
        self.reason[b] = reason

    def insert(self, b: int, ids: Sequence[int]) -> int:
        """Row b's next positions forced to ``ids`` (an observation) -> the first of them; its
        next model turn (the text searched) starts after them."""
        n = int(self.num_new[b])
        start = self.prompt_lens[b] + n
        self.tokens[b, start:start + len(ids)] = to_device(list(ids), self.tokens.device)
        self.forced_end[b] = start + len(ids)
        self.num_new[b] = n + len(ids)
        self.text_start[b] = self.checked[b] = n + len(ids)
        return start


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
    """The replay's chooser: the recorded tokens."""

    def __init__(self, tokens: torch.Tensor, num_rows: int) -> None:
        self.tokens = tokens
        self.none = torch.zeros(num_rows, dtype=torch.long, device=tokens.device)

    def choose_rows(self, targets, positions, logprobs):
        return self.tokens[targets, positions + 1]

    def record_rows(self, targets, positions, tokens) -> None:
        pass

    def flag_codes(self):
        return self.none

    def check(self, t: int) -> None:
        pass


class _ForceTopK(_Force):
    """The replay's chooser that also keeps, at every position it forces, the k most probable
    tokens of the processed distribution and their log-probs (grpo.teacher_topk: the teacher's
    top-k for the forward-KL term, learner/distill.py). It reads the log-probs the step already
    computed: the forced tokens and their values are the plain replay's."""

    def __init__(self, tokens: torch.Tensor, num_rows: int, k: int) -> None:
        super().__init__(tokens, num_rows)
        self.k = k
        self.ids = torch.zeros(*tokens.shape, k, dtype=torch.long, device=tokens.device)  # (S, capacity, k)
        self.lp = torch.zeros(*tokens.shape, k, dtype=torch.float32, device=tokens.device)

    def choose_rows(self, targets, positions, logprobs):
        top = torch.topk(logprobs, self.k, dim=-1)  # (B, k), descending
        self.ids[targets, positions + 1] = top.indices
        self.lp[targets, positions + 1] = top.values.to(self.lp.dtype)
        return super().choose_rows(targets, positions, logprobs)


def _seq_tokens(layout: RowLayout, rows: torch.Tensor, capacity: int, pad_id: int) -> torch.Tensor:
    """(S, capacity): the rows' tokens (R, n <= capacity), then each entry's prompt."""
    R = layout.num_rows
    out = torch.full((layout.num_seqs, capacity), pad_id, dtype=torch.long, device=rows.device)
    out[:R, :rows.shape[1]] = rows
    for u, members in enumerate(layout.entry_rows):
        P = layout.prompt_lens[members[0]]
        out[R + u, :P] = rows[members[0], :P]
    return out


class Sampler:
    """Rollout and replay for one model replica: ``model`` is this rank's part of it (the whole
    model on one process; the pipeline stage with its TP shard under parallelism, every rank of
    the replica calling with the same arguments) and ``comms`` how the parts talk
    (rollout/comms.py). Several batches passed together run as micro-batches in flight in the
    pipeline ring; each remains its own batch (own state, own schedule), so how batches are
    grouped never changes a value.

    rows: the plan's options (schedule/rows.py: shared prompts, compaction, slots); ``LOCKSTEP``
    is the lockstep schedule (the benchmarks' baseline arm). check_every: decoder steps between
    the host's reads of the finish flags. decoder: the decoder step (default: the model's own;
    rlt_mega/reference.py's for the benchmarks' reference arm). A replay always runs the plan its
    rollout recorded, and refuses another decoder step."""

    def __init__(self, model: RLT, comms: Optional[Comms] = None, layers: Optional[range] = None,
                 check_every: int = DEFAULT_CHECK_EVERY, rows: RowSwitches = RowSwitches(), decoder=None) -> None:
        if check_every < 1:
            raise ValueError(f"check_every={check_every}: must be >= 1")
        self.model, self.rows, self.check_every = model, rows, check_every
        self.device = next(model.parameters()).device
        self.comms = comms if comms is not None else Comms.local(self.device)
        self.executor = RowExecutor(model, self.comms, layers, check_every, decoder)

    def generate(self, batches: Sequence[Sequence[Sequence[int]]], params: SamplingParams | Sequence[SamplingParams],
                 seeds: Sequence[Sequence[int]], pad_id: int, dtype: str = "fp32",
                 decode: Optional[Callable[[list[int]], str]] = None,
                 episodes: Optional[Sequence[Sequence[Episode]]] = None, version: int = 0,
                 switch: Sequence[int] = (), load: Optional[Callable[[int], None]] = None) -> list[Rollout]:
        """Samples one completion per prompt of each batch (the module docstring). seeds: one per
        prompt; a request's draws come from its own generator, so they do not depend on its
        batch-mates. params: one for all batches or one per batch. decode: token ids -> text,
        needed for stop strings and episodes. episodes: one environment episode per prompt of
        each batch (rollout/turns.py; they need check_every = 1 and run on the last stage).
        version: the policy version of the current parameters, recorded with every token;
        switch (step, version): partial rollouts, the parameters become that version before
        that step (a multiple of the memory block), by ``load(version)`` (this stage's parameters,
        in place; it is also called with ``version`` first). Every stage returns the rollouts."""
        if isinstance(params, SamplingParams):
            params = [params] * len(batches)
        self._check_call(batches, params, seeds, pad_id, decode, episodes, switch, load)
        works = []
        for i, (prompts, p, batch_seeds) in enumerate(zip(batches, params, seeds)):
            layout = row_layout(prompts, p.max_new_tokens, self.model.cfg.memory_block, self.rows.slots or None,
                                self.rows.share_prompts, self.rows.compact, self.check_every, version=version,
                                switch=switch)
            capacity = max(layout.prompt_lens) + p.max_new_tokens
            _check_model_fits(self.model, capacity)
            rows = torch.full((len(prompts), capacity), pad_id, dtype=torch.long)
            for b, x in enumerate(prompts):
                rows[b, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
            rows = to_device(rows, self.device)
            tokens = _seq_tokens(layout, rows, capacity, pad_id)
            seq_lens = [layout.seq_len(s) for s in range(layout.num_seqs)]
            gens = make_generators(list(batch_seeds) + [0] * (layout.num_seqs - layout.num_rows), self.device)
            turns = None if episodes is None else Turns(episodes[i], decode, self.comms.once_in_tp, layout.num_rows,
                                                          self.device)
            works.append(RowWork(tokens, RowPlan(layout), _Draw(tokens, seq_lens, p, gens, decode, pad_id,
                                                                layout.num_rows), turns))
        with torch.no_grad(), precision(dtype, self.device):
            results = self.executor.run(works, params[0].processing, load)
        rollouts = None
        if self.comms.is_last_stage:
            rollouts = []
            for res, work, p in zip(results, works, params):
                check(work, work.plan.num_steps - 1)  # the tokens drawn after the last check
                rollouts.append(_rollout(res, work, p.processing, dtype, pad_id, self.model.cfg.memory_block))
            if self.comms.num_stages > 1:
                rollouts = [ro.to("cpu") for ro in rollouts]
        rollouts = self.comms.share_results(rollouts)
        return [ro.to(self.device) for ro in rollouts]

    def _check_call(self, batches, params: Sequence[SamplingParams], seeds, pad_id: int, decode, episodes, switch,
                    load) -> None:
        """Every request of a generate call checked before any work (one line each)."""
        if not (len(batches) == len(params) == len(seeds)) or len(batches) == 0:
            raise ValueError(f"{len(batches)} batches, {len(params)} sampling params, {len(seeds)} seed lists: "
                             "give at least one batch and one of each per batch")
        for i, (prompts, p, batch_seeds) in enumerate(zip(batches, params, seeds)):
            _check_request(prompts, p, batch_seeds, decode)
            _check_vocabulary(prompts, pad_id, self.model.cfg.vocab_size, i)
        if episodes is not None:
            if self.check_every != 1:
                raise ValueError(f"environment turns need check_every=1 (got {self.check_every}): an observation "
                                 "goes in right after its trigger (set sampling.check_every: 1)")
            if decode is None or [len(e) for e in episodes] != [len(b) for b in batches]:
                raise ValueError("episodes need a decode function and one episode per prompt of each batch")
        if len({p.processing for p in params}) != 1:
            raise ValueError("batches sampled together must share one logits processing")
        if switch and load is None:
            raise ValueError(f"a weight switch {tuple(switch)} needs load (the parameters of each policy version)")

    def replay_topk(self, rollouts: Sequence[Rollout], k: int
                    ) -> list[Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """``replay`` (current parameters throughout) that also returns, at every sampled token's
        position, the k most probable tokens of the processed distribution: (values (B, N), ids
        (B, N, k), log-probs (B, N, k) fp32, descending) on the last stage, 0 where masked; None
        on the others. values are torch.equal to ``replay``'s."""
        if k < 1:
            raise ValueError(f"replay_topk needs k >= 1, got {k}")
        return self._replay(rollouts, None, k)

    def replay(self, rollouts: Sequence[Rollout], load: Optional[Callable[[int], None]] = None
               ) -> list[Optional[torch.Tensor]]:
        """Re-executes each rollout's schedule with the model's current parameters, tokens
        forced, no grad, same plan (batches, events, capacity), processing and dtype -> log-probs
        (B, N) in the layout of ``rollout.mu`` (0 where masked) on the last stage, None on the
        others. With unchanged parameters they are torch.equal to ``rollout.mu``. load: the
        parameters of each policy version (``generate``'s): the recorded start version first and
        a weight switch's at it, so a partial rollout's replay is torch.equal to its mu; None: the
        current parameters throughout (a switch then changes nothing)."""
        return self._replay(rollouts, load, 0)

    def _replay(self, rollouts: Sequence[Rollout], load: Optional[Callable[[int], None]], k: int) -> list:
        if len(rollouts) == 0:
            return []
        schedules = [ro.schedule for ro in rollouts]
        for s in schedules:
            if s.memory_block != self.model.cfg.memory_block:
                raise ValueError(f"the rollout was sampled with memory_block C={s.memory_block} but the model "
                                 f"has C={self.model.cfg.memory_block}")
            if s.decoder != self.executor.decoder_name:
                raise ValueError(f"the rollout ran the {s.decoder} decoder step but this sampler runs the "
                                 f"{self.executor.decoder_name} one: replay with the step it was sampled with")
        if len({(s.processing, s.dtype) for s in schedules}) != 1:
            raise ValueError("rollouts replayed together must share one processing and dtype")
        works = []
        for ro in rollouts:
            s, record = ro.schedule, ro.schedule.rows
            tokens = _seq_tokens(record.layout, ro.tokens.to(self.device), s.capacity, s.pad_id)
            force = _ForceTopK(tokens, record.layout.num_rows, k) if k else _Force(tokens, record.layout.num_rows)
            works.append(RowWork(tokens, RowPlan(record.layout, recorded=record), force))
        with torch.no_grad(), precision(schedules[0].dtype, self.device):
            results = self.executor.run(works, schedules[0].processing, load)
        values = [_replay_values(ro, work, res) for ro, work, res in zip(rollouts, works, results)]
        if not k:
            return values
        return [None if v is None else (v, *_topk_values(ro, work.chooser))
                for ro, work, v in zip(rollouts, works, values)]


def _check_model_fits(model: RLT, capacity: int) -> None:
    if capacity > model.cfg.max_seq_len:
        raise ValueError(f"longest prompt + max_new_tokens = {capacity} positions exceeds "
                         f"model.max_seq_len={model.cfg.max_seq_len}: shorten the prompts, lower "
                         "max_new_tokens or raise model.max_seq_len")


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


def _check_vocabulary(prompts: Sequence[Sequence[int]], pad_id: int, vocab_size: int, batch: int) -> None:
    """Every prompt token id (and the pad id) is a row of the embedding: else one line naming the
    row and the id, before any work (not an IndexError from inside a decoder step)."""
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad id {pad_id} is outside the model's vocabulary [0, {vocab_size}) "
                         f"(model.vocab_size={vocab_size}): the tokenizer and the model disagree")
    for b, prompt in enumerate(prompts):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None) if prompt else None
        if bad is not None:
            raise ValueError(f"prompt row {b} of batch {batch} holds token id {bad} (position "
                             f"{list(prompt).index(bad)}), outside the model's vocabulary [0, {vocab_size}) "
                             f"(model.vocab_size={vocab_size}): the tokenizer and the model disagree "
                             "(check data.tokenizer and model.vocab_size)")


def _rollout(res: RowResult, work: RowWork, processing: Processing, dtype: str, pad_id: int,
             memory_block: int) -> Rollout:
    """The Rollout record of a call (tokens (R, T), T = the longest prompt + completion; mu (R, N)
    from the per-sequence log-probs)."""
    plan, layout, chooser = work.plan, work.plan.layout, work.chooser
    R = layout.num_rows
    completion_lens = chooser.num_new[:R].tolist()
    finish_reasons = [Finish(r).label for r in chooser.reason[:R].tolist()]
    T = max(P + n for P, n in zip(layout.prompt_lens, completion_lens))
    record = plan.record()
    mask = _sampled_mask(layout.prompt_lens, completion_lens, record, res.lp.device)
    mu = _completion_values(res.lp[:R], layout.prompt_lens, completion_lens, mask)
    if res.version is None:
        version = torch.where(mask, layout.version, 0)
    else:
        step, _ = completion_positions(layout.prompt_lens, completion_lens, mask.device)
        version = torch.where(mask, res.version[:R].gather(1, step + 1), 0)
    schedule = Schedule(prompt_lens=list(layout.prompt_lens), memory_block=memory_block,
                        capacity=work.tokens.shape[1], num_steps=T - 1,
                        encoder_calls=[(c[1], c[2]) for c in res.encoder_calls], processing=processing,
                        dtype=dtype, pad_id=pad_id, rows=record, decoder=res.decoder)
    return Rollout(tokens=work.tokens[:R, :T].clone(), mu=mu, mask=mask, completion_lens=completion_lens,
                   finish_reasons=finish_reasons, schedule=schedule,
                   episodes=None if work.turns is None else work.turns.stats, version=version)


def _replay_values(ro: Rollout, work: RowWork, res: RowResult) -> Optional[torch.Tensor]:
    """Checks the replay repeated the rollout's events -> log-probs (R, N), or None (not the last
    stage)."""
    s, record = ro.schedule, ro.schedule.rows
    if work.plan.log != record.log or work.plan.num_steps != record.num_steps:
        raise RuntimeError("the replay's row events differ from the rollout's record (forks, leaves, entries, "
                           "encoder calls): the schedule (prompt lengths, C, slots, check_every) differs")
    if [(c[1], c[2]) for c in res.encoder_calls] != [tuple(c) for c in s.encoder_calls]:
        raise RuntimeError(f"replay made encoder calls {res.encoder_calls} but the rollout recorded "
                           f"{list(s.encoder_calls)}")
    if res.lp is None:
        return None
    return _completion_values(res.lp[:record.layout.num_rows], s.prompt_lens, ro.completion_lens,
                              ro.mask.to(res.lp.device).bool())


def _topk_values(ro: Rollout, force: _ForceTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k a replay kept, in the layout of ``rollout.mu`` (B, N, k); 0 where masked."""
    R = ro.schedule.rows.layout.num_rows
    mask = ro.mask.to(force.lp.device).bool()
    step, _ = completion_positions(ro.schedule.prompt_lens, ro.completion_lens, mask.device)  # (B, N)
    at = (step + 1)[..., None].expand(-1, -1, force.k)
    ids = torch.where(mask[..., None], force.ids[:R].gather(1, at), 0)
    lp = torch.where(mask[..., None], force.lp[:R].gather(1, at), torch.zeros((), device=mask.device))
    return ids, lp


def generate(model: RLT, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int],
             pad_id: int, dtype: str = "fp32", decode: Optional[Callable[[list[int]], str]] = None,
             device: torch.device | str | None = None, check_every: int = DEFAULT_CHECK_EVERY,
             rows: RowSwitches = RowSwitches(), decoder=None, episodes: Optional[Sequence[Episode]] = None) -> Rollout:
    """One batch on one process (``Sampler`` for several, or under parallelism)."""
    if device is not None and torch.device(device) != next(model.parameters()).device:
        raise ValueError(f"generate on {device}: the model is on {next(model.parameters()).device}")
    sampler = Sampler(model, check_every=check_every, rows=rows, decoder=decoder)
    return sampler.generate([prompts], params, [seeds], pad_id, dtype, decode,
                            None if episodes is None else [episodes])[0]


def replay(model: RLT, rollout: Rollout, decoder=None) -> torch.Tensor:
    """One rollout on one process (``Sampler.replay`` for several, or under parallelism)."""
    return Sampler(model, check_every=rollout.schedule.rows.layout.check_every, decoder=decoder).replay([rollout])[0]
