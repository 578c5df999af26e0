"""The start-up of a cluster run on a world of one: run by tools/gpu_check.sh's ``world_of_one``
part under ``torchrun --standalone --nproc_per_node 1``. On CUDA it runs what a first cluster run
does before and during its first steps, on NCCL:

- ``init_process_group`` with NCCL and ``device_id`` (parallel/dims.py), megatron-core's
  ``initialize_model_parallel``, the per-channel pipeline groups created and warmed up by a
  barrier each (the channels of a 4-stage pipeline, every member this rank: a world of one has
  no second stage), object collectives (``all_gather_object``, ``broadcast_object_list``);
- the distributed engine (DeepSpeed ZeRO-1, bf16): pretraining for 3 steps straight, and for 2
  steps, a checkpoint, then a resume for the third: the two step-3 weights torch.equal;
- one GRPO step on the same layout, its first minibatch's on-policy ratio exactly 1.

``--smoke``: the same on the CPU with gloo (tiny shapes, the same code). Writes one JSON object
to ``--out``: {"status": "ok" | "fail: ...", "phases": {name: {...}}}.

    torchrun --standalone --nproc_per_node 1 tools/gpu/world_of_one.py --out result.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# A small model: the start-up is what is checked here, not the speed.
MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128", "model.n_layers=2",
         "model.memory_block=2"]
PRETRAIN = ["data.seq_len=32", "data.generated.num_train=200", "data.generated.num_eval=8", "train.micro_batch_size=4",
            "train.eval_every=0", "train.log_every=1", "logging.progress=false", "optim.warmup_steps=1",
            "optim.lr=1e-3", "train.steps=3"]


def _config(device: str, tmp: Path, name: str, *extra: str):
    from rlt_mega.config import load_config

    return load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), [
        *MODEL, *PRETRAIN, f"train.device={device}", "train.dtype=bf16", "parallel.zero_stage=1",
        f"checkpoint.dir={tmp / name / 'ckpt'}", f"logging.dir={tmp / name / 'tb'}", *extra])


def _pretrain(cfg, dims) -> dict:
    """supervised.run's body on an existing layout (the process groups stay up between runs)."""
    from rlt_mega.data.datasets import DataStats
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.train.builders import build_engine
    from rlt_mega.train.loop import Trainer
    from rlt_mega.train.pretrain import packed_data
    from rlt_mega.train.supervised import SupervisedJob, phase_timers

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    batches, eval_batches = packed_data(cfg, dims, tokenizer, DataStats())
    engine = build_engine(cfg, dims)
    timers = phase_timers()
    try:
        return Trainer(cfg, dims, engine, SupervisedJob(cfg.train, dims, engine, batches, eval_batches, timers),
                       timers).run()
    finally:
        engine.close()


