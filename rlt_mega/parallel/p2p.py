"""Point-to-point messages between the stages of one pipeline, in a form NCCL cannot deadlock on.

What NCCL does differently from gloo (which every CPU test runs on), read from torch's
ProcessGroupNCCL and NCCL's issues (ENGINES.md):

- tags are ignored: the n-th send from rank a to rank b pairs with the n-th receive b posts
  from a, whatever the tags say;
- unbatched sends and receives between a pair of ranks share one communicator and one stream,
  where they run in posting order: a posted receive blocks the stream until its message
  arrives, and a large send blocks until its receive is posted. So when both directions of a
  pair share a stream, "post the next receive early" waits for a message whose sender is
  itself waiting behind that receive, and even without early receives, a message that its
  receiver takes only later (a micro-batch's memory, fanned out in the warm-up) holds up the
  messages behind it (``nccl_sim.py`` finds both deadlocks in the training ring).

So every *channel* -- one direction between two stages, (src, dst, lane) -- has a process group
of its own (built once with the layout, ``ParallelDims.p2p_groups``): on NCCL its own
communicator and stream, on which only that direction's messages run, in order. A receive then
waits only for its own message and a send delays only the sends behind it on the same channel:
NCCL behaves as the dataflow the schedules are written for, and a schedule is correct when each
channel's messages are received in the order they are sent, which ``nccl_sim`` checks for every
program we run. Lanes split a direction whose streams are consumed in another order than sent:
the sampler's memory fan-out (``lane_of``).

Tags: by default each stream gets its own tag, which gloo honours, so a schedule bug blocks and
times out instead of swapping two tensors of the same shape. ``RLT_P2P_TAGS=order`` sets every
tag to 0: gloo then pairs by order alone, as NCCL does (the distributed tests run both ways).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict, deque
from typing import Optional

import torch
import torch.distributed as dist

TAG_POLICY_ENV = "RLT_P2P_TAGS"  # "stream" (default): one tag per stream; "order": every tag 0

# One tag per message stream (training ring, then the sampler's ring in rollout/executor.py).
STREAM_TAGS = {"enc": 1, "mem": 2, "dec": 3, "ring": 4, "dec_grad": 5, "ring_grad": 6, "mem_grad": 7,
               "enc_grad": 8, "r_enc": 11, "r_mem": 12, "r_dec": 13, "r_ring": 14, "r_ctl": 15}
MEMORY_STREAMS = ("mem", "r_mem")  # the last stage's memory fan-out: its own lane


def tag_policy() -> str:
    policy = os.environ.get(TAG_POLICY_ENV, "stream")
    if policy not in ("stream", "order"):
        raise ValueError(f"{TAG_POLICY_ENV}={policy!r}: expected 'stream' (one tag per message stream) or "
                         "'order' (every tag 0: messages pair by order alone, as NCCL does)")
    return policy


def lane_of(stream: str) -> str:
    return "mem" if stream in MEMORY_STREAMS else "main"


def pipeline_channels(num_stages: int) -> list[tuple[int, int, str]]:
    """Every channel (src stage, dst stage, lane) the rings use: both directions between
    neighbours, both directions between the last stage and every other (its memory, the ring
    z_t -> stage 0 and their gradients), and the memory lane from the last stage to every other.
    Pure: every rank lists the same channels in the same order (their groups are created
    collectively)."""
    P, last = num_stages, num_stages - 1
    out: list[tuple[int, int, str]] = []
    for s in range(P - 1):
        for pair in ((s, s + 1), (s + 1, s), (last, s), (s, last)):
            if (*pair, "main") not in out:
                out.append((*pair, "main"))
    out += [(last, s, "mem") for s in range(P - 1)]
    return out


class P2P:
    """The point-to-point transport of one pipeline stage: blocking receives, non-blocking sends
    (kept alive until completed), each on its channel's group. A message to oneself (one
    stage: the ring closes on itself) goes through a local queue. ``log``, when a list,
    records every posted message as ("send" | "recv", peer stage, stream, shape) in posting
    order (tests compare it with the schedules' pure descriptions)."""

    def __init__(self, stage_ranks: list[int], my_stage: int, device: torch.device,
                 groups: Optional[dict] = None) -> None:
        self.ranks, self.me, self.device = stage_ranks, my_stage, device
        self.groups = groups or {}  # (src stage, dst stage, lane) -> process group
        if len(stage_ranks) > 1 and not self.groups:
            raise ValueError("a pipeline of several stages needs its channel groups (ParallelDims.p2p_groups)")
        self.pending: deque = deque()  # (work, tensor) of sends in flight, oldest first
        self.local: dict[str, deque] = defaultdict(deque)
        self._wait_s = 0.0  # seconds blocked in receives, summed so far (wait_s)
        self._waits: list = []  # CUDA: (start, end) events around each wait, not yet summed
        self.log: Optional[list] = None
        self.policy = tag_policy()  # read once: every rank of a run uses one policy

    @property
    def wait_s(self) -> float:
        """Time blocked in receives since it was last set (the bubble measurement). On the CPU
        (gloo) ``work.wait()`` blocks the host: host time. On CUDA (NCCL) it returns at once and
        makes the compute stream wait for the communication stream, so the host time reads ~0:
        the stream's stall is measured instead, by CUDA events recorded before and after each
        wait, summed here (reading it waits for the last event)."""
        if self._waits:
            self._waits[-1][1].synchronize()
            self._wait_s += sum(a.elapsed_time(b) for a, b in self._waits) / 1000.0
            self._waits.clear()
        return self._wait_s

    @wait_s.setter
    def wait_s(self, value: float) -> None:
        self._wait_s, self._waits = value, []

    @classmethod
    def for_pipeline(cls, dims) -> "P2P":
        """My stage of the pipeline of ``dims`` (parallel.dims.ParallelDims)."""
        return cls(dims.pp_ranks, dims.pp_rank, dims.device, dims.p2p_groups)

    def _tag(self, stream: str) -> int:
        return 0 if self.policy == "order" else STREAM_TAGS[stream]

    def _group(self, src: int, dst: int, stream: str):
        key = (src, dst, lane_of(stream))
        if key not in self.groups:
            raise RuntimeError(f"pipeline: no channel {key} for stream {stream!r} (pipeline_channels lists the "
                               "channels the schedules may use)")
        return self.groups[key]

    def send(self, tensor: torch.Tensor, stage: int, stream: str) -> None:
        tensor = tensor.detach()
        if stage == self.me:
            self.local[stream].append(tensor)
            return
        tensor = tensor.contiguous()
        # Free the buffers of sends that completed, oldest first, stopping at the first that has
        # not: a scan of the whole list per send was O(sends) (a gloo send completes only when
        # the receiver posts, so a round's ring keeps ~M*T in flight: 40% of the schedule's CPU
        # time at M=8, T=16, measured).
        while self.pending and self.pending[0][0].is_completed():
            self.pending.popleft()
        work = dist.isend(tensor, dst=self.ranks[stage], group=self._group(self.me, stage, stream),
                          tag=self._tag(stream))
        self.pending.append((work, tensor))
        if self.log is not None:
            self.log.append(("send", stage, stream, tuple(tensor.shape)))

    def post_recv(self, shape: tuple, dtype: torch.dtype, stage: int, stream: str):
        """Posts a receive now and returns a handle for ``wait``. The schedules post an op's
        receives one op ahead, so a transfer overlaps the current op's compute (a gloo send
        completes only once its receive is posted); on its own channel a posted receive waits
        only for its own message."""
        if stage == self.me:
            return (None, stream)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src=self.ranks[stage], group=self._group(stage, self.me, stream), tag=self._tag(stream))
        if self.log is not None:
            self.log.append(("recv", stage, stream, tuple(shape)))
        return (work, buf)

    def wait(self, handle) -> torch.Tensor:
        work, buf = handle
        if work is None:  # a message to oneself: buf is the stream's name
            return self.local[buf].popleft()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self._waits.append((start, end))
        else:
            t0 = time.perf_counter()
            work.wait()
            self._wait_s += time.perf_counter() - t0
        return buf

    def recv(self, shape: tuple, dtype: torch.dtype, stage: int, stream: str) -> torch.Tensor:
        return self.wait(self.post_recv(shape, dtype, stage, stream))

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        if any(self.local.values()):
            raise RuntimeError("pipeline: unconsumed local messages (a schedule bug)")
