"""Bounded staleness for GRPO (grpo.max_staleness = s), as a fixed pipeline.

Policy version v is the policy after v GRPO steps. The samples of data step j (its prompts,
seeds and order: exactly those synchronous GRPO draws at step j) are drawn by version
max(0, j - s), and learner step k learns from data step k. So step k's staleness is
min(k, s), fixed by k and s alone, never "whatever is ready": two runs are the same run, and
s = 0 is synchronous GRPO (sample step k, learn it) through the same code, bit for bit.

Colocated form (train/grpo.py): at the start of step k, with the parameters of version k, the
job samples every data step not yet queued up to k + s (steps 0..s at the first step, one
step after), then learns the queue's head, data step k. Between steps the queue holds data
steps k + 1 .. k + s, drawn by versions that no longer exist, so it cannot be regenerated: it
is part of every rank's checkpoint (``state_dict``: each rank keeps its own part of the
rollouts, the mu of its pipeline stage, its replica's prompts), and a resumed run learns
exactly what the uninterrupted one would have. A checkpoint whose queue is not empty resumes
under the max_staleness it was written with, on any layout (``resplit``: another dp too).

Partial rollouts (grpo.partial_rollouts = n >= 1): data step j's rollout calls start under
version max(0, j - s - 1) and switch to version max(0, j - s) before decode step
k* = C * ceil(n / C) of the call (a memory-block boundary: every memory block is decoded and
encoded under one version), so a sampler can start a data step before the weights it ends with
exist (``DataStepVersions``). A data step's calls (minibatches, dynamic sampling's rounds) run
in order, and once one of them has switched, the rest run under the new version: versions only
move forward, as a sampler receiving weights does. The colocated job keeps the parameters of
versions k - 1 and k at step k (``KeptVersions``, version k - 1 in every rank's checkpoint);
a sampler role receives them (``ReceivedVersions``). Step k's lag is k minus its data step's
start version; the tokens' own versions give the staleness metrics.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.utils import parameters_to_vector

from rlt_mega.config import ConfigError
from rlt_mega.log import get_logger
from rlt_mega.parallel.roles import PoolEnded, RoleChannel
from rlt_mega.train.grpo_rounds import Round
from rlt_mega.train.loop import StopAfter

log = get_logger(__name__)


def queue_types() -> tuple:
    """The plain records a queue's state holds (the queued samples, their rollouts and recorded
    schedules: typed events, no callables): the allow-list of job_rank*.pt's weights-only load."""
    from rlt_mega.schedule import rows
    from rlt_mega.rollout.processing import Processing
    from rlt_mega.rollout.sampler import Rollout, Schedule
    from rlt_mega.rollout.turns import EpisodeStats

    return (*rows.EVENTS.values(), rows.FromBatch, rows.FromParked, rows.Fresh, rows.RowRecord, rows.RowLayout,
            Processing, Rollout, Schedule, EpisodeStats, Generated, Round)


@dataclass
class Generated:
    """Data step ``step``'s rounds (one, or dynamic sampling's), sampled by policy ``version``
    (the version it started under: with partial rollouts later tokens may be one newer,
    ``Rollout.version``)."""

    step: int
    version: int
    rounds: list[Round]
    sampling: dict[str, float]  # dynamic sampling's counts
    t_generate: float = 0.0  # seconds the sampling took
    idle: float = 0.0  # seconds the sampler waited for weights before it (roles)
    order: Optional[dict] = None  # the data order's state after it (roles: the learner follows it)
    replica: int = -1  # the sampler replica that sampled it (roles)

    def lag(self, learner_step: int) -> int:
        return learner_step - self.version


