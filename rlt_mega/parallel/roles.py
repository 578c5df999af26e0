"""Sampler and learner roles in one job (grpo.sampler_replicas): the messages between them.

The launcher's world is the learner's replica (tp x pp x dp ranks) then R sampler replicas of
n = tp x pp ranks each; each replica is torch.distributed's world of its ranks
(dims.init_distributed(replica_size=[n dp, n, ...])), so it builds its layout exactly as a
colocated job does. The roles talk between the ranks at the same place of the tp x pp layout
(the same TP and PP rank, its "position"), over two groups per position made from the
launcher's store: the data group (every learner rank there, one per data-parallel rank, then
one rank per sampler) and the weights group (the learner's data-parallel rank 0 there, then the
samplers). Rollouts travel from a sampler rank to the learner rank of the data-parallel share
they belong to as pickled objects over point-to-point messages (a size, then the bytes),
posted without waiting, so that a sampler that has sent a batch can go on to receive the next
weights while the learner is still learning; new weights travel from the learner's
data-parallel rank 0 at each position to the sampler ranks there as one flat vector of its
shard (gathered first from ZeRO-3's partitions by the sampling copy, parallel/sampling_copy.py),
broadcast (NCCL on GPUs, gloo here), posted without waiting on the learner, from a copy taken
after the update (the learner may step again while it is in flight). Neither touches the file
system. A broadcast copies the parameters exactly, so a sampler's version v is the learner's
version v bit for bit.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from rlt_mega.parallel.dims import launcher_store

LEARNER = 0


def role_group(name: str, rank: int, size: int, device: torch.device, timeout_s: float = 1800.0):
    """A group of the roles (``name``: the same on each of its ``size`` members; ``rank`` this
    process's there), made directly on the launcher's store; not registered with
    torch.distributed (messages go through its methods)."""
    store, _, generation = launcher_store()
    prefixed = dist.PrefixStore(f"{generation}/roles/{name}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class RoleChannel:
    """This rank's end of the roles' messages at its ``position`` of the tp x pp layout;
    ``role``: the learner's data-parallel rank (0 .. learner_dp - 1) on a learner rank, else
    learner_dp + r - 1 on sampler replica r (1 .. R); ``device``: where message tensors live (CPU
    for gloo, this rank's GPU for NCCL). ``rank`` is the role; ``learners`` and ``samplers`` the
    roles of each kind (data rank d's share of each data step goes to ``learners[d]``)."""

    def __init__(self, num_samplers: int, learner_dp: int, position: int, role: int, device: torch.device) -> None:
        self.device, self.rank = device, role
        self.learners = list(range(learner_dp))
        self.samplers = list(range(learner_dp, learner_dp + num_samplers))
        self.group = role_group(f"data{position}", role, learner_dp + num_samplers, device)
        # the weights' group: the learner's data-parallel rank 0, then the samplers
        self._weights_rank = 0 if role == LEARNER else (role - learner_dp + 1 if role >= learner_dp else None)
        self.weights = (None if self._weights_rank is None else
                        role_group(f"weights{position}", self._weights_rank, 1 + num_samplers, device))
        self._pending: list[tuple[Any, ...]] = []  # posted sends and the buffers they read

    @property
    def is_learner(self) -> bool:
        return self.rank in self.learners

    @property
    def publishes(self) -> bool:
        """Whether this rank sends the learner's weights (its data-parallel rank 0)."""
        return self.rank == LEARNER

    # ------------------------------------------------------------------ rollouts
    def send(self, obj: Any, dst: int = LEARNER) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        self._reap()
        self._pending.append((self.group.send([size], dst, 0), self.group.send([payload], dst, 0), size, payload))

    def recv(self, src: int) -> tuple[Any, float]:
        """The next object ``src`` sent -> (object, seconds spent waiting for it)."""
        t0 = time.perf_counter()
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.group.recv([size], src, 0).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.group.recv([payload], src, 0).wait()
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
    def publish(self, params: list[torch.Tensor] | torch.Tensor, previous: Optional[Any]) -> tuple[Any, float]:
        """On the learner: posts a broadcast of ``params`` (copied; or a flat vector of them) ->
        (its handle, seconds spent: the copy, and waiting for ``previous`` to reach every sampler
        first); (None, 0.0) on the learner's other data-parallel ranks."""
        if not self.publishes:
            return None, 0.0
        t0 = time.perf_counter()
        if previous is not None:
            previous[0].wait()
        if torch.is_tensor(params):
            flat = params.detach().to(self.device, copy=True)
        else:
            flat = parameters_to_vector([p.detach() for p in params]).to(self.device)
        work = self._broadcast(flat)
        return (work, flat), time.perf_counter() - t0

    def receive_weights(self, params: list[torch.Tensor]) -> float:
        """On a sampler: the learner's next published weights into ``params`` -> seconds waited."""
        t0 = time.perf_counter()
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device)
        self._broadcast(flat).wait()
        with torch.no_grad():
            vector_to_parameters(flat.to(params[0].device), params)
        return time.perf_counter() - t0

    def _broadcast(self, flat: torch.Tensor):
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = LEARNER, 0
        return self.weights.broadcast([flat], options)
