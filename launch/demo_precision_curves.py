"""The bf16 finding's curves (docs/stability.md, "The bf16 copy"): from a GRPO run's metrics, the
held-out greedy accuracy at each evaluation and, under train.dtype=bf16, precision/stale_fraction
and precision/copy_lag at every step; printed and written as JSON with the machine and the date
(docs/stability.md says what remains to be measured).

    python launch/demo_precision_curves.py runs/bf16_stochastic_s0/tb --json out.json --run "GRPO_OVERRIDES=..."
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlt_mega.metrics import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tb_dir")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--run", default="")
    args = ap.parse_args()
    rows = read_metrics(args.tb_dir)
    out = {"eval_accuracy": [[r["step"], r["eval/accuracy"]] for r in rows if "eval/accuracy" in r],
           "reward": [[r["step"], r["reward/mean"]] for r in rows if "reward/mean" in r],
           "stale_fraction": [[r["step"], r["precision/stale_fraction"]] for r in rows
                              if "precision/stale_fraction" in r],
           "copy_lag": [[r["step"], r["precision/copy_lag"]] for r in rows if "precision/copy_lag" in r]}
    print("held-out greedy accuracy: " + ", ".join(f"step {s}: {a:.3f}" for s, a in out["eval_accuracy"]))
    if out["stale_fraction"]:
        print("stale fraction:           " + ", ".join(f"step {s}: {x:.3f}" for s, x in out["stale_fraction"]))
        print("copy lag:                 " + ", ".join(f"step {s}: {x:.1f}" for s, x in out["copy_lag"]))
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
        from harness import machine

        Path(args.json).write_text(json.dumps({"run": args.run, "machine": machine(), **out}, indent=1) + "\n")
        print(f"curves: {args.json}")


if __name__ == "__main__":
    main()
