"""The distillation demo's curves (launch/demo.sh --distill): the student's held-out greedy
accuracy by GRPO step and by training second (the sum of the step's phase timers: sampling,
replay, teacher scoring, update; evaluations excluded), GRPO alone against GRPO with the
teacher, and the teacher's own accuracy, printed and written as JSON with the machine and the
date.

    python launch/demo_distill_curves.py runs/demo_distill --teacher-accuracy 0.95 --json runs/demo_distill/distill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlt_mega.metrics import read_metrics


def arm(tb_dir: Path) -> dict:
    """{"eval_accuracy": [[step, acc]], "seconds": [[step, cumulative training seconds]], ...}."""
    rows = read_metrics(tb_dir)
    seconds, total = [], 0.0
    for r in rows:
        if "reward/mean" in r:
            total += sum(v for k, v in r.items() if k.startswith("time/"))
            seconds.append([r["step"], round(total, 3)])
    return {"eval_accuracy": [[r["step"], r["eval/accuracy"]] for r in rows if "eval/accuracy" in r],
            "reward": [[r["step"], r["reward/mean"]] for r in rows if "reward/mean" in r],
            "seconds": seconds,
            "reverse_kl": [[r["step"], r["distill/reverse_kl"]] for r in rows if "distill/reverse_kl" in r]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--teacher-accuracy", type=float, required=True)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--run", default="")
    args = ap.parse_args()
    run = Path(args.run_dir)
    arms = {name: arm(run / name / "tb") for name in ("grpo", "distill")}
    print(f"teacher held-out greedy accuracy: {args.teacher_accuracy:.3f}")
    for name, a in arms.items():
        at = dict(a["seconds"])
        print(f"student, {name:7s}: " + ", ".join(f"step {s} ({at.get(s, 0.0):.0f} s): {acc:.3f}"
                                                   for s, acc in a["eval_accuracy"]))
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
        from harness import machine

        Path(args.json).write_text(json.dumps({"run": args.run, "machine": machine(),
                                               "teacher_accuracy": args.teacher_accuracy, **arms}, indent=1) + "\n")
        print(f"curves: {args.json}")


if __name__ == "__main__":
    main()
