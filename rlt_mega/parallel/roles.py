"""Sampler and learner roles in one job (grpo.sampler_replicas): the messages between them,
built so that a sampler replica that dies costs time, never the run.

The launcher's world is the learner's replica (tp x pp x dp ranks) then R sampler replicas of
n = tp x pp ranks each; each replica is torch.distributed's world of its ranks
(dims.init_distributed(replica_size=[n dp, n, ...])), so it builds its layout exactly as a
colocated job does. No collective spans two replicas: a lost sampler can leave no learner rank
waiting in one. The roles talk between the ranks at the same place of the tp x pp layout (the
same TP and PP rank, its "position"):

- weights: from the learner's data-parallel rank 0 at each position to the sampler ranks there,
  one point-to-point group of two per sampler (NCCL on GPUs, gloo here), the flat vector of its
  shard (gathered first from ZeRO-3's partitions by the sampling copy,
  parallel/sampling_copy.py), sent without waiting from a copy taken after the update (the
  learner may step again while it is in flight). A sampler receives every version on a thread
  of its own as soon as it is announced, and keeps the versions a data step still to be learned
  may need (a lost replica's steps are redone with their own versions). A copy is exact, so a
  sampler's version v is the learner's version v bit for bit. A send to a sampler that is lost
  is abandoned, never waited for.
- everything else through the launcher's store (the c10d TCPStore of the rendezvous, under
  ``{generation}/roles/``): where the samplers start (``RolesStart``); the latest version
  published; which replica owns data step j (``owner/j``, claimed by compare-and-set: the first
  data step not owned whose versions are out); each sampler rank's heartbeat; the replicas lost;
  and the rollouts, pickled in chunks under ``roll/j/d/position`` for the learner's
  data-parallel rank d (the store holds values of at most 8 MiB).

A sampler rank that stops beating for grpo.sampler_timeout_s seconds (or whose weights' send
fails) marks its replica lost (``lost/r``); a learner rank waiting for a data step whose owner is
lost gives the step back (``owner/j`` emptied, by compare-and-set: once), and the next replica
that looks claims it. Sampling is a function of the data step, its policy versions and seeds,
never of the replica, so the redone step is the lost one bit for bit. Every wait polls and has
a bound; the groups are made with grpo.sampler_timeout_s as their timeout.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from rlt_mega.log import get_logger
from rlt_mega.parallel.dims import launcher_store

log = get_logger(__name__)

LEARNER = 0
CHUNK = 4 << 20  # bytes per store value (the store's server refuses values over 8 MiB)
BEAT_S = 0.5  # a sampler rank's heartbeat period
POLL_S = 0.002  # how soon a waiting rank looks at the store again, at first
POLL_MAX_S = 0.05  # and at the latest


class Poll:
    """A waiting rank's pauses between looks at the store: POLL_S, growing to POLL_MAX_S (so that
    many ranks waiting long do not load the store's server)."""

    def __init__(self) -> None:
        self.pause = POLL_S

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(POLL_MAX_S, self.pause * 1.5)


class SamplerLost(RuntimeError):
    """This sampler replica was marked lost (a rank of it stopped): it stops too."""


_JOINED: Optional[tuple] = None  # (the learner's store, its generation) of a replica that joins


def join(address: str, timeout_s: float) -> None:
    """This process's replica joins a running job (``RLT_ROLES_JOIN=host:port[/generation]``:
    the learner's launcher store): the roles' keys and groups are made on that store."""
    global _JOINED
    where, _, generation = address.partition("/")
    host, _, port = where.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    _JOINED = (store, int(generation or 1))


def roles_store() -> tuple:
    """(the store the roles' keys live on, the run's generation)."""
    if _JOINED is not None:
        return _JOINED
    store, _, generation = launcher_store()
    return store, generation


