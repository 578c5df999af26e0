"""Training-step benchmarks, measured side by side in one run (a measurement, not a test: it
asserts nothing). Timing and memory conventions: tools/bench/harness.py.

    PYTHONPATH=. python tools/bench/training.py                       # all sections
    PYTHONPATH=. python tools/bench/training.py --only memory --seq-len 512

Sections
- throughput: training tokens/s of a full step (forward, backward, AdamW) for tiny_cpu and
  small_cpu at their configured sequence lengths and micro-batch sizes.
- memory (activation checkpointing: peak <= 1/3 of none, step <= 1.35x): small_cpu at
  T=--seq-len, B=--batch, one model and one engine, every checkpointing mode switched on it in
  turn: the peak memory of a training step above what lives before it (weights, Adam state,
  inputs), as tensor bytes (harness.peak_tensor_bytes, the target's measure: one profiled step
  per mode) and as resident set size (RSS, allocator included), and the step time (interleaved
  rounds, unprofiled), each against no checkpointing.
- flops (the encoder FLOP rate: >= 50% of torch.mm): the encoder's forward+backward FLOP rate
  at d=512 against a large torch.mm in the same run (this CPU's fp32 matmul peak at the same
  thread count), and the decoder's (dense schedule, full BPTT). FLOPs are counted by torch's FlopCounterMode
  (rlt_mega.plan.measure.count_flops): matmuls and attention, nothing elementwise.
"""

from __future__ import annotations

import argparse

import torch

from harness import add_common_args, best_of_rounds, describe, peak_rss, peak_tensor_bytes, setup
from rlt_mega.config import CheckpointingConfig, load_config
from rlt_mega.model import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import EngineConfig, LocalEngine
from rlt_mega.plan.measure import count_flops

MODES = {  # label -> checkpointing
    "none": dict(decoder="none"),
    "every_k=8": dict(decoder="every_k", decoder_k=8),
    "step": dict(decoder="step"),
    "every_k=8+enc": dict(decoder="every_k", decoder_k=8, encoder=True),
    "step+enc": dict(decoder="step", encoder=True),
}


def make_step(cfg_path: str, seq_len: int, batch: int, overrides=()):
    """-> (model, step fn) of a LocalEngine training step on one fixed random micro-batch."""
    cfg = load_config(cfg_path, [f"data.seq_len={seq_len}", f"model.max_seq_len={max(seq_len, 1024)}",
                                 f"train.micro_batch_size={batch}", *overrides])
    model = build_model(cfg.model, seed=0)
    engine = LocalEngine(model, ParallelDims.single(cfg.model, "cpu"), cfg.optim, EngineConfig.from_train(cfg.train))
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    mb = [{"inputs": x[:, :-1], "targets": x[:, 1:]}]
    return model, cfg, lambda: engine.train_step(mb)


def section_throughput(args, clock) -> None:
    print("\n## training throughput (full step: forward, backward, AdamW; each config's own checkpointing)")
    print(f"{'config':<12} {'B x T':>10} {'step s':>8} {'tokens/s':>10}")
    for name in ("tiny_cpu", "small_cpu"):
        model, cfg, step = make_step(f"configs/{name}.yaml", load_config(f"configs/{name}.yaml").data.seq_len,
                                     load_config(f"configs/{name}.yaml").train.micro_batch_size)
        model.set_checkpointing(cfg.train.checkpointing)
        B, T = cfg.train.micro_batch_size, cfg.data.seq_len
        step()  # warm-up: Adam state
        best, _ = best_of_rounds({name: step}, args.repeats, clock)
        print(f"{name:<12} {f'{B} x {T}':>10} {best[name]:8.2f} {B * T / best[name]:10.0f}")