def _grpo(device: str, tmp: Path, dims) -> dict:
    from rlt_mega.config import from_dict
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.train.grpo import build_trainer, grpo_config

    cfg = grpo_config(from_dict({
        "model": {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "memory_block": 2, "max_seq_len": 128},
        "data": {"tokenizer": "byte", "seq_len": 64},
        "optim": {"lr": 1e-5, "min_lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
        "train": {"seed": 3, "steps": 1, "dtype": "bf16", "device": device},
        "parallel": {"zero_stage": 1},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "grpo": {"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "eval_size": 0, "verify_onpolicy": True},
        "logging": {"progress": False, "dir": str(tmp / "grpo" / "tb")},
        "checkpoint": {"dir": str(tmp / "grpo" / "ckpt")}}))
    records = [{"question": f"what is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(16)]
    trainer = build_trainer(cfg, dims, load_tokenizer("byte"), lambda text, answer: float(len(text) % 3), records, [])
    try:
        scalars = trainer.job.step(0)
    finally:
        trainer.engine.close()
    return {"onpolicy_max_dev": scalars["ratio/onpolicy_max_dev"], "ratio_max": scalars["ratio/max"],
            "engine": type(trainer.engine).__name__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="the CPU (gloo) at tiny shapes")
    ap.add_argument("--inject", action="store_true", help="self-test: one resumed weight one ulp off; must fail")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rlt_mega.determinism import configure
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.engine import EngineConfig
    from rlt_mega.parallel.p2p import pipeline_channels

    if not torch.cuda.is_available() and not args.smoke:
        args.out.write_text(json.dumps({"status": "skipped: no CUDA"}))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    configure(True)  # train.deterministic's default, before any CUDA or NCCL work (as launch() does)
    phases: dict = {}
    failures: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="world_of_one_"))

    def phase(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        phases[name] = {**out, "seconds": round(time.perf_counter() - t0, 2)}
        return out

    full_cfg = _config(device, tmp, "full")
    dims = phase("init", lambda: {"dims": ParallelDims.build(full_cfg.parallel, full_cfg.model, device,
                                                             EngineConfig.from_train(full_cfg.train), True)})
    dims = phases["init"].pop("dims")
    from megatron.core import parallel_state as ps

    phases["init"].update(backend=dims.backend, device=str(dims.device), megatron_initialized=ps.model_parallel_is_initialized(),
                          layout=[dims.tp, dims.pp, dims.dp])
    if dims.backend != ("nccl" if device == "cuda" else "gloo"):
        failures.append(f"backend {dims.backend} on {device}")

    def channels() -> dict:
        # The warm-up the layout does for its channels (dims._channel_groups), on groups of this rank.
        groups = [dist.new_group([dims.rank]) for _ in pipeline_channels(4)]
        for group in groups:
            dist.barrier(group=group, **({"device_ids": [dims.device.index]} if device == "cuda" else {}))
        gathered = [None] * dims.world_size
        dist.all_gather_object(gathered, {"rank": dims.rank, "channels": len(groups)})
        sent = [{"hello": dims.rank}]
        dist.broadcast_object_list(sent, src=0)
        for group in groups:
            dist.destroy_process_group(group)
        return {"channel_groups": len(groups), "all_gather_object": gathered, "broadcast_object_list": sent}

    phase("channels_and_objects", channels)
    phase("pretrain_3_steps", lambda: {"loss": _pretrain(full_cfg, dims).get("train/loss")})
    split_cfg = _config(device, tmp, "split", "train.stop_after=2", "checkpoint.every=2")
    phase("pretrain_2_steps_save", lambda: {"loss": _pretrain(split_cfg, dims).get("train/loss")})
    resume_cfg = _config(device, tmp, "split", "train.resume=auto")
    phase("resume_1_step", lambda: {"loss": _pretrain(resume_cfg, dims).get("train/loss")})
    full = load_file(str(tmp / "full" / "ckpt" / "step_00000003" / "model.safetensors"))
    resumed = load_file(str(tmp / "split" / "ckpt" / "step_00000003" / "model.safetensors"))
    if args.inject:
        k0 = next(iter(resumed))
        flat = resumed[k0].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    differ = [k for k in full if not torch.equal(full[k], resumed.get(k, torch.empty(0)))]
    phases["resume_1_step"]["weights_equal_to_uninterrupted"] = not differ
    if differ or full.keys() != resumed.keys():
        failures.append(f"the resumed run's step-3 weights differ from the uninterrupted run's in {differ[:3]}")
    grpo = phase("grpo_step", lambda: _grpo(device, tmp, dims))
    if grpo["onpolicy_max_dev"] != 0.0:
        failures.append(f"GRPO's on-policy max |ratio - 1| = {grpo['onpolicy_max_dev']!r}, not 0")
    dims.destroy()
    dist.destroy_process_group()
    status = "ok" if not failures else "fail: " + "; ".join(failures)
    args.out.write_text(json.dumps({"status": status, "phases": phases}, default=str))
    print(f"world_of_one: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