def role_group(name: str, rank: int, size: int, device: torch.device, timeout_s: float):
    """A group of the roles (``name``: the same on each of its ``size`` members; ``rank`` this
    process's there), made directly on the launcher's store with a timeout of ``timeout_s`` (its
    creation and each message: a lost peer raises instead of hanging); not registered with
    torch.distributed (messages go through its methods)."""
    store, generation = roles_store()
    prefixed = dist.PrefixStore(f"{generation}/roles/{name}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class RoleStore:
    """The roles' keys on the launcher's store (this run's generation), or on ``store``."""

    def __init__(self, store: Optional[dist.Store] = None) -> None:
        if store is None:
            store, generation = roles_store()
            store = dist.PrefixStore(f"{generation}/roles/", store)
        self.store = store

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        return self.store.get(key).decode() if self.has(key) else default

    def count(self, key: str, add: int = 0) -> int:
        return self.store.add(key, add)

    def claim(self, key: str, expected: str, desired: str) -> bool:
        """Compare-and-set: ``key`` becomes ``desired`` if it holds ``expected`` ("": absent)."""
        return self.store.compare_set(key, expected, desired).decode() == desired

    def put(self, key: str, obj: Any) -> int:
        """``obj`` pickled in chunks, its header (the chunk count) last -> the bytes."""
        data = pickle.dumps(obj)
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self.store.set(key, str(len(chunks)))
        return len(data)

    def take(self, key: str) -> Any:
        """The object ``put`` under ``key`` (present), its keys deleted."""
        n = int(self.store.get(key))
        data = b"".join(self.store.get(f"{key}/{i}") for i in range(n))
        for i in range(n):
            self.store.delete_key(f"{key}/{i}")
        self.store.delete_key(key)
        return pickle.loads(data)


class SamplerPool:
    """A learner rank's view of the sampler replicas: alive while each of their ``positions``
    ranks beats (``beat/r/position`` grows) at least every ``timeout_s`` seconds, lost once one
    does not (or once any rank marked it lost: ``lost/r``, which every rank reads). Replicas that
    join a running job (``joined``) are numbered on from ``num``."""

    def __init__(self, store: RoleStore, num: int, positions: int, timeout_s: float) -> None:
        self.store, self.base, self.num, self.positions, self.timeout_s = store, num, num, positions, timeout_s
        self.lost: dict[int, str] = {}
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}
        self._checked = 0.0

    def alive(self, refresh: bool = True) -> list[int]:
        if refresh:
            self.refresh()
        return [r for r in range(self.num) if r not in self.lost]

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < BEAT_S:
            return
        self._checked = now
        self.num = self.base + self.store.count("joined")
        for r in range(self.num):
            if r in self.lost:
                continue
            why = self.store.get(f"lost/{r}")
            if why is not None:
                self._note(r, why)
                continue
            for pos in range(self.positions):
                beats = self.store.count(f"beat/{r}/{pos}")
                last = self._seen.get((r, pos))
                if last is None or last[0] != beats:
                    self._seen[(r, pos)] = (beats, now)
                elif now - last[1] > self.timeout_s:
                    self.mark_lost(r, f"its rank at position {pos} sent no heartbeat for {now - last[1]:.0f} s "
                                      f"(grpo.sampler_timeout_s={self.timeout_s:g})")
                    break

    def mark_lost(self, r: int, why: str) -> None:
        if r in self.lost:
            return
        self.store.claim(f"lost/{r}", "", why)
        self._note(r, self.store.get(f"lost/{r}", why))

    def _note(self, r: int, why: str) -> None:
        self.lost[r] = why
        log.warning("GRPO roles: sampler replica %d is lost (%s); the others redo its data steps", r, why)


class Heartbeat:
    """A sampler rank's heartbeat: ``beat/r/position`` grows every BEAT_S seconds, on a thread
    (so that a long rollout never reads as a lost replica)."""

    def __init__(self, store: RoleStore, replica: int, position: int) -> None:
        self.store, self.key = store, f"beat/{replica}/{position}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.store.count(self.key, 1)
                self._stop.wait(BEAT_S)
        except Exception:  # the store is gone (the learner stopped): nothing left to tell
            return

    def stop(self) -> None:
        self._stop.set()


