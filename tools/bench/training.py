"""Training-step benchmarks: the decoder step (model/decoder.py, "fused") and the executable
reference (rlt_mega/reference.py: the decoder written plainly on the modules, plain autograd;
"module") side by side in one run (a measurement, not a test: it asserts nothing). Timing and
memory conventions: tools/bench/harness.py.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/training.py                  # all sections
    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/training.py --only flops --repeats 3

Sections
- flops (the decoder FLOP rate: >= 55% of torch.mm; the encoder's: >= 50%): the decoder's
  forward+backward FLOP rate (dense schedule, full BPTT) at d=512 H=8 ffn=1408 L=4 B=8
  T=--dec-len, the decoder step and the reference, against a 2048^3 torch.mm in the same run (this
  CPU's fp32 matmul peak at the same thread count), and the encoder's. FLOPs are counted by torch's
  FlopCounterMode on the reference (rlt_mega.cost.measure.count_flops: matmuls and attention,
  nothing elementwise) and used as the work of both paths (the fused path recomputes no more than
  the module path does). Each position-layer's time is split into GEMM and the rest by the share
  of the matrix-product operators' self time (mm, addmm, bmm, baddbmm, oneDNN linear) in one
  profiled run. Then the shape's ceiling on this machine: the per-position products measured
  alone (``products_only``: at B rows each weight byte read feeds B/2 FLOPs, and the weights do
  not stay in cache from one position to the next), the rest of the FLOPs at the matmul peak,
  and no time between operators; with the fused path's share of it. ``--dec-batch`` changes B.
- throughput: training tokens/s of a full step (forward, backward, AdamW) for tiny_cpu and small_cpu
  at their configured sequence lengths, micro-batch sizes and checkpointing, the decoder step
  against the reference (the plain spec, not a tuned baseline: its K/V are concatenated per step).
- memory (activation checkpointing: peak <= 1/3 of none, step+enc <= 1.35x none): small_cpu at
  T=--seq-len, B=--batch, fused path, every checkpointing mode in turn: the peak memory of a
  training step above what lives before it (weights, Adam state, inputs), as tensor bytes
  (harness.peak_tensor_bytes, the target's measure: one profiled step per mode, the fused step's
  workspace emptied first so that its slab counts) and as resident set size (RSS, allocator
  included), and the step time (interleaved rounds, unprofiled), each against no checkpointing;
  the reference's none and step+enc alongside; and what the fused step's buffers hold, by
  purpose (DecoderRun.buffer_bytes).
"""

from __future__ import annotations

import argparse
import types
from typing import Callable

import torch

from harness import (Results, add_common_args, add_json_arg, best_of_rounds, describe, peak_rss, peak_tensor_bytes, round_ratios, setup,
                     timed_rounds)
from rlt_mega.config import CheckpointingConfig, load_config
from rlt_mega.model.rlt import build_model
from rlt_mega.model.workspace import WORKSPACE
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import EngineConfig, LocalEngine
from rlt_mega.cost.measure import count_flops
from rlt_mega.reference import reference_decode, reference_forward

MODES = {  # label -> checkpointing
    "none": dict(decoder="none"),
    "every_k=8": dict(decoder="every_k", decoder_k=8),
    "every_k=16": dict(decoder="every_k", decoder_k=16),
    "step": dict(decoder="step"),
    "every_k=8+enc": dict(decoder="every_k", decoder_k=8, encoder=True),
    "step+enc": dict(decoder="step", encoder=True),
}
PATHS = {"fused": True, "module": False}  # the decoder step, the reference
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_", "aten::baddbmm_",
            "mkldnn::_linear_pointwise", "aten::addbmm", "aten::matmul")