def section_memory(args, clock) -> None:
    T, B = args.seq_len, args.batch
    model, _, step = make_step("configs/small_cpu.yaml", T, B)
    step()  # warm-up: Adam state, so that it is not counted as step memory
    modes = {label: CheckpointingConfig(**MODES[label]) for label in args.modes}
    tensors, rss = {}, {}
    for label, mode in modes.items():  # memory is deterministic: one step each
        model.set_checkpointing(mode)
        tensors[label] = peak_tensor_bytes(step)
        rss[label] = peak_rss(step)

    def run(mode):
        model.set_checkpointing(mode)
        step()

    times, _ = best_of_rounds({label: (lambda m=mode: run(m)) for label, mode in modes.items()}, args.repeats, clock)
    print(f"\n## activation checkpointing, small_cpu, B={B}, T={T}: peak = the step's memory above what lives "
          f"before it (tensors: the target's measure; RSS: with glibc's heap); time: best of {args.repeats} "
          "interleaved rounds")
    print(f"{'mode':<14} {'tensors MiB':>11} {'vs none':>8} {'RSS MiB':>8} {'vs none':>8} {'step s':>7} {'vs none':>8}")
    for label in modes:
        print(f"{label:<14} {tensors[label] / 2**20:11.1f} {tensors[label] / tensors['none']:8.2f} "
              f"{rss[label] / 2**20:8.1f} {rss[label] / rss['none']:8.2f} {times[label]:7.2f} "
              f"{times[label] / times['none']:8.2f}")


def matmul_peak(clock, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best, _ = best_of_rounds({"mm": lambda: torch.mm(a, b)}, repeats + 1, clock)
    return 2 * n ** 3 / best["mm"]


def section_flops(args, clock) -> None:
    cfg = load_config("configs/small_cpu.yaml", ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=8",
                                                 "model.ffn_hidden=1408"])
    model = build_model(cfg.model, seed=0)
    B = 8
    x_enc = torch.randint(0, cfg.model.vocab_size, (B, args.enc_len))
    x_dec = x_enc[:, :args.dec_len]
    h = model.embed(x_enc).detach().requires_grad_(True)
    with torch.no_grad():
        m = model.memory_norm(model.encode(model.embed(x_dec)))
    e = model.embed(x_dec).detach().requires_grad_(True)
    m = m.requires_grad_(True)

    def encoder():
        model.encode(h).sum().backward()

    def decoder():
        model.decode_dense(e, model.memory_kv(m)).sum().backward()

    fns = {"encoder": encoder, "decoder": decoder, "matmul": lambda: None}
    flops = {k: count_flops(fn) for k, fn in fns.items() if k != "matmul"}
    peaks = []

    def mm():
        peaks.append(matmul_peak(clock))

    fns["matmul"] = mm
    best, _ = best_of_rounds(fns, args.repeats, clock)
    peak = max(peaks)
    print(f"\n## dense training FLOP rate (forward + backward), d=512 H=8 ffn=1408 L={cfg.model.n_layers}, B={B}, "
          f"encoder T={args.enc_len}, decoder T={args.dec_len}; fp32 matmul peak (2048^3 torch.mm, same run) "
          f"{peak / 1e9:.1f} GFLOP/s; best of {args.repeats} rounds")
    print(f"{'part':<8} {'GFLOP':>7} {'s':>7} {'GFLOP/s':>8} {'of peak':>8}")
    for name in ("encoder", "decoder"):
        rate = flops[name] / best[name]
        print(f"{name:<8} {flops[name] / 1e9:7.2f} {best[name]:7.2f} {rate / 1e9:8.1f} {rate / peak:8.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["throughput", "memory", "flops"], nargs="+")
    p.add_argument("--seq-len", type=int, default=512, help="memory section: T")
    p.add_argument("--batch", type=int, default=8, help="memory section: B")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="memory section: checkpointing modes (none is always measured)")
    p.add_argument("--enc-len", type=int, default=256, help="flops section: encoder T")
    p.add_argument("--dec-len", type=int, default=64, help="flops section: decoder T")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each figure is the best")
    add_common_args(p)
    args = p.parse_args()
    args.modes = ["none"] + [m for m in args.modes if m != "none"]
    clock = setup(args)
    print(describe(args))
    for name, fn in (("throughput", section_throughput), ("memory", section_memory), ("flops", section_flops)):
        if args.only is None or name in args.only:
            fn(args, clock)


if __name__ == "__main__":
    main()