class WeightsReceiver:
    """A sampler rank's thread that receives versions ``first`` .. ``last`` from the learner as
    each is announced (``sent/position/v``), into flat vectors of ``numel`` x ``dtype``; keeps
    them until ``drop_below``; ``get(v)`` waits for version v."""

    def __init__(self, channel: "RoleChannel", numel: int, dtype: torch.dtype, first: int, last: int) -> None:
        self.channel, self.numel, self.dtype, self.first, self.last = channel, numel, dtype, first, last
        self.kept: dict[int, torch.Tensor] = {}
        self.error: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlt-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ch = self.channel
        try:
            for v in range(self.first, self.last + 1):
                poll = Poll()
                while not ch.store.has(f"sent/{ch.position}/{v}"):
                    if self._stop.is_set() or ch.store.has("stop"):
                        return
                    poll.sleep()
                flat = torch.empty(self.numel, dtype=self.dtype, device=ch.device)
                ch.pair.recv([flat], LEARNER, 0).wait()
                ch.store.set(f"recv/{ch.replica}/{ch.position}/{v}", "1")  # the learner's send is done
                with self._cond:
                    self.kept[v] = flat
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the sampling thread, which raises it
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def get(self, version: int) -> torch.Tensor:
        """Version ``version`` (waiting for it: the learner publishes in order)."""
        if not self.first <= version <= self.last:  # the pipeline's invariant, not a user error
            raise RuntimeError(f"policy version {version} is not published to this sampler ({self.first} .. "
                               f"{self.last})")
        while True:
            with self._cond:
                if version in self.kept:
                    return self.kept[version]
                if self.error is not None:
                    raise RuntimeError(f"the sampler's receipt of policy version {version} failed: "
                                       f"{self.error}") from self.error
                if not self._thread.is_alive():  # dropped already: the pipeline's invariant
                    raise RuntimeError(f"policy version {version} is no longer kept by this sampler")
                self._cond.wait(timeout=BEAT_S)
            self.channel.check_not_lost()

    def drop_below(self, version: int) -> None:
        with self._cond:
            self.kept = {v: x for v, x in self.kept.items() if v >= version}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * BEAT_S)