def make_step(cfg_path: str, seq_len: int, batch: int, fused: bool = True, overrides=()):
    """-> (model, cfg, step fn) of a LocalEngine training step on one fixed random micro-batch."""
    cfg = load_config(cfg_path, [f"data.seq_len={seq_len}", f"model.max_seq_len={max(seq_len, 1024)}",
                                 f"train.micro_batch_size={batch}", *overrides])
    model = build_model(cfg.model, seed=0)
    if not fused:  # the reference arm
        model.forward = types.MethodType(lambda self, tokens, documents=None: reference_forward(self, tokens, documents),
                                         model)
    engine = LocalEngine(model, ParallelDims.single(cfg.model, "cpu"), cfg.optim, EngineConfig.from_train(cfg.train))
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    mb = [{"inputs": x[:, :-1], "targets": x[:, 1:]}]
    return model, cfg, lambda: engine.train_step(mb)


def section_throughput(args, clock, res: Results) -> None:
    print("\n## training throughput (full step: forward, backward, AdamW; each config's own checkpointing)")
    print(f"{'config':<10} {'B x T':>9} {'checkpointing':>24} {'fused s':>8} {'module s':>9} {'fused tok/s':>11} "
          f"{'module tok/s':>12} {'ratio':>6}  (ratio: of the best times; per round: module / fused within "
          "each round, sorted)")
    for name in ("tiny_cpu", "small_cpu"):
        base = load_config(f"configs/{name}.yaml")
        B, T = base.train.micro_batch_size, base.data.seq_len
        steps = {}
        for label, fused in PATHS.items():
            model, cfg, step = make_step(f"configs/{name}.yaml", T, B, fused)
            model.set_checkpointing(cfg.train.checkpointing)
            step()  # warm-up: Adam state, the fused step's workspace
            steps[label] = step
        times, _ = timed_rounds(steps, args.repeats, clock)
        best = {k: min(v) for k, v in times.items()}
        paired = sorted(round_ratios(times, "module", "fused"))
        ck = base.train.checkpointing
        mode = ck.decoder + (f"(k={ck.decoder_k})" if ck.decoder == "every_k" else "") + ("+enc" if ck.encoder else "")
        print(f"{name:<10} {f'{B} x {T}':>9} {mode:>24} {best['fused']:8.2f} {best['module']:9.2f} "
              f"{B * T / best['fused']:11.0f} {B * T / best['module']:12.0f} {best['module'] / best['fused']:6.2f}  "
              f"per round {' '.join(f'{r:.2f}' for r in paired)}")
        res.row("training throughput, fused against module path", config=name, **{
            "B x T": f"{B} x {T}", "checkpointing": mode, "fused tok/s": round(B * T / best['fused']),
            "module tok/s": round(B * T / best['module']), "ratio": round(best['module'] / best['fused'], 2)})
        want = {"tiny_cpu": 2.0, "small_cpu": 2.5}[name]
        res.target(f"fused training throughput, {name}", f"full step tok/s >= {want}x the module path",
                   f"{best['module'] / best['fused']:.2f}x", best['module'] / best['fused'] >= want)


