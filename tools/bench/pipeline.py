"""Benchmark of the distributed engine (a measurement, not a test: it asserts nothing).

1. Bubble of the decoder-ring schedule for P = 2, 4 stages and M = 1, 2, 4, 8 micro-batches,
   against the ideal (P - 1) / (M*T + P - 1) ("formula"; target: within 10% of it). The formula
   holds for M >= P only: with M < P a position cannot start before its predecessor went round the
   ring, the makespan is P*T + M - 1 ticks, not M*T + P - 1 ("ring bound" = 1 - M*T / max of
   the two; equal to the formula for M >= P).
   * "model clock": rlt_mega.parallel.pipeline.simulate, each decoder op one tick, transfers free.
   * "clock+lat": the same with the measured one-way message latency of this machine.
   * "emul": the real schedule, real gloo messages and real ranks, with a stage whose decoder
     ops sleep a fixed time (4 or 20 ms) instead of computing, so that P ranks on a machine with
     fewer cores still run concurrently. Bubble = 1 - sum over stages of busy time / sum over
     stages of the round's wall time; busy = time inside stage ops, so message latency and
     the schedule's own Python overhead count as bubble.
   * "RLT tiny": the same with the real tiny model (P = 2 only: one rank per core here).
   * "ovh": the emulated bubble beyond the ring bound as time per decoder op outside compute
     (the schedule's Python, gloo calls and threads, waiting for a core). The bubble is
     bound + ovh / cost: within 10% of the formula needs ovh below 10% of the formula times
     the op cost (M=8, P=2, T=16: 0.08% of it).
2. Training tokens/s of TP=2, PP=2 (M=2) and DP=2 relative to one process (the same engine in a
   world of one), on a tiny model, after warm-up steps.

    PYTHONPATH=. python tools/bench/pipeline.py            # ~2-3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

import harness

from rlt_mega.parallel.dims import free_port

COSTS_S = (0.004, 0.020)  # emulated time of one decoder op of one stage
T_BUBBLE = 16


def _spawn(fn, nprocs: int, *args):
    """Runs fn(rank, queue, *args) on nprocs ranks (gloo); returns rank 0's queued result."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, nprocs, port, queue, args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join(timeout=120)
    return result


