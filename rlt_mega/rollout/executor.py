"""The rollout schedule as a program that every pipeline stage of a model replica runs
(docs/design.md: "One transition, three schedules", "Exact
log-probabilities", "Parallel layout"). Sampling and replay both run it: they differ only in how the
token after each decoder step is chosen (drawn, or read from the recorded rollout), so with
unchanged parameters their log-probs are equal bit for bit, on one process and under
tensor/pipeline parallelism alike.

Per micro-batch (a batch of B prompts, right-padded, all rows advancing in lockstep over
positions t; see sampler.py for the schedule itself):

- warm-up: the encoder prefill over [0, S0), S0 = C * floor(P_min / C);
- item (t, j): when a memory block [t+1-C, t+1) completes at or after S0, one encoder call over
  its C tokens; then decoder step t; on the last stage the head, the processing and the choice
  of x_{t+1}.

The ring (P stages, several micro-batches in flight): items run in t-major order, (t, 0),
(t, 1), ..., on every stage. Micro-batch j's item (t, j) on stage 0 needs z_{t-1} and x_t from
the last stage, produced by item (t-1, j); so with M >= P micro-batches in flight, stage s works
on a different micro-batch than stage s+1 and the stages overlap, as in the training ring. With
P = 1 the same program runs everything in order, the ring closing on itself.

Messages (every pair of stages posts them in the same order on both sides, since both walk the
same items in the same order; pipeline.P2P: blocking receives, non-blocking sends):

    r_enc   s -> s+1     encoder activations of a block (B, n, d)
    r_mem   last -> s    the block's memory m = memory_norm(h) (B, n, d), to every earlier stage
    r_dec   s -> s+1     decoder activation at position t (B, 1, d)
    r_ctl   last -> s    x_{t+1} (B,) and whether the micro-batch goes on (one more entry), to
                         every earlier stage (stage 0 embeds x_{t+1}; the others learn that it stops)
    r_ring  last -> 0    z_t (B, 1, d), when the micro-batch goes on

The decoder layers and the memory writes run the fused no-grad step of model/fast_decode.py
(weights snapshotted at the start of every run) when the stage's projections are plain
nn.Linear, else the model's own modules (tensor parallelism); either way rollout and replay
run the same one.

Stopping is data-dependent, so it travels with x_{t+1}: a stage learns at the start of item
(t+1, j) whether it exists. Replicas never communicate here: each runs its own lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from rlt_mega.model.cache import KVCache, MemoryKV
from rlt_mega.model.fast_decode import DecodeWeights, StepKV
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.processing import Processing, process_logits


class Chooser(Protocol):
    """How a micro-batch's next tokens are chosen, on the last stage."""

    def propose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs (B, V) processed, of step t -> the tokens x_{t+1} (B,)."""

    def accept(self, t: int, tokens: torch.Tensor) -> bool:
        """x_{t+1} (B,) as every TP rank continues with it -> whether the micro-batch goes on."""


@dataclass
class Plan:
    """One micro-batch. tokens (B, capacity) long: the prompts, left-aligned, then pad; rows
    that are still in their prompt at step t are forced to tokens[:, t + 1] by the chooser."""

    tokens: torch.Tensor
    prompt_lens: Sequence[int]
    max_steps: int  # at most this many decoder steps
    chooser: Optional[Chooser]  # needed on the last stage only


@dataclass
class Result:
    """What a micro-batch's run produced. step_logprobs (B, num_steps) fp32 on the last stage
    (None elsewhere): the log-prob of tokens[:, t + 1] under step t's processed distribution."""

    tokens: torch.Tensor
    num_steps: int
    encoder_calls: list
    step_logprobs: Optional[torch.Tensor]
    fast_decode: bool  # whether the decoder ran model/fast_decode.py's fused step


