"""Publishing a policy version from the learner's data-parallel ranks to the sampler replicas
(grpo.sampler_replicas, parallel/roles.py), one bucket at a time (grpo.publish_bucket_mb), while
the learner steps on.

The chunk space. Each parameter (n elements, in the module's order) is cut into dp chunks of
k = ceil(n / dp) elements, chunk d on the learner's data-parallel rank d, the last one padded
with zeros: exactly ZeRO-3's partition of it (DeepSpeed's ``ds_tensor``), and under ZeRO 0-2 a
slice of the whole parameter the rank holds. A rank's *snapshot* of a version is its chunks end to
end: C = sum of k elements, 1/dp of the model. Bucket b is the columns [b L, (b + 1) L) of the
(dp, C) matrix whose row d is rank d's snapshot (L = bucket bytes / (dp x element size)): the
learner's data-parallel rank 0 receives the other rows' pieces point to point into one (dp, L)
buffer, sends it to every sampler replica, waits until each has taken it (or is lost) and frees
it before the next bucket. So no rank ever holds more than one bucket of the gathered weights
(the other ranks none: they send views of their snapshot), whatever the ZeRO stage, and no rank
gathers the whole model to publish it. A sampler puts each bucket's columns back into its flat
vector of the version (``BucketLayout.scatter``), which the sampling module loads.

Overlap. ``Publisher.post`` only takes the snapshot (a local copy of 1/dp of the model: the next
optimizer step changes the parameters) and returns; a thread on each learner rank gathers and
sends, on a group of its own (the data-parallel ranks at this position), so its messages never
interleave with the step's collectives. The next publication waits for it first (``settle``).
Under grpo.max_staleness 0 the learner then waits for the data step that version samples, so
nothing overlaps; under s >= 1 version v travels while the learner learns data step v.

Jobs. What the threads send is a sequence of jobs written to the store by data-parallel rank 0
(``pubjob/position/n``: the version, ``keep_from``, the kind), run in order by every rank's thread:
a version published to the replicas alive (``p``), or a version sent again to a replica that
joined (``r``: it receives every version from keep_from on, so it can redo any data step the
learner still needs, and no replica ever waits for a version nobody will send it). A rank keeps
its snapshots of versions >= keep_from. ``end`` closes the sequence.
"""

from __future__ import annotations

import bisect
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlt_mega.log import get_logger

log = get_logger(__name__)

POLL_S, POLL_MAX_S = 0.002, 0.05  # a thread's pauses between looks at the store (parallel/roles.py)