def section_memory(args, clock, res: Results) -> None:
    T, B = args.seq_len, args.batch
    runs = {label: make_step("configs/small_cpu.yaml", T, B, fused) for label, fused in PATHS.items()
            if label in args.paths}
    for _, _, step in runs.values():
        step()  # warm-up: Adam state, so that it is not counted as step memory
    cases = [("fused", label) for label in args.modes] + [("module", label) for label in ("none", "step+enc")
                                                          if label in args.modes and "module" in runs]
    tensors, rss = {}, {}
    for path, label in cases:  # memory is deterministic: one step each
        model, _, step = runs[path]
        model.set_checkpointing(CheckpointingConfig(**MODES[label]))
        WORKSPACE.clear()
        tensors[path, label] = peak_tensor_bytes(step)
        WORKSPACE.clear()
        rss[path, label] = peak_rss(step)

    def run(path, label):
        model, _, step = runs[path]
        model.set_checkpointing(CheckpointingConfig(**MODES[label]))
        step()

    all_times, _ = timed_rounds({case: (lambda c=case: run(*c)) for case in cases}, args.repeats, clock)
    times = {k: min(v) for k, v in all_times.items()}
    print(f"\n## activation checkpointing, small_cpu, B={B}, T={T}: peak = the step's memory above what lives "
          f"before it (tensors: the target's measure; RSS: with glibc's heap); time: best of {args.repeats} "
          "interleaved rounds; each against its path's no checkpointing")
    print(f"{'path':<7} {'mode':<14} {'tensors MiB':>11} {'vs none':>8} {'RSS MiB':>8} {'vs none':>8} {'step s':>7} "
          f"{'vs none':>8}")
    for path, label in cases:
        ref = (path, "none")
        print(f"{path:<7} {label:<14} {tensors[path, label] / 2**20:11.1f} {tensors[path, label] / tensors[ref]:8.2f} "
              f"{rss[path, label] / 2**20:8.1f} {rss[path, label] / rss[ref]:8.2f} {times[path, label]:7.2f} "
              f"{times[path, label] / times[ref]:8.2f}")
        res.row(f"activation checkpointing, small_cpu, B={B}, T={T}", path=path, mode=label, **{
            "tensors MiB": round(tensors[path, label] / 2**20, 1),
            "vs none": round(tensors[path, label] / tensors[ref], 2),
            "step s": round(times[path, label], 2), "time vs none": round(times[path, label] / times[ref], 2)})
    print("fused step's buffers (MiB) by checkpointing mode: saved = activation slots + attention outputs; "
          "wgrad_ring = the deferred weight gradients' output-gradient ring; kv_rows = the deferred K/V gradients' "
          "rows; kv = decoder and memory K/V with their gradients; backward scratch = the rings, K/V gradients and "
          "rows, allocated by the decoder's backward and freed at its end; plus fp32 weight-gradient accumulators "
          "(a copy of the decoder's weights) during the decoder's backward")
    model = runs["fused"][0]
    per_row = {}
    for label in args.modes:
        model.set_checkpointing(CheckpointingConfig(**MODES[label]))
        sizes = fused_buffers(model, B, T)
        per_row[label] = sum(v for k, v in sizes.items() if k != "of which backward scratch") / B
        print(f"  {label:<14} " + "  ".join(f"{k} {v / 2**20:.1f}" for k, v in sizes.items()))
    if "none" in per_row:
        print("decoder memory per row (the run's buffers, forward slab and backward scratch, / B), against none:")
        for label, v in per_row.items():
            print(f"  {label:<14} {v / 2**20:8.2f} MiB  {v / per_row['none']:.2f}")
            res.row(f"decoder memory per row, small_cpu, B={B}, T={T}", mode=label,
                    **{"MiB": round(v / 2**20, 2), "vs none": round(v / per_row["none"], 3)})
        if "every_k=16" in per_row:
            ratio, slower = per_row["every_k=16"] / per_row["none"], times["fused", "every_k=16"] / times["fused", "none"]
            spread = sorted(round_ratios(all_times, ("fused", "every_k=16"), ("fused", "none")))
            print(f"every_k=16 step time / none, per round (sorted): {' '.join(f'{r:.2f}' for r in spread)}")
            res.target("decoder recomputation, small_cpu every_k=16", "decoder memory per row <= 40% of none, step "
                       "time <= 1.4x none", f"{ratio:.2f} of the memory, {slower:.2f}x the time",
                       ratio <= 0.40 and slower <= 1.4)


def fused_buffers(model, B: int, T: int) -> dict[str, int]:
    """The buffers of the fused run one training step of ``model`` builds (captured by a spy)."""
    from rlt_mega.model import decoder as fused_run

    seen = []
    original = fused_run.DecoderRun.__init__

    def spy(self, *a, **kw):
        original(self, *a, **kw)
        if self.grads is not None:
            seen.append(self)

    fused_run.DecoderRun.__init__ = spy
    try:
        x = torch.randint(0, model.cfg.vocab_size, (B, T))
        model(x).sum().backward()
        run = seen[-1]  # the training run (an evaluation forward builds none with grads)
        sizes = {**run.buffer_bytes(), "of which backward scratch": run.scratch_bytes()}
        model.zero_grad(set_to_none=True)
    finally:
        fused_run.DecoderRun.__init__ = original
    return sizes


