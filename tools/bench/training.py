"""Training-step benchmarks, measured side by side in one run (this machine is shared and
noisy: compare the ratios, not the absolute times).

    python tools/bench/training.py                  # all sections
    python tools/bench/training.py --only memory --seq-len 512

Sections
- throughput: training tokens/s of a full step (forward, backward, AdamW) for tiny_cpu and
  small_cpu at their configured sequence lengths.
- memory: peak memory and step time of small_cpu with and without decoder checkpointing.
  Peak memory is the peak resident set size of a fresh subprocess that builds the model and
  runs one step, minus the same process's resident size just before the step (so imports,
  weights and optimizer state are excluded; what remains is activations and gradients).
- encoder: the encoder's forward+backward FLOP rate against a large torch.mm in the same run
  (this CPU's fp32 matmul peak), and the decoder's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from rlt_mega.config import CheckpointingConfig, load_config
from rlt_mega.model import build_model
from rlt_mega.parallel.engine import LocalEngine


def _step_fn(cfg_path: str, seq_len: int, batch: int, ckpt: dict):
    cfg = load_config(cfg_path, [f"data.seq_len={seq_len}", f"model.max_seq_len={max(seq_len, 1024)}",
                                 f"train.micro_batch_size={batch}"])
    model = build_model(cfg.model, seed=0)
    model.set_checkpointing(CheckpointingConfig(**ckpt))
    engine = LocalEngine(model, cfg.optim, cfg.train, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    mb = [{"inputs": x[:, :-1], "targets": x[:, 1:]}]
    return lambda: engine.train_step(mb)


def time_step(cfg_path: str, seq_len: int, batch: int, ckpt: dict, repeats: int) -> float:
    step = _step_fn(cfg_path, seq_len, batch, ckpt)
    step()  # warm-up (allocations, optimizer state)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return min(times)


def _child(args: argparse.Namespace) -> None:
    """Runs in a subprocess: one step, prints the peak RSS growth in bytes and the step time."""
    step = _step_fn(args.config, args.seq_len, args.batch, json.loads(args.ckpt))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    # touch the optimizer state first so it is not counted as activation memory
    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_bytes": (peak - base) * 1024, "time": first}))


def measure_memory(cfg_path: str, seq_len: int, batch: int, ckpt: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--config", cfg_path, "--seq-len", str(seq_len),
           "--batch", str(batch), "--ckpt", json.dumps(ckpt)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def section_throughput(args) -> None:
    print("\n## training throughput (full step: forward, backward, AdamW)")
    print(f"{'config':<12} {'B x T':>10} {'step s':>8} {'tokens/s':>10}")
    for name in ("tiny_cpu", "small_cpu"):
        cfg = load_config(f"configs/{name}.yaml")
        B, T = cfg.train.micro_batch_size, cfg.data.seq_len
        ckpt = {"decoder": cfg.train.checkpointing.decoder, "decoder_k": cfg.train.checkpointing.decoder_k,
                "encoder": cfg.train.checkpointing.encoder}
        s = time_step(f"configs/{name}.yaml", T, B, ckpt, args.repeats)
        print(f"{name:<12} {f'{B} x {T}':>10} {s:8.2f} {B * T / s:10.0f}")


def section_memory(args) -> None:
    T, B = args.seq_len, args.batch
    print(f"\n## decoder checkpointing, small_cpu, B={B}, T={T} (peak = RSS growth during one step)")
    modes = [("none", {"decoder": "none"}), ("every_k=8", {"decoder": "every_k", "decoder_k": 8}),
             ("step", {"decoder": "step"}), ("step+encoder", {"decoder": "step", "encoder": True})]
    rows = []
    for label, ckpt in modes:
        mem = measure_memory("configs/small_cpu.yaml", T, B, ckpt)
        rows.append((label, mem["peak_bytes"], time_step("configs/small_cpu.yaml", T, B, ckpt, args.repeats)))
    base_mem, base_time = rows[0][1], rows[0][2]
    print(f"{'mode':<14} {'peak MiB':>9} {'vs none':>8} {'step s':>8} {'vs none':>8}")
    for label, peak, s in rows:
        print(f"{label:<14} {peak / 2**20:9.1f} {peak / base_mem:8.2f} {s:8.2f} {s / base_time:8.2f}")


def section_encoder(args) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config("configs/small_cpu.yaml", ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=8",
                                                 "model.ffn_hidden=1408"])
    model = build_model(cfg.model, seed=0)
    B, T = 8, 256
    x = torch.randint(0, cfg.model.vocab_size, (B, T))
    h = model.embed(x).detach().requires_grad_(True)

    def encoder():
        model.encode(h).sum().backward()

    def decoder():
        with torch.no_grad():
            m = model.memory_norm(model.encode(model.embed(x)))
        model.decode_dense(h, model.memory_kv(m)).sum().backward()

    peak = matmul_flops()
    print(f"\n## dense training FLOP rate, d=512, B={B}, T={T} (fp32; matmul peak {peak / 1e9:.1f} GFLOP/s)")
    for name, fn in (("encoder", encoder), ("decoder", decoder)):
        with FlopCounterMode(display=False) as counter:
            fn()
        flops = counter.get_total_flops()
        s = min(_timed(fn) for _ in range(args.repeats))
        print(f"{name:<8} {flops / s / 1e9:8.1f} GFLOP/s  = {flops / s / peak:5.1%} of the matmul peak")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["throughput", "memory", "encoder"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, fn in (("throughput", section_throughput), ("memory", section_memory), ("encoder", section_encoder)):
        if args.only in (None, name):
            fn(args)


if __name__ == "__main__":
    main()