class RoleChannel:
    """This rank's end of the roles at its ``position`` of the tp x pp layout (``positions`` of
    them); ``role``: the learner's data-parallel rank (0 .. learner_dp - 1) on a learner rank,
    else learner_dp + r on sampler replica r (0 .. R - 1); ``device``: where weight messages live
    (CPU for gloo, this rank's GPU for NCCL); ``timeout_s``: grpo.sampler_timeout_s."""

    def __init__(self, num_samplers: int, learner_dp: int, position: int, role: int, device: torch.device,
                 positions: int = 1, timeout_s: float = 120.0, joining: int = 0) -> None:
        """``joining``: the replicas expected to join (grpo.samplers_join: grpo.sampler_replicas),
        which the learner waits for, at most ``timeout_s``, before it starts them."""
        self.device, self.rank, self.position, self.timeout_s, self.joining = device, role, position, timeout_s, joining
        self.learners = list(range(learner_dp))
        self.num_samplers = num_samplers
        self.store = RoleStore()
        self.replica = None if role < learner_dp else role - learner_dp
        self.pool = SamplerPool(self.store, num_samplers, positions, timeout_s)
        self.pairs: dict[int, Any] = {}  # learner: sampler replica -> its weights' group at this position
        self.pair = None  # sampler: the learner's weights group
        self.heartbeat = None
        self.bytes_sent = 0  # weights sent by this rank in the last publication
        self._handle = None  # the last publication (its sends, the flat vector, its version, when)
        self._tasks = 0
        self._done: set[int] = set()  # data steps this replica sampled
        if self.replica is not None:
            self.heartbeat = Heartbeat(self.store, self.replica, position)
            self.pair = role_group(f"weights{position}/{self.replica}", 1, 2, device, timeout_s)
        elif self.publishes:
            for r in range(num_samplers):
                self.pairs[r] = role_group(f"weights{position}/{r}", 0, 2, device, timeout_s)

    @property
    def is_learner(self) -> bool:
        return self.replica is None

    @property
    def publishes(self) -> bool:
        """Whether this rank sends the learner's weights (its data-parallel rank 0)."""
        return self.rank == LEARNER

    # ------------------------------------------------------------------ the learner's end
    def begin(self, start: Any) -> None:
        """Where every sampler starts (written once, by the learner's first rank), once the
        replicas expected to join have (or grpo.sampler_timeout_s has passed)."""
        t0, poll = time.monotonic(), Poll()
        while self.store.count("joined") < self.joining and time.monotonic() - t0 < self.timeout_s:
            poll.sleep()
        if self.rank == LEARNER and self.position == 0:
            self.store.put("start", start)

    def announce(self, version: int) -> None:
        """Version ``version`` is published (the samplers may claim the data steps it samples)."""
        if self.rank == LEARNER and self.position == 0:
            self.store.set("published", str(version))

    def receive(self, step: int) -> tuple[Any, float]:
        """Data step ``step``'s share of this learner rank -> (its ``Generated``, seconds waited).
        While waiting, a step whose owner is lost is given back to the pool."""
        t0 = time.perf_counter()
        key = f"roll/{step}/{self.rank}/{self.position}"
        none_since = None  # since when no replica is alive
        poll = Poll()
        while not self.store.has(key):
            self.pool.refresh()
            if self.publishes:
                self._admit(None)
            owner = self.store.get(f"owner/{step}", "")
            if owner and int(owner) in self.pool.lost:
                self.store.claim(f"owner/{step}", owner, "")  # once, whichever rank sees it first
            if self.pool.alive(refresh=False):
                none_since = None
            elif none_since is None:
                none_since = time.monotonic()
            elif time.monotonic() - none_since > self.timeout_s:
                lost = "; ".join(f"{r}: {w}" for r, w in sorted(self.pool.lost.items())) or "none joined"
                raise RuntimeError(f"no sampler replica alive for grpo.sampler_timeout_s={self.timeout_s:g} s ({lost}) "
                                   f"while the learner waits for data step {step}: the job stops; start samplers "
                                   "(RLT_ROLES_JOIN) or resume it (train.resume=auto) with samplers running")
            poll.sleep()
        item = self.store.take(key)
        self.store.set(f"got/{key}", "1")
        return item, time.perf_counter() - t0

    def publish(self, params: list[torch.Tensor] | torch.Tensor, previous: Optional[Any], version: int
                ) -> tuple[Any, float]:
        """On the learner: posts version ``version`` (``params`` copied; or a flat vector of them)
        to every sampler replica not lost -> (its handle, seconds spent: the copy, and waiting for
        ``previous`` to reach every such sampler first); (None, 0.0) on the learner's other
        data-parallel ranks."""
        if not self.publishes:
            return None, 0.0
        t0 = time.perf_counter()
        self.settle(previous)
        if torch.is_tensor(params):
            flat = params.detach().to(self.device, copy=True)
        else:
            flat = parameters_to_vector([p.detach() for p in params]).to(self.device)
        self._admit(version)
        works = {}
        for r in self.pool.alive(refresh=False):
            if r not in self.pairs:  # joined after this position's admission: from the next version
                continue
            try:
                works[r] = self.pairs[r].send([flat], 1, 0)
            except Exception as exc:  # the peer closed its end (gloo says so when posting)
                self.pool.mark_lost(r, f"the weights' send failed: {exc}".splitlines()[0])
        self.store.set(f"sent/{self.position}/{version}", "1")
        self.bytes_sent = flat.numel() * flat.element_size() * len(works)
        self._handle = (works, flat, version, time.monotonic())
        return self._handle, time.perf_counter() - t0

    def _admit(self, version: Optional[int]) -> None:
        """Replicas that joined since: their weights' group at this position, and the first version
        they receive (``first/r/position``): ``version``, about to be published, or (None: while
        the learner waits for a data step) the last one published, sent to it now."""
        if version is not None:
            self.pool.refresh(force=True)
        elif self._handle is None:  # nothing published yet
            return
        for r in range(len(self.pairs), self.pool.num):
            self.pairs[r] = role_group(f"weights{self.position}/{r}", 0, 2, self.device, self.timeout_s)
            first = version if version is not None else self._handle[2]
            self.store.set(f"first/{r}/{self.position}", str(first))
            if version is None:  # settled with the last publication's other sends
                self._handle[0][r] = self.pairs[r].send([self._handle[1]], 1, 0)
            log.warning("GRPO roles: sampler replica %d joined; it receives policy versions from %d on", r, first)

    def settle(self, handle: Optional[Any]) -> None:
        """Waits until a publication reached every sampler it was sent to that is not lost (each
        says so in the store: a send's completion cannot be polled on every backend); a sampler
        that does not take it within grpo.sampler_timeout_s, or whose send fails, is lost."""
        if handle is None:
            return
        works, _, version, posted = handle
        for r, work in works.items():
            key = f"recv/{r}/{self.position}/{version}"
            poll = Poll()
            while r not in self.pool.lost:  # a lost peer's send is abandoned
                if self.store.has(key):
                    try:
                        work.wait()
                    except Exception as exc:  # the peer closed its end
                        self.pool.mark_lost(r, f"the weights' send failed: {exc}".splitlines()[0])
                    break
                if time.monotonic() - posted > self.timeout_s:
                    self.pool.mark_lost(r, f"it did not receive policy version {version} in "
                                           f"grpo.sampler_timeout_s={self.timeout_s:g} s")
                    break
                self.pool.refresh()
                poll.sleep()

    def stop(self) -> None:
        """Every data step was received: the samplers stop."""
        if self.rank == LEARNER and self.position == 0:
            self.store.set("stop", "1")

    # ------------------------------------------------------------------ a sampler's end
    def check_not_lost(self) -> None:
        why = self.store.get(f"lost/{self.replica}")
        if why is not None:
            raise SamplerLost(f"sampler replica {self.replica} was marked lost ({why}): it stops")

    def wait_start(self) -> Any:
        poll = Poll()
        while not self.store.has("start"):
            poll.sleep()
        n = int(self.store.store.get("start"))
        return pickle.loads(b"".join(self.store.store.get(f"start/{i}") for i in range(n)))

    def weights_receiver(self, numel: int, dtype: torch.dtype, first: int, last: int) -> WeightsReceiver:
        return WeightsReceiver(self, numel, dtype, first, last)

    def published(self) -> int:
        return int(self.store.get("published", "-1"))

    def first_version(self, positions: Optional[int] = None) -> Optional[int]:
        """On a replica that joined a running job: the first version the learner sends it at this
        position (``positions``: the newest of that over every position) -> None on the others."""
        if self.replica is None or self.replica < self.num_samplers:
            return None
        keys = [f"first/{self.replica}/{p}" for p in ([self.position] if positions is None else range(positions))]
        poll = Poll()
        while not all(self.store.has(k) for k in keys):
            self.check_not_lost()
            poll.sleep()
        return max(int(self.store.get(k)) for k in keys)

    def next_task(self, first: int, end: int, target, oldest=None) -> Optional[int]:
        """The next data step this replica samples (the same on each of its ranks), or None when
        the learner has every data step: position 0's rank claims the first data step in
        [first, end) that no live replica owns and whose versions are published
        (``target(j)``: the newest version data step j needs; ``oldest`` (j, version): a data
        step's oldest, where this replica joined at ``version``), and tells the others."""
        key = f"task/{self.replica}/{self._tasks}"
        self._tasks += 1
        if self.position == 0:
            j = self._claim(first, end, target, oldest)
            self.store.set(key, "stop" if j is None else str(j))
        poll = Poll()
        while not self.store.has(key):
            self.check_not_lost()
            poll.sleep()
        value = self.store.get(key)
        return None if value == "stop" else int(value)

    def _claim(self, first: int, end: int, target, oldest=None) -> Optional[int]:
        mine = str(self.replica)
        if oldest is not None:  # a replica that joined: the steps whose versions it receives
            start, joined = oldest
            first = next(j for j in range(first, end + 1) if j == end or start(j) >= joined)
        poll = Poll()
        while True:
            if self.store.has("stop"):
                return None
            self.check_not_lost()
            published = self.published()
            for j in range(max(first, published), end):  # steps below published are learned
                if target(j) > published:
                    break
                if self.store.claim(f"owner/{j}", "", mine) and j not in self._done:
                    return j
            poll.sleep()

    def put(self, step: int, share: int, obj: Any) -> None:
        """This rank's part of data step ``step``'s share ``share`` for the learner (skipped where
        that learner rank took it already: a redone step)."""
        key = f"roll/{step}/{share}/{self.position}"
        if not self.store.has(f"got/{key}"):
            self.store.put(key, obj)

    def done(self, step: int) -> None:
        self._done.add(step)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
