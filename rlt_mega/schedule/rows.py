"""The row schedule (DESIGN sections 2-3: a schedule may change its batch as it goes, every
change is recorded and the replay repeats it): shared prefixes, compaction and continuous
batching, as a pure host-side plan that every stage of a replica derives alike. The sampler's
rollout and replay run it step by step (rollout/executor.py); the learner's dense step runs the
same plan position by position (schedule/dense.py ``DensePlan``).

Sequences: the call's R rows are sequences 0 .. R-1; with shared prompts every distinct prompt
that two or more rows hold is an *entry*, sequence R + u. An entry runs through its prompt once
(encoder and decoder) and at its last prompt position P - 1 its step's distribution draws the
first completion token of each of its G rows: the entry then *forks* (its state, i.e. encoder
K/V, committed memory, decoder K/V and z, becomes the state of each row) and leaves. A row
whose prompt nobody shares runs its own prompt, as in the lockstep schedule.

The batch is a set of ``slots``; a sequence occupies one from the step it *enters* to the step it
*leaves*. Each sequence in the batch is at its own position (RoPE position, attention length,
vis(t) and memory-block encoder calls are its own), advancing by one per step. Events, applied
before step k in this order:

1. forks of step k - 1: the entry leaves; its rows wait for a slot (a row complete at the fork,
   max_new_tokens = 1, never enters);
2. length: a row past its last possible step (P + max_new_tokens - 2) leaves;
3. a check (k % check_every == 0): the finish flags read there (the one host read of issue 16's
   design) end rows: with ``compact`` they leave, and finished waiting rows are dropped; rows whose
   environment call starts there (``Flag.AWAY``, rollout/turns.py) leave, their state parked, and
   rejoin the waiting rows at the next check (its answer forced, ``Force``) unless it ended them;
4. free slots take waiting rows (FIFO), then sequences not started yet (FIFO): a fresh sequence
   gets its prompt's prefill, a waiting row its entry's forked state (*parked* on the device
   until the entry's last row has entered).

Everything but the flags of step 3 is known on the host from the prompt lengths, so the plan
needs no device read between checks; the flags reach every stage in the ring's control
message. The rollout records the flags it read (``RowRecord.checks``) and the event log; the
replay derives the same plan from the recorded flags and checks that its log equals the
recorded one, so it repeats every fork, leave, entry and encoder call with the batch
composition of the rollout (a row's values depend on its batch-mates only through GEMM shapes,
and those are repeated).

Events are typed (``Fork``, ``Leave``, ``Check``, ``Enter``, ``Encode``, ``End``: ``EVENTS``), and
so are the sources a step's batch is built from (``FromBatch``, ``FromParked``, ``Fresh``). A
new event is one dataclass here, the plan's rule that emits it, and the executor's handling.

Partial rollouts (``RowLayout.switch``): a call that starts under policy version
``layout.version`` changes its parameters to version v before step k* (``switch = (k*, v)``, k*
a multiple of the memory block C: the steps before it drew with the old parameters, the steps from
it on, their encoder calls included, with the new). The plan logs ``Switch(k*, v)`` when the call
reaches step k*, and the executor loads version v there; rows keep every state computed so far.

Encoder calls before step k: the prefill [0, C * floor(min P / C)) of the fresh sequences that
enter at k, and for every sequence at position t whose memory block [t + 1 - C, t + 1)
completes (and lies past its prefill) one call per distinct block start, over those rows.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Sequence


class Flag(IntEnum):
    """A row's finish flag as a check reads it (one code per row, host values: the chooser's
    ``flag_codes`` and an environment's turn's departures, rollout/executor.py ``check``, carried
    to the earlier stages in the ring's control message)."""

    RUNNING = 0
    FINISHED = 1
    AWAY = 2  # leaving the batch for an environment call (rollout/turns.py)


@dataclass(frozen=True)
class RowSwitches:
    """The plan's options: a prompt held by several rows runs once and forks (``share_prompts``),
    finished rows leave at the next check (``compact``), at most ``slots`` rows decode at once
    (0: one slot per row and entry, no row waits). Sharing and compaction change the batch
    compositions (so the rounding), never the function; only ``slots`` is a setting of a run
    (``sampling.slots``). ``LOCKSTEP`` (all off) is the lockstep schedule, the benchmarks'
    baseline arm."""

    share_prompts: bool = True
    compact: bool = True
    slots: int = 0

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"sampling.slots={self.slots}: must be >= 0 (0: one slot per row, no waiting)")


