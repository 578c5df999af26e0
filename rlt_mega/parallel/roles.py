"""Sampler and learner roles in one job (grpo.sampler_replicas): the messages between them,
built so that a sampler replica that dies costs time, never the run.

The launcher's world is the learner's replica (tp x pp x dp ranks) then R sampler replicas of
n = tp x pp ranks each; each replica is torch.distributed's world of its ranks
(dims.init_distributed(replica_size=[n dp, n, ...])), so it builds its layout exactly as a
colocated job does. No collective spans two replicas: a lost sampler can leave no learner rank
waiting in one. The roles talk between the ranks at the same place of the tp x pp layout (the
same TP and PP rank, its "position"):

- weights: from the learner's data-parallel rank 0 at each position to the sampler ranks there,
  one point-to-point group of two per sampler (NCCL on GPUs, gloo here), in buckets gathered
  from the learner's data-parallel ranks' partitions one at a time, on a thread, while the
  learner steps on (parallel/publication.py: no rank holds more than one bucket of the gathered
  weights). A sampler receives every version on a thread of its own as soon as it is
  announced, and keeps the versions a data step still to be learned may need (a lost replica's
  steps are redone with their own versions). A copy is exact, so a sampler's version v is the
  learner's version v bit for bit. A send to a sampler that is lost is abandoned, never waited
  for.
- everything else through the launcher's store (the c10d TCPStore of the rendezvous, under
  ``{generation}/roles/``): where the samplers start (``RolesStart``); the latest version
  published; which replica owns data step j (``owner/j``, claimed by compare-and-set: the first
  data step not owned whose versions are out); each sampler rank's heartbeat; the replicas lost;
  and the rollouts, in chunks under ``roll/j/d/position`` for the learner's data-parallel rank
  d (the store holds values of at most 8 MiB), encoded by torch.save and read back weights-only
  with an allow-list of the roles' record types (``RoleStore.put``/``take``): a value planted in
  the store can name no other type and run no code.

A sampler rank that stops beating for grpo.sampler_timeout_s seconds (or whose weights' send
fails) marks its replica lost (``lost/r``); a learner rank waiting for a data step whose owner is
lost gives the step back (``owner/j`` emptied, by compare-and-set: once), and the next replica
that looks claims it. Sampling is a function of the data step, its policy versions and seeds,
never of the replica, so the redone step is the lost one bit for bit. Every wait polls and has
a bound; the groups are made with grpo.sampler_timeout_s as their timeout (the learner's
publishing group three times that: its messages may wait while rank 0 waits out a replica's
receipt), and a sampler posts each bucket's receive only once its send is announced.

A replica that joins (a restarted one: ``RLT_ROLES_JOIN``) is admitted by the learner at its next
publication, or while the learner waits for a data step; it receives every version from the
oldest one a data step still to be learned needs (``keep_from``), and claims only data steps no
live replica owns whose versions it has. So every step the learner waits for can be sampled by
any live replica, the joiner included, and nobody waits for the joiner.
"""

from __future__ import annotations

import datetime
import io
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlt_mega.log import get_logger
from rlt_mega.parallel.dims import launcher_store
from rlt_mega.parallel.publication import BucketLayout, Publisher

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


class PoolEnded(RuntimeError):
    """The job ended (every data step learned) before this joining replica was admitted."""


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


class UntrustedMessage(RuntimeError):
    """A value in the roles' store names a type outside the roles' records: it is not loaded."""


