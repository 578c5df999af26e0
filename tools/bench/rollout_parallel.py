"""The sampler under tensor and pipeline parallelism (prints figures, asserts nothing).

In one torchrun run of two ranks, on the same seeded model and ragged prompts (the same total
rows each time): rollout tokens/s of one process (rank 0 alone, the other rank waiting), of
TP=2, and of PP=2 with M rollout micro-batches in flight (the sampler ring: with M >= P the
stages overlap); replay time / rollout time; and a check that every replay is torch.equal to
its mu. Timings are the best of --repeats, taken in rounds over all layouts.

    torchrun --nproc_per_node 2 tools/bench/rollout_parallel.py                # small_cpu, batch 8, 64 new tokens
    torchrun --nproc_per_node 2 tools/bench/rollout_parallel.py --new-tokens 16 model.d_model=64   # a quick look

On a CPU the ranks share the machine's cores and gloo carries every message through the
kernel's loopback, so the parallel layouts pay communication without gaining compute; on GPUs
TP splits each GEMM and PP overlaps the stages' decoder steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.distributed as dist

from rlt_mega.config import load_config
from rlt_mega.model import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.sharding import shard_for_rank
from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small_cpu.yaml", help="its model section is benchmarked")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=64")
    ap.add_argument("--batch", type=int, default=8, help="rows in all (split into M micro-batches under PP)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4], help="M values for PP=2")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(17, 41, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    model_cfg = dataclasses.replace(cfg.model, max_seq_len=max(cfg.model.max_seq_len, max(lengths) + args.new_tokens))
    params = SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=args.new_tokens)
    seeds = list(range(args.batch))

    layouts = [("1 process", None, 1)] + [("TP=2", {"tp": 2}, 1)] + [(f"PP=2 M={m}", {"pp": 2}, m) for m in args.micro]
    samplers = {}
    for name, parallel, _ in layouts:
        if parallel is None:
            samplers[name] = None
            continue
        dims = ParallelDims.build(dataclasses.replace(cfg.parallel, **parallel, dp=None), model_cfg, "cpu")
        model = shard_for_rank(build_model(model_cfg, "cpu", seed=0), dims)
        samplers[name] = (Sampler(model, Comms.from_dims(dims), dims.layers), dims)
    single = build_model(model_cfg, "cpu", seed=0)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{args.config}: d={model_cfg.d_model} L={model_cfg.n_layers} V={model_cfg.vocab_size} "
              f"C={model_cfg.memory_block} rows={args.batch} new_tokens={args.new_tokens} "
              f"ranks={dist.get_world_size()} "
              f"threads/rank={torch.get_num_threads()}")
    best = {name: (float("inf"), float("inf")) for name, _, _ in layouts}
    tokens, exact = {}, {}
    for _ in range(args.repeats):
        for name, parallel, M in layouts:
            split = [list(range(i, args.batch, M)) for i in range(M)]  # M micro-batches of the same rows
            batches = [[prompts[i] for i in idx] for idx in split]
            batch_seeds = [[seeds[i] for i in idx] for idx in split]
            dist.barrier()
            t0 = time.perf_counter()
            if parallel is None:  # rank 0 alone
                sampler = Sampler(single) if rank == 0 else None
            else:
                sampler = samplers[name][0]
            rollouts = sampler.generate(batches, params, batch_seeds, pad_id=0) if sampler else []
            t_roll = time.perf_counter() - t0
            t0 = time.perf_counter()
            replayed = sampler.replay(rollouts) if sampler else []
            t_replay = time.perf_counter() - t0
            dist.barrier()
            best[name] = (min(best[name][0], t_roll), min(best[name][1], t_replay))
            tokens[name] = sum(ro.num_completion_tokens() for ro in rollouts)
            exact[name] = all(torch.equal(r, ro.mu) for r, ro in zip(replayed, rollouts) if r is not None)
    if rank == 0:
        print(f"{'layout':>12} {'rollout tok/s':>14} {'replay/rollout':>15} {'replay exact':>13}")
        for name, _, _ in layouts:
            t_roll, t_replay = best[name]
            print(f"{name:>12} {tokens[name] / t_roll:>14.1f} {t_replay / t_roll:>15.3f} {str(exact[name]):>13}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
