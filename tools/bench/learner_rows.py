"""The GRPO learner's dense schedule following the data (issue 12 deliverable 5,
schedule/dense.py) against the padded dense schedule, side by side in one run (prints
figures; asserts nothing).

One learner call: GSM8K prompts x G (8 x 8 = 64 rows by default), tokenised by the byte-level BPE
of tools/bench/rollout_rows.py, each completion its gold solution's token length x U(0.6, 2) of
random tokens (``gsm8k_call``); small_cpu, random weights, fp32. Each variant runs the dense
forward and backward (encoder, decoder, head, a loss of the logits), timed by phase in
interleaved rounds (the head with compaction only at the positions the loss reads:
DenseRows.head (schedule/dense.py); best of --repeats, one thread, process CPU time by default,
tools/bench/harness.py):

- padded: every row at every position (grpo.dense_compact / dense_share_prompts false);
- compact: each position only on the rows still inside their sequence, the head only on the
  completion positions;
- compact+share: and each group's prompt once in the decoder, forked into its rows, and in the
  encoder (schedule/prompt_pack.py: each row's own tokens after its group's prompt; the default).

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/learner_rows.py --data DIR
    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/learner_rows.py --data DIR --quick   # 2 x 8 rows
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from rollout_rows import gsm8k_args, gsm8k_call, parse_gsm8k_args  # noqa: E402

from rlt_mega.config import load_config  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.schedule.dense import DenseRows, DensePlan  # noqa: E402


def dense_step(model, x: torch.Tensor, rows, clock) -> dict[str, float]:
    """One dense forward and backward -> seconds per phase."""
    out = {}
    t0 = clock()
    emb = model.embed(x)
    mem = model.memory_kv(model.dense_memory(emb, rows=rows))  # with shared prompts: schedule/prompt_pack.py
    t1 = clock()
    z = model.decode_dense(emb, mem, rows=rows)
    t2 = clock()
    (model.head(z) if rows is None else rows.head(model.head, z)).mean().backward()  # with compaction: the positions the loss reads only
    t3 = clock()
    model.zero_grad(set_to_none=True)
    out.update(encoder=t1 - t0, decoder_forward=t2 - t1, backward=t3 - t2, step=t3 - t0)
    return out


def main() -> None:
    args = parse_gsm8k_args(gsm8k_args(__doc__, repeats=2))
    res = harness.Results("learner_rows", args)
    clock = harness.setup(args)
    prompts, budgets, stats = gsm8k_call(args.data, args.prompts, args.group, args.vocab, seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = [p + torch.randint(1, args.vocab, (n,), generator=g).tolist() for p, n in zip(prompts, budgets)]
    B, T = len(seqs), max(map(len, seqs)) - 1
    x = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, :len(s) - 1] = torch.tensor(s[:-1])
    ids: dict[tuple, int] = {}
    groups = tuple(ids.setdefault(tuple(p), len(ids)) for p in prompts)
    lengths = tuple(len(p) + n - 1 for p, n in zip(prompts, budgets))
    prompt_lens = tuple(map(len, prompts))
    variants = {"padded": None, "compact": DenseRows(lengths, prompt_lens, None, True),
                "compact+share": DenseRows(lengths, prompt_lens, groups, True)}
    cfg = load_config(args.config)
    model = build_model(dataclasses.replace(cfg.model, vocab_size=args.vocab), "cpu", seed=0)
    best: dict[str, dict[str, float]] = {k: {} for k in variants}
    for _ in range(args.repeats):
        for k, rows in variants.items():
            times = dense_step(model, x, rows, clock)
            best[k] = {p: min(t, best[k].get(p, float("inf"))) for p, t in times.items()}
    print(f"# learner rows: {args.config} (vocab {args.vocab}), {args.prompts} GSM8K prompts x G={args.group} = {B} "
          f"rows, T={T}; {harness.describe(args)}")
    print(f"# prompt tokens mean {stats['prompt_len_mean']:.1f} max {stats['prompt_len_max']}; completion tokens "
          f"mean {stats['completion_mean']:.1f} max {stats['completion_max']}")
    print("| variant | decoder row-steps | x padded | encoder s | decoder fwd s | backward s | step s | step x padded |")
    print("|---|---|---|---|---|---|---|---|")
    for k, rows in variants.items():
        steps = B * T if rows is None else DensePlan(rows, T, torch.device("cpu")).active
        t, ref = best[k], best["padded"]
        print(f"| {k} | {steps} | {B * T / steps:.2f} | {t['encoder']:.2f} | {t['decoder_forward']:.2f} | "
              f"{t['backward']:.2f} | {t['step']:.2f} | {ref['step'] / t['step']:.2f} |")
        res.row(f"learner dense schedule, {B} rows, T={T}", variant=k, **{
            "decoder row-steps": steps, "x padded": round(B * T / steps, 2), "encoder s": round(t["encoder"], 2),
            "decoder fwd s": round(t["decoder_forward"], 2), "backward s": round(t["backward"], 2),
            "step s": round(t["step"], 2), "step x padded": round(ref["step"] / t["step"], 2)})
    res.write()


if __name__ == "__main__":
    main()
