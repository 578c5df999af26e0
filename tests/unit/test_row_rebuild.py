"""The row executor's in-place batch rebuild (rollout/row_executor.py ``_rebuild_buffer``)
against the plain gather it replaces: cat(old batch, entering rows)[index], on random batches
with rows that stay (moving down and up), forks read from the old batch, parked one-row
states, fresh (zero) rows, a base that must grow, and both position layouts (keys stored
transposed: positions last)."""

import random

import pytest
import torch

from rlt_mega.rollout.row_executor import _rebuild_buffer


def _written(rows: int, dim: int, used: int, size: int = 12) -> torch.Tensor:
    """A buffer (rows, 2, ., .) with values at positions [0, used) of dim ``dim``, zeros after."""
    shape = [rows, 2, size, 3] if dim == 2 else [rows, 2, 3, size]
    x = torch.zeros(shape)
    x.narrow(dim, 0, used).normal_()
    return x


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dim", [2, 3])
def test_rebuild_equals_the_gather(seed, dim):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    used = rng.randint(1, 12)
    n_old = rng.randint(1, 8)
    max_rows = rng.randint(n_old, 12)
    grow = rng.random() < 0.3  # the base holds the old batch only: entries make it grow
    base = _written(n_old if grow else max_rows, dim, used)
    buf = base[:n_old]
    # the new batch: stayers keep their order, entering rows in between
    stayers = sorted(rng.sample(range(n_old), rng.randint(0, n_old)))
    left = [i for i in range(n_old) if i not in stayers]
    n_enter = rng.randint(0 if stayers else 1, 5)
    slots = sorted(rng.sample(range(len(stayers) + n_enter), n_enter))
    stay, enter, expected, it = [], [], [], iter(stayers)
    for j in range(len(stayers) + n_enter):
        if j not in slots:
            i = next(it)
            stay.append(i)
            expected.append(buf[i].clone())
            continue
        stay.append(-1)
        kind = rng.choice(["fork", "parked", "fresh"] if left else ["parked", "fresh"])
        if kind == "fork":
            i = rng.choice(left)
            enter.append((j, i))
            expected.append(buf[i].clone())
        elif kind == "parked":
            one = _written(1, dim, used)
            enter.append((j, one))
            expected.append(one[0].clone())
        else:
            enter.append((j, None))
            expected.append(torch.zeros_like(buf[0]))
    out, new_base = _rebuild_buffer(buf, base, stay, enter, dim, used, max_rows)
    assert torch.equal(out, torch.stack(expected))
    assert out.data_ptr() == new_base.data_ptr() and new_base.shape[0] >= len(stay)
    if len(stay) <= base.shape[0]:
        assert new_base is base  # no allocation: rows moved inside the base


def test_a_buffer_never_written_stays_unallocated_or_takes_the_entering_rows():
    assert _rebuild_buffer(None, None, [-1, -1], [(0, None), (1, None)], 2, 3, 4) == (None, None)
    one = _written(1, 2, 3)
    out, base = _rebuild_buffer(None, None, [-1, -1, -1], [(1, one), (2, 0)], 2, 3, 4)
    assert base.shape[0] == 4 and torch.equal(out[1], one[0])
    assert not out[0].any() and not out[2].any()  # a batch row of a never-written buffer, a fork of it: zeros
