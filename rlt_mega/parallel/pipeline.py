"""The decoder-ring pipeline schedule (docs/design.md, "Parallel layout").

Every stage runs a *program*: a list of operations in a fixed order, produced by the pure
function :func:`stage_program`; :func:`op_messages` says what each receives and sends. An operation
receives its input (blocking; posted one op ahead), computes through the stage interface
(``stage.py``) and posts its output with a non-blocking send, each message on the channel of
its direction (``p2p.py``: one process group per direction, so that under NCCL a posted
receive blocks nothing but its own channel). Each channel's messages are received in the order
they are sent (the programs are built so), so they pair by order alone, as NCCL pairs them.
:func:`simulate` replays every stage's program under NCCL's rules (``nccl_sim.py``).

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
from typing import NamedTuple, Optional

import torch

from rlt_mega.parallel.nccl_sim import Msg, Step, simulate_nccl
from rlt_mega.parallel.p2p import P2P  # noqa: F401  (the transport, re-exported for the engines)


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


# Shape class of each stream: "enc" the encoder's layout (b, T, d, or a GRPO batch's prompt pack:
# RLTStage.activation_shape), "seq" (b, T, d) or "step" (b, 1, d).
SHAPES = {"enc": "enc", "mem": "seq", "mem_grad": "seq", "enc_grad": "enc",
          "dec": "step", "ring": "step", "dec_grad": "step", "ring_grad": "step"}


def op_messages(op: Op, stage: int, num_stages: int, seq_len: int) -> tuple[list, list]:
    """What an operation receives before it computes and sends after: ([(src, stream)],
    [(dst, stream)]). A pure function of the op and the layout, shared by the schedule and the
    simulation that checks every pair's message order."""
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


def _msg_t(op: Op, stream: str, receiving: bool) -> int:
    """The position a message carries: the sender's; a ring message crosses from t-1 (forward)
    or t+1 (backward) to the receiving op's t."""
    if not receiving:
        return op.t
    return op.t + {"ring": -1, "ring_grad": 1}.get(stream, 0)


def _default_cost(op: Op) -> float:
    return 1.0 if op.kind in ("dec_fwd", "dec_bwd") else 0.0


def ring_programs(num_stages: int, num_micro: int, seq_len: int, backward: bool, cost=_default_cost
                  ) -> list[list[Step]]:
    """The training ring of every stage as message programs (parallel/nccl_sim.py), messages
    named by (stream, micro-batch, the sender's position)."""
    P, T = num_stages, seq_len
    out = []
    for s in range(P):
        steps = []
        for op in stage_program(s, P, num_micro, T, backward):
            recvs, sends = op_messages(op, s, P, T)
            steps.append(Step(f"{op.kind}(j={op.j}, t={op.t})",
                              tuple(Msg(src, s, st, op.j, _msg_t(op, st, True)) for src, st in recvs if src != s),
                              tuple(Msg(s, dst, st, op.j, _msg_t(op, st, False)) for dst, st in sends if dst != s),
                              cost(op)))
        out.append(steps)
    return out


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

        def post(op: Op) -> list:  # the receives of op, posted in program order (each channel's order)
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
                if op.kind == "loss_fwd":
                    part = stage.loss_fwd(op.j)
                    out, loss_sum = None, part if loss_sum is None else loss_sum + part
                else:
                    out = self._compute(op, x, ins, mem_grads)
                self.busy_s += time.perf_counter() - t0
                for dst, stream in sends:
                    p2p.send(out, dst, stream)
        p2p.drain()
        stage.finish()
        return loss_sum

    def _compute(self, op: Op, x: Optional[torch.Tensor], ins: list, mem_grads: dict) -> Optional[torch.Tensor]:
        """The stage's work for one op other than ``loss_fwd``: what it sends on. The last stage
        sums the memory gradients of every stage into ``mem_grads`` (the encoder's backward reads
        them)."""
        stage, last = self.stage, self.s == self.P - 1
        if op.kind in ("enc_fwd", "mem_fwd"):
            return getattr(stage, op.kind)(op.j, x)
        if op.kind in ("dec_fwd", "dec_bwd"):
            return getattr(stage, op.kind)(op.j, op.t, x)
        if op.kind == "loss_bwd":
            return stage.loss_bwd(op.j)
        if op.kind == "mem_bwd":
            out = stage.mem_bwd(op.j)
            if last:
                mem_grads[op.j] = sum(ins, out)
            return out
        if op.kind == "enc_bwd":
            return stage.enc_bwd(op.j, mem_grads.pop(op.j) if last else x)
        raise AssertionError(f"unknown pipeline op {op}")  # pragma: no cover


def simulate(num_stages: int, num_micro: int, seq_len: int, backward: bool = True, cost=_default_cost,
             latency: float = 0.0, streams: str = "channels") -> dict:
    """The training ring of every stage under NCCL's rules (parallel/nccl_sim.py: messages pair
    by order alone, a stream per communicator, rendezvous sends), posted as ``RingSchedule``
    posts them (receives one op ahead; ``streams="pair"`` is the schedule before its channels:
    both directions of a pair on one stream), on a model clock where an op lasts ``cost(op)`` and a message
    ``latency``. Raises on a mismatched pair or a deadlock; returns {"makespan", "busy": [per
    stage], "bubble"}, the bubble being the idle fraction of stage time over the round."""
    return simulate_nccl(ring_programs(num_stages, num_micro, seq_len, backward, cost), streams, True, latency)
