"""Sampler and learner roles in one job (grpo.sampler_replicas): the messages between them.

World rank 0 learns; ranks 1..R sample. Rollouts travel from a sampler to the learner as
pickled objects over point-to-point messages (a size, then the bytes), posted without waiting
(``isend``), so that a sampler that has sent a batch can go on to receive the next weights
while the learner is still learning; new weights travel from the learner to every sampler as
one flat vector broadcast over their own process group (NCCL on GPUs, gloo here), posted
without waiting on the learner, from a copy taken after the update (the learner may step again
while it is in flight). Neither touches the file system. A broadcast copies the parameters
exactly, so a sampler's version v is the learner's version v bit for bit.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

LEARNER = 0


class RoleChannel:
    """This rank's end of the roles' messages; ``device``: where message tensors live (CPU for
    gloo, this rank's GPU for NCCL)."""

    def __init__(self, num_samplers: int, device: torch.device) -> None:
        self.rank, self.device = dist.get_rank(), device
        self.samplers = list(range(1, 1 + num_samplers))
        # Every rank creates every group (torch.distributed's rule), here just the one.
        self.weights_group = dist.new_group([LEARNER, *self.samplers])
        self._pending: list[tuple[Any, ...]] = []  # posted sends and the buffers they read

    @property
    def is_learner(self) -> bool:
        return self.rank == LEARNER

    # ------------------------------------------------------------------ rollouts
    def send(self, obj: Any, dst: int = LEARNER) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self._reap()
        self._pending.append((dist.isend(size, dst), dist.isend(payload, dst), size, payload))

    def recv(self, src: int) -> tuple[Any, float]:
        """The next object ``src`` sent -> (object, seconds spent waiting for it)."""
        t0 = time.perf_counter()
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(payload, src)
        waited = time.perf_counter() - t0
        return pickle.loads(payload.cpu().numpy().tobytes()), waited

    def _reap(self) -> None:
        self._pending = [p for p in self._pending if not (p[0].is_completed() and p[1].is_completed())]

    def flush(self) -> None:
        """Waits until every posted send was received."""
        for work_size, work_payload, *_ in self._pending:
            work_size.wait()
            work_payload.wait()
        self._pending = []

    # ------------------------------------------------------------------ weights
    def publish(self, params: list[torch.Tensor], previous: Optional[Any]) -> tuple[Any, float]:
        """On the learner: posts a broadcast of ``params`` (copied) -> (its handle, seconds spent:
        the copy, and waiting for ``previous`` to reach every sampler first)."""
        t0 = time.perf_counter()
        if previous is not None:
            previous[0].wait()
        flat = parameters_to_vector([p.detach() for p in params]).to(self.device)
        work = dist.broadcast(flat, LEARNER, group=self.weights_group, async_op=True)
        return (work, flat), time.perf_counter() - t0

    def receive_weights(self, params: list[torch.Tensor]) -> float:
        """On a sampler: the learner's next published weights into ``params`` -> seconds waited."""
        t0 = time.perf_counter()
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
        dist.broadcast(flat, LEARNER, group=self.weights_group)
        with torch.no_grad():
            vector_to_parameters(flat.to(params[0].device), params)
        return time.perf_counter() - t0
