"""Scenarios for issue-16 checks, run on every rank by tests/distributed/worker.py
(``nccl_scenarios.<fn>``); they return numbers and message logs, the tests assert.

- ``ring_messages``: the messages the real executors post (the P2P log: the sampler ring's
  generate and replay, the training ring's round) for the test to compare with the pure
  descriptions the NCCL simulation checks (rollout/ring.py, parallel/pipeline.py);
- ``bf16_accumulates_in_fp32``: a bf16 ZeRO step's gradient against references that accumulate
  the per-micro-batch bf16 gradients in fp32 and in bf16;
- ``pipeline_handover_keeps_fp32``: the pipeline's fp32 gradient sums, handed to DeepSpeed,
  read back from DeepSpeed's fp32 accumulators.
"""

from __future__ import annotations

import torch

from rlt_mega.config import from_dict
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel import distributed
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.gather import gather_full
from rlt_mega.parallel.sharding import shard_for_rank
from rlt_mega.parallel.tp import token_losses
from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams
from tests.distributed.grpo_scenarios import MODEL, RAGGED
from tests.distributed.scenarios import _close, _engine, global_batch, local_batches, make_cfg


def _log(entries: list) -> list:
    return [[kind, peer, stream] for kind, peer, stream, _ in entries]


def ring_messages(parallel: dict, model: dict | None = None, check_every: int = 2, plan: str = "lockstep",
                  train: bool = True) -> dict:
    """One generate (two micro-batches in flight, a stop token, stop strings) and its replay on the
    sampler ring, with the stage's P2P log on and the rollouts' records for the pure description;
    plan "lockstep" (ragged prompts) or "rows" (grouped prompts, shared and forked, slots < rows);
    with ``train``, then one training round on the training ring."""
    from rlt_mega.schedule.rows import LOCKSTEP, RowSwitches, record_to_json
    from tests.distributed.grpo_scenarios import GROUPED

    cfg = from_dict({"model": {**MODEL, **(model or {})}, "data": {"seq_len": 32}, "parallel": parallel})
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu")
    mine = shard_for_rank(build_model(cfg.model, "cpu", seed=7), dims)
    rows, batches = (LOCKSTEP, RAGGED) if plan == "lockstep" else (RowSwitches(slots=5), GROUPED)
    sampler = Sampler(mine, Comms.from_dims(dims), dims.layers, check_every=check_every, rows=rows)
    params = SamplingParams(Processing(temperature=0.9), max_new_tokens=9, stop_token_ids=(3,),
                            stop_strings=("ab",))
    decode = lambda ids: "".join("ab"[i % 2] for i in ids)  # noqa: E731  ("ab": an even token, then an odd)
    p2p = sampler.comms.p2p
    p2p.log = []
    seeds = [[11 + 10 * j + b for b in range(len(batch))] for j, batch in enumerate(batches)]
    rollouts = sampler.generate(batches, params, seeds, pad_id=0, decode=decode)
    out = {"stage": dims.pp_rank, "P": dims.pp, "check_every": check_every, "plan": plan, "generate": _log(p2p.log),
           "records": [record_to_json(ro.schedule.rows) for ro in rollouts]}
    p2p.log = []
    sampler.replay(rollouts)
    out["replay"] = _log(p2p.log)
    dims.destroy()
    if train:  # the training ring: one round of two micro-batches
        tcfg = make_cfg(model, {**parallel, "micro_batches": 2}, {"grad_accum": 2, "micro_batch_size": 2})
        dims, engine = _engine(tcfg)
        engine.ring.p2p.log = []
        engine.backward_step(local_batches(tcfg, 0, dims))
        out["train"] = _log(engine.ring.p2p.log)
        out["train_shape"] = [2, tcfg.data.seq_len]  # M, T
        _close(dims, engine)
    return out


