"""train.bf16_cast=stochastic under DeepSpeed (parallel/zero.py, DeepSpeedCopy): after each step
every rank's bf16 copy is precision.stochastic_bf16 of its fp32 masters keyed by the step, the
module's whole parameters (after DeepSpeed's all-gather; ZeRO-3's sampling copy) are that
copy of the consolidated masters, the precision metrics are reported, and a resume in a new
engine continues bit for bit."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from rlt_mega.precision import cast_key, stochastic_bf16
from tests.distributed.scenarios import _close, _engine, local_batches, make_cfg


def _copy_is_stochastic(engine, step: int, seed: int) -> tuple[bool, bool]:
    key = cast_key(seed, step)
    pairs = all(torch.equal(c, stochastic_bf16(m.detach().reshape(c.shape).float(), key))
                for m, c in engine.copy.pairs())
    masters = engine.parameters_fp32()  # collective under ZeRO-3
    module = engine.sampling_module()  # collective under ZeRO-3
    params = all(torch.equal(p.detach().to(torch.bfloat16), stochastic_bf16(masters[n].reshape(p.shape), key))
                 for n, p in module.named_parameters() if n in masters)
    return pairs, params


def _state(engine) -> dict:
    out = {n: v.clone() for n, v in engine.parameters_fp32().items()}
    out.update({"copy." + n: p.detach().clone() for n, p in engine.sampling_module().named_parameters()})
    return out


def stochastic_copy(parallel=None, steps=3, more=2) -> dict:
    cfg = make_cfg(None, parallel, {"dtype": "bf16", "bf16_cast": "stochastic"}, {"lr": 1e-3})
    dims, engine = _engine(cfg)
    stats = [engine.train_step(local_batches(cfg, s, dims)) for s in range(steps)]
    pairs, params = _copy_is_stochastic(engine, engine.steps_taken, cfg.train.seed)
    root = [tempfile.mkdtemp(prefix="rlt-cast-") if dims.rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    directory = Path(root[0]) / "engine"
    if dims.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    engine.save(directory)
    for s in range(steps, steps + more):
        engine.train_step(local_batches(cfg, s, dims))
    straight = _state(engine)
    _close(dims, engine)
    dims, engine = _engine(cfg)
    engine.load(directory)
    for s in range(steps, steps + more):
        engine.train_step(local_batches(cfg, s, dims))
    resumed = _state(engine)
    _close(dims, engine)
    metrics = [s.precision for s in stats]
    return {"pairs_stochastic": pairs, "params_stochastic": params,
            "stale_fraction": [m.get("precision/stale_fraction", math.nan) for m in metrics],
            "copy_lag": [m.get("precision/copy_lag", math.nan) for m in metrics],
            "resumed_equal": straight.keys() == resumed.keys()
            and all(torch.equal(straight[k], resumed[k]) for k in straight),
            "num_tensors": len(straight)}
