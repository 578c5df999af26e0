"""Every pipeline program we run, replayed under NCCL's point-to-point rules, on a model clock.

A *program* is one list of :class:`Step` per stage: receive some messages, compute, send some
messages. A step's sends are posted right after it computes; its receives just before it
(``ahead=False``, the sampler's executor) or before the previous step computes (``ahead=True``,
``RingSchedule``, so a transfer overlaps that computation). Where the operations run:

- ``streams="channels"`` (what ``parallel/p2p.py`` runs): each direction between two stages,
  (src, dst, lane), has a process group and so a communicator and stream of its own;
- ``streams="pair"`` (the schedules before their channels): both directions of a pair of ranks
  on one communicator's stream, as unbatched NCCL operations between two ranks are.

The rules, modelled on torch's ProcessGroupNCCL and NCCL (ENGINES.md, NCCL section):

1. Tags are ignored: the n-th send from a to b pairs with the n-th receive b posts from a. A
   pair whose n-th send and n-th receive are different messages is reported (on a GPU: a hang,
   an error, or a silently wrong tensor).
2. One stream per communicator and rank runs its operations in posting order; an operation
   starts when the one before it on its stream has completed and the computation posted before
   it has finished (the NCCL stream waits for the compute stream at posting).
3. A receive completes when its send has been posted; a send completes when its receive has
   been posted (rendezvous: a large send blocks until received; ``eager=True`` lets sends
   complete at once, as small ones may).
4. A computation starts when the previous one has finished and its receives have completed.

A program that cannot finish under these rules raises :class:`Deadlock` with the step where each
stage waits; a mismatched pair raises :class:`Mismatch`. Otherwise the result has the makespan,
the busy time per stage and the bubble, on the clock where a step lasts its ``cost`` and a
message ``latency``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import NamedTuple, Sequence

from rlt_mega.parallel.p2p import lane_of


class Msg(NamedTuple):
    src: int  # stage
    dst: int
    stream: str
    j: int = -1  # micro-batch
    t: int = -1  # position (or another index the schedule uses)


class Step(NamedTuple):
    name: str
    recvs: tuple = ()  # Msg, posted in this order before the computation
    sends: tuple = ()  # Msg, queued in this order after it
    cost: float = 0.0


class Deadlock(AssertionError):
    pass


class Mismatch(AssertionError):
    pass


class _Unit(NamedTuple):
    rank: int
    stream: tuple
    ops: tuple  # ("send" | "recv", Msg)
    after_compute: int  # index of the last computation posted before it (-1: none)
    waited_by: int  # the computation that waits for it (-1: none)


STREAMS = ("channels", "pair")


def _units(programs: Sequence[Sequence[Step]], streams: str, ahead: bool) -> list[list]:
    """Each stage's host events in posting order: ("unit", _Unit) and ("compute", k)."""
    if streams not in STREAMS:
        raise ValueError(f"streams={streams!r}: expected one of {STREAMS}")

    def key(m: Msg) -> tuple:
        if streams == "channels":
            return ("channel", m.src, m.dst, lane_of(m.stream))
        return ("pair",) + tuple(sorted((m.src, m.dst)))

    events = []
    for r, prog in enumerate(programs):
        ev: list = []

        def recvs(k: int, after: int) -> None:
            for m in prog[k].recvs:
                ev.append(("unit", _Unit(r, key(m), (("recv", m),), after, k)))

        if prog and ahead:
            recvs(0, -1)
        for k, step in enumerate(prog):
            if ahead and k + 1 < len(prog):
                recvs(k + 1, k - 1)  # posted before this step computes and sends
            elif not ahead:
                recvs(k, k - 1)
            ev.append(("compute", k))
            for m in step.sends:
                ev.append(("unit", _Unit(r, key(m), (("send", m),), k, -1)))
        events.append(ev)
    return events


def posting_order(programs: Sequence[Sequence[Step]], stage: int, ahead: bool) -> list[tuple[str, Msg]]:
    """The operations stage ``stage`` posts, in order: what its P2P log must show."""
    return [op for kind, u in _units(programs, "channels", ahead)[stage] if kind == "unit" for op in u.ops]


