"""Writes the demo's problems in GSM8K format: ``train.jsonl`` and ``test.jsonl`` in OUT_DIR.

Questions are one-step sums and differences of small numbers ("What is 7 + 5?"). The worked
answers come in two styles, as answers collected from different sources do: a concise one
("7 + 5 = 12\\n#### 12") and, in a fraction ``--long-winded`` of the training answers, the same
answer after a digit-free preamble ("Let me think step by step. 7 + 5 = 12\\n#### 12").

The demo samples under a budget of new tokens that the concise answer fits and the
long-winded one does not: a long-winded answer is cut before its number and scores 0. SFT
imitates both styles, so its greedy answers are long-winded about as often as the data is;
GRPO, rewarded only for correct final answers within the budget, learns to answer concisely,
and the held-out accuracy rises. (The test answers are concise; only the question is used.)

With ``--tool`` (``launch/demo.sh --tool``) the questions are sums of two products of a 3-digit
and a 2-digit number ("What is 347 * 28 + 512 * 16?"), arithmetic a tiny model cannot do in its
head, and every step of the answer is written with GSM8K's calculator annotation, its result
repeated after it: "<<347*28=9716>>9716 <<512*16=8192>>8192 <<9716+8192=17908>>17908\n#### 17908".
With the calculator environment (grpo.env=calculator) the model writes ``<<347*28=`` and the
environment appends ``9716>>``; without it the model has to produce the digits itself.

    python launch/demo_problems.py runs/demo/data --num-train 20000 --num-test 200
    python launch/demo_problems.py runs/demo_tool/data --tool
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PREAMBLE = "Let me think step by step. "  # 27 characters, no digits


def problem(rng: random.Random, max_value: int, long_winded: float) -> dict:
    a, b = rng.randint(0, max_value), rng.randint(0, max_value)
    if rng.random() < 0.5:
        op, result = "+", a + b
    else:
        a, b = max(a, b), min(a, b)
        op, result = "-", a - b
    answer = f"{a} {op} {b} = {result}\n#### {result}"
    if rng.random() < long_winded:
        answer = PREAMBLE + answer
    return {"question": f"What is {a} {op} {b}?", "answer": answer}


def tool_problem(rng: random.Random) -> dict:
    (a, b), (c, d) = [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(2)]
    x, y = a * b, c * d
    answer = f"<<{a}*{b}={x}>>{x} <<{c}*{d}={y}>>{y} <<{x}+{y}={x + y}>>{x + y}\n#### {x + y}"
    return {"question": f"What is {a} * {b} + {c} * {d}?", "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--num-train", type=int, default=20000)
    ap.add_argument("--num-test", type=int, default=200)
    ap.add_argument("--max-value", type=int, default=9)
    ap.add_argument("--long-winded", type=float, default=0.55, help="fraction of long-winded training answers")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tool", action="store_true", help="sums of products with calculator annotations <<a*b=c>>c")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, num, long_winded in (("train", args.num_train, args.long_winded), ("test", args.num_test, 0.0)):
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(num):
                record = tool_problem(rng) if args.tool else problem(rng, args.max_value, long_winded)
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
