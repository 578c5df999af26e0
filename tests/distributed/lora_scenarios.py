"""Low-rank adapters (model.lora, issue 30) under the distributed layouts: one GRPO step of the
trainer against the one-process step of grpo_scenarios.OneProcessGRPO with the same adapters.
Scenarios return numbers; tests/distributed/test_lora_parallel.py asserts."""

from __future__ import annotations

import torch

from rlt_mega.checkpoint import load_torch
from rlt_mega.config import LoraConfig
from rlt_mega.data.tokenizer import load_tokenizer
from rlt_mega.model.lora import adapters, apply_lora
from rlt_mega.parallel.adapter_files import adapter_state
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import param_groups
from rlt_mega.train.grpo import build_trainer, engine_config, grpo_config
from tests.distributed.grpo_scenarios import OneProcessGRPO, grpo_cfg, odd, records

LORA = LoraConfig(rank=4, alpha=8.0)


class OneProcessLoRA(OneProcessGRPO):
    """The one-process GRPO step with the adapters of every layout (seeded by name), base frozen."""

    def __init__(self, cfg, dp: int) -> None:
        super().__init__(cfg, dp)  # the reference is the base (no adapters), as the trainer's
        apply_lora(self.model, cfg.model.lora, cfg.train.seed)
        o = cfg.optim
        self.opt = torch.optim.AdamW(param_groups(self.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                     eps=o.eps, foreach=False)


def _whole(model, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """This rank's adapters, the tensor-parallel shards gathered (B of a column layer, A of a row
    layer) and, under ZeRO-3, the data-parallel partitions."""
    import deepspeed

    found = list(adapters(model))
    with deepspeed.zero.GatheredParameters([p for _, a in found for p in a.parameters()], modifier_rank=None):
        return _whole_gathered(found, dims)


def _whole_gathered(found, dims: ParallelDims) -> dict[str, torch.Tensor]:
    out = {}
    for name, a in found:
        for which, p in (("lora_A", a.lora_A), ("lora_B", a.lora_B)):
            t = p.detach().float()
            split = a.shard_dim is not None and (which == "lora_B") == (a.shard_dim == 0)
            if split and dims.tp > 1:
                parts = [torch.empty_like(t) for _ in range(dims.tp)]
                torch.distributed.all_gather(parts, t.contiguous(), group=dims.tp_group)
                t = torch.cat(parts, dim=a.shard_dim)
            out[f"{name}.{which}"] = t
    return out


def _frozen(model) -> dict[str, torch.Tensor]:
    """The frozen base's parameters of this rank (under ZeRO-3 gathered over the data-parallel group)."""
    import deepspeed

    params = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        return {n: p.detach().clone() for n, p in params}


def lora_grpo_step(parallel: dict, train: dict | None = None) -> dict:
    cfg = grpo_config(grpo_cfg(parallel, train))
    cfg.model.lora = LORA
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    recs = records()
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), odd, recs, [])
    model = trainer.engine.module
    frozen = _frozen(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lrs, original = [], trainer.engine.train_step

    def spy(batches, loss):
        stats = original(batches, loss)
        lrs.append(stats.lr)
        return stats

    trainer.engine.train_step = spy
    scalars = trainer.job.step(0)
    ref_model = OneProcessLoRA(cfg, dims.dp)
    ref = ref_model.step(recs, lrs)
    mine, theirs = _whole(model, dims), adapter_state(ref_model.model)
    start = adapter_state(OneProcessLoRA(cfg, dims.dp).model)
    out = {
        "onpolicy_dev": scalars["ratio/onpolicy_max_dev"],
        "only_adapters_train": bool(trainable) and all(n.endswith(("lora_A", "lora_B")) for n in trainable),
        "base_unchanged": _frozen(model).keys() == frozen.keys() and all(
            torch.equal(p, frozen[n]) for n, p in _frozen(model).items()),
        "adapters": len(mine),
        "adapter_diff": max(float((mine[k] - theirs[k]).abs().max()) for k in mine),
        "adapter_moved": max(float((theirs[k] - start[k]).abs().max()) for k in mine),
        "ref_norm": ref["norm"],
        **_optimizer_numel(trainer.engine, dims),
    }
    trainer.engine.close()
    dims.destroy()
    return out


def lora_checkpoint_round_trip(parallel: dict, shared: str) -> dict:
    """A GRPO step, the engine's checkpoint (DeepSpeed's files without the frozen base), a new
    engine of the same layout loading it (the adapters bit for bit), and one more training step
    on fixed tokens on both (the same adapters after it: the optimizer state came back); a base
    of another seed is refused."""
    from pathlib import Path

    from rlt_mega.checkpoint import CheckpointError

    cfg = grpo_config(grpo_cfg(parallel))
    cfg.model.lora = LORA
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu", engine_config(cfg))
    directory = Path(shared) / ("lora_" + "_".join(f"{k}{v}" for k, v in sorted(parallel.items())))
    directory.mkdir(parents=True, exist_ok=True)

    def trainer_of(seed: int = cfg.train.seed):
        c = grpo_config(grpo_cfg(parallel, {"seed": seed}))
        c.model.lora = LORA
        return build_trainer(c, dims, load_tokenizer("byte"), odd, records(), [])

    first = trainer_of()
    first.job.step(0)
    first.engine.save(directory)
    dims.barrier()
    saved = load_torch(next((directory / "deepspeed").glob("*mp_rank_*model_states.pt")), deepspeed=True)
    module_keys = list(saved["module"].keys())
    second = trainer_of()
    second.engine.load(directory)
    a, b = _whole(first.engine.module, dims), _whole(second.engine.module, dims)
    loaded_equal = all(torch.equal(a[k], b[k]) for k in a)
    g = torch.Generator().manual_seed(0)  # the same next step on both: one LM step on fixed tokens
    x = torch.randint(1, 200, (cfg.train.micro_batch_size, 13), generator=g)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:], "loss_mask": torch.ones(x.shape[0], 12)}
    first.engine.train_step([dict(batch)] * cfg.train.grad_accum)
    second.engine.train_step([dict(batch)] * cfg.train.grad_accum)
    a, b = _whole(first.engine.module, dims), _whole(second.engine.module, dims)
    stepped_equal = all(torch.equal(a[k], b[k]) for k in a)
    first.engine.close()
    second.engine.close()
    other = trainer_of(seed=cfg.train.seed + 1)
    try:
        other.engine.load(directory)
        refused = ""
    except CheckpointError as exc:
        refused = str(exc)
    other.engine.close()
    dims.destroy()
    return {"module_keys": module_keys, "loaded_equal": loaded_equal, "stepped_equal": stepped_equal,
            "refused": refused, "consolidated": (directory / "model.safetensors").exists()}