class RoleStore:
    """The roles' keys on the launcher's store (this run's generation), or on ``store``;
    ``trusted``: the record types ``take`` may build (besides tensors and plain containers)."""

    def __init__(self, store: Optional[dist.Store] = None, trusted: tuple = ()) -> None:
        if store is None:
            store, generation = roles_store()
            store = dist.PrefixStore(f"{generation}/roles/", store)
        self.store, self.trusted = store, tuple(trusted)

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
        """``obj`` (tensors, plain containers, the ``trusted`` records) by torch.save, in chunks,
        its header (the chunk count) last -> the bytes."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            self.store.set(f"{key}/{i}", chunk)
        self.store.set(key, str(len(chunks)))
        return len(data)

    def take(self, key: str, keep: bool = False) -> Any:
        """The object ``put`` under ``key`` (present), its keys deleted (``keep``: not), read
        weights-only: a value that names any other type or callable is refused, not run."""
        n = int(self.store.get(key))
        data = b"".join(self.store.get(f"{key}/{i}") for i in range(n))
        if not keep:
            for i in range(n):
                self.store.delete_key(f"{key}/{i}")
            self.store.delete_key(key)
        try:
            with torch.serialization.safe_globals(list(self.trusted)):
                return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:  # the weights-only unpickler refuses what is not on the list
            raise UntrustedMessage(f"GRPO roles: the value under {key!r} in the launcher's store is not one the roles "
                                   f"write (damaged, or naming a type or call outside their records: refused, not "
                                   f"run): "
                                   f"{str(exc).splitlines()[0][:200]}; is another process writing to this job's "
                                   "store (MASTER_ADDR:MASTER_PORT)?") from None


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
        self._lock = threading.RLock()  # the learner's thread and its publishing thread

    def alive(self, refresh: bool = True) -> list[int]:
        if refresh:
            self.refresh()
        return [r for r in range(self.num) if r not in self.lost]

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            self._refresh(force)

    def _refresh(self, force: bool) -> None:
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
        with self._lock:
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
    """A sampler rank's thread that receives versions ``first`` .. ``last`` from the learner, bucket
    by bucket (``layout``, parallel/publication.py) as each is announced (``sent/r/position/v/b``),
    into flat vectors of ``dtype``; keeps them until ``drop_below``; ``get(v)`` waits for version v."""

    def __init__(self, channel: "RoleChannel", layout: BucketLayout, dtype: torch.dtype, first: int, last: int
                 ) -> None:
        self.channel, self.layout, self.dtype, self.first, self.last = channel, layout, dtype, first, last
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
                flat = torch.empty(self.layout.numel, dtype=self.dtype, device=ch.device)
                for b in range(self.layout.num_buckets):
                    # Posted once its send is: so a receive never waits out the group's timeout
                    # while the learner waits for another replica's receipt of the bucket before.
                    key, poll = f"sent/{ch.replica}/{ch.position}/{v}/{b}", Poll()
                    while not ch.store.has(key):
                        if self._stop.is_set() or ch.store.has("stop"):
                            return
                        poll.sleep()
                    ch.store.store.delete_key(key)
                    a, e = self.layout.bounds(b)
                    buf = torch.empty(self.layout.dp, e - a, dtype=self.dtype, device=ch.device)
                    ch.pair.recv([buf], LEARNER, 0).wait()
                    ch.store.set(f"recv/{ch.replica}/{ch.position}/{v}/{b}", "1")  # the learner's send is done
                    self.layout.scatter(buf, b, flat)
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
    (CPU for gloo, this rank's GPU for NCCL); ``timeout_s``: grpo.sampler_timeout_s;
    ``bucket_mb``: grpo.publish_bucket_mb (the same on every rank of the job)."""

    def __init__(self, num_samplers: int, learner_dp: int, position: int, role: int, device: torch.device,
                 positions: int = 1, timeout_s: float = 120.0, joining: int = 0, bucket_mb: float = 64.0) -> None:
        """``joining``: the replicas expected to join (grpo.samplers_join: grpo.sampler_replicas),
        which the learner waits for, at most ``timeout_s``, before it starts them."""
        self.device, self.rank, self.position, self.timeout_s, self.joining = device, role, position, timeout_s, joining
        self.learners = list(range(learner_dp))
        self.num_samplers = num_samplers
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.store = RoleStore()
        self.replica = None if role < learner_dp else role - learner_dp
        self.pool = SamplerPool(self.store, num_samplers, positions, timeout_s)
        self.pairs: dict[int, Any] = {}  # learner: sampler replica -> its weights' group at this position
        self.pair = None  # sampler: the learner's weights group
        self.heartbeat = None
        self.publisher: Optional[Publisher] = None  # learner: made at the first publication
        self.keep_from = 0  # learner: the oldest version a data step still to be learned needs
        self._published = -1  # learner: the newest version published
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

    @property
    def bytes_sent(self) -> int:
        """The bytes of the last version published, over every replica it reached (this rank's)."""
        return 0 if self.publisher is None else self.publisher.bytes_sent

    @property
    def peak_bytes(self) -> int:
        """The most bytes of gathered weights this rank held at once while publishing, so far."""
        return 0 if self.publisher is None else self.publisher.live.peak

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

    def publish(self, params: list[torch.Tensor] | torch.Tensor, version: int, keep_from: int) -> float:
        """On every learner rank: posts version ``version`` (``params``: this rank's parameters,
        or a flat vector of whole ones) to every sampler replica not lost, in buckets, on the
        publishing thread (parallel/publication.py) -> seconds spent here (waiting for the last
        publication to be done, and the snapshot). ``keep_from``: the oldest version a data step
        still to be learned needs (a replica that joins receives those from it on)."""
        t0 = time.perf_counter()
        if self.publisher is None:  # the parameters' shapes
            self.prepare(params)
        self.settle()
        tensors = self.publisher.layout.split(params) if torch.is_tensor(params) else list(params)
        snapshot = self.publisher.layout.snapshot(tensors, self.rank, self.device)
        self.keep_from = keep_from
        targets = []
        if self.publishes:
            self._admit(version)
            targets = [r for r in self.pool.alive(refresh=False) if self.pairs.get(r) is not None]
        self.publisher.post(version, snapshot, keep_from, targets)
        self._published = version
        return time.perf_counter() - t0

    def prepare(self, params: list[torch.Tensor]) -> None:
        """The publishing thread, for ``params`` (the learner's parameters at this rank: their
        whole sizes, ZeRO-3's too) and its group of the learner's data-parallel ranks here (every
        learner rank calls this at the same point)."""
        if self.publisher is not None:
            return
        params = list(params)
        numels = [int(getattr(t, "ds_numel", t.numel())) for t in params]
        layout = BucketLayout.of(numels, len(self.learners), params[0].element_size(), self.bucket_bytes)
        group = None
        if len(self.learners) > 1:  # its messages wait while rank 0 waits for a bucket's receipts (one timeout)
            group = role_group(f"publish{self.position}", self.rank, len(self.learners), self.device,
                               3 * self.timeout_s)
        self.publisher = Publisher(self, layout, self.rank, group)

    def _admit(self, version: Optional[int]) -> None:
        """Replicas that joined since (data-parallel rank 0): their weights' group at this position,
        the first version they receive (``first/r/position``: keep_from, the oldest a data step
        still to be learned needs) and every version from it on: those published already sent
        again now (a job of the publishing thread), ``version`` (about to be published; None: while
        the learner waits for a data step) with the others'."""
        if version is not None:
            self.pool.refresh(force=True)
        elif self.publisher is None:  # nothing published yet
            return
        last = self._published
        for r in range(len(self.pairs), self.pool.num):
            try:
                self.pairs[r] = role_group(f"weights{self.position}/{r}", 0, 2, self.device, self.timeout_s)
            except Exception as exc:  # it died joining (the group's creation timed out): the job goes on
                self.pairs[r] = None
                self.pool.mark_lost(r, f"its weights' group was not made: {exc}".splitlines()[0])
                continue
            first = min(self.keep_from, last if version is None else version)
            self.store.set(f"first/{r}/{self.position}", str(first))
            for v in range(first, last + 1):
                self.publisher.post(v, None, self.keep_from, [r], kind="r")
            log.warning("GRPO roles: sampler replica %d joined; it receives policy versions from %d on", r, first)

    def taken(self, r: int, version: int, bucket: int, work, posted: float) -> bool:
        """Waits until replica ``r`` took bucket ``bucket`` of version ``version`` (it says so in the
        store: a send's completion cannot be polled on every backend) -> True; a replica that does
        not within grpo.sampler_timeout_s of ``posted`` (when the bucket's sends were posted), or
        whose send fails, is lost (False)."""
        key, poll = f"recv/{r}/{self.position}/{version}/{bucket}", Poll()
        while r not in self.pool.lost:  # a lost peer's send is abandoned
            if self.store.has(key):
                self.store.store.delete_key(key)
                try:
                    work.wait()
                    return True
                except Exception as exc:  # the peer closed its end
                    self.pool.mark_lost(r, f"the weights' send failed: {exc}".splitlines()[0])
                    return False
            if time.monotonic() - posted > self.timeout_s:
                self.pool.mark_lost(r, f"it did not receive policy version {version} in "
                                       f"grpo.sampler_timeout_s={self.timeout_s:g} s")
                return False
            self.pool.refresh()
            poll.sleep()
        return False

    def settle(self) -> None:
        """Waits until the last publication is done (every wait of it is bounded)."""
        if self.publisher is not None and self._published >= 0:
            self.publisher.settle(self._published)

    def stop(self) -> None:
        """Every data step was received: the publications end and the samplers stop."""
        if self.publisher is not None:
            self.publisher.end()
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
        return self.store.take("start", keep=True)

    def weights_receiver(self, numels: list[int], dtype: torch.dtype, first: int, last: int) -> WeightsReceiver:
        layout = BucketLayout.of(numels, len(self.learners), dtype.itemsize, self.bucket_bytes)
        return WeightsReceiver(self, layout, dtype, first, last)

    def published(self) -> int:
        return int(self.store.get("published", "-1"))

    def first_version(self, positions: Optional[int] = None) -> Optional[int]:
        """On a replica that joined a running job: the first version the learner sends it at this
        position (``positions``: the newest of that over every position) -> None on the others."""
        if self.replica is None or self.replica < self.num_samplers:
            return None
        keys = [f"first/{self.replica}/{p}" for p in ([self.position] if positions is None else range(positions))]
        poll = Poll()
        while not all(self.store.has(k) for k in keys):  # bounded by the job: it admits, or it ends
            self.check_not_lost()
            if self.store.has("stop"):
                raise PoolEnded(f"sampler replica {self.replica}: the job ended before it was admitted")
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
