"""The row schedule (rollout/rows.py: shared prompts, compaction, continuous batching) as the
program every stage of a model replica runs, through the sampler ring's row description
(``ring.row_ring_steps``). Rollout and replay both run it; with unchanged parameters and the
recorded events their log-probs are equal bit for bit (same batch compositions, same shapes,
same kernels).

State per micro-batch, every tensor indexed by the batch row of the current step (the plan's
slot order): the encoder K/V, the committed memory, the decoder K/V (``KVCache``/``MemoryKV``
or, on the fused path, ``StepKV``) and, on stage 0, z_{k-1}. An event (fork, leave, entry)
rebuilds them once with one ``index_select`` per buffer from the old batch, the parked states
(an entry's forked state kept while its rows wait) and a fresh row (null memory slot, z_init);
steps without events touch nothing but the step's own writes. Positions live on the device
((B,) long, advanced in place), masks are built from them per step, so a step does no host read;
the host reads the finish flags only at a check (as in the lockstep executor).

Tokens and log-probs live per *sequence* (rows, then entries): tokens (S, capacity), and on the
last stage lp (S, capacity), the log-prob of the token at each position under the step that
drew (or forced) it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from rlt_mega.model.cache import KVCache, MemoryKV, RowsView
from rlt_mega.model.fast_decode import DecodeWeights, RowPositions, StepKV
from rlt_mega.model.rlt import RLT
from rlt_mega.rollout.comms import Comms
from rlt_mega.rollout.processing import Processing, process_logits
from rlt_mega.rollout.ring import CTL_ROWS, RingStep, is_check, row_ring_steps
from rlt_mega.rollout.rows import RowPlan, StepPlan


class RowChooser(Protocol):
    def choose_rows(self, targets: torch.Tensor, positions: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs (B', V) of the targets' steps -> their next tokens (B',); no host read."""

    def record_rows(self, targets: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens every TP rank continues with: updates the finish flags on the device."""

    def finished_rows(self) -> torch.Tensor:
        """(R,) bool: the rows that are done."""

    def check(self, t: int) -> None:
        """At a check (host work allowed): stop strings."""


@dataclass
class RowWork:
    """One micro-batch: tokens (S, capacity) per sequence (rows then entries), its plan, and on
    the last stage its chooser."""

    tokens: torch.Tensor
    plan: RowPlan
    chooser: Optional[RowChooser]


@dataclass
class RowResult:
    lp: Optional[torch.Tensor]  # (S, capacity) fp32 on the last stage
    encoder_calls: list
    fast_decode: bool


@dataclass
class _Run:
    work: RowWork
    enc: KVCache
    dec: object  # KVCache or StepKV
    mem: object  # MemoryKV or StepKV
    fresh_mem: object
    lp: Optional[torch.Tensor]
    z: Optional[torch.Tensor] = None  # stage 0: z of the last step's batch (B, d)
    parked: dict = field(default_factory=dict)  # entry -> (enc, dec, mem, z) one-row states
    sp: Optional[StepPlan] = None  # the step the state is at
    num_rows: int = 0  # batch rows of sp
    pos: Optional[torch.Tensor] = None  # (B,)
    seqs: Optional[torch.Tensor] = None  # (B,)
    targets: Optional[torch.Tensor] = None  # (B',)
    target_pos: Optional[torch.Tensor] = None  # (B',)
    expand: Optional[torch.Tensor] = None
    high: int = -1  # the furthest position a step of the run reached so far
    bases: dict = field(default_factory=dict)  # (cache, list, layer) -> the buffer's rows for all slots
    calls: list = field(default_factory=list)


def _lists(cache) -> list:
    return [cache.k_t, cache.v] if isinstance(cache, StepKV) else [cache.k, cache.v]


def _take(parts: list, sizes: list[int], index: torch.Tensor) -> Optional[torch.Tensor]:
    """cat(parts)[index]; None parts are zeros of their size (a buffer never written there)."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    full = [p if p is not None else like.new_zeros((n,) + tuple(like.shape[1:])) for p, n in zip(parts, sizes)]
    return torch.cat(full).index_select(0, index)


def _position_dim(cache, n_list: int) -> int:
    """The positions' dimension of a cache buffer: StepKV keys (B, h_kv, Dh, S), every other
    buffer (B, h_kv, S, Dh)."""
    return 3 if isinstance(cache, StepKV) and n_list == 0 else 2


def _rebuild_buffer(buf: Optional[torch.Tensor], base: Optional[torch.Tensor], stay: list[int], enter: list,
                    dim: int, used: int, max_rows: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One buffer of a rebuilt batch, in place -> (the new batch's buffer: rows [0, n) of its
    base, the base). Row j of the new batch is old row stay[j] (a row that stays, -1: an
    entering row) or, for (j, src) in ``enter``: old row src (an int: a fork's row), the
    one-row buffer src (a parked or fresh state), or zeros (None).

    The base holds ``max_rows`` rows (the call's slots) for the whole call, so leaves and
    entries move rows inside it instead of allocating and filling new buffers (on CPU a fresh
    buffer pays a page fault per 4 KiB, more than the copy). Only positions [0, used) were ever
    written (every step so far ran at positions < used - 1), so rows are copied over that
    prefix only and every row's tail keeps the zeros it was allocated with; rows past the
    batch are never read. The rows that stay keep their order (their slots), so moving the
    ones that go down in ascending order and the ones that go up in descending order never
    overwrites a row before it is read; a fork's row is copied out first."""
    n = len(stay)
    if base is None or buf is None or buf.data_ptr() != base.data_ptr():
        base = buf
    like = base if base is not None else next((x for _, x in enter if isinstance(x, torch.Tensor)), None)
    if like is None:
        return None, None
    p = min(used, like.shape[dim])

    def row(x: torch.Tensor, j: int) -> torch.Tensor:
        return x[j].narrow(dim - 1, 0, p)

    forked = {} if base is None else {i: row(base, i).clone() for _, i in enter if isinstance(i, int)}
    if base is None or base.shape[0] < n:
        grown = like.new_zeros((max(max_rows, n),) + tuple(like.shape[1:]))
        if base is not None:
            kept = min(base.shape[0], n)
            grown[:kept].narrow(dim, 0, p).copy_(base[:kept].narrow(dim, 0, p))
        else:
            stay = [-1] * n  # the batch never wrote this buffer: its rows are zeros already
        base = grown
    moves = [(j, i) for j, i in enumerate(stay) if i >= 0 and i != j]
    for j, i in [m for m in moves if m[1] > m[0]] + [m for m in reversed(moves) if m[1] < m[0]]:
        row(base, j).copy_(row(base, i))
    for j, src in enter:
        if isinstance(src, int):
            src = forked.get(src)  # None: the batch never wrote this buffer
        elif src is not None:
            src = row(src, 0)
        if src is None:
            row(base, j).zero_()
        else:
            row(base, j).copy_(src)
    return base[:n], base


def _layer(cache, n_list: int, layer: int) -> Optional[torch.Tensor]:
    """A buffer of a cache, None where it has none (a stage's fused snapshot holds its layers only)."""
    lst = _lists(cache)[n_list]
    return lst[layer] if layer < len(lst) else None


def _one_row(cache, i: int):
    """A copy of row i of a cache (a parked state)."""
    out = type(cache)(len(_lists(cache)[0]), cache.capacity)
    for src, dst in zip(_lists(cache), _lists(out)):
        for layer, x in enumerate(src):
            dst[layer] = None if x is None else x[i:i + 1].clone()
    return out


class RowExecutor:
    """Runs the row schedule of one stage (``model``: the stage's layers, possibly TP)."""

    def __init__(self, model: RLT, comms: Comms, layers: Optional[range] = None, check_every: int = 8) -> None:
        self.model, self.comms, self.layers = model, comms, layers
        self.C, self.d, self.check_every = model.cfg.memory_block, model.cfg.d_model, check_every
        self.fast: Optional[DecodeWeights] = None

    @property
    def act_dtype(self) -> torch.dtype:
        return self.model.null_memory.dtype

    def run(self, works: Sequence[RowWork], processing: Processing, fast_decode: bool = True) -> list[RowResult]:
        model, L, comms = self.model, self.model.cfg.n_layers, self.comms
        self.fast = DecodeWeights.build(model, self.layers) if fast_decode else None
        runs = []
        for w in works:
            S, capacity = w.tokens.shape
            if self.fast is None:
                dec, mem = KVCache(L, capacity), MemoryKV(L, 1 + capacity)
                fresh_mem = model.init_memory(1, capacity, self.layers)
            else:
                dec, mem = self.fast.new_cache(capacity), StepKV(L, 1 + capacity)
                fresh_mem = self.fast.new_memory(model.null_memory, 1, capacity)
            lp = None
            if comms.is_last_stage:
                lp = torch.zeros(S, capacity, dtype=torch.float32, device=w.tokens.device)
            runs.append(_Run(w, KVCache(L, capacity), dec, mem, fresh_mem, lp))
        every = {w.plan.layout.check_every for w in works}
        if len(every) != 1:
            raise ValueError(f"row-schedule batches run together must share one check_every, got {sorted(every)}")
        self.check_every = every.pop()  # the record's (a replay repeats its rollout's checks)
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
                self._append(run, run.sp.calls[step.block[2]], ins[0])
            elif step.kind == "dec":
                self._decoder_step(run, step, ins, processing)
            else:  # pragma: no cover
                raise AssertionError(f"unknown row ring step {step}")
        comms.p2p.drain()
        used_fast, self.fast = self.fast is not None, None
        return [RowResult(run.lp, run.calls, used_fast) for run in runs]

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
        """Brings the run's state to step k's batch (once per step)."""
        sp = run.work.plan.prev
        if run.sp is not None and run.sp.k == k:
            return
        assert sp is not None and sp.k == k, (sp, k)
        device = run.work.tokens.device
        for u, i in sp.park:
            run.parked[u] = tuple(_one_row(c, i) for c in (run.enc, run.dec, run.mem)) + (
                None if run.z is None else run.z[i:i + 1].clone(),)
        if sp.build is None:
            run.pos += 1
        else:
            self._rebuild(run, sp)
            run.pos = torch.as_tensor(sp.positions, dtype=torch.long, device=device)
            run.seqs = torch.as_tensor(sp.seqs, dtype=torch.long, device=device)
        for u in sp.unpark:
            run.parked.pop(u, None)
        if sp.expand is None:  # one target per row: the batch's own sequences and positions
            run.targets, run.target_pos, run.expand = run.seqs, run.pos, None
        else:  # a fork after this step: its G rows' draws come from its one distribution
            run.targets = torch.as_tensor(sp.targets, dtype=torch.long, device=device)
            run.target_pos = torch.as_tensor(sp.target_positions, dtype=torch.long, device=device)
            run.expand = torch.as_tensor(sp.expand, dtype=torch.long, device=device)
        run.sp, run.num_rows = sp, len(sp.seqs)
        run.high = max(run.high, max(sp.positions))

    def _rebuild(self, run: _Run, sp: StepPlan) -> None:
        """The batch of step k from the old batch, parked states and fresh rows (StepPlan.build).
        Every buffer is rebuilt in place, over the positions written so far (``_rebuild_buffer``)."""
        old = run.num_rows
        device = run.work.tokens.device
        prev_seqs = run.sp.seqs if old else []
        stay = [i if kind == "batch" and prev_seqs[i] == s else -1 for (kind, i), s in zip(sp.build, sp.seqs)]
        entering = [(j, kind, i) for j, (kind, i) in enumerate(sp.build) if stay[j] < 0]
        used = run.high + 2  # decoder K/V, encoder K/V and memory slots (null + 1) never written past it
        fresh_states = (None, None, run.fresh_mem)
        for c, cache in enumerate((run.enc, run.dec, run.mem)):
            for n_list, lst in enumerate(_lists(cache)):
                for layer in range(len(lst)):
                    enter = []
                    for j, kind, i in entering:
                        src = i if kind == "batch" else run.parked[i][c] if kind == "parked" else fresh_states[c]
                        enter.append((j, src if src is None or isinstance(src, int) else _layer(src, n_list, layer)))
                    key = (c, n_list, layer)
                    lst[layer], run.bases[key] = _rebuild_buffer(
                        lst[layer], run.bases.get(key), stay, enter, _position_dim(cache, n_list), used,
                        run.work.plan.layout.slots)
        if self.comms.is_first_stage:
            parked = sorted({u for kind, u in sp.build if kind == "parked"})
            offset = {u: old + n for n, u in enumerate(parked)}
            index = torch.as_tensor([i if kind == "batch" else offset[i] if kind == "parked" else old + len(parked)
                                     for kind, i in sp.build], dtype=torch.long, device=device)
            z_init = self.model.initial_state(1)
            parts = [run.z if old else None] + [run.parked[u][3] for u in parked] + [z_init]
            run.z = _take(parts, [old] + [1] * len(parked) + [1], index)

    # ------------------------------------------------------------------ steps
    def _rows_of(self, run: _Run, call) -> Optional[torch.Tensor]:
        """None when the call covers the whole batch (no gather needed)."""
        if len(call.rows) == run.num_rows:
            return None
        return torch.as_tensor(call.rows, dtype=torch.long, device=run.work.tokens.device)

    def _encoder_call(self, run: _Run, step: RingStep, ins: list) -> None:
        model, comms = self.model, self.comms
        call = run.sp.calls[step.block[2]]
        rows = self._rows_of(run, call)
        if comms.is_first_stage:
            seqs = torch.as_tensor(call.seqs, dtype=torch.long, device=run.work.tokens.device)
            h = model.embed(run.work.tokens.index_select(0, seqs)[:, call.start:call.end])  # (n, C, d)
        else:
            h = ins[0]
        cache = run.enc if rows is None else RowsView(run.enc, rows, run.num_rows)
        h = model.encode(h, start=call.start, cache=cache, layers=self.layers)
        if comms.is_last_stage:
            h = model.memory_norm(h)
            self._append(run, call, h)
        for msg in step.sends:
            self._send(h, msg.dst, msg.stream)
        run.calls.append((step.t, call.start, call.end, list(call.seqs)))

    def _append(self, run: _Run, call, m: torch.Tensor) -> None:
        rows = self._rows_of(run, call)
        if self.fast is not None:
            if rows is None:
                self.fast.append_memory(run.mem, m, call.start)
            else:
                self.fast.append_memory_rows(run.mem, rows, run.num_rows, m, call.start)
        else:
            mem = run.mem if rows is None else RowsView(run.mem, rows, run.num_rows)
            self.model.append_memory(mem, m, call.start, self.layers)

    def _take_control(self, run: _Run, step: RingStep, ins: list) -> None:
        """Stages < last, before step k: step k-1's tokens (stage 0) and, at a check, the flags."""
        ctl = ins[0]  # (CTL_ROWS, B' + R)
        n = len(run.sp.targets)
        if self.comms.is_first_stage:
            run.work.tokens[run.targets, run.target_pos + 1] = ctl[0, :n]
            run.z = ins[1].squeeze(1)
        if is_check(step.t, self.check_every):
            run.work.plan.set_flags(step.t, ctl[1, n:].bool().tolist())  # the check's host read

    def _decoder_step(self, run: _Run, step: RingStep, ins: list, processing: Processing) -> None:
        model, comms, k = self.model, self.comms, step.t
        tokens = run.work.tokens
        if comms.is_first_stage:
            x = tokens[run.seqs, run.pos]  # (B,)
            u = model.decoder_input(model.embed(x), run.z)  # (B, 1, d)
        else:
            u = ins[0]
        lo, hi = min(run.sp.positions), max(run.sp.positions)
        if lo == hi:  # every row at one position (no row waited): the lockstep step, no masks
            if self.fast is not None:
                y = self.fast.decoder_layers(u, lo, run.dec, run.mem)
            else:
                y = model.decoder_layers(u, lo, run.dec, run.mem, self.layers)
        else:
            rp = RowPositions.build(run.pos, hi + 1, self.C)
            if self.fast is not None:
                y = self.fast.decoder_layers_rows(u, rp, run.dec, run.mem)
            else:
                y = model.decoder_layers_rows(u, rp, run.dec, run.mem, self.layers)
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
        if comms.is_first_stage:
            run.z = y.squeeze(1)
        if not plan.may_run(k + 1):
            return
        finished = None
        if is_check(k + 1, self.check_every):
            chooser.check(k)  # may end rows (stop strings): before the flags leave
            finished = chooser.finished_rows()
            if plan.recorded is None:
                plan.set_flags(k + 1, finished.tolist())  # the check's host read
        if step.sends:
            flags = finished if finished is not None else chooser.finished_rows()
            ctl = torch.zeros(CTL_ROWS, len(nxt) + len(flags), dtype=torch.long, device=nxt.device)
            ctl[0, :len(nxt)] = nxt
            ctl[1, len(nxt):] = flags.long()
            for msg in step.sends:
                self._send(ctl if msg.stream == "r_ctl" else y, msg.dst, msg.stream)