def bf16_accumulates_in_fp32(parallel: dict, train: dict | None = None) -> dict:
    """bf16 parameters, four micro-batches per rank (DeepSpeed's gradient accumulation), two
    data-parallel ranks. The reference runs the same bf16 model on every rank's micro-batches
    and sums their bf16 gradients in fp32 (what parallel.grad_accum_dtype=fp32 promises) and,
    for contrast, in bf16; the data-parallel mean is taken in fp32."""
    cfg = make_cfg(None, parallel, {"dtype": "bf16", "grad_accum": 4, "micro_batch_size": 2, **(train or {})})
    dims, engine = _engine(cfg)
    engine.backward_step(local_batches(cfg, 0, dims))
    mine = gather_full(engine.gradients(), dims)
    x, y = global_batch(cfg, 0, dims.dp)
    scale = dims.dp / float((y != -100).sum())  # the engine's per-token weight (distributed.backward_step)
    ref = build_model(cfg.model, "cpu", seed=cfg.train.seed).to(torch.bfloat16)
    acc32 = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    acc16 = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    per_rank = cfg.train.grad_accum * cfg.train.micro_batch_size
    sums32, sums16 = [], []
    for r in range(dims.dp):
        for n in acc32:
            acc32[n].zero_()
            acc16[n].zero_()
        for i in range(r * per_rank, (r + 1) * per_rank, cfg.train.micro_batch_size):
            ref.zero_grad(set_to_none=True)
            xb, yb = x[i:i + cfg.train.micro_batch_size], y[i:i + cfg.train.micro_batch_size]
            (token_losses(ref(xb), yb, 1).sum() * scale).backward()
            for n, p in ref.named_parameters():
                acc32[n] += p.grad.float()
                acc16[n] += p.grad
        sums32.append({n: t.clone() for n, t in acc32.items()})
        sums16.append({n: t.float() for n, t in acc16.items()})
    ref32 = {n: sum(s[n] for s in sums32) / dims.dp for n in acc32}
    ref16 = {n: sum(s[n] for s in sums16) / dims.dp for n in acc32}
    peak = max(float(t.abs().max()) for t in ref32.values())

    def rel(a: dict, b: dict) -> float:
        return max(float((a[n].float() - b[n]).abs().max()) for n in b) / peak

    out = {"diff_fp32_reference": rel(mine, ref32), "diff_bf16_reference": rel(mine, ref16),
           "optimizer": type(engine.ds.optimizer).__name__}
    _close(dims, engine)
    return out


def pipeline_handover_keeps_fp32(parallel: dict) -> dict:
    """The fp32 sums the pipeline's shadow parameters accumulated, read back from DeepSpeed's
    fp32 gradient accumulators after the hand-over (one data-parallel rank: no reduction)."""
    cfg = make_cfg(None, parallel, {"dtype": "bf16", "grad_accum": 2, "micro_batch_size": 2})
    dims, engine = _engine(cfg)
    captured = {}
    original = distributed.deposit_grads

    def spy(eng, grads, pieces=1):
        captured.update({id(p): g.clone() for p, g in grads.items()})
        captured["pieces"] = pieces
        return original(eng, grads, pieces)

    distributed.deposit_grads = spy
    try:
        engine.backward_step(local_batches(cfg, 0, dims))
    finally:
        distributed.deposit_grads = original
    from deepspeed.utils import safe_get_full_grad

    equal, rounded_equal, n, worst = True, True, 0, (0.0, "")
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        want = captured[id(p)]
        equal &= g.dtype == torch.float32 and bool(torch.equal(g, want))
        worst = max(worst, (float((g.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)), name))
        rounded_equal &= bool(torch.equal(want, want.bfloat16().float()))
        n += 1
    out = {"equal": equal, "worst": worst, "sums_are_not_bf16": not rounded_equal, "pieces": captured["pieces"],
           "params": n, "optimizer": type(engine.ds.optimizer).__name__}
    _close(dims, engine)
    return out
