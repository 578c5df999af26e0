"""Packed SFT against one pair a row, side by side in one run (a measurement, not a test: it
asserts nothing). Timing conventions: tools/bench/harness.py.

    PYTHONPATH=. python tools/bench/sft_packing.py --data DIR             # GSM8K pairs (DIR/train.jsonl), BPE
    PYTHONPATH=. python tools/bench/sft_packing.py --seq-len 512 --tokenizer path/to/tokenizer.json
    PYTHONPATH=. python tools/bench/sft_packing.py --data my_pairs.jsonl --pairs 256 --repeats 3

The same ``--pairs`` prompt/answer pairs (GSM8K train pairs from --data, tokenised by a BPE
trained on them; generated arithmetic problems without --data) are trained through the engine's
full step (forward, backward, AdamW) in two ways, in interleaved rounds:

- unpacked: ``--batch`` pairs a batch, each a row padded to the batch's longest (the SFT path
  without data.pack, as train/sft.py cuts batches: in the dataset's order);
- packed: the pairs best-fit into rows of ``--seq-len`` positions, ``--batch`` rows a batch,
  with document resets (data.pack + data.reset_at_document: the loss equals the unpacked one).

Reported per mode: time for one pass over the pairs (best of rounds), pair tokens/s (the
positions that hold pairs; padding excluded, the same count in both modes), answer tokens/s,
rows, the fraction of the computed positions that are pairs, and the decoder's sequential
steps (batches x row length); then packed / unpacked. The decoder is sequential in the row
length, so a pass costs about its steps: packing saves the padding of each batch to its
longest pair (more the shorter the pairs against data.seq_len and the larger the batch), and a
batch of rows of data.seq_len costs what one of pairs that long costs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from harness import Results, add_common_args, add_json_arg, best_of_rounds, describe, setup
from rlt_mega.config import ModelConfig, OptimConfig
from rlt_mega.data.arithmetic import generate_problems
from rlt_mega.data.packing import PackedPairs
from rlt_mega.data.pairs import pair_ids
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.data.tokenizer_train import train_bpe
from rlt_mega.loss import count_tokens
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import EngineConfig, LocalEngine
from rlt_mega.train.sft import sft_batch

def load_pairs(path, num: int) -> tuple[list[tuple[str, str]], str]:
    """``num`` question/answer pairs of ``path`` (a jsonl, or a directory with train.jsonl: GSM8K's
    layout); without a path, generated arithmetic problems."""
    if not path:
        return [(r["question"], r["answer"]) for r in generate_problems(num, seed=0)], "generated arithmetic problems"
    file = Path(path) / "train.jsonl" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise SystemExit(f"--data {path}: no such file (pass a jsonl of question/answer records, or a directory "
                         "holding train.jsonl)")
    with open(file) as f:
        records = [json.loads(line) for _, line in zip(range(num), f)]
    return [(r["question"], r["answer"]) for r in records], str(file)


def bpe_tokenizer(pairs: list[tuple[str, str]], vocab: int, folder: str):
    """A byte-level BPE of ``vocab`` ids trained on the pairs (realistic token counts: about 3-4 bytes
    a token on GSM8K), saved in ``folder`` and loaded as any tokenizer.json is."""
    path = Path(folder) / "tokenizer.json"
    train_bpe((q + "\n" + a for q, a in pairs), vocab).save(str(path))
    return load_tokenizer(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="a jsonl of question/answer records, or a directory with "
                        "train.jsonl (GSM8K's); default: generated arithmetic problems")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (trained on the pairs, --vocab ids), byte, or a "
                        "tokenizer.json")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-block", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    add_common_args(parser)
    add_json_arg(parser)
    args = parser.parse_args()
    res = Results("sft_packing", args)
    clock = setup(args)

    raw, source = load_pairs(args.data, args.pairs)
    folder = tempfile.TemporaryDirectory()
    tok = bpe_tokenizer(raw, args.vocab, folder.name) if args.tokenizer == "bpe" else load_tokenizer(args.tokenizer)
    ids, num_prompt = [], []
    for q, a in raw:
        p, ans = pair_ids(tok, q, a)
        x = (p + ans)[:args.seq_len + 1]
        if len(p) < len(x):
            ids.append(x)
            num_prompt.append(len(p))
    pairs = {"ids": ids, "num_prompt": num_prompt}
    n = len(ids)

    unpacked = [sft_batch({"ids": ids[i:i + args.batch], "num_prompt": num_prompt[i:i + args.batch]}, tok.pad_id)
                for i in range(0, n, args.batch)]
    rows = PackedPairs(pairs, args.seq_len, tok.pad_id, reset=True, seed=0)
    packed = [rows.batch(list(range(i, min(i + args.batch, len(rows))))) for i in range(0, len(rows), args.batch)]
    pair_tokens = rows.num_positions
    answer_tokens = sum(count_tokens(b["targets"]) for b in unpacked)
    if answer_tokens != sum(count_tokens(b["targets"]) for b in packed):
        raise RuntimeError("packed and unpacked batches hold different answer tokens")

    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=args.d_model, n_layers=args.layers,
                      n_heads=max(1, args.d_model // 32), memory_block=args.memory_block,
                      max_seq_len=max(args.seq_len, 64))
    model = build_model(cfg, seed=0)
    engine = LocalEngine(model, ParallelDims.single(cfg, "cpu"), OptimConfig(lr=1e-4, warmup_steps=0),
                         EngineConfig(total_steps=10**6, micro_batch_size=args.batch, grad_accum=1))

    def run(batches):
        return lambda: [engine.train_step([b]) for b in batches]

    modes = {"unpacked": unpacked, "packed": packed}
    best, _ = best_of_rounds({k: run(v) for k, v in modes.items()}, args.repeats, clock)

    print(f"# SFT packing: {n} pairs from {source}, tokenizer {args.tokenizer}, {pair_tokens} pair tokens "
          f"({answer_tokens} answer tokens), mean {pair_tokens / n:.0f} a pair")
    print(f"# model d={args.d_model} L={args.layers} C={args.memory_block}, batch {args.batch}, "
          f"seq_len {args.seq_len}; {describe(args)}; best of {args.repeats} rounds")
    print(f"{'mode':>9} {'rows':>5} {'positions':>9} {'fill':>6} {'steps':>6} {'s/pass':>8} {'pair tok/s':>11} "
          f"{'answer tok/s':>13}")
    for k, batches in modes.items():
        positions = sum(b["inputs"].numel() for b in batches)
        num_rows = sum(b["inputs"].shape[0] for b in batches)
        steps = sum(b["inputs"].shape[1] for b in batches)  # sequential decoder steps of the pass
        print(f"{k:>9} {num_rows:>5} {positions:>9} {pair_tokens / positions:>6.1%} {steps:>6} {best[k]:>8.2f} "
              f"{pair_tokens / best[k]:>11.1f} {answer_tokens / best[k]:>13.1f}")
        res.row(f"packed SFT against one pair a row, {n} pairs, seq_len {args.seq_len}", mode=k, rows=num_rows,
                positions=positions, fill=f"{pair_tokens / positions:.1%}", steps=steps, **{
                    "s/pass": round(best[k], 2), "pair tok/s": round(pair_tokens / best[k], 1),
                    "answer tok/s": round(answer_tokens / best[k], 1)})
    print(f"packed / unpacked tokens/s: {best['unpacked'] / best['packed']:.2f}x")
    res.row(f"packed SFT against one pair a row, {n} pairs, seq_len {args.seq_len}", mode="packed / unpacked",
            **{"pair tok/s": f"{best['unpacked'] / best['packed']:.2f}x"})
    res.write()


if __name__ == "__main__":
    main()
