"""Generates the tables of docs/costs_at_scale.md from the planner (rlt_mega/cost/planner.py).

    PYTHONPATH=. python tools/docs/costs_at_scale.py            # rewrites the tables in the page
    PYTHONPATH=. python tools/docs/costs_at_scale.py --check    # exit 1 when the page differs

The page's prose is kept; everything between the markers ``<!-- tables:begin -->`` and
``<!-- tables:end -->`` is this script's output (tests/unit/test_costs_page.py holds the two equal).
Each point: rlt_48x48 at sequence length T with n_kv_heads key/value heads, B rows per decoder
step, on 8 x 8 H100 80 GB (the planner's default hardware), one layout per point: the widest
tensor parallelism the heads allow (tp <= 8, dividing n_kv_heads), no pipeline, ZeRO-1, the
decoder checkpointed per position with the encoder blocks (step+enc) and the head over chunks of
HEAD_CHUNK positions (train.checkpointing.head_chunk: one chunk's fp32 logits alive), one
micro-batch per replica; the prediction as if memory were unlimited, with whether it fits beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PAGE = ROOT / "docs" / "costs_at_scale.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
SEQ_LENS = (512, 1024, 4096)
KV_HEADS = (16, 4, 2, 1)
ROWS = (8, 32, 128, 512)
HEAD_CHUNK = 4096  # positions: one row of T = 4096


def point(model, T: int, B: int, hw):
    """The planner's estimate of one point (see the module docstring)."""
    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.cost.layout import Layout
    from rlt_mega.cost.planner import evaluate

    tp = max(t for t in (1, 2, 4, 8) if model.n_kv_heads % t == 0)
    dp = hw.world_size // tp
    layout = Layout(seq_len=T, micro_batch_size=B, tp=tp, pp=1, dp=dp, zero_stage=1, dtype="bf16",
                    checkpointing=CheckpointingConfig(decoder="step", encoder=True, head_chunk=HEAD_CHUNK),
                    keep_logits=False)
    return evaluate(model, layout, hw)


def tables() -> str:
    from rlt_mega.config import load_config
    from rlt_mega.cost.planner import Hardware

    base = load_config(str(ROOT / "configs" / "rlt_48x48.yaml")).model
    hw = Hardware(nodes=8, gpus_per_node=8, gpu_mem_gb=80)
    out = []
    for T in SEQ_LENS:
        out += [f"### T = {T}", "",
                "| n_kv_heads | B | layout | tokens/s | MFU | peak GB | fits 80 GB | a decoder tick is bound by |",
                "|---:|---:|---|---:|---:|---:|---|---|"]
        for kv in KV_HEADS:
            model = dataclasses.replace(base, n_kv_heads=kv, max_seq_len=max(T, base.max_seq_len))
            for B in ROWS:
                p = point(model, T, B, hw)
                fits = "yes" if p.peak_memory <= hw.capacity_bytes else "no"
                out.append(f"| {kv} | {B} | {p.describe()} | {p.tokens_per_s:,.0f} | {100 * p.mfu:.1f}% | "
                           f"{p.peak_memory / 1e9:.1f} | {fits} | {p.breakdown['decoder_bound']} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def render(page: str) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{tables()}{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when the page's tables are not the generator's")
    args = p.parse_args(argv)
    page = PAGE.read_text()
    new = render(page)
    if args.check:
        return 0 if new == page else 1
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
