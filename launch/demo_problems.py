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

With ``--tool`` (``launch/demo.sh --tool``) a question is a product of a 3-digit and a 2-digit
number plus a digit ("What is (896*66)+7?"), a two-step sum whose product a tiny model cannot do
in its head. Most training answers (``--plain`` sets the others' fraction) compute it in the
head: "(896*66)=59136 59136+7=59143\n#### 59143", whose digits the model must produce itself
(and cannot); the others write every step with GSM8K's calculator annotation, its result
repeated after it: "<<(896*66)=59136>>59136 <<59136+7=59143>>59143\n#### 59143". Every number
has a fixed width (the product and the sum 5 digits), so each number the model copies, from the
question or from the calculator's result, lies at the same distance back in every problem: a
tiny model learns the layout and the copying in a few hundred SFT steps. SFT imitates both
styles, and its greedy answers follow the more frequent one, the plain one; with the calculator
environment (grpo.env=calculator) a sampled ``<<(896*66)=`` gets ``59136>>`` appended, so GRPO,
rewarded for correct final answers, learns to call the calculator: the held-out accuracy with
the tool rises, and the same model without the tool stays near 0.

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


def tool_problem(rng: random.Random, plain: float) -> dict:
    while True:  # fixed widths: a 5-digit product, a 5-digit sum
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(1, 9)
        if 10000 <= a * b and a * b + c < 100000:
            break
    x, total = a * b, a * b + c
    if rng.random() < plain:
        answer = f"({a}*{b})={x} {x}+{c}={total}\n#### {total}"
    else:
        answer = f"<<({a}*{b})={x}>>{x} <<{x}+{c}={total}>>{total}\n#### {total}"
    return {"question": f"What is ({a}*{b})+{c}?", "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--num-train", type=int, default=20000)
    ap.add_argument("--num-test", type=int, default=200)
    ap.add_argument("--max-value", type=int, default=9)
    ap.add_argument("--long-winded", type=float, default=0.55, help="fraction of long-winded training answers")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tool", action="store_true", help="a product plus a digit, with calculator annotations <<a*b=x>>x")
    ap.add_argument("--plain", type=float, default=0.6,
                    help="with --tool: the fraction of training answers computed in the head (no annotations)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, num, long_winded in (("train", args.num_train, args.long_winded), ("test", args.num_test, 0.0)):
        with open(out / f"{name}.jsonl", "w") as f:
            for _ in range(num):
                record = (tool_problem(rng, args.plain if name == "train" else 0.0) if args.tool
                          else problem(rng, args.max_value, long_winded))
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