def _set_b(model, seed: int, dims: ParallelDims) -> None:
    """B of every adapter drawn whole (from a generator of its name) and cut to this rank's shard."""
    import hashlib

    for name, a in adapters(model):
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(),
                                                                         digest_size=6).digest(), "little"))
        out = a.lora_B.shape[0] * (dims.tp if a.shard_dim == 0 else 1)
        full = torch.randn(out, a.lora_B.shape[1], generator=g, dtype=torch.float64) * 0.2
        if a.shard_dim == 0:
            full = full.chunk(dims.tp)[dims.tp_rank]
        with torch.no_grad():
            a.lora_B.copy_(full)


def lora_replay_exact(parallel: dict, dtype: str = "fp32") -> dict:
    """The sampler ring of this layout on a model with trained-looking adapters (B != 0): replay
    torch.equal to mu; the rollout's tokens and mu against one process sampling the same batches
    with the same adapters (bf16: parameters in bf16, as DeepSpeed runs them)."""
    from rlt_mega.config import from_dict
    from rlt_mega.model.rlt import build_model
    from rlt_mega.parallel.sharding import adapt_for_rank, shard_for_rank
    from rlt_mega.rollout import Comms, Processing, Sampler, SamplingParams, generate
    from rlt_mega.schedule.rows import LOCKSTEP
    from tests.distributed.grpo_scenarios import MODEL, RAGGED

    cfg = from_dict({"model": {**MODEL, "lora": {"rank": 4, "alpha": 8.0}}, "data": {"seq_len": 32},
                     "parallel": parallel})
    dims = ParallelDims.build(cfg.parallel, cfg.model, "cpu")
    one = ParallelDims.single(cfg.model, "cpu")
    full = adapt_for_rank(build_model(cfg.model, "cpu", seed=7), one, seed=1)
    mine = adapt_for_rank(shard_for_rank(build_model(cfg.model, "cpu", seed=7), dims), dims, seed=1)
    _set_b(full, 2, one)
    _set_b(mine, 2, dims)
    if dtype == "bf16":
        full, mine = full.to(torch.bfloat16), mine.to(torch.bfloat16)
    sampler = Sampler(mine, Comms.from_dims(dims), dims.layers, rows=LOCKSTEP, check_every=8)
    params = SamplingParams(Processing(temperature=0.7, top_p=0.9), max_new_tokens=9, stop_token_ids=(0,))
    seeds = [[11 + 10 * j + b for b in range(len(batch))] for j, batch in enumerate(RAGGED)]
    rollouts = sampler.generate(RAGGED, params, seeds, pad_id=0, dtype=dtype)
    replays = sampler.replay(rollouts)
    out = {"exact": True, "has_values": replays[0] is not None, "tokens_equal": True, "mu_diff": 0.0, "tokens": 0}
    for ro, rp, batch, s in zip(rollouts, replays, RAGGED, seeds):
        ref = generate(full, batch, params, s, pad_id=0, dtype=dtype, rows=LOCKSTEP, check_every=8)
        out["tokens"] += ro.num_completion_tokens()
        if rp is not None:
            out["exact"] &= bool(torch.equal(rp, ro.mu))
        same = ro.tokens.shape == ref.tokens.shape and bool(torch.equal(ro.tokens, ref.tokens))
        out["tokens_equal"] &= same
        if same:
            out["mu_diff"] = max(out["mu_diff"], float((ro.mu - ref.mu).abs().max()))
    dims.destroy()
    return out


