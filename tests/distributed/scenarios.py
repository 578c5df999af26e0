"""Distributed scenarios, run on every rank by tests/distributed/worker.py. Each builds a layout,
runs the engine, runs a single-process reference (full model, combined batch of every
data-parallel rank, torch AdamW and torch clipping) in the same process, and returns numbers
(max differences, norms, losses) that the tests check. Nothing here asserts: a scenario that
raises is reported with its traceback."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from rlt_mega.config import Config, ConfigError, from_dict
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import param_groups
from rlt_mega.parallel.gather import gather_full
from rlt_mega.train.builders import build_engine

TINY = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, memory_block=2,
            max_seq_len=16)


def make_cfg(model=None, parallel=None, train=None, optim=None) -> Config:
    data = {
        "model": {**TINY, **(model or {})},
        "data": {"seq_len": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1, "grad_clip": 1.0, **(optim or {})},
        "train": {"micro_batch_size": 4, "grad_accum": 1, "seed": 3, **(train or {})},
        "parallel": parallel or {},
    }
    return from_dict(data)


def global_batch(cfg: Config, step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch of every data-parallel rank: rows ordered (dp_rank, accum, row)."""
    rows = dp * cfg.train.grad_accum * cfg.train.micro_batch_size
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.data.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_batches(cfg: Config, step: int, dims: ParallelDims) -> list:
    x, y = global_batch(cfg, step, dims.dp)
    per_rank = cfg.train.grad_accum * cfg.train.micro_batch_size
    x, y = x[dims.dp_rank * per_rank:(dims.dp_rank + 1) * per_rank], y[dims.dp_rank * per_rank:(dims.dp_rank + 1) * per_rank]
    mbs = cfg.train.micro_batch_size
    return [{"inputs": x[i:i + mbs], "targets": y[i:i + mbs]} for i in range(0, per_rank, mbs)]


class Reference:
    """The single-process model: same seed, combined batch, torch AdamW, torch clipping.
    plain: the decoder written plainly (rlt_mega/reference.py) instead of the decoder step."""

    def __init__(self, cfg: Config, plain: bool = False) -> None:
        self.cfg, self.plain = cfg, plain
        self.model = build_model(cfg.model, "cpu", seed=cfg.train.seed)
        self.model.set_checkpointing(cfg.train.checkpointing)
        o = cfg.optim
        self.opt = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                     eps=o.eps, foreach=False)

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        if self.plain:
            from rlt_mega.reference import reference_forward

            logits = reference_forward(self.model, x)
        else:
            logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") / y.numel()
        loss.backward()
        return float(loss)

    def step(self, lr: float) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        clip = self.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.opt.step()
        return float(norm)

    def grads(self) -> dict:
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}

    def params(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def max_diff(full: dict, ref: dict) -> tuple[float, str]:
    """Largest |a - b| over the reference's names (relative to 1 + |b|max per tensor)."""
    worst, where = 0.0, ""
    for name, r in ref.items():
        if name not in full:
            return float("inf"), f"missing {name}"
        a = full[name].to(r.dtype)
        if a.shape != r.shape:
            return float("inf"), f"shape {name} {tuple(a.shape)} vs {tuple(r.shape)}"
        d = float((a - r).abs().max())
        if d > worst:
            worst, where = d, name
    return worst, where


_ENGINES = []


def _engine(cfg: Config):
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    engine = build_engine(cfg, dims)
    _ENGINES.append(engine)
    return dims, engine


def _close(dims, engine) -> None:
    engine.close()
    dims.destroy()


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Scenarios
# ------------------------------------------------------------------------------------------

def gradients_vs_reference(model=None, parallel=None, train=None, with_logits=False) -> dict:
    """One backward: loss, gathered gradients (and with pp == 1 the gathered logits) against
    the single-process reference on the combined batch."""
    cfg = make_cfg(model, parallel, train)
    dims, engine = _engine(cfg)
    ref = Reference(cfg)
    x, y = global_batch(cfg, 0, dims.dp)
    ref_loss = ref.backward(x, y)
    out = {}
    if with_logits:
        mine = local_batches(cfg, 0, dims)[0]["inputs"]
        with torch.no_grad():
            ref_logits = ref.model(mine)
        out["logits_diff"] = float((engine.logits(mine) - ref_logits).abs().max())
    loss, tokens, _ = engine.backward_step(local_batches(cfg, 0, dims))
    full = gather_full(engine.gradients(), dims)
    out["grad_diff"], out["grad_worst"] = max_diff(full, ref.grads())
    out["loss"], out["ref_loss"], out["tokens"] = loss, ref_loss, tokens
    out["grad_scale"] = max(float(g.abs().max()) for g in ref.grads().values())
    if cfg.model.tie_embeddings and dims.pp > 1:
        out["tied_diff"] = float((full["lm_head.weight"] - full["embed.weight"]).abs().max())
    _close(dims, engine)
    return out


def steps_vs_reference(model=None, parallel=None, train=None, optim=None, steps=3) -> dict:
    """``steps`` optimizer steps; per-step loss and gradient norm, then the gathered fp32
    parameters, against the reference."""
    cfg = make_cfg(model, parallel, train, optim)
    dims, engine = _engine(cfg)
    ref = Reference(cfg)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "lr": []}
    for step in range(steps):
        m = engine.train_step(local_batches(cfg, step, dims))
        x, y = global_batch(cfg, step, dims.dp)
        out["ref_loss"].append(ref.backward(x, y))
        out["ref_norm"].append(ref.step(m.lr))
        out["lr"].append(m.lr)
        out["loss"].append(m.loss)
        out["norm"].append(m.grad_norm)
    full = gather_full(engine.parameters_fp32(), dims)
    out["param_diff"], out["param_worst"] = max_diff(full, ref.params())
    moved, _ = max_diff(ref.params(), Reference(cfg).params())
    out["param_moved"] = moved  # how far the parameters travelled: the comparison is not vacuous
    _close(dims, engine)
    return out