# ---------------------------------------------------------------------- policy versions
@dataclass(frozen=True)
class VersionPlan:
    """Which policy versions data step j's rollout calls run under (the module docstring)."""

    max_staleness: int
    partial_rollouts: int
    memory_block: int

    def target(self, data_step: int) -> int:
        """The newest version data step ``data_step``'s tokens may come from."""
        return max(0, data_step - self.max_staleness)

    def start(self, data_step: int) -> int:
        """The version data step ``data_step``'s rollouts start under."""
        return max(0, data_step - self.max_staleness - 1) if self.partial_rollouts else self.target(data_step)

    @property
    def switch_step(self) -> int:
        return self.memory_block * -(-self.partial_rollouts // self.memory_block)  # n rounded up to a block


class DataStepVersions:
    """The versions of data step ``data_step``'s rollout calls (``plan``); ``holder`` makes the
    sampling module's parameters a version (``KeptVersions``, ``ReceivedVersions``)."""

    def __init__(self, data_step: int, plan: VersionPlan, holder) -> None:
        self.target, self.start, self.switch_step = plan.target(data_step), plan.start(data_step), plan.switch_step
        self.holder, self.switched = holder, False

    def call(self) -> dict:
        """The next call's ``Sampler.generate`` arguments (version, switch, load)."""
        if self.switched or self.start == self.target:
            return {"version": self.target, "switch": (), "load": self.load}
        return {"version": self.start, "switch": (self.switch_step, self.target), "load": self.load}

    def load(self, version: int) -> None:
        self.holder.load(version)
        self.switched |= version == self.target != self.start


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    return parameters_to_vector([p.detach() for p in module.parameters()]).clone()


def copy_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """The flat vector's values into ``params``, in place (torch's ``vector_to_parameters`` would
    make them views of ``flat`` instead: an optimizer step would then write into the copy)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class KeptVersions:
    """The colocated job at step ``live``: ``kept`` flat copies of versions (live - 1 and live
    with partial rollouts, none without), written into ``module``'s parameters in place;
    ``restore`` puts the live version back after sampling."""

    def __init__(self, module: torch.nn.Module, kept: dict[int, torch.Tensor], live: int) -> None:
        self.params, self.kept, self.version, self.live = list(module.parameters()), kept, live, live

    def load(self, version: int) -> None:
        if version == self.version:
            return
        if version not in self.kept:  # the pipeline's invariant, not a user error
            raise RuntimeError(f"policy version {version} is not kept (versions {sorted(self.kept)} at step "
                               f"{self.live})")
        copy_into(self.kept[version].to(self.params[0].device), self.params)
        self.version = version

    def restore(self) -> None:
        self.load(self.live)


class PolicyHistory:
    """Flat copies of the policy versions the learner still needs beside its live one: version
    done - 1 under partial rollouts (the next rollouts start under it), and under
    grpo.verify_onpolicy every version that sampled a queued data step (the on-policy check
    replays the samples under their own version, train/grpo_learn.py). In every rank's checkpoint."""

    def __init__(self, plan: VersionPlan, verify: bool) -> None:
        self.plan, self.verify = plan, verify
        self.kept: dict[int, torch.Tensor] = {}

    def oldest_needed(self, done: int) -> int:
        """The oldest version that step ``done`` or a later one still uses."""
        oldest = done - 1 if self.plan.partial_rollouts else done
        return min(oldest, self.plan.start(done)) if self.verify else oldest

    def begin_step(self, done: int, module: torch.nn.Module) -> None:
        """At the start of step ``done`` (``module`` holds version ``done``): keeps a copy of it if
        a later step needs it, drops the versions no step needs any more."""
        if self.oldest_needed(done + 1) <= done:
            self.kept[done] = flat_parameters(module)
        self.kept = {v: x for v, x in self.kept.items() if v >= self.oldest_needed(done)}

    def holds(self, versions) -> bool:
        return all(v in self.kept for v in versions)

    def state_dict(self, done: int) -> dict:
        """``previous``: version done - 1 (what a checkpoint held before versions were kept for the
        check; None without it)."""
        return {"previous": self.kept.get(done - 1), "versions": dict(self.kept)}

    def load_state_dict(self, state: Optional[dict], step: int) -> None:
        state = state or {}
        kept = state.get("versions")
        if kept is None:  # a checkpoint that holds version step - 1 only
            kept = {} if state.get("previous") is None else {step - 1: state["previous"]}
        self.kept = dict(kept)


class ReceivedVersions:
    """A sampler role's parameters: versions arrive in order from the learner on the channel's
    receiving thread (parallel/roles.py), which keeps the ones a data step still to be learned
    may need (a lost replica's steps are redone under their own versions); ``waited`` sums the
    seconds spent waiting for them."""

    def __init__(self, channel: RoleChannel, module: torch.nn.Module, first: int, last: int) -> None:
        """``first`` .. ``last``: the versions the learner publishes to this sampler."""
        self.params = list(module.parameters())
        self.receiver = channel.weights_receiver([p.numel() for p in self.params], self.params[0].dtype, first, last)
        self.version: Optional[int] = None  # the version in the parameters (None: the initial ones)
        self.waited = 0.0

    def load(self, version: int) -> None:
        if version == self.version:
            return
        t0 = time.perf_counter()
        flat = self.receiver.get(version)
        self.waited += time.perf_counter() - t0
        copy_into(flat.to(self.params[0].device), self.params)
        self.version = version

    def drop_below(self, version: int) -> None:
        self.receiver.drop_below(version)

    def restore(self) -> None:
        pass

    def close(self) -> None:
        self.receiver.close()


@dataclass(frozen=True)
class ShareCut:
    """How this run cuts a replica's rows of a data step (train/grpo_settings.py ``RowCut``): share
    ``share`` of ``dp`` replicas, ``minibatch_rows`` rows per minibatch in rollout batches of
    ``batch_rows``, groups of ``group_size`` rows (a prompt's completions, contiguous)."""

    dp: int
    share: int
    minibatch_rows: int
    batch_rows: int
    group_size: int


def resplit(items: list[Generated], cut: ShareCut) -> Generated:
    """One data step's queued items of every saved replica (``items[d]``: replica d's share of
    the step's global batch) -> share ``cut.share`` of ``cut.dp``, as this layout samples it.

    A replica d of D holds every D-th prompt of the global batch from d (``RecordOrder.take``), so
    its row i is the global batch's row of prompt d + D * (i // G); on this layout that prompt is
    share p % dp's, at its row (p // dp) * G + i % G, and its seed is the same
    (``request_seeds``: a function of the global row). A rollout batch is the unit that moves: it
    was sampled together and its recorded schedule replays it (replay == mu), so it is never cut
    or joined; batches that share a group move together. Per round and minibatch, the units of
    every saved replica, ordered by their first row's (share, row) on this layout, are dealt in
    blocks of this layout's minibatch rows, block ``share`` being this share's: exactly this
    layout's shares, rows in its order, where each unit's prompts belong to one share (always
    when replicas are merged; when they are split, where a batch holds at most one prompt),
    else the same rows in blocks of the right size. Rows, scores, penalties and kept groups
    (dynamic sampling's decisions, the saved run's) move with their rows; a round's reward
    failure counts (per replica, not per row) with the saved replica's first row; dynamic
    sampling's counts are recounted. What cannot move is refused naming the numbers: another
    global batch (grpo.prompts_per_step x dp) or group size, or rollout batches of another size
    than this layout cuts (train.grad_accum and the pipeline's pieces)."""
    first, D, G = items[0], len(items), cut.group_size
    if any(x.step != first.step or x.version != first.version or len(x.rounds) != len(first.rounds) for x in items):
        raise ConfigError(f"the checkpoint's queued data step {first.step} differs between its {D} replicas (steps "
                          f"{[x.step for x in items]}, versions {[x.version for x in items]}, rounds "
                          f"{[len(x.rounds) for x in items]}): it is damaged")
    rounds = [_resplit_round([x.rounds[r] for x in items], cut, first.step) for r in range(len(first.rounds))]
    minibatches = len(first.rounds[0].rollouts)
    prompts = cut.minibatch_rows * minibatches // G
    kept = sum(int(rnd.group_keep.sum()) for rnd in rounds)
    counts = {"sampling/prompts_drawn": float(len(rounds) * prompts), "sampling/groups_kept": float(kept),
              "sampling/groups_dropped": float(len(rounds) * prompts - kept), "sampling/rounds": float(len(rounds))}
    return Generated(first.step, first.version, rounds, {**first.sampling, **counts}, t_generate=first.t_generate,
                     idle=first.idle, order=first.order, replica=first.replica)


def _resplit_round(olds: list[Round], cut: ShareCut, step: int) -> Round:
    D, G, mr, br = len(olds), cut.group_size, cut.minibatch_rows, cut.batch_rows
    rows = [len(rnd.rows) for rnd in olds]
    minibatches = len(olds[0].rollouts)
    if len(set(rows)) > 1 or rows[0] * D != mr * minibatches * cut.dp:
        raise ConfigError(
            f"the checkpoint queues data step {step} as {D} replicas x {rows[0]} rows, and this run's global batch is "
            f"dp={cut.dp} x {mr * minibatches} rows (grpo.prompts_per_step x grpo.group_size): resume with "
            f"grpo.prompts_per_step={rows[0] * D // (G * cut.dp) if rows[0] * D % (G * cut.dp) == 0 else '?'} "
            f"(the same global batch of {rows[0] * D // G} prompts; the same grpo.group_size and grpo.minibatches)")
    sizes = {ro.batch_size for rnd in olds for mb in rnd.rollouts for ro in mb}
    if sizes != {br}:
        raise ConfigError(
            f"the checkpoint queues data step {step} in rollout batches of {sorted(sizes)} rows, and this run cuts its "
            f"minibatches of {mr} rows into batches of {br} (train.grad_accum x the pipeline's pieces per "
            "minibatch): a rollout batch replays as it was sampled and is never cut or joined; resume with "
            f"train.grad_accum and parallel.micro_batches that cut {mr // min(sizes)} batches of "
            f"{min(sizes)} rows per minibatch")
    mine: list[list[tuple[int, int, int]]] = []  # [minibatch] (saved replica, first local row, rows) of each unit
    for k in range(minibatches):
        units = []  # (key on this layout, saved replica, first local row, rows)
        for d, rnd in enumerate(olds):
            a = k * (rows[0] // minibatches)
            for j, ro in enumerate(rnd.rollouts[k]):
                if j == 0 or a % G == 0:  # a batch starting inside a group joins the one before
                    p = d + D * (a // G)
                    units.append(((p % cut.dp, (p // cut.dp) * G + a % G), d, a, 0))
                key, dd, start, n = units[-1]
                units[-1] = (key, dd, start, n + ro.batch_size)
                a += ro.batch_size
        units.sort()
        at, block = 0, []
        for _, d, start, n in units:  # every share's blocks checked, so that every rank refuses alike
            if start % G or n % G or at // mr != (at + n - 1) // mr:
                raise ConfigError(
                    f"the checkpoint's queued data step {step}: a group of {G} rows or a run of rollout batches "
                    f"sampled together ({n} rows) would fall across this layout's replicas (minibatches of {mr} "
                    f"rows on dp={cut.dp}): resume with parallel.dp={D}, or with train.grad_accum cutting "
                    "batches of whole groups")
            if at // mr == cut.share:
                block.append((d, start, n))
            at += n
        mine.append(block)
    out_rows, scores, penalties, keep, rollouts = [], [], [], [], []
    for k, block in enumerate(mine):
        batches = []
        for d, start, n in block:
            rnd = olds[d]
            out_rows += rnd.rows[start:start + n]
            scores += rnd.scores[start:start + n]
            penalties += rnd.penalties[start:start + n]
            keep.append(rnd.group_keep[start // G:(start + n) // G])
            a = k * (rows[0] // minibatches)
            for ro in rnd.rollouts[k]:
                if start <= a < start + n:
                    batches.append(ro)
                a += ro.batch_size
        rollouts.append(batches)
    firsts = {d for block in mine for d, start, _ in block if start == 0}  # the replicas whose row 0 is here
    return Round(out_rows, rollouts, scores, penalties, sum(olds[d].failures for d in firsts),
                 sum(olds[d].nonfinite for d in firsts),
                 group_keep=torch.cat(keep) if keep else torch.zeros(0, dtype=torch.bool))


class StalenessPipeline:
    """The queue of sampled data steps; ``layout`` names the rank's place (dp, tp, pp, rank). A
    queue resumes under its max_staleness and partial_rollouts, on any layout: on the same one
    each rank takes its own, on another each rank takes every saved replica's queue (from its
    last stage, train/loop.py ``source_ranks``) and keeps its share (``load_moved``, ``resplit``)."""

    def __init__(self, max_staleness: int, layout: tuple, partial_rollouts: int = 0) -> None:
        self.max_staleness, self.layout, self.partial_rollouts = max_staleness, tuple(layout), partial_rollouts
        self.queue: deque[Generated] = deque()

    def to_sample(self, done: int) -> range:
        """The data steps to sample at the start of step ``done`` (with version ``done``)."""
        start = self.queue[-1].step + 1 if self.queue else done
        return range(start, done + self.max_staleness + 1)

    def push(self, item: Generated) -> None:
        self.queue.append(item)

    def pop(self, done: int) -> Generated:
        item = self.queue.popleft()
        if item.step != done:  # the pipeline's invariant, not a user error
            raise RuntimeError(f"GRPO step {done}: the staleness queue's head is data step {item.step}")
        return item

    def state_dict(self) -> dict:
        return {"max_staleness": self.max_staleness, "layout": self.layout, "partial_rollouts": self.partial_rollouts,
                "queue": list(self.queue)}

    def load_state_dict(self, state: Optional[dict], step: int) -> None:
        """``state`` None: the checkpoint has no queue for this rank (then none may be needed)."""
        queue = [] if state is None else state["queue"]
        self._check(state, len(queue), step)
        if queue and queue[0].step != step:
            raise ConfigError(f"the checkpoint at step {step} queues data step {queue[0].step} first: it is damaged")
        self.queue = deque(queue)

    def load_moved(self, states: list[Optional[dict]], step: int, cut: ShareCut) -> None:
        """On another layout: ``states[d]``, saved replica d's queue (None: its file is missing),
        each data step re-split into this rank's share (``resplit``)."""
        missing = [d for d, s in enumerate(states) if s is None]
        if missing and self.max_staleness > 0 and step > 0:
            self._check(None, 0, step)
        queues = [s["queue"] for s in states if s is not None]
        if missing or not any(queues):
            self.load_state_dict(None if missing or not states else states[0], step)
            return
        self._check(states[0], len(queues[0]), step)
        if len({len(q) for q in queues}) > 1 or any(q[0].step != step for q in queues):
            steps = [[x.step for x in q] for q in queues]
            raise ConfigError(f"the checkpoint at step {step} queues data steps {steps} on its replicas: it is damaged")
        self.queue = deque(resplit([q[i] for q in queues], cut) for i in range(len(queues[0])))

    def _check(self, state: Optional[dict], queued: int, step: int) -> None:
        partial = 0 if state is None else state.get("partial_rollouts", 0)
        if queued and (state["max_staleness"] != self.max_staleness or partial != self.partial_rollouts):
            raise ConfigError(
                f"the checkpoint at step {step} holds {queued} sampled steps queued for grpo.max_staleness="
                f"{state['max_staleness']}, partial_rollouts={partial} on layout {tuple(state['layout'])}; this run "
                f"has max_staleness={self.max_staleness}, partial_rollouts={self.partial_rollouts} on {self.layout}: "
                "resume with the checkpoint's, or start afresh")
        if not queued and step > 0 and self.max_staleness > 0:
            raise ConfigError(
                f"the checkpoint at step {step} holds no sampled steps for grpo.max_staleness={self.max_staleness} "
                "(it was written by a synchronous run, or this rank's file job_rank<r>.pt is missing): the queued "
                "samples of older policies cannot be regenerated; resume with grpo.max_staleness=0 or start afresh")


# ---------------------------------------------------------------------- where samples come from
class ColocatedSource:
    """The job samples on its own ranks (``sampling``: the sample phase, train/grpo_sample.py) with
    its parameters at the start of each step (``policy``), and under partial rollouts version
    done - 1 from ``history``."""

    def __init__(self, sampling, policy, history: PolicyHistory) -> None:
        self.sampling, self.policy, self.history = sampling, policy, history

    def fill(self, pipeline: StalenessPipeline, done: int) -> float:
        """Samples what the step needs -> seconds the learner idled meanwhile."""
        t0 = time.perf_counter()
        for data_step in pipeline.to_sample(done):
            sampler = self.policy.sampler()
            item, = self.sampling.sample(sampler, data_step, KeptVersions(sampler.model, self.history.kept, done))
            pipeline.push(item)
        return time.perf_counter() - t0

    def sampler_idle_fraction(self, item: Generated, step_seconds: float, fill_seconds: float) -> float:
        """The sampler (the same ranks) idles while the step learns."""
        return 1.0 - fill_seconds / max(step_seconds, 1e-9)

    def publish(self, done: int) -> float:
        return 0.0

    def pool_metrics(self, item: Generated) -> dict[str, float]:
        return {}

    def complete(self, pipeline: StalenessPipeline, done: int) -> None:
        """Before a save: the queue holds data steps done .. done + s - 1 already."""

    def close(self, pipeline: StalenessPipeline, done: int) -> None:
        pass


@dataclass
class RolesStart:
    """What the learner tells every sampler before its first data step (fresh or resumed at
    step ``done``): sample data steps ``first`` .. ``end`` + s - 1 (those it claims), with the
    data order in ``order``'s state (after data step first - 1), receiving policy versions
    ``version`` (the first one data step ``first``'s rollouts start under) .. ``last``."""

    first: int
    end: int
    version: int
    order: dict
    last: int


class RemoteSource:
    """The learner's end of the roles (grpo.sampler_replicas): data steps arrive from the pool of
    samplers (parallel/roles.py) in order, each from whichever replica claimed it (a lost
    replica's from the one that redoes it); weights are published after every step a sampler
    still needs (version v samples data step v + s, for data steps below ``end`` + s).

    ``begin`` starts the samplers at step ``done`` (0, or the step a run resumed at; it runs at
    the first use otherwise): the queue holds data steps done .. first - 1 already (a
    checkpoint's queue is complete), the samplers start at ``first`` with the learner's data
    order (``order``, which follows each data step received), and receive the versions that data
    step's rollouts run under (``plan``), ``done`` (``policy``'s parameters) and, with partial
    rollouts, ``done - 1`` (``history``: the checkpoint's previous parameters): so a run resumed
    with the roles continues as the uninterrupted one. The samplers stop after the step
    ``stop_after`` ends this process at (of ``steps``)."""

    def __init__(self, channel: RoleChannel, plan: VersionPlan, order, policy, history: PolicyHistory,
                 stop_after: StopAfter, steps: int) -> None:
        self.channel, self.plan, self.order, self.policy, self.history = channel, plan, order, policy, history
        self.stop_after, self.steps = stop_after, steps
        self.end: Optional[int] = None  # set by begin
        self._first = 0  # the first data step the samplers sample (set by begin)
        self._received = -1  # the last data step received
        channel.store.trusted = roles_types()

    def begin(self, pipeline: StalenessPipeline, done: int) -> None:
        if self.end is not None:
            return
        self.end = self.stop_after.end(done, self.steps)
        first = pipeline.to_sample(done).start
        version = self.plan.start(first)
        self.channel.begin(RolesStart(first, self.end, version, self.order.state_dict(), max(done, self.end - 1)))
        self._received, self._first = first - 1, first
        self.channel.prepare(self._parameters())
        for v in range(version, done + 1):
            if v < done and v not in self.history.kept:  # load_rank_state_dict refuses such a checkpoint first
                raise RuntimeError(f"policy version {v} is not kept at step {done}")
            params = self.history.kept[v] if v < done else self._parameters()
            self.channel.publish(params, v, keep_from=version)
        self.channel.announce(done)

    def _parameters(self) -> list[torch.Tensor]:
        """The engine's parameters as trained (ZeRO-3's partitioned: published from the
        partitions, never gathered whole, parallel/publication.py)."""
        return list(self.policy.engine.module.parameters())

    def _receive_through(self, pipeline: StalenessPipeline, step: int) -> float:
        waited = 0.0
        while self._received < step:
            item, w = self.channel.receive(self._received + 1)
            waited += w
            self._received = item.step
            self.order.load_state_dict(item.order)
            pipeline.push(item)
        return waited

    def fill(self, pipeline: StalenessPipeline, done: int) -> float:
        self.begin(pipeline, done)
        return self._receive_through(pipeline, done)

    def sampler_idle_fraction(self, item: Generated, step_seconds: float, fill_seconds: float) -> float:
        """Of the sampler's time for this data step: waiting (for a data step to claim, for
        weights) / (that + sampling)."""
        return item.idle / max(item.idle + item.t_generate, 1e-9)

    def pool_metrics(self, item: Generated) -> dict[str, float]:
        """The sampler replicas alive, the replica that sampled this data step (the step's
        ``sampler_idle_fraction`` is that replica's), the bytes of the last publication (every
        position's, summed on the learner's ranks by the caller's reduction: this rank's)."""
        return {"async/samplers_alive": float(len(self.channel.pool.alive())),
                "async/sampler_replica": float(item.replica),
                "async/weight_bytes": float(self.channel.bytes_sent),
                "async/weight_peak_bytes": float(self.channel.peak_bytes)}

    def publish(self, done: int) -> float:
        """``done`` steps are done: publishes version ``done`` if a data step below end + s needs it."""
        if done >= self.end:
            return 0.0
        seconds = self.channel.publish(self._parameters(), done, keep_from=self.plan.start(max(done, self._first)))
        self.channel.announce(done)
        return seconds

    def complete(self, pipeline: StalenessPipeline, done: int) -> None:
        self.begin(pipeline, done)
        self._receive_through(pipeline, done + self.plan.max_staleness - 1)

    def close(self, pipeline: StalenessPipeline, done: int) -> None:
        """At the end: whatever the samplers still send (their last data steps) is received,
        the last publication settled, and the samplers told to stop."""
        self.begin(pipeline, done)
        self._receive_through(pipeline, self.end + self.plan.max_staleness - 1)
        self.channel.settle()
        self.channel.stop()


def roles_types() -> tuple:
    """The records the roles pass through the store (``RoleStore.take``'s allow-list): a queue's
    (what a checkpoint's job_rank*.pt may hold, numpy's scalars included) and ``RolesStart``."""
    from rlt_mega.checkpoint import trusted_globals

    return (*trusted_globals(allow=queue_types()), RolesStart)


class OrderCursor:
    """A sampler's data order at any data step from ``start.first`` on (a lost replica's step may
    lie behind this replica's): each data step reserves a fixed number of prompts, so the order
    at step j is the start's with the steps before j skipped."""

    def __init__(self, sampling, start: RolesStart) -> None:
        self.sampling, self.start, self.at = sampling, start, start.first
        sampling.order.load_state_dict(start.order)

    def seek(self, data_step: int) -> None:
        if data_step < self.at:
            self.sampling.order.load_state_dict(self.start.order)
            self.at = self.start.first
        while self.at < data_step:
            self.sampling.skip(self.at)
            self.at += 1
        self.at = data_step + 1  # the sampling reserves its own


def run_sampler(sampling, policy, channel: RoleChannel) -> None:
    """A sampler rank's loop: told where to start (``RolesStart``: a fresh or a resumed run), it
    takes data steps from the pool (``channel.next_task``: the first one no live replica owns,
    below end + s; with more than one replica only once every version it needs is published, so
    that no replica ever waits inside a data step for a version that a lost replica's step holds
    back), samples each under version max(0, j - s) (received from the learner, parallel/roles.py)
    and hands each learner data-parallel rank its share. ``sampling``: the sample phase on this
    rank (train/grpo_sample.py, every learner rank's share), ``policy`` its model."""
    plan = sampling.plan
    channel.store.trusted = roles_types()
    start = channel.wait_start()
    last = start.end + plan.max_staleness  # data steps first .. last - 1
    try:
        joined = channel.first_version(channel.pool.positions)  # a replica that joined a running job
    except PoolEnded as exc:
        log.warning("GRPO roles: %s", exc)
        channel.close()
        return
    first_version = start.version if joined is None else channel.first_version()
    versions = ReceivedVersions(channel, policy.module(), first_version, start.last)
    cursor = OrderCursor(sampling, start)
    target = plan.target if channel.num_samplers > 1 or joined is not None else plan.start
    oldest = None if joined is None else (plan.start, joined)
    try:
        t_free = time.perf_counter()
        while (data_step := channel.next_task(start.first, last, target, oldest)) is not None:
            idle = time.perf_counter() - t_free
            versions.drop_below(plan.start(max(start.first, channel.published())))
            cursor.seek(data_step)
            waited = versions.waited
            shares = sampling.sample(policy.sampler(), data_step, versions)
            for share, item in zip(sampling.shares, shares):
                item.idle = idle + versions.waited - waited  # waiting for a step and weights
                item.t_generate -= versions.waited - waited
                item.replica = channel.replica
                channel.put(data_step, share, item)
            channel.done(data_step)
            t_free = time.perf_counter()
    finally:
        versions.close()
        channel.close()
