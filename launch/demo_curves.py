"""Prints the demo's GRPO curves (held-out greedy accuracy at each evaluation, the training
reward at each step; with an environment, grpo.env, also its tool calls and tool errors per
completion) and saves them as a PNG beside the TensorBoard logs.

    python launch/demo_curves.py runs/demo/grpo/tb runs/demo/grpo/curves.png [--json curves.json --run "train.seed=1"]

With --json the curves are also written as JSON with the machine (CPU model, cores, torch) and the
date: docs/guide/demo.md's table is rendered from such files (docs/demo/*.json) when the docs are built.
"""

from __future__ import annotations

import argparse

from rlt_mega.metrics import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tb_dir")
    ap.add_argument("png")
    ap.add_argument("--json", metavar="PATH", help="also write the curves, the machine and the date as JSON")
    ap.add_argument("--run", default="", help="the demo's overrides, recorded in the JSON (e.g. train.seed=1)")
    args = ap.parse_args()
    rows = read_metrics(args.tb_dir)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    rewards = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    tools = [(r["step"], r["env/tool_calls"], r["env/tool_errors"]) for r in rows if "env/tool_calls" in r]
    print("held-out greedy accuracy: " + ", ".join(f"step {s}: {a:.3f}" for s, a in evals))
    shown = rewards[:: max(1, len(rewards) // 10)] + ([rewards[-1]] if len(rewards) % 10 else [])
    print("training reward:          " + ", ".join(f"step {s}: {r:.3f}" for s, r in dict(shown).items()))
    if tools:
        shown = tools[:: max(1, len(tools) // 10)] + ([tools[-1]] if len(tools) % 10 else [])
        print("tool calls per completion: " + ", ".join(f"step {s}: {c:.2f} ({e:.2f} errors)"
                                                       for s, c, e in {t[0]: t for t in shown}.values()))
    if evals:
        best = max(a for _, a in evals)
        print(f"before GRPO {evals[0][1]:.3f}, best {best:.3f}, final {evals[-1][1]:.3f} "
              f"(final - best = {evals[-1][1] - best:+.3f})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], label="training reward (sampled)", color="tab:blue",
            alpha=0.7)
    ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", label="held-out greedy accuracy", color="tab:red")
    if tools:
        calls = ax.twinx()
        calls.plot([s for s, _, _ in tools], [c for _, c, _ in tools], "--", color="tab:green",
                   label="tool calls per completion")
        calls.plot([s for s, _, _ in tools], [e for _, _, e in tools], ":", color="tab:gray",
                   label="tool errors per completion")
        calls.set_ylabel("calls per completion")
        calls.set_ylim(0, max([c for _, c, _ in tools] + [1.0]) * 1.1)
        calls.legend(loc="center right")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("CPU demo: GRPO from the SFT model")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"curves: {args.png}")
    if args.json:
        import json
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
        from harness import machine

        Path(args.json).write_text(json.dumps({"run": args.run, "machine": machine(), "eval_accuracy": evals,
                                               "reward": rewards, **({"tool_calls": tools} if tools else {})}, indent=1) + "\n")
        print(f"curves: {args.json}")


if __name__ == "__main__":
    main()
