"""The buckets of a weight publication (parallel/publication.py): each learner data-parallel
rank's snapshot of its chunks (ZeRO-3's partitions, or slices of whole parameters), gathered one
bucket at a time, scattered back by a sampler, give the flat vector of the whole parameters bit
for bit, for any dp, bucket size and parameter sizes (a bucket that splits a parameter, a
parameter smaller than dp); the publishing thread sends a version after ``post`` returned (the
learner steps on: overlap) from its snapshot, one bucket alive at a time, and sends the kept
versions again to a replica that joins."""

import threading

import pytest
import torch

from rlt_mega.parallel.publication import BucketLayout, LiveBytes


def params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in [(7, 5), (1,), (13,), (2, 3, 4), (260, 3)]]


def zero3_partition(p: torch.Tensor, rank: int, dp: int) -> torch.Tensor:
    """A stand-in for a ZeRO-3 parameter: its data released, its partition in ``ds_tensor``
    (DeepSpeed's layout: ceil(n / dp) elements per rank, the last padded)."""
    k = -(-p.numel() // dp)
    part = torch.zeros(k)
    piece = p.reshape(-1)[rank * k:(rank + 1) * k]
    part[:piece.numel()] = piece
    stub = torch.empty(0)
    stub.ds_tensor, stub.ds_numel = part, p.numel()
    return stub


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes", [4, 40, 1 << 20])
@pytest.mark.parametrize("zero3", [False, True])
def test_buckets_scatter_back_to_the_whole_parameters(dp, bucket_bytes, zero3):
    ps = params()
    layout = BucketLayout.of([p.numel() for p in ps], dp, 4, bucket_bytes)
    snaps = [layout.snapshot([zero3_partition(p, d, dp) for p in ps] if zero3 else ps, d, torch.device("cpu"))
             for d in range(dp)]
    assert all(s.numel() == layout.width for s in snaps) and layout.width <= sum(p.numel() for p in ps) + len(ps) * dp
    flat = torch.full((layout.numel,), float("nan"))
    for b in range(layout.num_buckets):
        a, e = layout.bounds(b)
        assert (e - a) * dp * 4 <= max(bucket_bytes, dp * 4)  # one bucket: at most bucket_bytes
        layout.scatter(torch.stack([s[a:e] for s in snaps]), b, flat)
    assert torch.equal(flat, torch.cat([p.reshape(-1) for p in ps]))
    if bucket_bytes == 40:
        assert layout.num_buckets > 5


def test_a_flat_vector_splits_into_the_parameters():
    ps = params(1)
    layout = BucketLayout.of([p.numel() for p in ps], 2, 4, 64)
    flat = torch.cat([p.reshape(-1) for p in ps])
    whole = layout.snapshot(layout.split(flat), 1, torch.device("cpu"))
    assert torch.equal(whole, layout.snapshot(ps, 1, torch.device("cpu")))


def test_live_bytes_counts_a_buffer_until_it_is_freed():
    live = LiveBytes()
    a = live.track(torch.empty(10))
    kept = live.track(torch.empty(20))
    del a
    b = live.track(torch.empty(10))
    assert live.now == 120 and live.peak == 120  # a was freed before b
    del b, kept
    assert live.now == 0 and live.peak == 120


class FakeChannel:
    """What the publishing thread uses of a RoleChannel: the store, the samplers' pairs (here
    recording each bucket sent, as a sampler would scatter it) and the receipts."""

    def __init__(self, layout: BucketLayout, replicas: int) -> None:
        import torch.distributed as dist

        from rlt_mega.parallel.roles import RoleStore

        self.store, self.position, self.timeout_s = RoleStore(dist.HashStore()), 0, 5.0
        self.pool = type("Pool", (), {"lost": {}, "mark_lost": lambda *a: None})()
        self.layout, self.received = layout, {}  # (replica, version) -> flat vector
        self.stepped, self.overlapped = threading.Event(), None  # the learner's next step began
        self.pairs = {r: self._pair(r) for r in range(replicas)}

    def _pair(self, r: int):
        channel = self

        class Pair:
            def send(self, tensors, dst, tag):
                (buf,) = tensors
                version = channel._version
                if channel.overlapped is None:  # the first send: does the learner step on meanwhile?
                    channel.overlapped = channel.stepped.wait(timeout=30)
                flat = channel.received.setdefault((r, version), torch.full((channel.layout.numel,), float("nan")))
                channel.layout.scatter(buf.clone(), channel._bucket, flat)
                return None

        return Pair()

    def taken(self, r, version, bucket, work, posted) -> bool:
        return True


def test_a_publication_sends_the_version_posted_while_the_learner_steps_on(monkeypatch):
    """The overlap: ``post`` returns once the snapshot is taken, the thread sends it bucket by
    bucket afterwards; the parameters changed meanwhile (the next step) do not leak into it,
    one bucket at a time is alive, and a replica that joins gets every version from keep_from."""
    from rlt_mega.parallel.publication import Publisher

    ps = params(2)
    layout = BucketLayout.of([p.numel() for p in ps], 1, 4, 64)
    channel = FakeChannel(layout, replicas=1)
    original = Publisher._bucket

    def bucket(self, b, version, snapshot, targets):  # tells the fake pairs which bucket is sent
        channel._version, channel._bucket = version, b
        return original(self, b, version, snapshot, targets)

    monkeypatch.setattr(Publisher, "_bucket", bucket)
    pub = Publisher(channel, layout, 0, None)
    versions = {}
    for v in range(3):
        versions[v] = torch.cat([p.reshape(-1) for p in ps]).clone()
        pub.post(v, layout.snapshot(ps, 0, torch.device("cpu")), keep_from=max(0, v - 1), targets=[0])
        with torch.no_grad():  # the next optimizer step, while version v may still travel
            for p in ps:
                p.add_(1.0)
        channel.stepped.set()
    pub.settle(2)
    assert channel.overlapped  # version 0's first bucket was sent after post returned and the step began
    assert all(torch.equal(channel.received[(0, v)], versions[v]) for v in range(3))
    assert sorted(pub.snapshots) == [1, 2]  # versions >= keep_from kept, for replicas that join
    channel.pairs[1] = channel._pair(1)  # a replica joins: versions 1 and 2 sent to it again
    for v in (1, 2):
        pub.post(v, None, keep_from=1, targets=[1], kind="r")
    pub.end()
    assert all(torch.equal(channel.received[(1, v)], versions[v]) for v in (1, 2))
    assert (1, 0) not in channel.received
    assert 0 < pub.live.peak <= 64 and layout.num_buckets > 5 and pub.live.now == 0
    assert pub.bytes_sent == layout.width * 4  # the last publication's, to its one replica
