"""Blends of indexed datasets (``data.blend: [w1, PREFIX1, w2, PREFIX2, ...]``), drawn in their
weights' proportions.

Which dataset each global sample comes from is megatron-core's blending index (its compiled
``helpers.build_blending_indices``, as Megatron-LM's ``BlendedDataset`` builds it): sample i
goes to the dataset whose count lags its weight's share of i the most, so after n samples every
dataset has its share to within one sample, a deterministic stream rather than random draws.
Sample i is then the ``k``-th draw of its dataset, which reads that dataset's windows in its own
seeded order, reshuffled at each of its epochs. The index is a prefix-stable function of the
weights alone (the first n entries do not depend on the size built), so it is built for the run's
length and extended when a run goes further.

The state is one number, the next global sample: a resumed run draws the same samples. As in
the single-dataset path, data-parallel ranks take disjoint strided rows of each global batch.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from rlt_mega.data.windows import TokenWindows
from rlt_mega.log import get_logger

log = get_logger(__name__)


def blending_index(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample (size,) int16, the sample's draw number within its dataset (size,) int64)."""
    with warnings.catch_warnings():  # megatron.core's import warns about Transformer Engine and Apex
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        from megatron.core.datasets import helpers
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, np.asarray(weights, dtype=np.float64),
                                   len(weights), size, False)
    return dataset_index, dataset_sample_index


class BlendedBatches:
    """Endless batches (batch_size, seq_len + 1) from several window sets in the weights' proportions."""

    def __init__(self, members: list[TokenWindows], weights: list[float], batch_size: int, seed: int,
                 shuffle: bool = True, rank: int = 0, world: int = 1, num_samples: int = 0) -> None:
        total = float(sum(weights))
        self.members, self.weights = members, [w / total for w in weights]
        self.batch_size, self.seed, self.shuffle, self.rank, self.world = batch_size, seed, shuffle, rank, world
        self.sample = 0  # the next global sample
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # member -> (epoch, its window order)
        self._build(max(num_samples, batch_size * world))

    def _build(self, size: int) -> None:
        self.dataset_index, self.dataset_sample_index = blending_index(self.weights, size)

    def _order(self, member: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(member)
        if cached is None or cached[0] != epoch:
            num = len(self.members[member])
            if self.shuffle:
                order = np.random.default_rng([self.seed, member, epoch]).permutation(num)
            else:
                order = np.arange(num)
            self._orders[member] = cached = (epoch, order)
        return cached[1]

    def window_ids(self, samples: range) -> list[tuple[int, int]]:
        """The (member, window) pairs of global samples ``samples``."""
        if samples.stop > len(self.dataset_index):
            self._build(max(samples.stop, 2 * len(self.dataset_index)))
        out = []
        for i in samples:
            member, draw = int(self.dataset_index[i]), int(self.dataset_sample_index[i])
            num = len(self.members[member])
            out.append((member, int(self._order(member, draw // num)[draw % num])))
        return out

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        step = self.batch_size * self.world
        ids = self.window_ids(range(self.sample + self.rank, self.sample + step, self.world))
        self.sample += step
        rows = torch.empty(len(ids), self.members[0].window, dtype=torch.int64)
        for member in {m for m, _ in ids}:  # one read per member: only this rank's windows
            at = [i for i, (m, _) in enumerate(ids) if m == member]
            rows[at] = self.members[member].read([ids[i][1] for i in at])
        return rows  # (batch_size, seq_len + 1)

    def state_dict(self) -> dict:
        return {"blend_sample": self.sample, "weights": self.weights, "sizes": [len(m) for m in self.members]}

    def load_state_dict(self, state: dict) -> None:
        sizes = [len(m) for m in self.members]
        same = len(state["weights"]) == len(self.weights) and np.allclose(state["weights"], self.weights)
        if not same or list(state["sizes"]) != sizes:  # a deliberate change of the mixture is allowed
            log.warning("the checkpoint's blend had weights %s and windows %s, this run's has %s and %s: from sample "
                        "%d on, the samples are not the ones the uninterrupted run would have seen",
                        [round(w, 4) for w in state["weights"]], state["sizes"], [round(w, 4) for w in self.weights],
                        sizes, state["blend_sample"])
        self.sample = int(state["blend_sample"])
