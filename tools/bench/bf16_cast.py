"""train.bf16_cast side by side (docs/stability.md, "The bf16 copy"): a tiny RLT trained by the
local engine in bf16 on random tokens with each cast, at several constant learning rates;
precision/stale_fraction and precision/copy_lag at every step (not a test: it prints figures).

    python tools/bench/bf16_cast.py [--steps 8] [--lr 1e-5 1e-4 1e-3]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from rlt_mega.config import ModelConfig, OptimConfig  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.parallel.dims import ParallelDims  # noqa: E402
from rlt_mega.parallel.engine import EngineConfig, LocalEngine  # noqa: E402

CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=2, max_seq_len=32,
                  init_std=0.1)


def run(cast: str, lr: float, steps: int) -> list[dict]:
    engine = LocalEngine(build_model(CFG, seed=1), ParallelDims.single(CFG, "cpu"),
                         OptimConfig(lr=lr, min_lr=lr, warmup_steps=0, schedule="constant"),
                         EngineConfig(total_steps=steps, micro_batch_size=3, grad_accum=1, dtype="bf16",
                                      bf16_cast=cast, seed=11))
    out = []
    for i in range(steps):
        t = torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(100 + i))
        out.append(engine.train_step([{"inputs": t[:, :-1], "targets": t[:, 1:]}]).precision)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3])
    harness.add_json_arg(p)
    args = p.parse_args()
    res = harness.Results("bf16_cast", args)
    torch.set_num_threads(1)
    for lr in args.lr:
        for cast in ("nearest", "stochastic"):
            m = run(cast, lr, args.steps)
            stale = [x["precision/stale_fraction"] for x in m]
            lag = [x["precision/copy_lag"] for x in m]
            print(f"lr {lr:g} {cast:10s} stale_fraction " + " ".join(f"{x:.3f}" for x in stale)
                  + " | copy_lag " + " ".join(f"{x:.1f}" for x in lag))
            res.row("casts", lr=lr, cast=cast, stale_fraction=stale, copy_lag=lag)
    res.write()


if __name__ == "__main__":
    main()
