"""The rollout schedule as a program that every pipeline stage of a model replica runs
(docs/design.md: "One transition, three schedules", "Exact
log-probabilities", "Parallel layout"). Sampling and replay both run it: they differ only in how the
token after each decoder step is chosen (drawn, or read from the recorded rollout), so with
unchanged parameters their log-probs are equal bit for bit, on one process and under
tensor/pipeline parallelism alike.

Per micro-batch (a batch of B prompts, right-padded, all rows advancing in lockstep over
positions t; see sampler.py for the schedule itself): the encoder prefill over [0, S0),
S0 = C * floor(P_min / C); then items (t, j): when a memory block [t+1-C, t+1) completes at or
after S0, one encoder call over its C tokens; then decoder step t; on the last stage the head,
the processing and the choice of x_{t+1}.

Which steps a stage runs, in which order, and which messages they receive and send is the pure
description of ``ring.py`` (the NCCL-rule simulation checks the same description): items run in
t-major order on every stage, so with M >= P micro-batches in flight the stages overlap, as in
the training ring; with P = 1 the same program runs everything in order, the ring closing on
itself. Messages travel through ``parallel/p2p.py`` (one channel per direction).

The per-step loop does not synchronise with the host: the next tokens, the finish flags and the
random numbers (drawn once per row and rollout) stay on the device, and a stage reads the flags
only at a check, every ``check_every`` steps (``ring.py``), where the last stage also looks for
stop strings in the newest text. Replicas never communicate here: each runs its own lengths.

The decoder layers and the memory writes run the fused no-grad step of model/fast_decode.py
(weights snapshotted at the start of every run) when the stage's projections are plain
nn.Linear, else the model's own modules (tensor parallelism); either way rollout and replay
run the same one.
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
from rlt_mega.rollout.ring import CTL_ROWS, MicroBatchMeta, RingStep, is_check, ring_steps

DEFAULT_CHECK_EVERY = 8


class Chooser(Protocol):
    """How a micro-batch's next tokens are chosen, on the last stage. ``choose`` and ``record``
    run every step and must not synchronise with the host; ``check`` runs every check_every
    steps and may."""

    def choose(self, t: int, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs (B, V) processed, of step t -> the tokens x_{t+1} (B,)."""

    def record(self, t: int, tokens: torch.Tensor) -> None:
        """x_{t+1} (B,) as every TP rank continues with it: updates the finish flags."""

    def finished(self) -> torch.Tensor:
        """(B,) bool on the device: the rows that are done."""

    def check(self, t: int) -> None:
        """At a check after step t (host work allowed): e.g. stop strings in the newest text."""


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
    z_prev: Optional[torch.Tensor] = None  # stage 0: z_{t-1} (B, d) for the next decoder step
    num_steps: int = 0
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class Executor:
    """Runs the program of one stage: ``model`` holds the stage's layers (all of them on one
    process; the pruned, possibly tensor-parallel stage otherwise). check_every: steps between
    the reads of the finish flags (a micro-batch runs a multiple of it, or max_steps, steps)."""

    def __init__(self, model: RLT, comms: Comms, layers: Optional[range] = None,
                 check_every: int = DEFAULT_CHECK_EVERY) -> None:
        if check_every < 1:
            raise ValueError(f"check_every={check_every}: must be >= 1")
        self.model, self.comms = model, comms
        self.layers = layers  # None: every layer
        self.C = model.cfg.memory_block
        self.d = model.cfg.d_model
        self.check_every = check_every
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
        model, L, comms = self.model, self.model.cfg.n_layers, self.comms
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
        metas = [MicroBatchMeta(run.prefill_end, run.plan.max_steps) for run in runs]
        decided: list[Optional[int]] = [None] * len(runs)  # steps of a micro-batch a check stopped
        for step in ring_steps(comms.stage, comms.num_stages, self.C, self.check_every, metas, decided.__getitem__):
            run = runs[step.j]
            ins = [comms.p2p.recv(*self._message(m.stream, step, run), m.src, m.stream) for m in step.recvs]
            if step.kind in ("prefill", "enc"):
                self._encoder_call(run, step, ins)
            elif step.kind in ("prefill_mem", "mem"):
                self._append_memory(run, ins[0], step.block[0])
            elif step.kind == "in":
                if self._take_control(run, step, ins):
                    decided[step.j] = step.t
            elif step.kind == "dec":
                if self._decoder_step(run, step, ins, processing):
                    decided[step.j] = step.t + 1
            else:  # pragma: no cover
                raise AssertionError(f"unknown sampler ring step {step}")
        comms.p2p.drain()
        used_fast, self.fast = self.fast is not None, None  # the snapshot's memory goes with the run
        return [Result(run.plan.tokens, run.num_steps, run.calls,
                       torch.cat(run.logprobs, dim=1) if run.logprobs else None, used_fast) for run in runs]

    def _message(self, stream: str, step: RingStep, run: _Run) -> tuple[tuple, torch.dtype]:
        """Shape and dtype of a message the step receives."""
        B = run.plan.tokens.shape[0]
        if stream in ("r_enc", "r_mem"):
            start, end = step.block
            return (B, end - start, self.d), self.act_dtype
        if stream == "r_ctl":
            return (CTL_ROWS, B), torch.long
        return (B, 1, self.d), self.act_dtype  # r_dec, r_ring

    def _send(self, x: torch.Tensor, stage: int, stream: str) -> None:
        if x.is_floating_point() and x.dtype != self.act_dtype:
            # The receiver allocates act_dtype; anything else would arrive as garbage.
            raise RuntimeError(f"sampler stream {stream}: {x.dtype} activations, expected {self.act_dtype}")
        self.comms.p2p.send(x, stage, stream)

    # ------------------------------------------------------------------ the steps
    def _encoder_call(self, run: _Run, step: RingStep, ins: list) -> None:
        """One encoder call over the block (B, n, d) at [start, end); the last stage's memory
        goes to every earlier stage (the ``mem`` steps there take it)."""
        model, comms = self.model, self.comms
        start, end = step.block
        h = model.embed(run.plan.tokens[:, start:end]) if comms.is_first_stage else ins[0]  # (B, n, d)
        h = model.encode(h, start=start, cache=run.enc, layers=self.layers)
        if comms.is_last_stage:
            m = model.memory_norm(h)
            self._append_memory(run, m, start)
            h = m
        for msg in step.sends:
            self._send(h, msg.dst, msg.stream)
        run.calls.append((start, end))

    def _append_memory(self, run: _Run, m: torch.Tensor, start: int) -> None:
        if self.fast is None:
            self.model.append_memory(run.mem, m, start, self.layers)
        else:
            self.fast.append_memory(run.mem, m, start)

    def _take_control(self, run: _Run, step: RingStep, ins: list) -> bool:
        """x_t, the finish flags of step t-1 and (stage 0) z_{t-1} from the last stage ->
        whether the micro-batch stops here (read only at a check: the one host sync)."""
        ctl = ins[0]  # (CTL_ROWS, B)
        if self.comms.is_first_stage:
            run.plan.tokens[:, step.t] = ctl[0]
            run.z_prev = ins[1].squeeze(1)
        return is_check(step.t, self.check_every) and bool(ctl[1].bool().all())

    def _decoder_step(self, run: _Run, step: RingStep, ins: list, processing: Processing) -> bool:
        """Decoder step t; on the last stage the choice of x_{t+1} -> whether the micro-batch
        stops after this step (decided only at a check)."""
        model, comms = self.model, self.comms
        t, tokens = step.t, run.plan.tokens
        B = tokens.shape[0]
        if comms.is_first_stage:
            z = model.initial_state(B) if t == 0 else run.z_prev  # (B, d)
            u = model.decoder_input(model.embed(tokens[:, t]), z)  # (B, 1, d)
        else:
            u = ins[0]
        if self.fast is not None:
            y = self.fast.decoder_layers(u, t, run.dec, run.mem)  # (B, 1, d)
        else:
            y = model.decoder_layers(u, t, run.dec, run.mem, self.layers)  # (B, 1, d)
        run.num_steps = t + 1
        if not comms.is_last_stage:
            for msg in step.sends:
                self._send(y, msg.dst, msg.stream)
            return False
        chooser = run.plan.chooser
        logprobs = process_logits(comms.gather_vocab(model.head(y.squeeze(1))), processing)  # (B, V) fp32
        nxt = comms.share_tokens(chooser.choose(t, logprobs))
        chooser.record(t, nxt)
        tokens[:, t + 1] = nxt
        run.logprobs.append(logprobs.gather(1, nxt.unsqueeze(1)))  # (B, 1)
        if t + 1 >= run.plan.max_steps:
            return False
        stop = False
        if is_check(t + 1, self.check_every):
            chooser.check(t)  # may end rows (stop strings): before the flags leave
            stop = bool(chooser.finished().all())  # the check's host read
        ctl = torch.stack([tokens[:, t + 1], chooser.finished().long()])  # (CTL_ROWS, B)
        for msg in step.sends:
            self._send(ctl if msg.stream == "r_ctl" else y, msg.dst, msg.stream)
        if comms.is_first_stage:  # one stage: the ring closes on itself
            run.z_prev = y.squeeze(1)
        return stop
