"""The recurrence's training stability under two embedding initialisations, side by side
(docs/stability.md): loss spikes (a step whose loss exceeds the best of the previous five by
more than 1.0), the worst loss after warm-up and the mean of the last ten steps.

    python tools/bench/stability.py [--steps 120] [--lr 1e-3 3e-3]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "e2e"))
import harness  # noqa: E402
from test_stability import training_losses  # noqa: E402  (the test's run, unchanged)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3])
    harness.add_json_arg(p)
    args = p.parse_args()
    res = harness.Results("stability", args)
    torch.set_num_threads(1)
    print(f"{'embed_init_std':>14} {'lr':>7} {'spikes':>6} {'max after 20':>12} {'last 10':>8}")
    for lr in args.lr:
        for std in (0.02, 1.0):
            curve = training_losses(args.steps, lr, (f"model.embed_init_std={std}",))
            spikes = sum(1 for i in range(5, len(curve)) if curve[i] > min(curve[i - 5:i]) + 1.0)
            print(f"{std:14.2f} {lr:7.0e} {spikes:6d} {max(curve[20:]):12.2f} {sum(curve[-10:]) / 10:8.3f}")
            res.row(f"loss spikes, {args.steps} steps", embed_init_std=std, lr=f"{lr:.0e}", spikes=spikes,
                    **{"max after 20": round(max(curve[20:]), 2), "last 10": round(sum(curve[-10:]) / 10, 3)})
    res.write()


if __name__ == "__main__":
    main()