@dataclass(frozen=True)
class BucketLayout:
    """The chunk space of one position's parameters (``numels``, in the module's order) over
    ``dp`` learner ranks, cut into buckets of ``columns`` columns (module docstring)."""

    numels: tuple[int, ...]
    dp: int
    columns: int
    chunks: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)  # each parameter's first column
    starts: tuple[int, ...] = field(init=False)  # each parameter's first element in the flat vector

    def __post_init__(self) -> None:
        chunks = tuple(-(-n // self.dp) for n in self.numels)
        offsets, starts = [0], [0]
        for n, k in zip(self.numels, chunks):
            offsets.append(offsets[-1] + k)
            starts.append(starts[-1] + n)
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "starts", tuple(starts))

    @classmethod
    def of(cls, numels, dp: int, element_size: int, bucket_bytes: int) -> "BucketLayout":
        return cls(tuple(int(n) for n in numels), dp, max(1, int(bucket_bytes) // (dp * element_size)))

    @property
    def width(self) -> int:
        """C: the columns (a rank's snapshot's elements)."""
        return self.offsets[-1]

    @property
    def numel(self) -> int:
        return self.starts[-1]

    @property
    def num_buckets(self) -> int:
        return max(1, -(-self.width // self.columns))

    def bounds(self, bucket: int) -> tuple[int, int]:
        return bucket * self.columns, min(self.width, (bucket + 1) * self.columns)

    def snapshot(self, tensors: list[torch.Tensor], rank: int, device: torch.device) -> torch.Tensor:
        """Rank ``rank``'s chunks of ``tensors`` (the parameters, or whole tensors of their
        shapes) end to end -> (C,). A ZeRO-3 parameter gives its partition (``ds_tensor``: the
        same chunk, never gathered), any other its slice."""
        out = torch.zeros(self.width, dtype=tensors[0].dtype, device=device)
        with torch.no_grad():
            for i, t in enumerate(tensors):
                k, n, at = self.chunks[i], self.numels[i], self.offsets[i]
                part = getattr(t, "ds_tensor", None)
                if part is not None:
                    out[at:at + k].copy_(part.detach().reshape(-1)[:k])
                else:
                    piece = t.detach().reshape(-1)[rank * k:min(n, (rank + 1) * k)]
                    out[at:at + piece.numel()].copy_(piece)
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat vector of the parameters -> whole tensors per parameter (views)."""
        return [flat[self.starts[i]:self.starts[i + 1]] for i in range(len(self.numels))]

    def scatter(self, buf: torch.Tensor, bucket: int, flat: torch.Tensor) -> None:
        """Bucket ``bucket`` ((dp, columns): row d rank d's columns) into ``flat`` (the version's
        flat vector of whole parameters)."""
        a, e = self.bounds(bucket)
        i = bisect.bisect_right(self.offsets, a) - 1
        while i < len(self.numels) and self.offsets[i] < e:
            k, n, at, start = self.chunks[i], self.numels[i], self.offsets[i], self.starts[i]
            c0, c1 = max(a, at), min(e, at + k)
            for d in range(self.dp):
                lo, hi = d * k + (c0 - at), min(n, d * k + (c1 - at))
                if hi > lo:
                    flat[start + lo:start + hi].copy_(buf[d, c0 - a:c0 - a + (hi - lo)])
            i += 1


class LiveBytes:
    """The bytes of the gathered buffers alive now, and the most at once (a buffer counts until
    the tensor itself is freed: a reference kept by mistake would show)."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._free, nbytes)
        return tensor

    def _free(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes


class Publisher:
    """One learner rank's publication at its ``position`` (module docstring): ``channel`` the
    roles' end of this rank (parallel/roles.py ``RoleChannel``: the store, the samplers' pairs,
    the pool), ``group`` the learner's data-parallel ranks at this position (None for one)."""

    def __init__(self, channel, layout: BucketLayout, dp_rank: int, group: Any) -> None:
        self.channel, self.layout, self.dp_rank, self.group = channel, layout, dp_rank, group
        self.snapshots: dict[int, torch.Tensor] = {}
        self.live = LiveBytes()
        self.bytes_sent = 0  # the last version's bytes, over every replica it reached (rank 0)
        self.error: Optional[BaseException] = None
        self._jobs = 0  # jobs posted (rank 0)
        self._targets: dict[int, list[int]] = {}  # rank 0: job -> the replicas it goes to
        self._through = -1  # the newest version whose publication job is done
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rlt-publish", daemon=True)
        self._thread.start()

    @property
    def is_root(self) -> bool:
        return self.dp_rank == 0

    def _key(self, n: int) -> str:
        return f"pubjob/{self.channel.position}/{n}"

    # ------------------------------------------------------------------ the learner's thread
    def post(self, version: int, snapshot: Optional[torch.Tensor], keep_from: int, targets=(),
             kind: str = "p") -> None:
        """Version ``version``'s snapshot (this rank's; None: kept already) and, on rank 0, the
        job that sends it to ``targets``."""
        with self._cond:
            if snapshot is not None:
                self.snapshots[version] = snapshot
                self._cond.notify_all()
        if self.is_root:
            self._targets[self._jobs] = list(targets)
            self.channel.store.set(self._key(self._jobs), f"{version} {keep_from} {kind}")
            self._jobs += 1

    def end(self) -> None:
        """The sequence ends (rank 0 says so); waits for this rank's thread to finish it."""
        if self.is_root:
            self.channel.store.set(self._key(self._jobs), "end")
        self._thread.join(timeout=self.channel.timeout_s * 4)
        self._raise()

    def settle(self, version: int) -> None:
        """Waits until version ``version``'s publication is done (its sends taken, or their
        replicas lost: every wait of the thread is bounded)."""
        with self._cond:
            while self._through < version and self.error is None and self._thread.is_alive():
                self._cond.wait(timeout=0.5)
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"GRPO roles: the publication of the weights failed: {self.error}") from self.error

    # ------------------------------------------------------------------ the publishing thread
    def _run(self) -> None:
        n = 0
        try:
            while True:
                job = self._wait_job(n)
                if job == "end":
                    return
                version, keep_from, kind = job.split()
                version, keep_from = int(version), int(keep_from)
                with self._cond:
                    while version not in self.snapshots:
                        self._cond.wait(timeout=0.5)
                    snapshot = self.snapshots[version]
                if self.is_root:
                    self._send(n, version, snapshot, kind)
                else:
                    self._give(snapshot)
                del snapshot
                with self._cond:
                    self.snapshots = {v: s for v, s in self.snapshots.items() if v >= keep_from}
                    if kind == "p":
                        self._through = version
                    self._cond.notify_all()
                n += 1
        except BaseException as exc:  # handed to the learner's thread, which raises it
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def _wait_job(self, n: int) -> str:
        store, pause = self.channel.store, POLL_S
        while not store.has(self._key(n)):
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 1.5)
        return store.get(self._key(n))

    def _give(self, snapshot: torch.Tensor) -> None:
        """A data-parallel rank other than 0: its row of each bucket, to rank 0."""
        for b in range(self.layout.num_buckets):
            a, e = self.layout.bounds(b)
            self.group.send([snapshot[a:e]], 0, 0).wait()

    def _send(self, n: int, version: int, snapshot: torch.Tensor, kind: str) -> None:
        targets = self._targets.pop(n)
        sent = sum(self._bucket(b, version, snapshot, targets) for b in range(self.layout.num_buckets))
        if kind == "p":
            self.bytes_sent = sent

    def _bucket(self, b: int, version: int, snapshot: torch.Tensor, targets: list[int]) -> int:
        """Bucket ``b``: gathered, sent to ``targets``, taken -> the bytes sent. Its buffer (and
        the sends that hold it) are freed on return, before the next bucket is gathered."""
        ch, layout = self.channel, self.layout
        a, e = layout.bounds(b)
        if layout.dp == 1:
            buf = self.live.track(snapshot[a:e].view(1, -1))
        else:
            buf = self.live.track(torch.empty(layout.dp, e - a, dtype=snapshot.dtype, device=snapshot.device))
            buf[0].copy_(snapshot[a:e])
            for d in range(1, layout.dp):
                self.group.recv([buf[d]], d, 0).wait()
        works, posted = {}, time.monotonic()
        for r in targets:
            if r in ch.pool.lost:
                continue
            try:
                ch.store.set(f"sent/{r}/{ch.position}/{version}/{b}", "1")  # its receiving thread may post
                works[r] = ch.pairs[r].send([buf], 1, 0)
            except Exception as exc:  # the peer closed its end (gloo says so when posting)
                ch.pool.mark_lost(r, f"the weights' send failed: {exc}".splitlines()[0])
        taken = sum(ch.taken(r, version, b, work, posted) for r, work in works.items())
        return taken * buf.numel() * buf.element_size()
