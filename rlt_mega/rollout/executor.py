"""The rollout and replay schedule (schedule/rows.py: shared prompts, compaction, continuous
batching; all off is the lockstep schedule) as the program every stage of a model replica runs,
through the sampler ring's description (``ring.row_ring_steps``). Rollout and replay both run it;
with unchanged parameters and the recorded events their log-probs are equal bit for bit (same
batch compositions, same shapes, same kernels), on one process and under tensor/pipeline
parallelism alike.

The decoder is the model's one decoder step (``model.decoder``, model/dense_decode.py): each call
prepares its products from the parameters as they are now, and each micro-batch gets a runner
(model/decoder.py ``StepRunner``) holding its decoder K/V and memory K/V for the call's slots.
Under tensor parallelism the step runs on the rank's shards with the tensor-parallel reduce the
model's decoder was built with. (The executable reference, rlt_mega/reference.py, has the same
interface: the benchmarks' reference arm.)

State per micro-batch, every tensor indexed by the batch row of the current step (the plan's slot
order), allocated once for the call's slots: the encoder K/V (``KVCache``), the runner's K/V state
and, on stage 0, z_{k-1}. An event (fork, leave, entry) moves rows inside those buffers once
(``move_rows``) from the old batch, the parked states (an entry's forked state kept while its rows
wait) and fresh rows (z_init); steps without events touch nothing but the step's own writes.
Positions live on the device ((B,) long, built once per event and advanced in place), masks are
built from them per step, so a step does no host read; the host reads the finish flags only at a
check.

Tokens and log-probs live per *sequence* (rows, then entries): tokens (S, capacity), and on the
last stage lp (S, capacity), the log-prob of the token at each position under the step that drew
(or forced) it, and with a weight switch (partial rollouts) ``version`` (S, capacity), the policy
version of that step.

A weight switch (the plan's ``Switch`` before step k*, schedule/rows.py) calls ``load(v)``, which
makes the stage's parameters version v in place, then prepares the decoder's products anew
(``decoder.reload``); the K/V states, the encoder caches and z computed so far stay. Micro-batches
run k-major on every stage (``row_ring_steps``), so every step before k* of every micro-batch ran
under the old version. A replay without ``load`` runs the whole call under the current parameters
(the learner's replay): products prepared again from the same parameters are the same, so the
switch changes nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from rlt_mega.model.cache import KVCache
from rlt_mega.model.dense_decode import compute_dtype_of
from rlt_mega.model.layout import to_device
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.processing import Processing, process_logits
from rlt_mega.rollout.ring import CTL_ROWS, RingStep, is_check, row_ring_steps
from rlt_mega.rollout.turns import Turns
from rlt_mega.schedule.rows import FromBatch, FromParked, RowPlan, StepPlan


class RowChooser(Protocol):
    def choose_rows(self, targets: torch.Tensor, positions: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs (B', V) of the targets' steps -> their next tokens (B',); no host read."""

    def record_rows(self, targets: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens every TP rank continues with: updates the finish flags on the device."""

    def flag_codes(self) -> torch.Tensor:
        """(R,) long: the finish flags a check reads (``RowPlan.set_flags``): 1 done, else 0."""

    def check(self, t: int) -> None:
        """At a check (host work allowed): stop strings."""


@dataclass
class RowWork:
    """One micro-batch: tokens (S, capacity) per sequence (rows then entries), its plan, on the
    last stage its chooser and, with an environment, its turns (rollout/turns.py ``Turns``)."""

    tokens: torch.Tensor
    plan: RowPlan
    chooser: Optional[RowChooser]
    turns: Optional[Turns] = None


def check(work: RowWork, k: int) -> torch.Tensor:
    """The check after step k's draws, between decoder steps (last stage): the chooser's stop
    strings, then the environment's turn (its answers forced as the plan's ``Force`` events, its
    departures flagged ``Flag.AWAY``) -> the flags (R,) the check reads."""
    work.chooser.check(k)
    if work.turns is None:
        return work.chooser.flag_codes()
    work.turns.at_check(k + 1, work.chooser, work.plan)
    return work.turns.codes(work.chooser.flag_codes())


class RowsView:
    """Some rows of a cache with ``batch_size`` rows, as a cache of n rows for one encoder call of
    the rollout: ``rows`` (n,) long, or None for the prefix [:n]. ``write`` goes into those rows
    (the buffer allocated for the whole batch at the first write), ``view`` reads them (a view of
    the prefix, a gathered copy of other rows)."""

    def __init__(self, cache: KVCache, rows: Optional[torch.Tensor], batch_size: int, n: int) -> None:
        self.cache, self.rows, self.batch_size, self.n = cache, rows, batch_size, n
        self.capacity = cache.capacity

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, start, k, v, self.rows, self.batch_size)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.view(layer, end)
        if self.rows is None:
            return k[:self.n], v[:self.n]
        return k.index_select(0, self.rows), v.index_select(0, self.rows)


@dataclass
class RowResult:
    lp: Optional[torch.Tensor]  # (S, capacity) fp32 on the last stage
    encoder_calls: list
    decoder: str  # which decoder step ran ("fused": the model's; "reference": rlt_mega/reference.py)
    version: Optional[torch.Tensor] = None  # (S, capacity) the policy version of each position's step (a switch)


@dataclass
class _Run:
    work: RowWork
    enc: KVCache
    runner: object  # model/decoder.py StepRunner (or the reference's)
    lp: Optional[torch.Tensor]
    version: Optional[torch.Tensor] = None  # (S, capacity) long on the last stage, with a weight switch
    z: Optional[torch.Tensor] = None  # stage 0: z of the last step's batch (B, d)
    parked: dict = field(default_factory=dict)  # entry -> one-row copies of every buffer (and z)
    sp: Optional[StepPlan] = None  # the step the state is at
    num_rows: int = 0  # batch rows of sp
    pos: Optional[torch.Tensor] = None  # (B,)
    seqs: Optional[torch.Tensor] = None  # (B,)
    targets: Optional[torch.Tensor] = None  # (B',)
    target_pos: Optional[torch.Tensor] = None  # (B',)
    expand: Optional[torch.Tensor] = None
    high: int = -1  # the furthest position a step of the run reached so far
    calls: list = field(default_factory=list)
    call_rows: list = field(default_factory=list)  # the step's encoder calls' rows ((n,) long, None: all)
    call_seqs: list = field(default_factory=list)  # their sequences ((n,) long)


def _buffers(run: _Run):
    """(key, tensor, dimension of the positions, first position a fresh row must clear) of every
    buffer a row's state lives in: the encoder K/V and the decoder's K/V state (memory slot 0, the
    null memory, is every row's)."""
    for layer, (k, v) in enumerate(zip(run.enc.k, run.enc.v)):
        if k is not None:
            yield ("enc_k", layer), k, 2, 0
            yield ("enc_v", layer), v, 2, 0
    for name, layer, x, dim in run.runner.state.tensors():
        yield (name, layer), x, dim, 1 if name in ("mkt", "mv") else 0


def move_rows(base: torch.Tensor, stay: list[int], enter: list, dim: int, used: int, fresh_from: int) -> None:
    """Rebuilds the batch inside ``base`` (the call's slots rows): row j of the new batch is old
    row stay[j] (a row that stays, -1: an entering row) or, for (j, src) in ``enter``, old row src
    (an int: a fork's row), the one-row buffer src (a parked state) or a fresh row (None: positions
    [fresh_from, used) cleared).

    Only positions [0, used) were ever written (every step so far ran at positions < used - 1), so
    rows are copied over that prefix only. The rows that stay keep their order (their slots), so
    moving the ones that go down in ascending order and the ones that go up in descending order
    never overwrites a row before it is read; a fork's row is copied out first."""
    p = min(used, base.shape[dim])

    def row(j: int) -> torch.Tensor:
        return base[j].narrow(dim - 1, 0, p)

    forked = {i: row(i).clone() for _, i in enter if isinstance(i, int)}
    moves = [(j, i) for j, i in enumerate(stay) if i >= 0 and i != j]
    for j, i in [m for m in moves if m[1] > m[0]] + [m for m in reversed(moves) if m[1] < m[0]]:
        row(j).copy_(row(i))
    for j, src in enter:
        if isinstance(src, int):
            row(j).copy_(forked[src])
        elif src is not None:
            row(j).copy_(src[0].narrow(dim - 1, 0, p))
        elif p > fresh_from:
            row(j).narrow(dim - 1, fresh_from, p - fresh_from).zero_()


class RowExecutor:
    """Runs the schedule of one stage (``model``: the stage's layers, possibly TP). decoder: the
    decoder step to run (default: the model's own; the benchmarks pass the reference)."""

    def __init__(self, model: RLT, comms: Comms, layers: Optional[range] = None, check_every: int = 8,
                 decoder=None) -> None:
        self.model, self.comms = model, comms
        self.layers = range(model.cfg.n_layers) if layers is None else layers
        self.C, self.d, self.check_every = model.cfg.memory_block, model.cfg.d_model, check_every
        self.decoder = model.decoder if decoder is None else decoder

    @property
    def act_dtype(self) -> torch.dtype:
        # The residual stream's dtype: the parameters' (fp32 parameters stay fp32 under
        # autocast, since every block adds its output to an fp32 stream).
        return self.model.null_memory.dtype

    @property
    def decoder_name(self) -> str:
        return getattr(self.decoder, "name", "fused")

    def run(self, works: Sequence[RowWork], processing: Processing,
            load: Optional[Callable[[int], None]] = None) -> list[RowResult]:
        """Runs the micro-batches together (all in flight). Call under no_grad and the rollout's
        precision context. load: makes the stage's parameters a policy version, in place (the
        call's start version before anything runs, a switch's at it); None: the current ones."""
        model, L, comms = self.model, self.model.cfg.n_layers, self.comms
        every = {w.plan.layout.check_every for w in works}
        if len(every) != 1:
            raise ValueError(f"row-schedule batches run together must share one check_every, got {sorted(every)}")
        versions = {(w.plan.layout.version, w.plan.layout.switch) for w in works}
        if len(versions) != 1:
            raise ValueError(f"row-schedule batches run together must share one start version and weight switch, "
                             f"got {sorted(versions)}")
        self.check_every = every.pop()  # the record's (a replay repeats its rollout's checks)
        version, switch = versions.pop()
        self._load, self._version = load, version
        if load is not None:
            load(version)
        device = works[0].tokens.device
        self._version_t = torch.tensor(version, device=device)
        shapes = [(w.plan.layout.slots, w.tokens.shape[1]) for w in works]
        runners = self.decoder.runners(model, self.layers, comms.is_first_stage, shapes, self.act_dtype,
                                       compute_dtype_of(self.act_dtype, device))
        runs = []
        for w, runner in zip(works, runners):
            S, capacity = w.tokens.shape
            lp_dtype = torch.promote_types(self.act_dtype, torch.float32)  # the processed log-probs' (fp64 model: fp64)
            lp = torch.zeros(S, capacity, dtype=lp_dtype, device=device) if comms.is_last_stage else None
            ver = torch.full((S, capacity), version, device=device) if switch and comms.is_last_stage else None
            runs.append(_Run(w, KVCache(L, capacity), runner, lp, ver))
        self._runs = runs
        for step in row_ring_steps(comms.stage, comms.num_stages, self.check_every, [r.work.plan for r in runs]):
            run = runs[step.j]
            if step.kind != "in":
                self._enter(run, step.t)
            ins = [comms.p2p.recv(*self._message(m.stream, step, run), m.src, m.stream) for m in step.recvs]
            if step.kind == "in":
                self._take_control(run, step, ins)
            elif step.kind == "enc":
                self._encoder_call(run, step, ins)
            elif step.kind == "mem":
                call = step.block[2]
                run.runner.write_memory(ins[0], run.sp.calls[call].start, run.call_rows[call])
            elif step.kind == "dec":
                self._decoder_step(run, step, ins, processing)
            else:  # pragma: no cover
                raise AssertionError(f"unknown row ring step {step}")
        comms.p2p.drain()
        self._runs = []
        return [RowResult(run.lp, run.calls, self.decoder_name, run.version) for run in runs]

    # ------------------------------------------------------------------ messages
    def _message(self, stream: str, step: RingStep, run: _Run) -> tuple[tuple, torch.dtype]:
        if stream in ("r_enc", "r_mem"):
            call = run.sp.calls[step.block[2]]
            return (len(call.rows), call.end - call.start, self.d), self.act_dtype
        if stream == "r_ctl":  # of the last step (k - 1)
            return (CTL_ROWS, len(run.sp.targets) + run.work.plan.layout.num_rows), torch.long
        return (run.num_rows, 1, self.d), self.act_dtype  # r_ring (of step k - 1), r_dec (of this step)

    def _send(self, x: torch.Tensor, stage: int, stream: str) -> None:
        if x.is_floating_point() and x.dtype != self.act_dtype:
            raise RuntimeError(f"sampler stream {stream}: {x.dtype} activations, expected {self.act_dtype}")
        self.comms.p2p.send(x, stage, stream)

    # ------------------------------------------------------------------ events
    def _enter(self, run: _Run, k: int) -> None:
        """Brings the run's state to step k's batch (once per step): the plan's events applied,
        the step's index tensors built (once per event, never per step)."""
        sp = run.work.plan.prev
        if run.sp is not None and run.sp.k == k:
            return
        assert sp is not None and sp.k == k, (sp, k)
        if sp.switch is not None:
            self._switch(sp.switch)
        device = run.work.tokens.device
        for u, i in sp.park:
            copies = {key: x[i:i + 1].clone() for key, x, _, _ in _buffers(run)}
            run.parked[u] = (copies, None if run.z is None else run.z[i:i + 1].clone())
        if sp.build is None:
            run.pos += 1
        else:
            self._rebuild(run, sp)
            run.pos = to_device(sp.positions, device)
            run.seqs = to_device(sp.seqs, device)
        for u in sp.unpark:
            run.parked.pop(u, None)
        if sp.expand is None:  # one target per row: the batch's own sequences and positions
            run.targets, run.target_pos, run.expand = run.seqs, run.pos, None
        else:  # a fork after this step: its G rows' draws come from its one distribution
            run.targets = to_device(sp.targets, device)
            run.target_pos = to_device(sp.target_positions, device)
            run.expand = to_device(sp.expand, device)
        run.call_rows = [None if len(c.rows) == len(sp.seqs) else to_device(c.rows, device) for c in sp.calls]
        run.call_seqs = [to_device(c.seqs, device) for c in sp.calls]
        run.sp, run.num_rows = sp, len(sp.seqs)
        run.high = max(run.high, max(sp.positions))

    def _switch(self, version: int) -> None:
        """Before step k* (the first micro-batch to reach it: every step before k* of every
        micro-batch has run): the parameters of ``version`` and the decoder's products from them."""
        if self._version == version:
            return
        self._version = version
        self._version_t.fill_(version)
        if self._load is None:  # the learner's replay: one set of parameters for the whole call
            return
        self._load(version)
        self.decoder.reload(self.model, self.layers, self.comms.is_first_stage, [r.runner for r in self._runs])

    def _rebuild(self, run: _Run, sp: StepPlan) -> None:
        """The batch of step k from the old batch, parked states and fresh rows (StepPlan.build),
        every buffer rebuilt in place over the positions written so far."""
        old = run.num_rows
        device = run.work.tokens.device
        prev_seqs = run.sp.seqs if old else []
        stay = [src.row if isinstance(src, FromBatch) and prev_seqs[src.row] == s else -1
                for src, s in zip(sp.build, sp.seqs)]
        entering = [(j, src) for j, src in enumerate(sp.build) if stay[j] < 0]

        def source(src, key):  # move_rows' form (a parked state taken before a buffer existed: a fresh row)
            if isinstance(src, FromBatch):
                return src.row
            return run.parked[src.entry][0].get(key) if isinstance(src, FromParked) else None

        used = run.high + 2  # decoder K/V, encoder K/V and memory slots (null + 1) never written past it
        for key, base, dim, fresh_from in _buffers(run):
            move_rows(base, stay, [(j, source(src, key)) for j, src in entering], dim, used, fresh_from)
        if self.comms.is_first_stage:
            parked = sorted({src.entry for src in sp.build if isinstance(src, FromParked)})
            offset = {u: old + n for n, u in enumerate(parked)}
            index = to_device([src.row if isinstance(src, FromBatch) else offset[src.entry]
                               if isinstance(src, FromParked) else old + len(parked) for src in sp.build], device)
            parts = [run.z[:old]] if old else []
            parts += [run.parked[u][1] for u in parked] + [self.model.initial_state(1).to(self.act_dtype)]
            run.z = torch.cat(parts).index_select(0, index)

    # ------------------------------------------------------------------ steps
    def _encoder_call(self, run: _Run, step: RingStep, ins: list) -> None:
        model, comms = self.model, self.comms
        c = step.block[2]
        call, rows = run.sp.calls[c], run.call_rows[c]
        if comms.is_first_stage:
            h = model.embed(run.work.tokens.index_select(0, run.call_seqs[c])[:, call.start:call.end])  # (n, C, d)
        else:
            h = ins[0]
        cache = RowsView(run.enc, rows, run.work.plan.layout.slots, len(call.rows))
        h = model.encode(h, start=call.start, cache=cache, layers=self.layers)
        if comms.is_last_stage:
            h = model.memory_norm(h)
            run.runner.write_memory(h, call.start, rows)
        for msg in step.sends:
            self._send(h, msg.dst, msg.stream)
        run.calls.append((step.t, call.start, call.end, list(call.seqs)))

    def _take_control(self, run: _Run, step: RingStep, ins: list) -> None:
        """Stages < last, before step k: step k-1's tokens (stage 0) and, at a check, the flags."""
        ctl = ins[0]  # (CTL_ROWS, B' + R)
        n = len(run.sp.targets)
        if self.comms.is_first_stage:
            run.work.tokens[run.targets, run.target_pos + 1] = ctl[0, :n]
            run.z = ins[1].squeeze(1)
        if is_check(step.t, self.check_every):
            run.work.plan.set_flags(step.t, ctl[1, n:].tolist())  # the check's host read (codes: set_flags)

    def _decoder_step(self, run: _Run, step: RingStep, ins: list, processing: Processing) -> None:
        model, comms, k = self.model, self.comms, step.t
        tokens = run.work.tokens
        e = None
        if comms.is_first_stage:
            e = model.embed(tokens[run.seqs, run.pos])  # (B, d)
            x = run.z
        else:
            x = ins[0].squeeze(1)
        lo, hi = min(run.sp.positions), max(run.sp.positions)
        if lo == hi:  # every row at one position (no row waited): no masks
            layout = run.runner.at(k, lo, run.num_rows)
        else:
            layout = run.runner.rows(k, run.pos, hi + 1)
        y = run.runner.step(layout, x, e).unsqueeze(1)  # (B, 1, d)
        if not comms.is_last_stage:
            for msg in step.sends:
                self._send(y, msg.dst, msg.stream)
            return
        chooser, plan = run.work.chooser, run.work.plan
        logprobs = process_logits(comms.gather_vocab(model.head(y.squeeze(1))), processing)  # (B, V) fp32
        if run.expand is not None:
            logprobs = logprobs.index_select(0, run.expand)  # (B', V): a fork's G draws
        nxt = comms.share_tokens(chooser.choose_rows(run.targets, run.target_pos, logprobs))
        chooser.record_rows(run.targets, run.target_pos, nxt)
        tokens[run.targets, run.target_pos + 1] = nxt
        run.lp[run.targets, run.target_pos + 1] = logprobs.gather(1, nxt.unsqueeze(1)).squeeze(1)
        if run.version is not None:
            run.version[run.targets, run.target_pos + 1] = self._version_t
        if comms.is_first_stage:
            run.z = y.squeeze(1)
        if not plan.may_run(k + 1):
            return
        finished = None
        if is_check(k + 1, self.check_every):
            finished = check(run.work, k)  # may end rows and insert observations: before the flags leave
            if plan.recorded is None:
                plan.set_flags(k + 1, finished.tolist())  # the check's host read
        if step.sends:
            flags = finished if finished is not None else chooser.flag_codes()
            ctl = torch.zeros(CTL_ROWS, len(nxt) + len(flags), dtype=torch.long, device=nxt.device)
            ctl[0, :len(nxt)] = nxt
            ctl[1, len(nxt):] = flags.long()
            for msg in step.sends:
                self._send(ctl if msg.stream == "r_ctl" else y, msg.dst, msg.stream)
