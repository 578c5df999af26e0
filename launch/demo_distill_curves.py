"""The distillation demo's curves (launch/demo.sh --distill): the student's held-out greedy
accuracy by GRPO step and by training second (the sum of the step's phase timers: sampling,
replay, teacher scoring, update; evaluations excluded), GRPO alone against GRPO with the
teacher, and the teacher's own accuracy, printed and written as JSON with the machine and the
date.

    python launch/demo_distill_curves.py runs/demo_distill --teacher-accuracy 0.95 --json runs/demo_distill/distill.json

With --seeds, the summary of several such runs' distill.json (one per seed): each arm's held-out
accuracy by step (every seed and the mean), and the issue's target, that the distilled student
reach the GRPO-alone student's final accuracy in at most half the steps: the first evaluated
step where the distilled arm's mean accuracy is at least the GRPO arm's final mean, against
half the steps (or, never reached, by how much the distilled arm's best mean falls short).

    python launch/demo_distill_curves.py --seeds runs/distill_s0/distill.json runs/distill_s1/distill.json \
      --json docs/demo/distill_seeds.json
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


def summary(paths: list[str]) -> dict:
    """The seeds' distill.json files -> accuracy by step per arm (each seed, the mean), the
    teacher's accuracy per seed, and the half-the-steps target."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out: dict = {"runs": [r["run"] for r in runs], "teacher_accuracy": [r["teacher_accuracy"] for r in runs]}
    for name in ("grpo", "distill"):
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for step, acc in r[name]["eval_accuracy"]:
                by_step.setdefault(step, []).append(acc)
        out[name] = [[step, accs, round(sum(accs) / len(accs), 4)] for step, accs in sorted(by_step.items())
                     if len(accs) == len(runs)]
    last = out["grpo"][-1][0]
    target = out["grpo"][-1][2]
    reached = next((step for step, _, mean in out["distill"] if mean >= target), None)
    best = max(mean for _, _, mean in out["distill"])
    out["target"] = {"grpo_final_step": last, "grpo_final_mean": target, "distill_first_step_reaching_it": reached,
                     "half_steps": last / 2, "met": reached is not None and reached <= last / 2,
                     "distill_best_mean": best, "shortfall": round(max(target - best, 0.0), 4)}
    return out


def print_summary(out: dict) -> None:
    print("teacher held-out greedy accuracy by seed: " + ", ".join(f"{a:.3f}" for a in out["teacher_accuracy"]))
    for name in ("grpo", "distill"):
        print(f"student, {name:7s} (mean [seeds]): " + ", ".join(
            f"step {s}: {m:.3f} [{' '.join(f'{a:.3f}' for a in accs)}]" for s, accs, m in out[name]))
    t = out["target"]
    verdict = (f"met: the distilled mean reached {t['grpo_final_mean']:.3f} at step "
               f"{t['distill_first_step_reaching_it']} <= {t['half_steps']:g}" if t["met"] else
               f"not met: reached at step {t['distill_first_step_reaching_it']}" if t["distill_first_step_reaching_it"]
               is not None else f"not met: the distilled mean's best, {t['distill_best_mean']:.3f}, is "
               f"{t['shortfall']:.3f} below")
    print(f"target (GRPO alone's final mean {t['grpo_final_mean']:.3f} at step {t['grpo_final_step']}, in at most "
          f"half the steps): {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?")
    ap.add_argument("--teacher-accuracy", type=float)
    ap.add_argument("--seeds", nargs="+", metavar="DISTILL_JSON")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--run", default="")
    args = ap.parse_args()
    if args.seeds:
        out = summary(args.seeds)
        print_summary(out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            print(f"summary: {args.json}")
        return
    if args.run_dir is None or args.teacher_accuracy is None:
        ap.error("give RUN_DIR and --teacher-accuracy (one run), or --seeds DISTILL_JSON ... (a summary)")
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