def _optimizer_numel(engine, dims: ParallelDims) -> dict:
    """Elements of Adam's first moment over the data-parallel partitions of this model-parallel
    rank (what ZeRO's inner torch optimizer holds), beside this rank's adapter and base sizes."""
    inner = engine.ds.optimizer.optimizer
    held = sum(s["exp_avg"].numel() for s in inner.state.values() if "exp_avg" in s)
    total = torch.tensor([float(held)])
    torch.distributed.all_reduce(total, group=dims.dp_group)
    params = dict(engine.module.named_parameters())
    sizes = {n: (p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for n, p in params.items()}
    return {"optimizer_numel": int(total.item()),
            "adapter_numel": sum(v for n, v in sizes.items() if params[n].requires_grad),
            "base_numel": sum(v for n, v in sizes.items() if not params[n].requires_grad)}


def lora_sft_steps(parallel: dict, steps: int = 2) -> dict:
    """``steps`` LM (SFT) optimizer steps of the engine with adapters against one process with
    the same adapters on the combined batch (scenarios.Reference, base frozen): gradient norms,
    then the adapters; only the adapters are in the optimizer."""
    from tests.distributed.scenarios import Reference, _close, _engine, global_batch, local_batches, make_cfg

    cfg = make_cfg({"lora": {"rank": 4, "alpha": 8.0}}, parallel, optim={"lr": 1e-2, "grad_clip": 0.5})
    dims, engine = _engine(cfg)
    ref = Reference(cfg)
    apply_lora(ref.model, cfg.model.lora, cfg.train.seed)
    o = cfg.optim
    ref.opt = torch.optim.AdamW(param_groups(ref.model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                foreach=False)
    start = {k: v.clone() for k, v in adapter_state(ref.model).items()}
    out = {"norm": [], "ref_norm": []}
    for step in range(steps):
        m = engine.train_step(local_batches(cfg, step, dims))
        x, y = global_batch(cfg, step, dims.dp)
        ref.backward(x, y)
        out["ref_norm"].append(ref.step(m.lr))
        out["norm"].append(m.grad_norm)
    mine, theirs = _whole(engine.module, dims), adapter_state(ref.model)
    out["adapter_diff"] = max(float((mine[k] - theirs[k]).abs().max()) for k in theirs)
    out["adapter_moved"] = max(float((theirs[k] - start[k]).abs().max()) for k in theirs)
    out.update(_optimizer_numel(engine, dims))
    _close(dims, engine)
    return out
