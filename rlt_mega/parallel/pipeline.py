"""The decoder-ring pipeline schedule (docs/design.md, "Parallel layout").

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
``P - 1`` ticks every stage is busy. Ideal bubble: ``(P - 1) / (M*T + P - 1)``. With ``M < P``
only M items circulate among P stages and every stage idles ``1 - M/P`` of the time; with a
message hop of ``L`` per step of cost ``c`` the ring stays full only while ``M*c >= P*(c + L)``
(:func:`simulate` models both).

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


# Message streams. The order already makes every pair unambiguous; distinct tags (which gloo
# honours, NCCL ignores) make a schedule bug block and time out instead of swapping two tensors.
TAGS = {"enc": 1, "mem": 2, "dec": 3, "ring": 4, "dec_grad": 5, "ring_grad": 6, "mem_grad": 7, "enc_grad": 8,
        # the sampler's ring (rollout/executor.py)
        "r_enc": 11, "r_mem": 12, "r_dec": 13, "r_ring": 14, "r_ctl": 15}
# Shape class of each stream: "seq" (b, T, d) or "step" (b, 1, d).
SHAPES = {"enc": "seq", "mem": "seq", "mem_grad": "seq", "enc_grad": "seq",
          "dec": "step", "ring": "step", "dec_grad": "step", "ring_grad": "step"}


def op_messages(op: Op, stage: int, num_stages: int, seq_len: int) -> tuple[list, list]:
    """What an operation receives before it computes and sends after: ([(src, stream)],
    [(dst, stream)]). A pure function of the op and the layout, shared by the executor and the
    tests that check every pair's message order."""
    s, P, T, t = stage, num_stages, seq_len, op.t
    first, last = s == 0, s == P - 1
    recvs, sends = [], []
    if op.kind == "enc_fwd":
        if not first:
            recvs.append((s - 1, "enc"))
        sends += [(s + 1, "enc")] if not last else [(r, "mem") for r in range(P - 1)]
    elif op.kind == "mem_fwd":
        if not last:
            recvs.append((P - 1, "mem"))
    elif op.kind == "dec_fwd":
        if not first:
            recvs.append((s - 1, "dec"))
        elif t > 0:
            recvs.append((P - 1, "ring"))
        if not last:
            sends.append((s + 1, "dec"))
        elif t < T - 1:
            sends.append((0, "ring"))
    elif op.kind == "dec_bwd":
        if not last:
            recvs.append((s + 1, "dec_grad"))
        elif t < T - 1:
            recvs.append((0, "ring_grad"))
        if not first:
            sends.append((s - 1, "dec_grad"))
        elif t > 0:
            sends.append((P - 1, "ring_grad"))
    elif op.kind == "mem_bwd":
        if last:  # summed in stage order, so the result does not depend on arrival order
            recvs += [(r, "mem_grad") for r in range(P - 1)]
        else:
            sends.append((P - 1, "mem_grad"))
    elif op.kind == "enc_bwd":
        if not last:
            recvs.append((s + 1, "enc_grad"))
        if not first:
            sends.append((s - 1, "enc_grad"))
    return recvs, sends


