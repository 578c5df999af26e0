"""Rollout benchmark (prints figures, asserts nothing).

In one run, side by side on the same model and prompts:
- rollout tokens/s at each memory block C (deferred memory: the encoder runs once per C
  generated tokens, on C tokens);
- replay time / rollout time (the same schedule, tokens forced);
- hybrid learner step / dense-only learner step (forward + backward of a GRPO loss; the
  hybrid adds one replay to the dense forward/backward);
- the bf16 gap max/mean |dense - replay| over the completion tokens where both are finite
  (fp32 max for reference), and the fraction of sampled tokens that fall outside the dense
  schedule's top-p set in bf16 (the boundary moves with the rounding gap).

    PYTHONPATH=. python tools/bench/rollout.py     # configs/small_cpu.yaml (d=256, L=4), batch 8, 128 new tokens
    PYTHONPATH=. python tools/bench/rollout.py --new-tokens 16 --blocks 4 model.d_model=64   # a quick look
"""

from __future__ import annotations

import argparse
import time

import torch

import dataclasses

from rlt_mega.config import load_config
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs, mismatch_metrics, replay_logprobs
from rlt_mega.model import build_model
from rlt_mega.rollout import Processing, SamplingParams, generate


def timed(fn, repeats: int = 1):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def learner_step(model, rollout, hybrid: bool) -> None:
    dense = dense_logprobs(model, rollout)
    logp = hybrid_logprobs(dense, replay_logprobs(model, rollout)) if hybrid else dense
    adv = group_advantages(torch.arange(rollout.batch_size, dtype=torch.float32), group_size=rollout.batch_size)
    grpo_loss(logp, rollout.mu, adv, rollout.mask, rollout.num_completion_tokens()).loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/small_cpu.yaml", help="its model section is benchmarked")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=64")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--repeats", type=int, default=2, help="best of N timings")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = load_config(args.config, args.overrides).model
    vocab = base.vocab_size

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(17, 41, (args.batch,), generator=g).tolist()  # ragged prompts
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=args.new_tokens)
    seeds = list(range(args.batch))
    print(f"{args.config}: d={base.d_model} L={base.n_layers} H={base.n_heads}/{base.n_kv_heads} V={vocab} "
          f"batch={args.batch} new_tokens={args.new_tokens} prompts={min(lengths)}..{max(lengths)} "
          f"threads={torch.get_num_threads()} device={args.device}")
    header = (f"{'C':>3} {'rollout tok/s':>14} {'replay/rollout':>15} {'hybrid/dense step':>18} "
              f"{'fp32 max|d-r|':>14} {'bf16 max|d-r|':>14} {'bf16 mean|d-r|':>15} {'bf16 dense miss':>17}")
    print(header)
    models = {}
    for C in args.blocks:
        max_len = max(base.max_seq_len, max(lengths) + args.new_tokens)
        cfg = dataclasses.replace(base, memory_block=C, max_seq_len=max_len)
        models[C] = build_model(cfg, device=args.device, seed=0)  # the same weights for every C
        generate(models[C], [p[:4] for p in prompts], SamplingParams(max_new_tokens=4), seeds, pad_id=0)  # warm-up
    # Every timing below is the best of --repeats, taken in rounds over everything it is compared
    # with, so that a busy neighbour on the machine slows all of them alike.
    t_roll = {C: float("inf") for C in args.blocks}
    t_replay = dict(t_roll)
    rollouts = {}
    for _ in range(args.repeats):
        for C, model in models.items():
            t, rollouts[C] = timed(lambda: generate(model, prompts, params, seeds, pad_id=0), 1)
            t_roll[C] = min(t_roll[C], t)
            t, replayed = timed(lambda: replay_logprobs(model, rollouts[C]), 1)
            t_replay[C] = min(t_replay[C], t)
            assert torch.equal(replayed, rollouts[C].mu), "replay is not bit-exact"
    for C, model in models.items():
        rollout = rollouts[C]
        t_dense = t_hybrid = float("inf")
        for _ in range(args.repeats):
            t_dense = min(t_dense, timed(lambda: learner_step(model, rollout, hybrid=False), 1)[0])
            t_hybrid = min(t_hybrid, timed(lambda: learner_step(model, rollout, hybrid=True), 1)[0])
        with torch.no_grad():
            gap32 = (dense_logprobs(model, rollout) - rollout.mu)[rollout.mask].abs().max().item()
        rollout16 = generate(model, prompts, params, seeds, pad_id=0, dtype="bf16")
        replayed16 = replay_logprobs(model, rollout16)
        assert torch.equal(replayed16, rollout16.mu), "bf16 replay is not bit-exact"
        with torch.no_grad():
            m16 = mismatch_metrics(rollout16.mu, dense_logprobs(model, rollout16), replayed16, rollout16.mask)
        tokens_per_s = rollout.num_completion_tokens() / t_roll[C]
        print(f"{C:>3} {tokens_per_s:>14.1f} {t_replay[C] / t_roll[C]:>15.3f} {t_hybrid / t_dense:>18.3f} "
              f"{gap32:>14.2e} {m16['logprob_diff_max']:>14.2e} {m16['logprob_diff_mean']:>15.2e} "
              f"{m16['support_miss_dense']:>17.4f}")


if __name__ == "__main__":
    main()
