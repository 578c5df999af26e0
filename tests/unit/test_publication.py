"""The buckets of a weight publication (parallel/publication.py): each learner data-parallel
rank's snapshot of its chunks (ZeRO-3's partitions, or slices of whole parameters), gathered one
bucket at a time, scattered back by a sampler, give the flat vector of the whole parameters bit
for bit, for any dp, bucket size and parameter sizes (a bucket that splits a parameter, a
parameter smaller than dp); the publishing thread of one rank holds one bucket at a time."""

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