LOCKSTEP = RowSwitches(share_prompts=False, compact=False, slots=0)


@dataclass(frozen=True)
class RowLayout:
    """Who is who in one rollout call; fixed for the call."""

    prompt_lens: tuple[int, ...]  # per row
    entry_of: tuple[int, ...]  # per row: its entry u (sequence R + u), -1: runs its own prompt
    entry_rows: tuple[tuple[int, ...], ...]  # per entry: its rows, in order
    max_new_tokens: int
    memory_block: int
    slots: int
    compact: bool
    check_every: int
    lengths: Optional[tuple[int, ...]] = None  # per row: the positions it needs (None: P + max_new_tokens - 1)
    version: int = 0  # the policy version the call starts under (partial rollouts)
    switch: tuple[int, ...] = ()  # (step, version): from that step on, that version's parameters; (): none

    def __post_init__(self) -> None:
        if self.switch and (len(self.switch) != 2 or self.switch[0] < 1 or self.switch[0] % self.memory_block
                            or self.switch[1] == self.version):
            raise ValueError(f"row layout: weight switch {self.switch} must be (step, version) with the step a "
                             f"positive multiple of the memory block C={self.memory_block} and a version other "
                             f"than the start's ({self.version})")

    @property
    def num_rows(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_seqs(self) -> int:
        return self.num_rows + len(self.entry_rows)

    def seq_len(self, seq: int) -> int:
        """The prompt length of a sequence."""
        R = self.num_rows
        return self.prompt_lens[seq if seq < R else self.entry_rows[seq - R][0]]

    def last_position(self, seq: int) -> int:
        """The position of the sequence's last decoder step: an entry's fork, a row's last draw."""
        if seq >= self.num_rows:
            return self.seq_len(seq) - 1
        if self.lengths is not None:
            return self.lengths[seq] - 1
        return self.prompt_lens[seq] + self.max_new_tokens - 2

    def initial(self) -> list[int]:
        """The sequences that start fresh (at position 0), in order of their first row."""
        R, seen, out = self.num_rows, set(), []
        for b, u in enumerate(self.entry_of):
            s = b if u < 0 else R + u
            if s not in seen and (s >= R or self.last_position(s) >= 0):
                seen.add(s)
                out.append(s)
        return out


def row_layout(prompts: Sequence[Sequence[int]], max_new_tokens: int, memory_block: int, slots: Optional[int],
               share_prompts: bool, compact: bool, check_every: int, groups: Optional[Sequence] = None,
               lengths: Optional[Sequence[int]] = None, version: int = 0, switch: Sequence[int] = ()) -> RowLayout:
    """Groups identical prefixes (two rows or more) into entries when ``share_prompts``: rows whose
    ``prompts`` are token for token the same or, given ``groups`` (one id a row), rows of one id.
    slots None: one per row and entry (no row ever waits). lengths, version, switch: see ``RowLayout``."""
    R = len(prompts)
    ids = [tuple(p) for p in prompts] if groups is None else list(groups)
    members: dict = {}
    for b, g in enumerate(ids):
        members.setdefault(g, []).append(b)
    entry_of, entry_rows = [-1] * R, []
    if share_prompts:
        for rows in members.values():
            if len(rows) > 1:
                for b in rows:
                    entry_of[b] = len(entry_rows)
                entry_rows.append(tuple(rows))
    if slots is None:
        slots = R + len(entry_rows)
    if slots < 1:
        raise ValueError(f"sampling.slots={slots}: must be >= 1")
    return RowLayout(tuple(len(p) for p in prompts), tuple(entry_of), tuple(entry_rows), max_new_tokens,
                     memory_block, slots, compact, check_every, None if lengths is None else tuple(lengths),
                     version, tuple(switch))


# ---------------------------------------------------------------------- events (``step``: before which step)
@dataclass(frozen=True)
class Fork:  # after step ``step`` the entry (sequence ``entry``) hands its state to its ``rows``
    step: int
    entry: int
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Leave:  # sequence ``seq`` leaves the batch (``why``: fork, length, finished, env: its environment call runs)
    step: int
    seq: int
    why: str


@dataclass(frozen=True)
class Check:  # the finish flags read: ``rows`` newly finished
    step: int
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Enter:  # sequence ``seq`` takes slot ``slot``
    step: int
    seq: int
    slot: int


@dataclass(frozen=True)
class Encode:  # an encoder call over positions [start, end) of ``seqs``
    step: int
    start: int
    end: int
    seqs: tuple[int, ...]


@dataclass(frozen=True)
class End:  # the call is over
    step: int


@dataclass(frozen=True)
class Force:  # from step ``step`` on, row ``seq``'s positions [start, start + len(ids)) are forced to ``ids``
    step: int  # (an environment's observation, tokenized once: no mu, no loss); read at the check ``step``
    seq: int
    start: int
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Switch:  # before step ``step`` the call's parameters become policy version ``version`` (partial rollouts)
    step: int
    version: int


EVENTS = {e.__name__: e for e in (Fork, Leave, Check, Enter, Encode, End, Force, Switch)}


# ---------------------------------------------------------------------- where a step's batch row comes from
@dataclass(frozen=True)
class FromBatch:  # row ``row`` of the previous step's batch (a row that stays, or a fork's entry)
    row: int


@dataclass(frozen=True)
class FromParked:  # entry ``entry``'s parked state (its fork's, kept while its rows wait)
    entry: int


@dataclass(frozen=True)
class Fresh:  # a sequence starting at position 0
    pass


Source = FromBatch | FromParked | Fresh


@dataclass
class EncoderCall:
    start: int
    end: int
    rows: list[int]  # indices into the step's batch
    seqs: list[int]  # the sequences of those rows


@dataclass
class StepPlan:
    """The batch of step k and how it is built from step k - 1's (``build`` None: the same rows,
    one position further)."""

    k: int
    seqs: list[int]  # the batch, in slot order
    positions: list[int]  # each sequence's position at this step
    build: Optional[list[Source]]  # per batch row: where its state comes from
    park: list[tuple[int, int]]  # (entry u, its row at k - 1): state kept for rows still waiting
    unpark: list[int]  # entries whose parked state is no longer needed (after the build)
    calls: list[EncoderCall]
    expand: Optional[list[int]]  # batch row of every target (None: one target per row)
    targets: list[int]  # the sequence whose next token each target chooses (a fork: its G rows)
    target_positions: list[int]
    switch: Optional[int] = None  # a policy version to load before this step (partial rollouts)


@dataclass
class RowRecord:
    """What the replay needs besides the layout: the finish flags read at each check (the rows
    newly seen finished there) and, to verify it, the event log."""

    layout: RowLayout
    checks: dict[int, list[int]]
    log: list  # the events, in order
    num_steps: int  # decoder steps of the call (sequential, whatever the batch size)
    row_steps: int  # sum over steps of the batch size (the decoder's work)
    forces: dict[int, list[Force]] = dataclasses.field(default_factory=dict)  # check step -> insertions there
    away: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # check step -> rows leaving for a call


class RowPlan:
    """The plan of one call, advanced step by step: ``may_run(k)`` (host-known, before a check's
    flags), ``set_flags(k, finished)`` at a check, then ``begin(k)``. With ``recorded`` (a
    replay, or the NCCL simulation) the flags come from the record instead."""

    def __init__(self, layout: RowLayout, recorded: Optional[RowRecord] = None) -> None:
        self.layout = layout
        self.recorded = recorded
        self.slots: list[Optional[int]] = [None] * layout.slots
        self.pos: dict[int, int] = {}  # sequence in the batch -> its position at the last planned step
        self.cover: dict[int, int] = {}  # sequence -> end of its prefill
        self.pending = deque(layout.initial())
        self.waiting: deque[int] = deque()
        self.parked: set[int] = set()
        self.done: set[int] = set()  # rows known finished
        self.flags: dict[int, list[int]] = {}  # check step -> rows newly known finished there
        self.forces: dict[int, list[Force]] = {}  # check step -> the insertions decided there
        self.away: dict[int, list[int]] = {}  # check step -> rows leaving for an environment call there
        self.out: list[int] = []  # rows out of the batch while their call runs (back at the next check)
        self.resume: dict[int, int] = {}  # such a row -> the position it re-enters at
        self.log: list = []
        self.num_steps = 0
        self.row_steps = 0
        self.prev: Optional[StepPlan] = None
        self.over = False
        self._forks: list[int] = []  # entries that forked at the last planned step

    # ------------------------------------------------------------------ queries
    def batch(self) -> list[int]:
        return [s for s in self.slots if s is not None]

    def _after_host_events(self) -> list[int]:
        """The batch that steps 1-2 (forks, length) leave for the next step."""
        out = []
        for s in self.batch():
            if s in self._forks:
                continue
            if s < self.layout.num_rows and self.pos[s] + 1 > self.layout.last_position(s):
                continue
            out.append(s)
        return out

    def may_run(self, k: int) -> bool:
        """Whether step k can happen as far as the host knows (a check may still stop it)."""
        if k == 0:
            return True
        if self.prev is None or self.prev.k != k - 1:
            return False
        forked = [b for u in self._forks for b in self.layout.entry_rows[u - self.layout.num_rows]
                  if self._starts(b)]
        return bool(self._after_host_events() or self.waiting or self.pending or forked or self.out)

    def _starts(self, row: int) -> bool:
        """A forked row has work left (it is not complete at the fork)."""
        return self.layout.prompt_lens[row] <= self.layout.last_position(row)

    # ------------------------------------------------------------------ the flags
    def set_flags(self, k: int, finished: Sequence[int]) -> None:
        """The rows' finish flags (R,) read at check k (host values, ``Flag`` codes; a bool is
        FINISHED or RUNNING)."""
        self.flags[k] = [b for b, f in enumerate(finished) if f == Flag.FINISHED and b not in self.done]
        away = [b for b, f in enumerate(finished) if f == Flag.AWAY]
        if away:
            self.away[k] = away

    def force(self, k: int, row: int, start: int, ids: Sequence[int]) -> None:
        """At check k (host values, before ``set_flags``): row ``row``'s positions from ``start``
        are forced to ``ids`` (an observation). The plan's batches do not change (the row stays at
        its own position and budget); the event is logged so that the replay repeats it."""
        self.forces.setdefault(k, []).append(Force(k, row, start, tuple(int(i) for i in ids)))

    def _check_flags(self, k: int) -> Optional[list[int]]:
        if self.recorded is not None:
            return self.recorded.checks.get(k, [])
        if k not in self.flags:
            raise RuntimeError(f"row plan: the finish flags of check {k} were never read")
        return self.flags[k]

    # ------------------------------------------------------------------ one step
    def begin(self, k: int) -> Optional[StepPlan]:
        """Applies the events before step k (module docstring: forks, length, a check, free
        slots) -> the step's plan, or None when the call is over."""
        if self.over:
            return None
        if self.prev is not None and not self.may_run(k):
            return self._finish(k)
        prev_rows = {s: i for i, s in enumerate(self.prev.seqs)} if self.prev is not None else {}
        park: list[tuple[int, int]] = []
        self._fork_rows(k)
        self._length_rule(k)
        if k > 0 and k % self.layout.check_every == 0 and self._check(k, prev_rows, park):
            return self._finish(k)
        entering = self._fill_slots(k, prev_rows)
        for u in self._forks:  # rows of this fork still waiting: keep its state
            if self._still_parked(u):
                park.append((u, prev_rows[u]))
                self.parked.add(u)
        self._forks = []
        seqs = self.batch()
        if not seqs:
            if self.out:
                raise RuntimeError(f"row plan: step {k} has no row to run while rows {self.out} wait for their "
                                   "environment calls (the sampler waits at once when no other row can run)")
            return self._finish(k)
        return self._step_plan(k, seqs, entering, prev_rows, park)

    def _fork_rows(self, k: int) -> None:
        """1. The entries that forked at step k - 1 leave; their rows wait for a slot."""
        R = self.layout.num_rows
        for u in self._forks:
            self._leave(u, k, "fork")
            rows = self.layout.entry_rows[u - R]
            for b in rows:
                if self._starts(b):
                    self.waiting.append(b)
                else:
                    self.done.add(b)
            self.log.append(Fork(k - 1, u, tuple(rows)))

    def _length_rule(self, k: int) -> None:
        """2. A row past its last possible step leaves."""
        for s in self.batch():
            if s < self.layout.num_rows and self.pos[s] + 1 > self.layout.last_position(s):
                self.done.add(s)
                self._leave(s, k, "length")

    def _check(self, k: int, prev_rows: dict[int, int], park: list[tuple[int, int]]) -> bool:
        """3. The check at step k: finished rows (leave with ``compact``), rows back from their
        environment call (they wait for a slot), rows whose call starts here (they leave, their
        state parked until they re-enter; a row forked at the last step, still waiting, keeps its
        entry's state instead). True when the call is over."""
        newly = self._check_flags(k)
        self.done.update(newly)
        self.log += (self.recorded.forces if self.recorded is not None else self.forces).get(k, [])
        if newly:
            self.log.append(Check(k, tuple(newly)))
        self.waiting.extend(b for b in self.out if b not in self.done)
        self.out = list((self.recorded.away if self.recorded is not None else self.away).get(k, []))
        for b in self.out:
            if b in self.slots:
                park.append((b, prev_rows[b]))
                self.parked.add(b)
                self.resume[b] = self.pos[b] + 1
                self._leave(b, k, "env")
            else:
                self.waiting.remove(b)
        if self.layout.compact:
            for s in self.batch():
                if s in self.done:
                    self._leave(s, k, "finished")
        self.waiting = deque(b for b in self.waiting if b not in self.done)
        return all(s in self.done for s in self.batch()) and not self.waiting and not self.pending and not self.out

    def _fill_slots(self, k: int, prev_rows: dict[int, int]) -> dict[int, Source]:
        """4. Free slots take waiting rows (FIFO), then sequences not started yet -> where each
        entering sequence's state comes from."""
        R = self.layout.num_rows
        entering: dict[int, Source] = {}
        for i in range(self.layout.slots):
            if self.slots[i] is not None:
                continue
            if self.waiting:
                b = self.waiting.popleft()
                u = R + self.layout.entry_of[b]
                if b in self.resume:  # back from an environment call: its own parked state
                    entering[b] = FromParked(b)
                else:
                    entering[b] = FromBatch(prev_rows[u]) if u in prev_rows and u in self._forks else FromParked(u)
            elif self.pending:
                b = self.pending.popleft()
                entering[b] = Fresh()
            else:
                break
            self.slots[i] = b
            self.log.append(Enter(k, b, i))
        return entering

    def _step_plan(self, k: int, seqs: list[int], entering: dict[int, Source], prev_rows: dict[int, int],
                   park: list[tuple[int, int]]) -> StepPlan:
        """Step k's batch ``seqs`` after the events: positions, the build from step k - 1's batch,
        the encoder calls, the forks after this step and the targets of its draws."""
        L, R = self.layout, self.layout.num_rows
        switch = None
        if L.switch and k == L.switch[0]:  # the call runs on past the switch: the new version from here
            switch = L.switch[1]
            self.log.append(Switch(k, switch))
        for s in seqs:
            if s in entering:
                self.pos[s] = (0 if isinstance(entering[s], Fresh) else self.resume.pop(s) if s in self.resume
                               else L.prompt_lens[s])
            else:
                self.pos[s] += 1
        same = self.prev is not None and not entering and seqs == self.prev.seqs
        build = None if same else [entering.get(s, FromBatch(prev_rows.get(s, -1))) for s in seqs]
        unpark = [u for u in sorted(self.parked) if not self._still_parked(u)]
        self.parked.difference_update(unpark)
        calls = self._calls(k, seqs, [s for s in seqs if isinstance(entering.get(s), Fresh)])
        expand, targets, target_pos = [], [], []
        for i, s in enumerate(seqs):
            p = self.pos[s]
            if s >= R and p == L.last_position(s):  # an entry forks after this step: a draw per row
                self._forks.append(s)
                drawn = L.entry_rows[s - R]
            else:
                drawn = (s,)
            for b in drawn:
                expand.append(i)
                targets.append(b)
                target_pos.append(p)
        plan = StepPlan(k, seqs, [self.pos[s] for s in seqs], build, park, unpark, calls,
                        None if len(expand) == len(seqs) else expand, targets, target_pos, switch)
        self.prev = plan
        self.num_steps = k + 1
        self.row_steps += len(seqs)
        return plan

    def _still_parked(self, u: int) -> bool:
        """An entry's forked state is kept while a row of it waits (or, not entered yet, is in
        an environment call); a row's own (left for a call) until it re-enters or finishes."""
        R = self.layout.num_rows
        if u < R:
            return u in self.out or u in self.waiting
        return any(self.layout.entry_of[b] == u - R and b not in self.resume for b in (*self.waiting, *self.out))

    def _leave(self, s: int, k: int, why: str) -> None:
        i = self.slots.index(s)
        self.slots[i] = None
        del self.pos[s]
        self.log.append(Leave(k, s, why))

    def _calls(self, k: int, seqs: list[int], fresh: list[int]) -> list[EncoderCall]:
        C = self.layout.memory_block
        calls = []
        if fresh:
            end = C * (min(self.layout.seq_len(s) for s in fresh) // C)
            for s in fresh:
                self.cover[s] = end
            if end > 0:
                calls.append(EncoderCall(0, end, [seqs.index(s) for s in fresh], list(fresh)))
        blocks: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            t = self.pos[s]
            start = t + 1 - C
            if (t + 1) % C == 0 and start >= self._cover(s):
                blocks.setdefault(start, []).append(i)
        for start in sorted(blocks):
            rows = blocks[start]
            calls.append(EncoderCall(start, start + C, rows, [seqs[i] for i in rows]))
        for c in calls:
            self.log.append(Encode(k, c.start, c.end, tuple(c.seqs)))
        return calls

    def _cover(self, s: int) -> int:
        """A forked row's prefill is its entry's."""
        R = self.layout.num_rows
        if s in self.cover:
            return self.cover[s]
        return self.cover[R + self.layout.entry_of[s]]

    def _finish(self, k: int) -> None:
        self.prev, self.over = None, True
        self.log.append(End(k))
        return None

    def record(self) -> RowRecord:
        return RowRecord(self.layout, {k: v for k, v in self.flags.items() if v}, list(self.log), self.num_steps,
                         self.row_steps, {k: list(v) for k, v in self.forces.items()},
                         {k: list(v) for k, v in self.away.items()})


def planned_record(layout: RowLayout, finish_step) -> RowRecord:
    """The record of a call in which row b's finish flag reads true from step finish_step(b) on:
    the NCCL simulation's stand-in for real draws (tools/nccl_check.py, tests)."""
    plan = RowPlan(layout)
    k = 0
    while True:
        if k > 0 and k % layout.check_every == 0 and plan.may_run(k):
            plan.set_flags(k, [finish_step(b) <= k for b in range(layout.num_rows)])
        if plan.begin(k) is None:
            return plan.record()
        k += 1


def record_to_json(record: RowRecord) -> dict:
    return {"layout": dataclasses.asdict(record.layout), "checks": {str(k): v for k, v in record.checks.items()},
            "log": [_event_json(e) for e in record.log], "num_steps": record.num_steps, "row_steps": record.row_steps,
            "forces": {str(k): [_event_json(e) for e in v] for k, v in record.forces.items()},
            "away": {str(k): v for k, v in record.away.items()}}


def record_from_json(d: dict) -> RowRecord:
    lay = dict(d["layout"])
    for key in ("prompt_lens", "entry_of", "switch"):
        lay[key] = tuple(lay[key])
    lay["entry_rows"] = tuple(tuple(r) for r in lay["entry_rows"])
    if lay.get("lengths") is not None:
        lay["lengths"] = tuple(lay["lengths"])
    log = [_event(dict(e)) for e in d["log"]]
    forces = {int(k): [_event(dict(e)) for e in v] for k, v in d["forces"].items()}
    return RowRecord(RowLayout(**lay), {int(k): list(v) for k, v in d["checks"].items()}, log, d["num_steps"],
                     d["row_steps"], forces, {int(k): list(v) for k, v in d["away"].items()})


def _event_json(e) -> dict:
    return {"event": type(e).__name__, **dataclasses.asdict(e)}


def _event(d: dict):
    cls = EVENTS[d.pop("event")]
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