def matmul_peak(clock, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best, _ = best_of_rounds({"mm": lambda: torch.mm(a, b)}, repeats + 1, clock)
    return 2 * n ** 3 / best["mm"]


def gemm_share(fn) -> float:
    """The share of one profiled call of fn spent in the matrix-product operators: their self
    time over the call's, both elapsed time (the profiler's clock)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
    return min(1.0, sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6 / total)


def products_only(model, B: int, T: int) -> tuple[Callable[[], object], float, int]:
    """The per-position products of a fused training step and nothing else: the stack the fused
    path prepares for ``model`` (fp32, B rows, backward forms too), and for each of T positions
    every layer's forward products in the step's order (qkv, o, cross_q, cross_o, gate_up, down;
    the recurrence input's) then their input-gradient products in reverse, each weight read from
    wherever the previous position left it, as in the step -> (fn, their FLOPs, the bytes of
    weight forms one position reads)."""
    spec, weights = model.decoder.weights(model, range(model.cfg.n_layers), True)
    stack = model.decoder.stack(model, spec, weights, B, True, torch.float32, torch.float32)
    gemms = [stack.recur] + [getattr(stack.layers[i], n) for i in spec.layers
                             for n in ("qkv", "o", "cross_q", "cross_o", "gate_up", "down")]
    xs = [torch.randn(B, g.in_features) for g in gemms]
    gs = [torch.randn(B, g.out_features) for g in gemms]

    def run():
        for _ in range(T):
            for g, x in zip(gemms, xs):
                g(x)
            for g, gy in zip(reversed(gemms), reversed(gs)):
                g.grad_input(gy)

    flops = T * sum(2 * 2 * B * g.in_features * g.out_features for g in gemms)
    return run, flops, sum(2 * g.w.numel() * g.w.element_size() for g in gemms)  # a forward and a backward form


def section_flops(args, clock, res: Results) -> None:
    cfg = load_config("configs/small_cpu.yaml", ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=8",
                                                 "model.ffn_hidden=1408"])
    models = {label: build_model(cfg.model, seed=0) for label in PATHS}
    B, L, T = args.dec_batch, cfg.model.n_layers, args.dec_len
    module = models["module"]
    x_enc = torch.randint(0, cfg.model.vocab_size, (B, args.enc_len))
    x_dec = x_enc[:, :T]
    h = module.embed(x_enc).detach().requires_grad_(True)
    with torch.no_grad():
        m = module.memory_norm(module.encode(module.embed(x_dec)))
    e = module.embed(x_dec).detach().requires_grad_(True)
    m = m.requires_grad_(True)

    def encoder():
        module.encode(h).sum().backward()

    def decoder(label):
        model = models[label]
        if label == "module":
            return lambda: reference_decode(model, e, m).sum().backward()
        return lambda: model.decode_dense(e, model.memory_kv(m)).sum().backward()

    fns = {"encoder": encoder, **{label: decoder(label) for label in PATHS}}
    flops = {"encoder": count_flops(encoder), "decoder": count_flops(decoder("module"))}
    for label in PATHS:
        fns[label]()  # warm-up (the fused step's workspace)
    share = {label: gemm_share(fns[label]) for label in PATHS}
    fns["products"], product_flops, form_bytes = products_only(models["fused"], B, T)
    peaks = []
    fns["matmul"] = lambda: peaks.append(matmul_peak(clock))
    best, _ = best_of_rounds(fns, args.repeats, clock)
    peak = max(peaks)
    print(f"\n## dense training FLOP rate (forward + backward), d=512 H=8 ffn=1408 L={L}, B={B}, encoder "
          f"T={args.enc_len}, decoder T={T}; fp32 matmul peak (2048^3 torch.mm, same run) {peak / 1e9:.1f} GFLOP/s; "
          f"best of {args.repeats} rounds; decoder FLOPs counted on the reference (module)")
    print(f"{'part':<16} {'GFLOP':>7} {'s':>7} {'GFLOP/s':>8} {'of peak':>8} {'per position-layer: ms':>23} "
          f"{'GEMM':>6} {'rest':>6}")
    rate = flops["encoder"] / best["encoder"]
    print(f"{'encoder':<16} {flops['encoder'] / 1e9:7.2f} {best['encoder']:7.2f} {rate / 1e9:8.1f} {rate / peak:8.1%}")
    table = f"dense training FLOP rate, d=512 L={L} B={B} (peak {peak / 1e9:.1f} GFLOP/s, torch.mm 2048^3)"
    res.row(table, part="encoder", **{"GFLOP/s": round(rate / 1e9, 1), "of peak": f"{rate / peak:.1%}"})
    res.target("encoder FLOP rate", ">= 50% of the same run's torch.mm peak, d=512", f"{rate / peak:.1%}", rate >= 0.5 * peak)
    for label in PATHS:
        rate = flops["decoder"] / best[label]
        per = best[label] / (T * L) * 1e3
        g = share[label] * per
        print(f"{'decoder ' + label:<16} {flops['decoder'] / 1e9:7.2f} {best[label]:7.2f} {rate / 1e9:8.1f} "
              f"{rate / peak:8.1%} {per:23.3f} {g:6.3f} {per - g:6.3f}")
        res.row(table, part=f"decoder {label}", **{"GFLOP/s": round(rate / 1e9, 1), "of peak": f"{rate / peak:.1%}"})
        if label == "fused":
            res.target("fused decoder FLOP rate", f">= 55% of the torch.mm peak (d=512, L={L}, B={B}, T={T})",
                       f"{rate / peak:.1%}", rate >= 0.55 * peak)
    print(f"reference (module) / fused decoder time: {best['module'] / best['fused']:.2f}x (GEMM/rest split: the shares of "
          "one profiled run, whose per-operator overhead inflates the rest, applied to the unprofiled time)")
    # The ceiling of this shape on this machine: the per-position products as measured alone (each
    # reads its weight form from memory once per position: at B rows a weight byte feeds B/2 FLOPs),
    # everything else (the deferred weight gradients, the memory K/V, attention) at the matmul peak,
    # and no time between operators.
    floor = best["products"] + (flops["decoder"] - product_flops) / peak
    stream = form_bytes * T / best["products"]
    ceiling = flops["decoder"] / floor / peak
    print(f"ceiling at B={B}: the per-position products alone {best['products']:.2f} s ({product_flops / 1e9:.2f} "
          f"GFLOP, {product_flops / best['products'] / peak:.1%} of peak: {form_bytes / 2**20:.0f} MiB of weight forms "
          f"read per position at {stream / 1e9:.1f} GB/s), the rest of the FLOPs at peak, nothing between operators: "
          f"{floor:.2f} s = {ceiling:.1%} of peak; the fused path reaches {floor / best['fused']:.0%} of it")
    res.row(table, part=f"ceiling at B={B}", **{"GFLOP/s": round(ceiling * peak / 1e9, 1), "of peak": f"{ceiling:.1%}"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["throughput", "memory", "flops"], nargs="+")
    p.add_argument("--seq-len", type=int, default=512, help="memory section: T")
    p.add_argument("--batch", type=int, default=8, help="memory section: B")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="memory section: checkpointing modes (none is always measured)")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS),
                   help="memory section: the decoder step (fused) and/or the reference (module)")
    p.add_argument("--enc-len", type=int, default=256, help="flops section: encoder T")
    p.add_argument("--dec-len", type=int, default=64, help="flops section: decoder T")
    p.add_argument("--dec-batch", type=int, default=8,
                   help="flops section: B, of the encoder and the decoder (the target is at 8)")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each figure is the best")
    add_common_args(p)
    add_json_arg(p)
    args = p.parse_args()
    res = Results("training", args)
    args.modes = ["none"] + [m for m in args.modes if m != "none"]
    clock = setup(args)
    print(describe(args))
    for name, fn in (("flops", section_flops), ("throughput", section_throughput), ("memory", section_memory)):
        if args.only is None or name in args.only:
            fn(args, clock, res)
    res.write()


if __name__ == "__main__":
    main()