class P2P:
    """Point-to-point between the stages of one pipeline: blocking receives, non-blocking sends
    (kept alive until completed). A message to oneself (one stage: the ring closes on itself)
    goes through a local queue."""

    def __init__(self, stage_ranks: list[int], my_stage: int, device: torch.device) -> None:
        self.ranks, self.me, self.device = stage_ranks, my_stage, device
        self.pending: deque = deque()  # (work, tensor) of sends in flight, oldest first
        self.local: dict[str, deque] = defaultdict(deque)
        self.wait_s = 0.0  # time blocked in receives (for the bubble measurement)

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
        self.pending.append((dist.isend(tensor, dst=self.ranks[stage], tag=TAGS[stream]), tensor))

    def recv(self, shape: tuple, dtype: torch.dtype, stage: int, stream: str) -> torch.Tensor:
        if stage == self.me:
            return self.local[stream].popleft()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        t0 = time.perf_counter()
        dist.irecv(buf, src=self.ranks[stage], tag=TAGS[stream]).wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def post_recv(self, shape: tuple, dtype: torch.dtype, stage: int, stream: str):
        """Posts a receive now and returns a handle for ``wait``. A gloo send completes only once
        its receive is posted (measured: isend does not complete while the peer has not called
        recv), so the schedule posts an op's receives one op ahead and the transfer overlaps
        the current op's compute instead of starting when the op needs its input."""
        if stage == self.me:
            return (None, stream)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return (dist.irecv(buf, src=self.ranks[stage], tag=TAGS[stream]), buf)

    def wait(self, handle) -> torch.Tensor:
        work, buf = handle
        if work is None:  # a message to oneself: buf is the stream's name
            return self.local[buf].popleft()
        t0 = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - t0
        return buf

    def drain(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        assert not any(self.local.values()), "pipeline: unconsumed local messages (schedule bug)"


class RingSchedule:
    """Runs :func:`stage_program` for one stage: receives what an op needs, calls the stage
    interface, sends what it produced (op_messages says what goes where)."""

    def __init__(self, stage, p2p: P2P, my_stage: int, num_stages: int) -> None:
        self.stage, self.p2p = stage, p2p
        self.s, self.P = my_stage, num_stages
        self.busy_s = 0.0  # compute time of the last round (bubble measurement)

    def run(self, batches: list[dict], loss_scale: float, backward: bool, loss) -> Optional[torch.Tensor]:
        """One round: the batch dict of each micro-batch in flight (``inputs`` (b, T), one T for
        the round) and their loss (rlt_mega/loss.py, LogitsLoss). Returns the sum of the losses
        on the last stage (None elsewhere)."""
        stage, p2p, s, P = self.stage, self.p2p, self.s, self.P
        M, T = len(batches), batches[0]["inputs"].shape[1]
        stage.start(batches, loss_scale, grad=backward, loss=loss)
        self.busy_s, p2p.wait_s = 0.0, 0.0
        loss_sum: Optional[torch.Tensor] = None
        mem_grads: dict[int, torch.Tensor] = {}  # last stage: summed memory gradient per micro-batch
        program = stage_program(s, P, M, T, backward)

        def post(op: Op) -> list:  # the receives of op, posted in program order (pairs stay matched)
            return [p2p.post_recv(stage.activation_shape(op.j, SHAPES[stream]), stage.dtype, src, stream)
                    for src, stream in op_messages(op, s, P, T)[0]]

        posted = post(program[0]) if program else []
        with torch.enable_grad() if backward else torch.no_grad():
            for k, op in enumerate(program):
                sends = op_messages(op, s, P, T)[1]
                ins = [p2p.wait(h) for h in posted]
                # the next op's receives go out before this op computes (a message to oneself,
                # P == 1, is only taken from the local queue at wait, after this op sent it)
                posted = post(program[k + 1]) if k + 1 < len(program) else []
                x = ins[0] if ins else None
                t0 = time.perf_counter()
                if op.kind == "enc_fwd":
                    out = stage.enc_fwd(op.j, x)
                elif op.kind == "mem_fwd":
                    out = stage.mem_fwd(op.j, x)
                elif op.kind == "dec_fwd":
                    out = stage.dec_fwd(op.j, op.t, x)
                elif op.kind == "loss_fwd":
                    part = stage.loss_fwd(op.j)
                    out, loss_sum = None, part if loss_sum is None else loss_sum + part
                elif op.kind == "loss_bwd":
                    out = stage.loss_bwd(op.j)
                elif op.kind == "dec_bwd":
                    out = stage.dec_bwd(op.j, op.t, x)
                elif op.kind == "mem_bwd":
                    out = stage.mem_bwd(op.j)
                    if s == P - 1:
                        mem_grads[op.j] = sum(ins, out)
                elif op.kind == "enc_bwd":
                    out = stage.enc_bwd(op.j, mem_grads.pop(op.j) if s == P - 1 else x)
                else:  # pragma: no cover
                    raise AssertionError(f"unknown pipeline op {op}")
                self.busy_s += time.perf_counter() - t0
                for dst, stream in sends:
                    p2p.send(out, dst, stream)
        p2p.drain()
        stage.finish()
        return loss_sum


def simulate(num_stages: int, num_micro: int, seq_len: int, backward: bool = True,
             cost=lambda op: 1.0 if op.kind in ("dec_fwd", "dec_bwd") else 0.0, latency: float = 0.0) -> dict:
    """Runs every stage's program on a model clock: an op starts when its stage is free and its
    messages have arrived (a transfer takes ``latency``), and lasts ``cost(op)``. Checks that each pair
    of stages posts sends and receives in the same order (what gloo and NCCL need) and that no
    stage waits forever. Returns {"makespan", "busy": [per stage], "bubble"} where bubble is the
    idle fraction of stage time over the whole round."""
    P, M, T = num_stages, num_micro, seq_len
    programs = [stage_program(s, P, M, T, backward) for s in range(P)]
    sent: dict[tuple, list] = defaultdict(list)  # (src, dst) -> [(stream, j, t, arrival time)]
    posted_recv: dict[tuple, list] = defaultdict(list)
    pc, clock, busy = [0] * P, [0.0] * P, [0.0] * P
    taken: dict[tuple, int] = defaultdict(int)
    progress = True
    while progress:
        progress = False
        for s in range(P):
            while pc[s] < len(programs[s]):
                op = programs[s][pc[s]]
                recvs, sends = op_messages(op, s, P, T)
                ready = all(taken[(src, s)] < len(sent[(src, s)]) or src == s for src, _ in recvs)
                if not ready:
                    break
                start = clock[s]
                for src, stream in recvs:
                    if src == s:  # a stage's ring to itself (P == 1)
                        continue
                    msg = sent[(src, s)][taken[(src, s)]]
                    taken[(src, s)] += 1
                    t_sent = op.t + {"ring": -1, "ring_grad": 1}.get(stream, 0)
                    if msg[:3] != (stream, op.j, t_sent):
                        raise AssertionError(f"stage {s} op {op} expects {stream} of ({op.j}, {t_sent}) from stage "
                                             f"{src}, the next message of that pair is {msg[:3]}")
                    posted_recv[(src, s)].append(stream)
                    start = max(start, msg[3])
                clock[s] = start + cost(op)
                busy[s] += cost(op)
                for dst, stream in sends:
                    if dst != s:
                        sent[(s, dst)].append((stream, op.j, op.t, clock[s] + latency))
                pc[s] += 1
                progress = True
    if any(pc[s] < len(programs[s]) for s in range(P)):
        raise AssertionError(f"deadlock: stages stopped at ops {[programs[s][pc[s]] if pc[s] < len(programs[s]) else None for s in range(P)]}")
    for pair, msgs in sent.items():
        if [m[0] for m in msgs] != posted_recv[pair]:
            raise AssertionError(f"pair {pair}: sends {[m[0] for m in msgs]} vs receives {posted_recv[pair]}")
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy, "bubble": 1.0 - sum(busy) / (P * makespan) if makespan else 0.0}