def loss_falls(model=None, parallel=None, train=None, optim=None, steps=8) -> dict:
    """Training on one repeated batch (bf16): the loss must fall."""
    cfg = make_cfg(model, parallel, {"dtype": "bf16", **(train or {})}, optim)
    dims, engine = _engine(cfg)
    batch = local_batches(cfg, 0, dims)
    losses = [engine.train_step(batch).loss for _ in range(steps)]
    dtype = str(next(engine.module.parameters()).dtype)
    _close(dims, engine)
    return {"losses": losses, "dtype": dtype}


def resume(model=None, parallel=None, train=None, optim=None, phase="save", ckpt="", steps_before=2,
           steps_after=2) -> dict:
    """phase "save": train steps_before, save, train steps_after, store the parameters.
    phase "load": a fresh process loads the checkpoint and trains steps_after; the parameters
    must equal those stored by the uninterrupted run (torch.equal, per rank)."""
    import torch.distributed as dist

    cfg = make_cfg(model, parallel, train, optim)
    dims, engine = _engine(cfg)
    ckpt = Path(ckpt)
    directory = ckpt / "engine"
    if phase == "save":
        for step in range(steps_before):
            engine.train_step(local_batches(cfg, step, dims))
        if dims.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        engine.save(directory)
        # The consolidated single-device weights equal the gathered shards (fp32 masters).
        full = gather_full(engine.parameters_fp32(), dims)
        if dims.rank == 0:
            from safetensors.torch import load_file

            saved = load_file(directory / "model.safetensors")
            consolidated = {k: v for k, v in saved.items()}
            out_consolidated = all(torch.equal(consolidated[k], full[k]) for k in consolidated if k in full) and \
                set(full) <= set(consolidated) | {"lm_head.weight"}
        else:
            out_consolidated = True
    else:
        out_consolidated = True
        engine.load(directory)
    start = engine.state_dict()["steps_taken"]
    for step in range(start, start + steps_after):
        engine.train_step(local_batches(cfg, step, dims))
    mine = {k: v.cpu() for k, v in engine.parameters_fp32().items()}
    ref_file = ckpt / f"uninterrupted_rank{dims.rank}.pt"
    out = {"start": start, "consolidated": out_consolidated,
           "files": sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())}
    if phase == "save":
        torch.save(mine, ref_file)
    else:
        ref = torch.load(ref_file, weights_only=True)
        out["equal"] = set(mine) == set(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)
        out["max_diff"] = max(float((mine[k] - ref[k]).abs().max()) for k in ref)
    _close(dims, engine)
    return out


def bad_layout(model=None, parallel=None, train=None) -> dict:
    """A layout that does not fit must raise a ConfigError before any collective."""
    try:
        cfg = make_cfg(model, parallel, train)
        ParallelDims.build(cfg.parallel, cfg.model, "cpu", cfg.train)
    except ConfigError as exc:
        return {"raised": True, "message": str(exc)}
    return {"raised": False, "message": ""}


def nonfinite_skipped(parallel=None, train=None) -> dict:
    """A step whose loss is NaN (null_memory, on every stage, poisoned in the working copy) is
    reported skipped and changes no other parameter; the learning-rate schedule does not move."""
    cfg = make_cfg(None, parallel, train)
    dims, engine = _engine(cfg)
    before = engine.parameters_fp32()
    with torch.no_grad():
        dict(engine.module.named_parameters())["null_memory"].fill_(float("nan"))
    stats = engine.train_step(local_batches(cfg, 0, dims))
    after = engine.parameters_fp32()
    others_equal = all(torch.equal(before[k], after[k]) for k in before if k != "null_memory")
    out = {"skipped": stats.skipped, "loss": stats.loss, "others_equal": others_equal,
           "steps_taken": engine.state_dict()["steps_taken"]}
    _close(dims, engine)
    return out
