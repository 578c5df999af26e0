"""The sampler under tensor and pipeline parallelism (prints figures; asserts nothing but
exactness: every replay torch.equal to its rollout's mu).

In one torchrun run of two ranks, GSM8K-shaped rows (tools/bench/rollout_rows.py ``gsm8k_call``:
--prompts GSM8K train questions x G = --group, BPE-tokenised, each row's completion its gold
solution's length x U(0.6, 2)), the same seeded small_cpu model, the rows as the trainer samples
them (shared prompts, compaction), side by side in rounds (best of --repeats):

- TP=2, the model's decoder step (model/decoder.py on megatron-core's shards, the tensor-parallel
  reduce between the ranks) against TP=2 on the reference arm (rlt_mega/reference.py: the modules
  of the sharded model, the path tensor-parallel sampling ran before the one decoder step): the
  target is completion tokens per second of rollout + replay >= 1.5x the reference's;
- one process on the decoder step (rank 0 alone, the other waiting), and PP=2 with M micro-batches
  in flight (the sampler ring: with M >= P the stages overlap), for scale.

    torchrun --nproc_per_node 2 tools/bench/rollout_parallel.py --data DIR          # the figures
    torchrun --nproc_per_node 2 tools/bench/rollout_parallel.py --data DIR --quick  # 2 prompts x 8

On a CPU the ranks share the machine's cores and gloo carries every message through the
kernel's loopback, so the parallel layouts pay communication without gaining compute; on GPUs
TP splits each GEMM and PP overlaps the stages' decoder steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from rollout_rows import gsm8k_args, gsm8k_call, parse_gsm8k_args  # noqa: E402

from rlt_mega.config import load_config  # noqa: E402
from rlt_mega.model.rlt import build_model  # noqa: E402
from rlt_mega.parallel.dims import ParallelDims  # noqa: E402
from rlt_mega.parallel.sharding import shard_for_rank  # noqa: E402
from rlt_mega.reference import ReferenceDecoder  # noqa: E402
from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams  # noqa: E402

TARGET = 1.5  # TP=2 tokens/s of the decoder step over the reference arm's


def report(res: harness.Results, layouts: list[tuple], best: dict, tokens: dict, exact: dict) -> None:
    """Rank 0: prints each layout's rollout and replay rates (``best``: name -> (rollout s, replay s);
    ``tokens``: completion tokens; ``exact``: replay == mu) and the TP=2 target, and records them in ``res``."""
    print("| layout | decoder | rollout tok/s | replay/rollout | rollout+replay tok/s | replay == mu |")
    print("|---|---|---|---|---|---|")
    rate = {}
    for name, _, _, decoder in layouts:
        t_roll, t_replay = best[name]
        rate[name] = tokens[name] / (t_roll + t_replay)
        print(f"| {name} | {'reference' if decoder else 'step'} | {tokens[name] / t_roll:.1f} | "
              f"{t_replay / t_roll:.3f} | {rate[name]:.1f} | {exact[name]} |")
        res.row("the sampler under TP=2 and PP=2, 2 ranks (gloo, wall clock)", layout=name,
                decoder="reference" if decoder else "step", **{
                    "rollout tok/s": round(tokens[name] / t_roll, 1), "replay/rollout": round(t_replay / t_roll, 3),
                    "rollout+replay tok/s": round(rate[name], 1), "replay == mu": exact[name]})
    ratio = rate["TP=2 step"] / rate["TP=2 reference"]
    print(f"TP=2: the decoder step over the reference arm, rollout + replay tokens/s: {ratio:.2f}x "
          f"(target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'})")
    res.target("TP=2 sampler: decoder step against the reference arm", f"rollout + replay tok/s >= {TARGET}x",
               f"{ratio:.2f}x", ratio >= TARGET)


def main() -> None:
    ap = gsm8k_args(__doc__, repeats=2)
    ap.add_argument("--micro", type=int, nargs="*", default=[2], help="M values for PP=2 (none: skip PP)")
    args = parse_gsm8k_args(ap)
    harness.setup(args)  # threads (the clock here is the wall clock: the ranks wait on each other)
    dist.init_process_group("gloo")
    prompts, budgets, stats = gsm8k_call(args.data, args.prompts, args.group, args.vocab, seed=0)
    cfg = load_config(args.config)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=args.vocab,
                                    max_seq_len=max(cfg.model.max_seq_len, max(map(len, prompts)) + max(budgets)))
    params = SamplingParams(Processing(temperature=1.0), max_new_tokens=max(budgets), row_budgets=tuple(budgets))
    seeds = list(range(len(prompts)))
    layouts = [("1 process", None, 1, None), ("TP=2 step", {"tp": 2}, 1, None),
               ("TP=2 reference", {"tp": 2}, 1, ReferenceDecoder())]
    layouts += [(f"PP=2 M={m}", {"pp": 2}, m, None) for m in args.micro]
    samplers = {}
    for name, parallel, _, decoder in layouts:
        if parallel is None:
            samplers[name] = Sampler(build_model(model_cfg, "cpu", seed=0)) if dist.get_rank() == 0 else None
            continue
        dims = ParallelDims.build(dataclasses.replace(cfg.parallel, **parallel, dp=None), model_cfg, "cpu")
        model = shard_for_rank(build_model(model_cfg, "cpu", seed=0), dims)
        samplers[name] = Sampler(model, Comms.from_dims(dims), dims.layers, decoder=decoder)
    rank = dist.get_rank()
    if rank == 0:
        print(f"# rollout_parallel: {args.config} d={model_cfg.d_model} L={model_cfg.n_layers} V={model_cfg.vocab_size} "
              f"C={model_cfg.memory_block}; {args.prompts} GSM8K prompts x G={args.group} = {len(prompts)} rows, "
              f"completion tokens mean {stats['completion_mean']:.1f}; ranks={dist.get_world_size()} "
              f"threads/rank={torch.get_num_threads()}; best of {args.repeats} rounds (wall clock)")
    best = {name: (float("inf"), float("inf")) for name, *_ in layouts}
    tokens, exact = {}, {}
    for _ in range(args.repeats):
        for name, parallel, M, _ in layouts:
            split = [list(range(i, len(prompts), M)) for i in range(M)]  # M micro-batches of the same rows
            batches = [[prompts[i] for i in idx] for idx in split]
            batch_params = [dataclasses.replace(params, row_budgets=tuple(budgets[i] for i in idx)) for idx in split]
            batch_seeds = [[seeds[i] for i in idx] for idx in split]
            sampler = samplers[name]
            dist.barrier()
            t0 = time.perf_counter()
            rollouts = sampler.generate(batches, batch_params, batch_seeds, pad_id=0) if sampler else []
            t_roll = time.perf_counter() - t0
            t0 = time.perf_counter()
            replayed = sampler.replay(rollouts) if sampler else []
            t_replay = time.perf_counter() - t0
            dist.barrier()
            best[name] = (min(best[name][0], t_roll), min(best[name][1], t_replay))
            tokens[name] = sum(ro.num_completion_tokens() for ro in rollouts)
            exact[name] = all(torch.equal(r, ro.mu) for r, ro in zip(replayed, rollouts) if r is not None)
    if rank == 0:  # rank 0 alone writes --json
        res = harness.Results("rollout_parallel", args)
        report(res, layouts, best, tokens, exact)
        res.write()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