@dataclass
class _Run:
    plan: Plan
    prefill_end: int
    enc: KVCache
    dec: KVCache | StepKV  # StepKV on the fast path (model/fast_decode.py)
    mem: MemoryKV | StepKV
    active: bool = True
    num_steps: int = 0
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class Executor:
    """Runs the program of one stage: ``model`` holds the stage's layers (all of them on one
    process; the pruned, possibly tensor-parallel stage otherwise)."""

    def __init__(self, model: RLT, comms: Comms, layers: Optional[range] = None) -> None:
        self.model, self.comms = model, comms
        self.layers = layers  # None: every layer
        self.C = model.cfg.memory_block
        self.d = model.cfg.d_model
        self.fast: Optional[DecodeWeights] = None  # this run's weight snapshot (fast_decode.py)

    @property
    def act_dtype(self) -> torch.dtype:
        # The residual stream's dtype: the parameters' (fp32 parameters stay fp32 under
        # autocast, since every block adds its output to an fp32 stream).
        return self.model.null_memory.dtype

    # ------------------------------------------------------------------ the program
    def run(self, plans: Sequence[Plan], processing: Processing, fast_decode: bool = True) -> list[Result]:
        """Runs the micro-batches together (all in flight). Call under no_grad and the
        rollout's precision context. fast_decode: use the fused decoder step where the
        stage's projections allow it (Result.fast_decode says whether it did)."""
        model, L = self.model, self.model.cfg.n_layers
        # A fresh snapshot per run, like the caches: parameters may have changed since the last.
        self.fast = DecodeWeights.build(model, self.layers) if fast_decode else None
        runs = []
        for plan in plans:
            B, capacity = plan.tokens.shape
            # Fresh preallocated caches on every call: nothing computed under other parameters
            # is ever reused.
            if self.fast is None:
                dec, mem = KVCache(L, capacity), model.init_memory(B, capacity, self.layers)
            else:
                dec, mem = self.fast.new_cache(capacity), self.fast.new_memory(model.null_memory, B, capacity)
            runs.append(_Run(plan, prefill_end=self.C * (min(plan.prompt_lens) // self.C), enc=KVCache(L, capacity),
                             dec=dec, mem=mem))
        # warm-up: every micro-batch's prefill
        for run in runs:
            if run.prefill_end > 0:
                self._encoder_call(run, 0, run.prefill_end)
        # the ring, item (t, j) in t-major order
        t = 0
        while any(run.active for run in runs):
            for run in runs:
                if run.active:
                    self._item(run, t, processing)
            t += 1
        self.comms.p2p.drain()
        used_fast, self.fast = self.fast is not None, None  # the snapshot's memory goes with the run
        return [Result(run.plan.tokens, run.num_steps, run.calls,
                       torch.cat(run.logprobs, dim=1) if run.logprobs else None, used_fast) for run in runs]

    def _item(self, run: _Run, t: int, processing: Processing) -> None:
        comms, P = self.comms, self.comms.num_stages
        B = run.plan.tokens.shape[0]
        z_prev = None
        if t > 0:
            if not comms.is_last_stage:  # x_t and whether item (t, j) exists, from step t-1
                ctl = comms.p2p.recv((B + 1,), torch.long, P - 1, "r_ctl")
                run.plan.tokens[:, t] = ctl[:B]
                if not bool(ctl[B]):
                    run.active = False
                    return
            if comms.is_first_stage:  # received here (not at the decoder step) to keep the pair's order
                z_prev = comms.p2p.recv((B, 1, self.d), self.act_dtype, P - 1, "r_ring").squeeze(1)
        start = t + 1 - self.C
        if (t + 1) % self.C == 0 and start >= run.prefill_end:
            # Block [t+1-C, t+1) completes: encoded before decoder step t, the first to see it.
            self._encoder_call(run, start, t + 1)
        self._decoder_step(run, t, z_prev, processing)

    def _encoder_call(self, run: _Run, start: int, end: int) -> None:
        model, comms, P = self.model, self.comms, self.comms.num_stages
        shape = (run.plan.tokens.shape[0], end - start, self.d)
        if comms.is_first_stage:
            h = model.embed(run.plan.tokens[:, start:end])  # (B, n, d)
        else:
            h = comms.p2p.recv(shape, self.act_dtype, comms.stage - 1, "r_enc")
        h = model.encode(h, start=start, cache=run.enc, layers=self.layers)
        if comms.is_last_stage:
            m = model.memory_norm(h)
            for s in range(P - 1):
                self._send(m, s, "r_mem")
        else:
            self._send(h, comms.stage + 1, "r_enc")
            m = comms.p2p.recv(shape, self.act_dtype, P - 1, "r_mem")
        if self.fast is None:
            model.append_memory(run.mem, m, start, self.layers)
        else:
            self.fast.append_memory(run.mem, m, start)
        run.calls.append((start, end))

    def _decoder_step(self, run: _Run, t: int, z_prev: Optional[torch.Tensor], processing: Processing) -> None:
        model, comms, P = self.model, self.comms, self.comms.num_stages
        tokens = run.plan.tokens
        B = tokens.shape[0]
        if comms.is_first_stage:
            z = model.initial_state(B) if t == 0 else z_prev  # (B, d)
            u = model.decoder_input(model.embed(tokens[:, t]), z)  # (B, 1, d)
        else:
            u = comms.p2p.recv((B, 1, self.d), self.act_dtype, comms.stage - 1, "r_dec")
        if self.fast is not None:
            y = self.fast.decoder_layers(u, t, run.dec, run.mem)  # (B, 1, d)
        else:
            y = model.decoder_layers(u, t, run.dec, run.mem, self.layers)  # (B, 1, d)
        run.num_steps = t + 1
        if not comms.is_last_stage:
            self._send(y, comms.stage + 1, "r_dec")
            return
        logprobs = process_logits(comms.gather_vocab(model.head(y.squeeze(1))), processing)  # (B, V) fp32
        nxt = comms.share_tokens(run.plan.chooser.propose(t, logprobs))
        tokens[:, t + 1] = nxt
        go_on = run.plan.chooser.accept(t, nxt) and t + 1 < run.plan.max_steps
        run.logprobs.append(logprobs.gather(1, tokens[:, t + 1:t + 2]))  # (B, 1)
        ctl = torch.cat([nxt, torch.tensor([int(go_on)], dtype=torch.long, device=nxt.device)])
        for s in range(P - 1):
            self._send(ctl, s, "r_ctl")
        if go_on:
            self._send(y, 0, "r_ring")
        run.active = go_on

    def _send(self, x: torch.Tensor, stage: int, stream: str) -> None:
        if x.is_floating_point() and x.dtype != self.act_dtype:
            # The receiver allocates act_dtype; anything else would arrive as garbage.
            raise RuntimeError(f"sampler stream {stream}: {x.dtype} activations, expected {self.act_dtype}")
        self.comms.p2p.send(x, stage, stream)
