"""Evaluates every calculator annotation ``<<expr=value>>`` of a GSM8K split with the calculator
environment and prints how many give their annotated value, and the ones that do not.

    python tools/calculator_gsm8k.py --data DIR/train.jsonl
"""

import argparse
import json
import re

from rlt_mega.rollout.env.calculator import CalcError, evaluate

ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="a GSM8K jsonl file (records with 'answer')")
    ap.add_argument("--show", type=int, default=20, help="mismatches to print")
    args = ap.parse_args()
    total, ok, bad = 0, 0, []
    with open(args.data) as f:
        for line in f:
            for expr, value in ANNOTATION.findall(json.loads(line)["answer"]):
                total += 1
                try:
                    got = evaluate(expr)
                    text = value.replace(",", "").replace("$", "").rstrip("%").strip()
                    want = float(text)
                    decimals = len(text.partition(".")[2])  # the annotation's own rounding
                    good = round(got, decimals) == want or abs(got - want) <= 10 ** -decimals / 2 + 1e-9
                except (CalcError, ValueError) as exc:
                    got, good = f"error: {exc}", False
                ok += good
                if not good:
                    bad.append((expr, value, got))
    print(f"calculator: {ok}/{total} annotations give their value ({100 * ok / max(total, 1):.3f}%), "
          f"{len(bad)} do not")
    for expr, value, got in bad[:args.show]:
        print(f"  <<{expr}={value}>> -> {got}")


if __name__ == "__main__":
    main()
