"""The executor's in-place batch rebuild (rollout/executor.py ``move_rows``) against the plain
gather it replaces: cat(old batch, entering rows)[index], on random batches with rows that stay
(moving down and up), forks read from the old batch, parked one-row states and fresh rows
(cleared from a first position on), in both position layouts (keys stored transposed: positions
last)."""

import random

import pytest
import torch

from rlt_mega.rollout.executor import move_rows


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
    slots = rng.randint(n_old, 12)
    fresh_from = rng.choice([0, 1])  # (memory slot 0, the null memory, is every row's)
    base = _written(slots, dim, used)
    buf = base[:n_old].clone()
    # the new batch: stayers keep their order, entering rows in between
    stayers = sorted(rng.sample(range(n_old), rng.randint(0, n_old)))
    left = [i for i in range(n_old) if i not in stayers]
    n_enter = rng.randint(0 if stayers else 1, slots - len(stayers))
    where = sorted(rng.sample(range(len(stayers) + n_enter), n_enter))
    stay, enter, expected, it = [], [], [], iter(stayers)
    for j in range(len(stayers) + n_enter):
        if j not in where:
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
            cleared = base[j].clone()  # what the slot held, positions [fresh_from, used) zeroed
            cleared.narrow(dim - 1, fresh_from, max(0, used - fresh_from)).zero_()
            expected.append(cleared)
    move_rows(base, stay, enter, dim, used, fresh_from)
    got = base[:len(stay)].narrow(dim, 0, used)
    assert torch.equal(got, torch.stack(expected).narrow(dim, 0, used))
