"""Low-rank adapters (model.lora, issue 30) against full fine-tuning at small_cpu (d=256, L=4, C=8),
random weights, fp32, one run, interleaved rounds (tools/bench/harness.py conventions; a
measurement, it asserts nothing):

- SFT: a training step of the local engine (forward, backward, clip, AdamW) on a B x T batch of
  random tokens (small_cpu's micro-batch, T = --seq-len), full weights and r=--rank adapters on
  every target (q, k, v, o, gate, up, down, the cross-attention's, recur_proj): step time (best
  of --repeats), peak tensor bytes of one step above what lives before it
  (harness.peak_tensor_bytes), and the trained state (parameters with gradients + AdamW's two
  moments);
- GRPO: one step of the real trainer (rollout of 2 prompts x 4, the replay, two minibatches'
  updates; sampling.max_new_tokens=--new-tokens), same two arms: step time and peak tensor bytes.
- the planner's memory (``rlt-mega plan``'s per-GPU estimate) for configs/rlt_48x48.yaml with
  and without r=--rank adapters.

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/lora.py
    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/bench/lora.py --repeats 1 --seq-len 64   # quick
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from harness import Results, add_common_args, add_json_arg, describe, peak_tensor_bytes, setup, timed_rounds
from rlt_mega.config import LoraConfig, load_config
from rlt_mega.model.rlt import build_model
from rlt_mega.model.lora import apply_lora
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import EngineConfig, LocalEngine

ARMS = ("full", "lora")


def trained_state_bytes(model) -> int:
    """Parameters that train, their gradients and AdamW's two moments (fp32)."""
    return sum(4 * p.numel() * 4 for p in model.parameters() if p.requires_grad)


def sft_step(rank: int, seq_len: int):
    cfg = load_config("configs/small_cpu.yaml")
    B = cfg.train.micro_batch_size
    model = build_model(cfg.model, seed=0)
    if rank:
        apply_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank), seed=0)
    engine_cfg = dataclasses.replace(EngineConfig.from_train(cfg.train), total_steps=1000)
    engine = LocalEngine(model, ParallelDims.single(cfg.model, "cpu"), cfg.optim, engine_cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (B, seq_len + 1), generator=g)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "loss_mask": torch.ones(B, seq_len)}
    return model, (lambda: engine.train_step([batch])), B * seq_len


