"""Where a rank sits in a colocated GRPO run, and the few collectives the trainer needs beyond
the engine's: one object for one process and for any TP x PP x DP layout.

- A *replica* (data-parallel rank) samples its own prompts with its own TP/PP layout; its
  ranks agree on prompts, seeds, rollouts and rewards. Rewards are computed once per replica
  (on its first rank) and broadcast, so a reward function runs once per completion and its
  result is the same on every rank of the replica even if it is not deterministic.
- The *loss ranks* hold the learner's per-token metrics: every rank without pipeline
  parallelism, the last stage with it; TP rank 0 of each contributes, so TP copies are not
  counted twice.
- Metrics are reduced over the whole world (sums, minima, maxima) so that rank 0, which logs,
  sees global values whichever stage it is.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class Replica:
    def __init__(self, dims=None) -> None:
        self.dims = dims  # parallel.dims.ParallelDims, or None on one process
        self.device = dims.device if dims is not None else torch.device("cpu")
        if dims is not None:
            mp_ranks = dist.get_process_group_ranks(dims.mp_group)
            self._replica_src = mp_ranks[0]
            self._replica_size = len(mp_ranks)

    @property
    def distributed(self) -> bool:
        return self.dims is not None

    @property
    def rank(self) -> int:
        return self.dims.rank if self.distributed else 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank if self.distributed else 0

    @property
    def dp(self) -> int:
        return self.dims.dp if self.distributed else 1

    @property
    def is_replica_source(self) -> bool:
        """The rank that computes what a replica shares (rewards) and reports replica totals."""
        return not self.distributed or self.dims.rank == self._replica_src

    @property
    def is_loss_rank(self) -> bool:
        """Computes the loss and holds its metrics (one TP rank of the stage with the head)."""
        return not self.distributed or (self.dims.is_last_stage and self.dims.tp_rank == 0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def share_in_replica(self, obj: Any) -> Any:
        """The replica source's ``obj`` on every rank of the replica (picklable)."""
        if not self.distributed or self._replica_size == 1:
            return obj
        box = [obj if self.is_replica_source else None]
        dist.broadcast_object_list(box, src=self._replica_src, group=self.dims.mp_group)
        return box[0]

    def sum_over_dp(self, values: list[float]) -> list[float]:
        """Per-replica values (the same on every rank of a replica) summed over replicas."""
        if not self.distributed or self.dims.dp == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dims.dp_group)
        return t.tolist()

    def reduce(self, sums: dict[str, float], mins: Optional[dict[str, float]] = None,
               maxs: Optional[dict[str, float]] = None) -> dict[str, float]:
        """Sums, minima and maxima over the world; every rank passes the same keys (a rank
        without a value passes 0 for a sum, +inf for a minimum, -inf for a maximum)."""
        mins, maxs = mins or {}, maxs or {}
        out: dict[str, float] = {}
        for values, op in ((sums, "sum"), (mins, "min"), (maxs, "max")):
            if not values:
                continue
            keys = sorted(values)
            t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
            if self.distributed:
                dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
                                       "max": dist.ReduceOp.MAX}[op])
            out.update(zip(keys, t.tolist()))
        return out