def _match(events: list[list]) -> dict[tuple, tuple]:
    """(unit id, op index) -> the partner's (unit id, op index), pairing by order per direction."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, ev in enumerate(events):
        for e, (kind, u) in enumerate(ev):
            if kind != "unit":
                continue
            lane = u.stream[3] if u.stream[0] == "channel" else None  # None: both directions share the stream
            for i, (op, m) in enumerate(u.ops):
                (sends if op == "send" else recvs)[(m.src, m.dst, lane)].append(((r, e, i), m))
    partner = {}
    for key in sorted(set(sends) | set(recvs), key=str):
        s, rv = sends.get(key, []), recvs.get(key, [])
        where = f"stages {key[0]} -> {key[1]}" + (f" ({key[2]} lane)" if key[2] else "")
        for n in range(max(len(s), len(rv))):
            if n >= len(s) or n >= len(rv):
                extra = (s if n < len(s) else rv)[n][1]
                raise Mismatch(f"{where}: {len(s)} sends but {len(rv)} receives; message {n} ({extra}) has no "
                               "partner")
            if s[n][1] != rv[n][1]:
                raise Mismatch(f"{where}: message {n} is sent as {s[n][1]} but received as {rv[n][1]} (NCCL "
                               "pairs by order alone)")
            partner[s[n][0]] = rv[n][0]
            partner[rv[n][0]] = s[n][0]
    return partner


def _longest_paths(deps: dict[tuple, list], plus: dict[tuple, float]) -> dict[tuple, float]:
    """Each node's finish time: the longest path to it (Kahn's order); nodes left out wait in a
    cycle."""
    users = defaultdict(list)
    missing = {}
    for node in plus:
        missing[node] = len(deps[node])
        for d in deps[node]:
            users[d].append(node)
    ready = deque(n for n, c in missing.items() if c == 0)
    value: dict[tuple, float] = {}
    while ready:
        n = ready.popleft()
        value[n] = max((value[d] for d in deps[n]), default=0.0) + plus[n]
        for u in users[n]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
    return value


def simulate_nccl(programs: Sequence[Sequence[Step]], streams: str = "channels", ahead: bool = True,
                  latency: float = 0.0, eager: bool = False) -> dict:
    """Runs the stages' programs under NCCL's rules (module docstring) -> {"makespan", "busy",
    "bubble"}; raises Mismatch or Deadlock. ``ahead``: a step's receives are posted before the
    previous step computes (the training ring) instead of just before the step (the sampler)."""
    events = _units(programs, streams, ahead)
    partner = _match(events)
    # Nodes: ("s", r, e) unit start, ("e", r, e) unit end, ("c", r, k) computation end.
    deps: dict[tuple, list] = defaultdict(list)
    plus: dict[tuple, float] = {}
    last_on_stream: dict[tuple, tuple] = {}
    for r, ev in enumerate(events):
        waits: dict[int, list] = defaultdict(list)
        for e, (kind, x) in enumerate(ev):
            if kind != "unit":
                continue
            start, end = ("s", r, e), ("e", r, e)
            if (r, x.stream) in last_on_stream:  # streams are per rank
                deps[start].append(last_on_stream[(r, x.stream)])
            if x.after_compute >= 0:
                deps[start].append(("c", r, x.after_compute))
            deps[end].append(start)
            for i, (op, _) in enumerate(x.ops):
                pr, pe, _ = partner[(r, e, i)]
                if op == "recv" or not eager:
                    deps[end].append(("s", pr, pe))
            plus[start], plus[end] = 0.0, latency
            last_on_stream[(r, x.stream)] = end
            if x.waited_by >= 0:
                waits[x.waited_by].append(end)
        for k in range(len(programs[r])):
            node = ("c", r, k)
            deps[node] += ([("c", r, k - 1)] if k > 0 else []) + waits[k]
            plus[node] = programs[r][k].cost
    value = _longest_paths(deps, plus)
    if len(value) < len(plus):
        raise Deadlock(f"deadlock under NCCL's rules ({streams}): " + _where(programs, events, value))
    P = len(programs)
    busy = [sum(s.cost for s in prog) for prog in programs]
    makespan = max([value[("c", r, len(programs[r]) - 1)] for r in range(P) if programs[r]], default=0.0)
    return {"makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (P * makespan) if makespan else 0.0}


def _where(programs, events, value) -> str:
    parts = []
    for r, prog in enumerate(programs):
        k = next((k for k in range(len(prog)) if ("c", r, k) not in value), None)
        if k is None:
            parts.append(f"stage {r} done")
            continue
        waiting = list(prog[k].recvs)
        parts.append(f"stage {r} at step {k} {prog[k].name}" + (f" (receives {waiting})" if waiting else ""))
    return "; ".join(parts)


def check_pairs(programs: Sequence[Sequence[Step]]) -> None:
    """Only rule 1: each direction's sends and receives are the same messages in the same order."""
    _match(_units(programs, "channels", True))