def grpo_step(rank: int, new_tokens: int):
    """The real GRPO trainer at small_cpu's model on one process: arithmetic prompts, a reward
    that differs between completions (the fraction of odd code points: a random model solves
    nothing, and the compute does not depend on the reward)."""
    from rlt_mega.config import from_dict
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.train.grpo import build_trainer, grpo_config

    small = dataclasses.asdict(load_config("configs/small_cpu.yaml").model)
    small.update(max_seq_len=96, lora={"rank": rank, "alpha": 2.0 * max(rank, 1)})
    cfg = grpo_config(from_dict({
        "model": small, "data": {"tokenizer": "byte", "seq_len": 64},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "train": {"seed": 3, "steps": 100, "checkpointing": {"decoder": "none", "encoder": False}},
        "sampling": {"temperature": 1.0, "max_new_tokens": new_tokens},
        "grpo": {"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "eval_size": 0},
        "logging": {"progress": False}}))

    def odd(completion: str, answer) -> float:
        return sum(ord(c) % 2 for c in completion) / max(len(completion), 1)

    records = [{"question": f"What is {i} + {2 * i}?", "answer": f"#### {3 * i}"} for i in range(64)]
    trainer = build_trainer(cfg, ParallelDims.single(cfg.model, "cpu"), load_tokenizer("byte"), odd, records, [])
    counter = iter(range(10**6))
    return trainer.engine.module, (lambda: trainer.job.step(next(counter)))


def section(res: Results, title: str, steps: dict, models: dict, repeats: int, clock, tokens: int = 0) -> None:
    for fn in steps.values():
        fn()  # warm-up: Adam state, the step's workspace
    peaks = {k: peak_tensor_bytes(fn) for k, fn in steps.items()}
    times, _ = timed_rounds(steps, repeats, clock)
    best = {k: min(v) for k, v in times.items()}
    print(f"\n## {title}")
    print(f"{'arm':<6} {'step s':>8} {'tok/s':>8} {'peak MB':>8} {'trained MB':>10} {'trained params':>14}")
    for k in ARMS:
        n = sum(p.numel() for p in models[k].parameters() if p.requires_grad)
        rate = f"{tokens / best[k]:8.0f}" if tokens else f"{'-':>8}"
        print(f"{k:<6} {best[k]:8.3f} {rate} {peaks[k] / 1e6:8.1f} {trained_state_bytes(models[k]) / 1e6:10.2f} "
              f"{n:14,d}")
        res.row(title, arm=k, **{"step s": round(best[k], 3), "tok/s": round(tokens / best[k]) if tokens else "-",
                                 "peak MB": round(peaks[k] / 1e6, 1),
                                 "trained MB": round(trained_state_bytes(models[k]) / 1e6, 2), "trained params": n})
    print(f"ratios lora/full: step time {best['lora'] / best['full']:.3f}, peak memory "
          f"{peaks['lora'] / peaks['full']:.3f}, trained state "
          f"{trained_state_bytes(models['lora']) / trained_state_bytes(models['full']):.4f}")


def planner_lines(res: Results, rank: int) -> None:
    from rlt_mega.cost.costmodel import estimate
    from rlt_mega.cost.layout import Layout

    print(f"\n## planner (rlt-mega plan --config configs/rlt_48x48.yaml), full against r={rank} adapters")
    reps = {}
    for label, over in (("full", []), (f"r{rank}", [f"model.lora.rank={rank}", f"model.lora.alpha={2 * rank}"])):
        cfg = load_config("configs/rlt_48x48.yaml", over)
        rep = reps[label] = estimate(cfg.model, Layout.from_config(cfg))
        m = rep["per_rank"][0]["memory"]
        lay = rep["layout"]
        print(f"- {label}: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} ZeRO-{lay['zero_stage']}: trained params "
              f"{rep['params'].get('adapters', rep['params']['total']):,}; stage 0 per rank: Adam "
              f"{m['optimizer_states'] / 2**30:.3f} GiB, master {m['master_weights'] / 2**30:.3f} GiB, grads "
              f"{m['gradients'] / 2**30:.3f} GiB; peak {rep['peak_memory'] / 2**30:.2f} GiB")
        res.row("planner, configs/rlt_48x48.yaml, stage 0 per rank", arm=label,
                layout=f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} ZeRO-{lay['zero_stage']}",
                **{"trained params": rep["params"].get("adapters", rep["params"]["total"]),
                   "Adam GiB": round(m["optimizer_states"] / 2**30, 3), "master GiB": round(m["master_weights"] / 2**30, 3),
                   "grads GiB": round(m["gradients"] / 2**30, 3), "peak GiB": round(rep["peak_memory"] / 2**30, 2)})
    full, lora = reps["full"], reps[f"r{rank}"]
    print(f"ratios r{rank}/full: optimizer state "
          f"{lora['per_rank'][0]['memory']['optimizer_states'] / full['per_rank'][0]['memory']['optimizer_states']:.4f}"
          f", peak memory {lora['peak_memory'] / full['peak_memory']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=24)
    add_json_arg(p)
    args = p.parse_args()
    res = Results("lora", args)
    clock = setup(args)
    print(f"# LoRA r={args.rank} against full fine-tuning, small_cpu; {describe(args)}")
    built = {k: sft_step(args.rank if k == "lora" else 0, args.seq_len) for k in ARMS}
    section(res, f"SFT step (B x T = {built['full'][2] // args.seq_len} x {args.seq_len})",
            {k: v[1] for k, v in built.items()}, {k: v[0] for k, v in built.items()}, args.repeats, clock,
            built["full"][2])
    grpo = {k: grpo_step(args.rank if k == "lora" else 0, args.new_tokens) for k in ARMS}
    section(res, f"GRPO step (2 prompts x 4, {args.new_tokens} new tokens, 2 minibatches)",
            {k: v[1] for k, v in grpo.items()}, {k: v[0] for k, v in grpo.items()}, args.repeats, clock)
    planner_lines(res, args.rank)
    res.write()


if __name__ == "__main__":
    main()
