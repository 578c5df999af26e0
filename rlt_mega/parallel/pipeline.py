"""The decoder-ring pipeline schedule (DESIGN section 5).

Every stage runs a *program*: a list of operations in a fixed order, produced by the pure
function :func:`stage_program`. An operation receives its input (blocking), computes through
the stage interface (``stage.py``) and posts its output with a non-blocking send. Because each
pair of stages posts its messages in the same order on both sides (the programs are built so),
every point-to-point pair is unambiguous for gloo, which matches messages of a pair in posting
order, and for NCCL, which does the same per communicator; with two stages a rank's previous and
next stage are the same peer, and forward messages of one direction all precede backward ones.

The ring: ``z_t`` leaves the last stage and enters stage 0 for position ``t + 1``. Decoder work
items are ``(t, j)`` in t-major order; stage s runs item ``n = t*M + j`` at tick ``n + s`` when
``M >= P`` (stage s works on micro-batch ``(k - s) mod M`` at tick k), so after a warm-up of
``P - 1`` ticks every stage is busy; with ``M < P`` stage 0 waits for the ring and the bubble
grows. Ideal bubble: ``(P - 1) / (M*T + P - 1)``.

The backward runs the ring in reverse (decreasing t on every stage, which the decoder's K/V
gradient accumulation needs), then the memory gradients of all stages are summed on the last
stage, then the encoder backward drains through the stages.

The schedule knows the model only through the stage interface.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist


class Op(NamedTuple):
    kind: str  # enc_fwd mem_fwd dec_fwd loss_fwd | loss_bwd dec_bwd mem_bwd enc_bwd
    j: int  # micro-batch
    t: int = -1  # position (decoder ops)


def stage_program(stage: int, num_stages: int, num_micro: int, seq_len: int, backward: bool) -> list[Op]:
    """The operations of pipeline stage ``stage`` for one round of ``num_micro`` micro-batches."""
    P, M, T, s = num_stages, num_micro, seq_len, stage
    last = s == P - 1
    ops: list[Op] = []
    # ---- forward warm-up: the encoder over the micro-batches fills the pipeline; the last stage
    #      fans each micro-batch's memory out to every stage as soon as it has it.
    ops += [Op("enc_fwd", j) for j in range(M)]
    # ---- forward steady state: the decoder ring, item (t, j) in t-major order. A stage binds a
    #      micro-batch's memory just before its first decoder step.
    for t in range(T):
        for j in range(M):
            if t == 0:
                ops.append(Op("mem_fwd", j))
            ops.append(Op("dec_fwd", j, t))
    # ---- forward cool-down: the head and the loss on the last stage.
    if last:
        ops += [Op("loss_fwd", j) for j in range(M)]
    if not backward:
        return ops
    # ---- backward warm-up: the loss seeds the gradients of every z_t on the last stage.
    if last:
        ops += [Op("loss_bwd", j) for j in reversed(range(M))]
    # ---- backward steady state: the ring in reverse, decreasing t on every stage.
    for t in reversed(range(T)):
        for j in reversed(range(M)):
            ops.append(Op("dec_bwd", j, t))
    # ---- backward cool-down: memory gradients (all stages -> last), then the encoder drains.
    ops += [Op("mem_bwd", j) for j in reversed(range(M))]
    ops += [Op("enc_bwd", j) for j in reversed(range(M))]
    return ops


# Message streams; distinct gloo tags make a mismatch fail loudly instead of swapping tensors.
TAGS = {"enc": 1, "mem": 2, "dec": 3, "ring": 4, "dec_grad": 5, "ring_grad": 6, "mem_grad": 7, "enc_grad": 8}


class P2P:
    """Point-to-point between the stages of one pipeline: blocking receives, non-blocking sends
    (kept alive until completed). A message to oneself (one stage: the ring closes on itself)
    goes through a local queue."""

    def __init__(self, stage_ranks: list[int], my_stage: int, device: torch.device) -> None:
        self.ranks, self.me, self.device = stage_ranks, my_stage, device
        self.pending: list = []
        self.local: dict[str, deque] = defaultdict(deque)
        self.wait_s = 0.0  # time blocked in receives (for the bubble measurement)

    def send(self, tensor: torch.Tensor, stage: int, stream: str) -> None:
        tensor = tensor.detach()
        if stage == self.me:
            self.local[stream].append(tensor)
            return
        tensor = tensor.contiguous()
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(tensor, dst=self.ranks[stage], tag=TAGS[stream]), tensor))

    def recv(self, shape: tuple, dtype: torch.dtype, stage: int, stream: str) -> torch.Tensor:
        if stage == self.me:
            return self.local[stream].popleft()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        t0 = time.perf_counter()
        dist.irecv(buf, src=self.ranks[stage], tag=TAGS[stream]).wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        assert not any(self.local.values()), "pipeline: unconsumed local messages (schedule bug)"


class RingSchedule:
    """Runs :func:`stage_program` for one stage: moves tensors between the stage interface and
    the neighbouring stages."""

    def __init__(self, stage, p2p: P2P, my_stage: int, num_stages: int) -> None:
        self.stage, self.p2p = stage, p2p
        self.s, self.P = my_stage, num_stages
        self.first, self.last = 0, num_stages - 1
        self.busy_s = 0.0  # compute time of the last round (bubble measurement)

    def run(self, micro_batches: list, loss_scale: float, backward: bool) -> Optional[torch.Tensor]:
        """One round: micro_batches is a list of (inputs (b, T), targets (b, T)). Returns the sum
        of token losses on the last stage (None elsewhere)."""
        stage, p2p, s, P = self.stage, self.p2p, self.s, self.P
        M, T = len(micro_batches), micro_batches[0][0].shape[1]
        dtype = stage.dtype
        stage.start(micro_batches, loss_scale, grad=backward)
        loss_sum: Optional[torch.Tensor] = None
        mem_grads: dict[int, torch.Tensor] = {}
        is_first, is_last = s == self.first, s == self.last
        self.busy_s = 0.0
        p2p.wait_s = 0.0

        def recv(j, kind, src, stream):
            return p2p.recv(stage.activation_shape(j, kind), dtype, src, stream)

        grad_ctx = torch.enable_grad() if backward else torch.no_grad()
        with grad_ctx:
            for op in stage_program(s, P, M, T, backward):
                j, t = op.j, op.t
                if op.kind == "enc_fwd":
                    x = None if is_first else recv(j, "seq", s - 1, "enc")
                    y = self._timed(stage.enc_fwd, j, x)
                    if not is_last:
                        p2p.send(y, s + 1, "enc")
                    else:  # y is the memory m: to every other stage
                        for r in range(P - 1):
                            p2p.send(y, r, "mem")
                elif op.kind == "mem_fwd":
                    m = None if is_last else recv(j, "seq", self.last, "mem")
                    self._timed(stage.mem_fwd, j, m)
                elif op.kind == "dec_fwd":
                    if not is_first:
                        x = recv(j, "step", s - 1, "dec")
                    else:
                        x = recv(j, "step", self.last, "ring") if t > 0 else None
                    y = self._timed(stage.dec_fwd, j, t, x)
                    if not is_last:
                        p2p.send(y, s + 1, "dec")
                    elif t < T - 1:
                        p2p.send(y, self.first, "ring")
                elif op.kind == "loss_fwd":
                    part = self._timed(stage.loss_fwd, j)
                    loss_sum = part if loss_sum is None else loss_sum + part
                elif op.kind == "loss_bwd":
                    self._timed(stage.loss_bwd, j)
                elif op.kind == "dec_bwd":
                    if not is_last:
                        g = recv(j, "step", s + 1, "dec_grad")
                    else:
                        g = recv(j, "step", self.first, "ring_grad") if t < T - 1 else None
                    gx = self._timed(stage.dec_bwd, j, t, g)
                    if not is_first:
                        p2p.send(gx, s - 1, "dec_grad")
                    elif t > 0:
                        p2p.send(gx, self.last, "ring_grad")
                elif op.kind == "mem_bwd":
                    gm = self._timed(stage.mem_bwd, j)
                    if not is_last:
                        p2p.send(gm, self.last, "mem_grad")
                    else:  # summed in stage order, so the result does not depend on arrival order
                        for r in range(P - 1):
                            gm = gm + recv(j, "seq", r, "mem_grad")
                        mem_grads[j] = gm
                elif op.kind == "enc_bwd":
                    g = mem_grads.pop(j) if is_last else recv(j, "seq", s + 1, "enc_grad")
                    gx = self._timed(stage.enc_bwd, j, g)
                    if not is_first:
                        p2p.send(gx, s - 1, "enc_grad")
                else:  # pragma: no cover
                    raise AssertionError(f"unknown pipeline op {op}")
        p2p.drain()
        stage.finish()
        return loss_sum

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.busy_s += time.perf_counter() - t0
        return out