def _entry(fn, rank, world, port, queue, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", RLT_LOG_LEVEL="WARNING")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    out = fn(rank, *args)
    if rank == 0:
        queue.put(out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ bubble
class SleepStage:
    """The stage interface with emulated compute: decoder ops sleep ``cost`` s, others are free."""

    def __init__(self, d: int, cost: float) -> None:
        self.d, self.cost = d, cost

    dtype = torch.float32

    def start(self, batches, loss_scale, grad, loss=None):
        self.shapes = [b["inputs"].shape for b in batches]

    def finish(self):
        pass

    def activation_shape(self, j, kind):
        b, T = self.shapes[j]
        return (b, T, self.d) if kind in ("enc", "seq") else (b, 1, self.d)

    def _seq(self, j):
        return torch.zeros(self.activation_shape(j, "seq"))

    def _step(self, j):
        time.sleep(self.cost)
        return torch.zeros(self.activation_shape(j, "step"))

    def enc_fwd(self, j, x):
        return self._seq(j)

    def mem_fwd(self, j, m):
        return None

    def dec_fwd(self, j, t, x):
        return self._step(j)

    def loss_fwd(self, j):
        return torch.zeros(())

    def loss_bwd(self, j):
        return None

    def dec_bwd(self, j, t, g):
        return self._step(j)

    def mem_bwd(self, j):
        return self._seq(j)

    def enc_bwd(self, j, g):
        return self._seq(j)


def _latency(dims, d: int, rounds: int = 50) -> float:
    """One-way time of a decoder message (b=2, 1, d) between stages 0 and 1 (ping-pong / 2)."""
    import torch.distributed as dist

    buf = torch.zeros(2, 1, d)
    if dims.pp_rank > 1:
        return 0.0
    peer = dims.pp_ranks[1 - dims.pp_rank]
    t0 = time.perf_counter()
    for _ in range(rounds):
        if dims.pp_rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    return (time.perf_counter() - t0) / rounds / 2


def _round_bubble(ring, run, P) -> float:
    """1 - (sum over stages of busy time) / (sum over stages of the round's wall time)."""
    import torch.distributed as dist

    for _ in range(2):  # the first round warms up
        dist.barrier()
        t0 = time.perf_counter()
        run()
        busy = torch.tensor([ring.busy_s, time.perf_counter() - t0])
        dist.all_reduce(busy)
    return 1.0 - float(busy[0]) / float(busy[1])


def _bubble_worker(rank, P, Ms, real):
    from rlt_mega.config import ParallelConfig
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.p2p import P2P
    from rlt_mega.parallel.pipeline import RingSchedule

    cfg = _tiny_cfg(pp=P)
    dims = ParallelDims.build(ParallelConfig(pp=P), cfg.model, "cpu")
    p2p = P2P.for_pipeline(dims)
    out = {"latency": _latency(dims, cfg.model.d_model)}
    batches = {M: [{"inputs": torch.randint(0, 32, (2, T_BUBBLE)), "targets": torch.randint(0, 32, (2, T_BUBBLE))}
                   for _ in range(M)] for M in Ms}
    if real:
        from rlt_mega.model.rlt import build_model
        from rlt_mega.parallel.grads import ShadowGrads
        from rlt_mega.loss import LM_LOSS, WHOLE_VOCAB
        from rlt_mega.parallel.stage import RLTStage, prune_to_stage

        model = prune_to_stage(build_model(cfg.model, "cpu", seed=0), dims.layers, dims.is_first_stage,
                               dims.is_last_stage)
        ring = RingSchedule(RLTStage(model, dims.layers, dims.is_first_stage, dims.is_last_stage, WHOLE_VOCAB),
                            p2p, dims.pp_rank, P)

        def run_real(M):
            with ShadowGrads(model).active():
                ring.run(batches[M], 1.0, backward=True, loss=LM_LOSS)

        out["rlt"] = {M: _round_bubble(ring, lambda: run_real(M), P) for M in Ms}
    for cost in COSTS_S:
        ring = RingSchedule(SleepStage(cfg.model.d_model, cost), p2p, dims.pp_rank, P)
        out[cost] = {M: _round_bubble(ring, lambda: ring.run(batches[M], 1.0, backward=True, loss=None), P) for M in Ms}
    dims.destroy()
    return out


# ------------------------------------------------------------------------------ throughput
def _tiny_cfg(**parallel):
    from rlt_mega.config import from_dict

    return from_dict({
        "model": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=256,
                      memory_block=4, max_seq_len=64),
        "data": {"seq_len": 32}, "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"micro_batch_size": 8, "grad_accum": 1, "steps": 100}, "parallel": parallel})


def _throughput_worker(rank, parallel, steps):
    import torch.distributed as dist

    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.builders import build_engine

    cfg = _tiny_cfg(**parallel)
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    g = torch.Generator().manual_seed(dims.dp_rank)
    tokens = torch.randint(0, 256, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=g)
    batch = [{"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}]
    for _ in range(2):
        engine.train_step(batch)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.train_step(batch)
    dist.barrier()
    wall = time.perf_counter() - t0
    dims.destroy()
    return steps * tokens[:, :-1].numel() * dims.dp / wall  # training tokens per second, all replicas


def ring_bound(P: int, M: int, T: int) -> float:
    """Bubble of the ring on a model clock (unit decoder ops, free messages)."""
    return 1.0 - M * T / max(M * T + P - 1, P * T + M - 1)


def overhead_per_op(bubble: float, ideal: float, cost: float) -> float:
    """Seconds per decoder op that the stages spent outside compute beyond the ideal bubble:
    busy = (1 - bubble) * wall, so (bubble - ideal) * wall / (number of ops) with the number
    of ops = busy / cost. The schedule's Python, gloo's calls and threads, and waiting for a
    core on a shared machine all land here."""
    return (bubble - ideal) / (1.0 - bubble) * cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per layout and repeat")
    parser.add_argument("--repeats", type=int, default=2, help="throughput: best of this many launches per layout")
    parser.add_argument("--skip-throughput", action="store_true")
    harness.add_json_arg(parser)
    args = parser.parse_args()
    res = harness.Results("pipeline", args)
    from rlt_mega.parallel.pipeline import simulate

    out = sys.stdout
    Ms = [1, 2, 4, 8]
    measured = {P: _spawn(_bubble_worker, P, P, Ms, P == 2) for P in (2, 4)}
    latency = measured[2]["latency"]
    out.write(f"\nBubble of the ring schedule, forward + backward, T = {T_BUBBLE}. Measured one-way latency of a "
              f"decoder message (gloo, this machine): {latency * 1e3:.2f} ms\n")
    head = ["P", "M", "formula", "ring bound", "clock", "clock+lat 4ms", "emul 4ms", "ovh 4ms", "clock+lat 20ms",
            "emul 20ms", "ovh 20ms", "RLT tiny"]
    out.write(" ".join(f"{h:>{max(5, len(h))}}" for h in head) + "\n")
    for P in (2, 4):
        for M in Ms:
            cells = [P, M, (P - 1) / (M * T_BUBBLE + P - 1), ring_bound(P, M, T_BUBBLE),
                     simulate(P, M, T_BUBBLE)["bubble"]]
            for cost in COSTS_S:
                emul = measured[P][cost][M]
                cells += [simulate(P, M, T_BUBBLE, latency=latency / cost)["bubble"], emul,
                          f"{overhead_per_op(emul, ring_bound(P, M, T_BUBBLE), cost) * 1e3:.2f}ms"]
            cells.append(measured[P]["rlt"][M] if "rlt" in measured[P] else None)
            text = [f"{c:>{max(5, len(h))}}" if isinstance(c, (int, str)) else
                    (f"{'-':>{max(5, len(h))}}" if c is None else f"{c:>{max(5, len(h))}.3f}")
                    for c, h in zip(cells, head)]
            out.write(" ".join(text) + "\n")
            res.row(f"ring bubble, forward + backward, T = {T_BUBBLE}", **{
                h: (round(c, 4) if isinstance(c, float) else c) for h, c in zip(head, cells)})
            if M == 8:
                formula, emul = cells[2], measured[P][COSTS_S[-1]][M]
                res.target(f"ring bubble P={P} M={M}", f"within 10% of (P-1)/(M*T+P-1) = {formula:.3f}",
                           f"{emul:.3f} (real ranks, {COSTS_S[-1] * 1e3:.0f} ms emulated ops)",
                           abs(emul - formula) <= 0.1 * formula)
    if args.skip_throughput:
        res.write()
        return
    layouts = [("one process", 1, {}), ("TP=2", 2, {"tp": 2}), ("PP=2 (M=2)", 2, {"pp": 2, "micro_batches": 2}),
               ("DP=2", 2, {})]
    best = {name: 0.0 for name, _, _ in layouts}
    for _ in range(args.repeats):  # interleaved, best of: the machine is shared
        for name, n, parallel in layouts:
            best[name] = max(best[name], _spawn(_throughput_worker, n, parallel, args.steps))
    base = best["one process"]
    out.write("\nTraining throughput, d=128 L=4 T=32, 8 sequences per replica, fp32, ZeRO off, gloo, "
              f"best of {args.repeats}\n")
    out.write(f"{'layout':<12} {'tokens/s':>10} {'relative':>9}\n")
    for name, _, _ in layouts:
        out.write(f"{name:<12} {best[name]:10.0f} {best[name] / base:9.2f}\n")
        res.row("training throughput, d=128 L=4 T=32, gloo", layout=name, **{
            "tokens/s": round(best[name]), "relative": round(best[name] / base, 2)})
    res.write()


if __name__ == "__main__":
    main()
