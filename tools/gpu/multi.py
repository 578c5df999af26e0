"""One layout of tools/gpu_check_multi.sh, on every rank of ``torchrun --nproc_per_node N``: the
distributed engine (NCCL on GPUs; gloo on the CPU with --smoke) against one process holding the
whole model on the same device (the same seed and the global batch: losses and the gathered
parameters after two optimizer steps, fp32, within 1e-4), a rollout's replay torch.equal to its mu
(fp32 and bf16, the layout's sampler ring and tensor-parallel groups), and, with a pipeline, the
training ring's bubble: the time the stage's compute stream waits for messages (P2P.wait_s: CUDA
events on CUDA) over the step's time.

    torchrun --nproc_per_node 2 tools/gpu/multi.py --layout "tp=2" --out result.json [--smoke]

--layout: "tp=2", "pp=2", "dp=2" (ZeRO-1 over data parallelism) or a combination ("tp=2,pp=2"
on 4 ranks). Rank 0 writes {"status": "ok" | "fail: ...", "ranks": [...]}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-4  # fp32 losses and parameters against one process (reduction orders differ)


def _layout(text: str) -> dict:
    out = {"tp": 1, "pp": 1, "dp": 1}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in out or not value.isdigit():
            raise SystemExit(f"--layout {text!r}: expected items tp=N, pp=N, dp=N separated by commas")
        out[key] = int(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="the CPU with gloo")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from rlt_mega.config import from_dict
    from rlt_mega.determinism import configure
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.engine import EngineConfig, LocalEngine
    from rlt_mega.parallel.gather import gather_full
    from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams
    from rlt_mega.train.builders import build_engine

    lay = _layout(args.layout)
    device = "cpu" if args.smoke else "cuda"
    configure(True)
    cfg = from_dict({
        "model": {"vocab_size": 96, "d_model": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "memory_block": 2, "max_seq_len": 128, "tie_embeddings": False},
        "data": {"seq_len": 16},
        "optim": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1, "grad_clip": 1.0},
        "train": {"micro_batch_size": 4, "grad_accum": 2, "seed": 3, "steps": 2, "device": device},
        "parallel": {"tp": lay["tp"], "pp": lay["pp"], "zero_stage": 1 if lay["dp"] > 1 else 0,
                     "micro_batches": 2 if lay["pp"] > 1 else 1}})
    dims = ParallelDims.build(cfg.parallel, cfg.model, device, EngineConfig.from_train(cfg.train), True)
    problems, out = [], {"rank": dims.rank, "layout": [dims.tp, dims.pp, dims.dp], "backend": dims.backend}
    if [dims.tp, dims.pp, dims.dp] != [lay["tp"], lay["pp"], lay["dp"]]:
        problems.append(f"the world of {dims.world_size} ranks gives tp, pp, dp = {[dims.tp, dims.pp, dims.dp]}, "
                        f"not {args.layout}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # --- training: two steps against one process on this rank's device
    engine = build_engine(cfg, dims)
    ref = LocalEngine(build_model(cfg.model, dims.device, seed=cfg.train.seed), ParallelDims.single(cfg.model, dims.device),
                      cfg.optim, EngineConfig(total_steps=2, micro_batch_size=4, grad_accum=2 * dims.dp))
    losses, ref_losses, step_s = [], [], []
    for step in range(2):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, cfg.model.vocab_size, (dims.dp * 8, 17), generator=g).to(dims.device)
        batches = [{"inputs": tokens[i:i + 4, :-1], "targets": tokens[i:i + 4, 1:]} for i in range(0, len(tokens), 4)]
        mine = batches[dims.dp_rank * 2:(dims.dp_rank + 1) * 2]
        sync()
        t0 = time.perf_counter()
        losses.append(engine.train_step(mine).loss)
        sync()
        step_s.append(time.perf_counter() - t0)
        ref_losses.append(ref.train_step(batches).loss)
        if dims.pp > 1 and step == 1:  # the ring's bubble in the second (warm) step
            wait = engine.ring.p2p.wait_s
            out["ring"] = {"wait_s": wait, "busy_host_s": engine.ring.busy_s, "step_s": step_s[-1],
                           "bubble": wait / step_s[-1], "timer": "cuda events" if device == "cuda" else "host"}
    full = gather_full(engine.parameters_fp32(), dims)
    reference = {n: p.detach() for n, p in ref.module.named_parameters()}
    param_diff = max(float((full[n].to(p.dtype) - p).abs().max()) for n, p in reference.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out.update(loss=losses, ref_loss=ref_losses, loss_diff=loss_diff, param_diff=param_diff)
    if not (loss_diff <= TOLERANCE and param_diff <= TOLERANCE):
        problems.append(f"against one process: loss {loss_diff:.3g}, parameters {param_diff:.3g} > {TOLERANCE}")

    # --- replay torch.equal to mu on the layout's sampler ring
    sampler = Sampler(engine.sampling_module(), Comms.from_dims(dims), dims.layers, check_every=2)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, cfg.model.vocab_size, (n,), generator=g).tolist() for n in (3, 7, 5, 4)]
    out["replay_equal"] = {}
    for dtype in ("fp32", "bf16"):
        params = SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=10, stop_token_ids=(5,))
        with torch.no_grad():
            ro = sampler.generate([prompts], params, [[11, 12, 13, 14]], pad_id=0, dtype=dtype)[0]
            replayed = sampler.replay([ro])[0]
        if dims.is_last_stage:
            equal = bool(torch.equal(replayed, ro.mu))
            out["replay_equal"][dtype] = equal
            if not equal:
                problems.append(f"replay differs from mu ({dtype})")
    engine.close()
    out["status"] = "ok" if not problems else "fail: " + "; ".join(problems)
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, out)
    dims.destroy()
    dist.destroy_process_group()
    if gathered[0]["rank"] == out["rank"] == 0:
        bad = [f"rank {r['rank']}: {r['status']}" for r in gathered if r["status"] != "ok"]
        args.out.write_text(json.dumps({"status": "ok" if not bad else "fail: " + "; ".join(bad),
                                        "layout": args.layout, "ranks": gathered}, default=str))
        print(f"{args.layout}: {'passed' if not bad else 'failed (' + '; '.join(bad) + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
