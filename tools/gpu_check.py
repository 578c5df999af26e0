"""The parts of tools/gpu_check.sh, one per subprocess (``--part NAME``), and the summary
(``--summarise DIR``). Each part writes {"status": "ok" | "fail: ..." | "skipped: ...", ...} as
JSON; a CUDA-only part reports "skipped: no CUDA" on a machine without one. ``--mode smoke``
runs every part at tiny shapes on whatever device there is (the CPU test of this script).

Parts: versions (and flags), sdpa (every backend at the model's shapes: supported, bit-stable,
distance to math), exactness (replay torch.equal to mu, three times per case), grpo_onpolicy
(one GRPO step's on-policy max |ratio - 1|), gradients (bit-identical across checkpointing modes
and runs), qwen2 (an imported random Qwen2's logits), sync_audit (host synchronisations of 32
sampler steps and a dense step), bench / bench_loose (grpo_gsm8k-size figures, deterministic
kernels on / off), fused_cuda_graph (train.cuda_graphs: the fused decoder's captured step,
tools/gpu/cuda_graphs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ["versions", "sdpa", "exactness", "grpo_onpolicy", "gradients", "qwen2", "sync_audit", "bench",
         "bench_loose", "fused_cuda_graph"]
# The fused decoder's CUDA-graph capture check (train.cuda_graphs); it prints one JSON line.
FUSED_GRAPH_CHECK = ROOT / "tools" / "gpu" / "cuda_graphs.py"
FUSED_GRAPH_ARGS = ["--seq-len", "64", "--repeats", "3"]  # inside the part's budget on one H200
NO_CUDA = "skipped: no CUDA"


def _torch():
    import torch

    return torch


def _device():
    torch = _torch()
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        _torch().cuda.synchronize()


def _model_cfg(smoke: bool, **over):
    """grpo_gsm8k's widths (configs/grpo_gsm8k.yaml), or a tiny model in smoke mode."""
    from rlt_mega.config import ModelConfig, load_config

    if smoke:
        base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, memory_block=2,
                    max_seq_len=128, qkv_bias=True, tie_embeddings=True, init_std=0.1)
    else:
        base = dataclasses.asdict(load_config(str(ROOT / "configs" / "grpo_gsm8k.yaml"), []).model)
    return ModelConfig(**{**base, **over})


# ---------------------------------------------------------------------------------- parts
def part_versions(smoke: bool) -> dict:
    torch = _torch()
    import deepspeed
    import megatron.core
    import transformers

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
           "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
           "deterministic": torch.are_deterministic_algorithms_enabled(),
           "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
           "cudnn_deterministic": torch.backends.cudnn.deterministic,
           "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_NVLS_ENABLE", "NCCL_ALGO",
                                                  "TORCH_NCCL_BLOCKING_WAIT", "CUDA_VISIBLE_DEVICES")}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        sdpa = torch.backends.cuda
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
                   nccl=str(torch.cuda.nccl.version()),
                   sdpa={"flash": sdpa.flash_sdp_enabled(), "mem_efficient": sdpa.mem_efficient_sdp_enabled(),
                         "cudnn": sdpa.cudnn_sdp_enabled(), "math": sdpa.math_sdp_enabled()})
    return {"status": "ok", **out}


def part_sdpa(smoke: bool) -> dict:
    """Every SDPA backend at the model's attention shapes: the encoder's causal attention (GQA
    at grpo_gsm8k's head_dim 64, MHA at rlt_48x48's head_dim 128) and the decoder's one-query
    cross-attention, fp32 and bf16, with and without grad."""
    torch = _torch()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = _device()
    if device.type != "cuda" and not smoke:
        return {"status": NO_CUDA}
    shapes = {  # name: (B, heads, kv heads, query length, key length, head_dim, causal)
        "encoder_gqa_hd64": (8, 14, 2, 512, 512, 64, True), "encoder_mha_hd128": (1, 16, 16, 2048, 2048, 128, True),
        "cross_gqa_hd64": (64, 2, 2, 7, 512, 64, False), "cross_mha_hd128": (8, 16, 16, 1, 1024, 128, False)}
    if smoke:
        shapes = {"encoder_gqa": (2, 4, 2, 16, 16, 8, True), "cross": (2, 2, 2, 2, 16, 8, False)}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    results, bad = {}, []
    g = torch.Generator(device=device).manual_seed(0)
    for shape_name, (B, H, Hkv, Tq, Tk, Dh, causal) in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            q0 = torch.randn(B, H, Tq, Dh, generator=g, device=device).to(dtype)
            k0 = torch.randn(B, Hkv, Tk, Dh, generator=g, device=device).to(dtype)
            v0 = torch.randn(B, Hkv, Tk, Dh, generator=g, device=device).to(dtype)
            for grad in (False, True):
                firsts = {}
                for name, backend in backends.items():
                    key = f"{shape_name}/{str(dtype)[6:]}/{'grad' if grad else 'nograd'}/{name}"

                    def run():
                        q, k, v = (x.clone().requires_grad_(grad) for x in (q0, k0, v0))
                        with sdpa_kernel([backend]), torch.set_grad_enabled(grad):
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=H != Hkv)
                            if grad:
                                out.float().square().sum().backward()
                        return [out.detach()] + ([q.grad, k.grad, v.grad] if grad else [])

                    try:
                        first = run()
                        _sync(device)
                        t0 = time.perf_counter()
                        second = run()
                        _sync(device)
                        ms = 1000 * (time.perf_counter() - t0)
                    except RuntimeError as exc:
                        results[key] = {"supported": False, "why": str(exc).splitlines()[0][:200]}
                        continue
                    firsts[name] = first
                    stable = all(torch.equal(a, b) for a, b in zip(first, second))
                    results[key] = {"supported": True, "bit_stable": stable, "ms": round(ms, 3)}
                    if not stable:
                        bad.append(key)
                for name, first in firsts.items():  # the distance to the math backend's output
                    if "math" in firsts:
                        key = f"{shape_name}/{str(dtype)[6:]}/{'grad' if grad else 'nograd'}/{name}"
                        diff = (first[0].float() - firsts["math"][0].float()).abs().max()
                        results[key]["max_diff_vs_math"] = float(diff)
    status = "ok" if not bad else f"fail: not bit-stable under deterministic mode: {bad}"
    return {"status": status, "backends_checked": list(backends), "results": results}


def _ragged_prompts(B: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (B,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def part_exactness(smoke: bool) -> dict:
    """Replay torch.equal to mu, three times, per case: B in {1, 8, 64}, ragged prompts,
    C in {1, 16}, top_p in {1, 0.95}, fp32 and bf16, fused decode on and off (grpo_gsm8k widths,
    L=4)."""
    torch = _torch()
    from rlt_mega.model import build_model
    from rlt_mega.reference import ReferenceDecoder
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    device = _device()
    batch_sizes, Cs, new = ((1, 3), (1, 2), 6) if smoke else ((1, 8, 64), (1, 16), 24)
    cases, failed = {}, []
    for C in Cs:
        cfg = _model_cfg(smoke, n_layers=2 if smoke else 4, memory_block=C)
        model = build_model(cfg, device, seed=0)
        for B in batch_sizes:
            prompts = _ragged_prompts(B, cfg.vocab_size, 3, 12 if smoke else 40, seed=B)
            for top_p in (1.0, 0.95):
                for dtype in ("fp32", "bf16"):
                    for fused in (True, False):
                        key = f"C={C}/B={B}/top_p={top_p}/{dtype}/{'step' if fused else 'reference'}"
                        sampler = Sampler(model, decoder=None if fused else ReferenceDecoder())
                        params = SamplingParams(Processing(temperature=1.0, top_p=top_p), max_new_tokens=new,
                                                stop_token_ids=(7,))
                        with torch.no_grad():
                            ro = sampler.generate([prompts], params, [list(range(B))], pad_id=0, dtype=dtype)[0]
                            equal = [bool(torch.equal(sampler.replay([ro])[0], ro.mu)) for _ in range(3)]
                        cases[key] = {"equal": equal, "tokens": ro.num_completion_tokens(),
                                      "steps": ro.schedule.num_steps}
                        if not all(equal):
                            failed.append(key)
    return {"status": "ok" if not failed else f"fail: replay differs from mu in {failed}", "cases": cases}


def part_grpo_onpolicy(smoke: bool) -> dict:
    """One GRPO step of the trainer on this device: the first minibatch's max |ratio - 1| must
    be exactly 0 (the second is off-policy)."""
    from rlt_mega.config import from_dict
    from rlt_mega.data.tokenizer import load_tokenizer
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.train.grpo import build_trainer, grpo_config

    model = dataclasses.asdict(_model_cfg(smoke, n_layers=2 if smoke else 4))
    model["vocab_size"] = max(model["vocab_size"], 260)  # the byte tokenizer's ids
    out = {}
    for dtype in ("fp32", "bf16"):
        cfg = grpo_config(from_dict({
            "model": model, "data": {"tokenizer": "byte", "seq_len": 64},
            "optim": {"lr": 1e-5, "min_lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
            "train": {"seed": 3, "steps": 1, "dtype": dtype, "device": str(_device())},
            "sampling": {"temperature": 1.0, "max_new_tokens": 8 if smoke else 32},
            # verify_onpolicy: the skipped first-minibatch replay runs anyway and must be torch.equal to mu
            "grpo": {"prompts_per_step": 2, "group_size": 4, "minibatches": 2, "eval_size": 0, "verify_onpolicy": True},
            "logging": {"progress": False, "dir": os.environ.get("GPU_CHECK_TMP", "/tmp") + "/gpu_check_tb"},
            "checkpoint": {"dir": os.environ.get("GPU_CHECK_TMP", "/tmp") + "/gpu_check_ckpt"}}))
        records = [{"question": f"what is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(16)]
        trainer = build_trainer(cfg, ParallelDims.single(cfg.model, cfg.train.device), load_tokenizer("byte"),
                                lambda text, answer: float(len(text) % 3), records, [])
        scalars = trainer.job.step(0)
        out[dtype] = {"onpolicy_max_dev": scalars["ratio/onpolicy_max_dev"], "ratio_max": scalars["ratio/max"]}
    ok = all(v["onpolicy_max_dev"] == 0.0 for v in out.values())
    return {"status": "ok" if ok else "fail: an on-policy ratio is not exactly 1", **out}


def part_gradients(smoke: bool) -> dict:
    """Dense-schedule gradients bit-identical across checkpointing modes (none, step, every_k,
    with and without the encoder) and across two runs, fp32 and bf16 autocast."""
    torch = _torch()
    import torch.nn.functional as F

    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.model import build_model
    from rlt_mega.precision import precision

    device = _device()
    cfg = _model_cfg(smoke, n_layers=2 if smoke else 4)
    B, T = (2, 12) if smoke else (2, 128)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g).to(device)
    modes = {"none": CheckpointingConfig(), "step": CheckpointingConfig(decoder="step"),
             "every_k": CheckpointingConfig(decoder="every_k", decoder_k=4),
             "every_k+encoder": CheckpointingConfig(decoder="every_k", decoder_k=4, encoder=True)}
    out, failed = {}, []
    for dtype in ("fp32", "bf16"):
        model = build_model(cfg, device, seed=1)
        grads = {}
        for name, mode in list(modes.items()) + [("none_again", CheckpointingConfig())]:
            model.zero_grad(set_to_none=True)
            model.set_checkpointing(mode)
            with precision(dtype, device):
                logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            grads[name] = [p.grad.clone() for p in model.parameters()]
        for name, gs in grads.items():
            same = all(torch.equal(a, b) for a, b in zip(gs, grads["none"]))
            out[f"{dtype}/{name}"] = same
            if not same:
                failed.append(f"{dtype}/{name}")
    return {"status": "ok" if not failed else f"fail: gradients differ: {failed}", "equal_to_none": out}


def part_qwen2(smoke: bool) -> dict:
    """A random Qwen2 (HF transformers, no download) imported: the RLT's logits against HF's."""
    torch = _torch()
    import tempfile

    import transformers

    from rlt_mega.checkpoint_tools import import_hf, load_exported
    from rlt_mega.model import RLT

    device = _device()
    V, D, L, H, KV, F_ = (64, 32, 2, 4, 2, 48) if smoke else (4096, 896, 4, 14, 2, 4864)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=F_, num_hidden_layers=L,
                                   num_attention_heads=H, num_key_value_heads=KV, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   max_position_embeddings=256, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(f"{tmp}/hf")
        rlt_cfg, sd = load_exported(import_hf(f"{tmp}/hf", f"{tmp}/rlt", memory_block=16))
    model = RLT(rlt_cfg).eval()
    model.load_state_dict(sd)
    model, hf = model.to(device), hf.to(device)
    tokens = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        diff = float((model(tokens) - hf(tokens).logits.float()).abs().max())
        scale = float(hf(tokens).logits.float().std())
    ok = diff < 1e-3 * max(scale, 1.0)
    return {"status": "ok" if ok else f"fail: logits differ by {diff}", "max_abs_diff": diff, "logit_std": scale}


def part_sync_audit(smoke: bool) -> dict:
    """torch.cuda.set_sync_debug_mode("warn") over 32 sampler steps (a check every 8: expected
    one read per check plus the set-up and the end) and one dense training step."""
    torch = _torch()
    if not torch.cuda.is_available():
        return {"status": NO_CUDA}
    from rlt_mega.model import build_model
    from rlt_mega.config import OptimConfig
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.engine import EngineConfig, LocalEngine
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    device = _device()
    cfg = _model_cfg(smoke, n_layers=4)
    model = build_model(cfg, device, seed=0)
    prompts = _ragged_prompts(8, cfg.vocab_size, 10, 20, seed=0)
    sampler = Sampler(model, check_every=8)
    params = SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=32)

    def audit(fn) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchron" in str(w.message).lower()]

    with torch.no_grad():
        sampler.generate([prompts], params, [list(range(8))], pad_id=0)  # warm-up (allocations)
        gen = audit(lambda: sampler.generate([prompts], params, [list(range(8))], pad_id=0))
    engine = LocalEngine(model, ParallelDims.single(cfg, device), OptimConfig(lr=1e-5, min_lr=1e-6),
                         EngineConfig(total_steps=2, micro_batch_size=2, grad_accum=1))
    batch = torch.randint(0, cfg.vocab_size, (2, 65), device=device)
    dense = audit(lambda: engine.train_step([{"inputs": batch[:, :-1], "targets": batch[:, 1:]}]))
    steps = 20 + 32
    checks = steps // 8
    ok = len(gen) <= checks + 12  # set-up, the end and the checks; a per-step sync would add ~50
    return {"status": "ok" if ok else f"fail: {len(gen)} syncs in {steps} sampler steps", "sampler_syncs": len(gen),
            "sampler_sync_sites": sorted(set(gen)), "checks": checks, "dense_step_syncs": len(dense),
            "dense_sync_sites": sorted(set(dense))}


def part_bench(smoke: bool) -> dict:
    """grpo_gsm8k size, bf16: rollout tokens/s at B=64, replay / rollout time, the dense and the
    hybrid learner's tokens/s and peak memory at B=8, T=512."""
    torch = _torch()
    from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs
    from rlt_mega.model import build_model
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    device = _device()
    cfg = _model_cfg(smoke)
    model = build_model(cfg, device, seed=0)
    B, new, T, LB = (4, 8, 24, 2) if smoke else (64, 128, 512, 8)
    sampler = Sampler(model, check_every=8)
    params = SamplingParams(Processing(temperature=1.0, top_p=1.0), max_new_tokens=new)
    prompts = _ragged_prompts(B, cfg.vocab_size, 8 if smoke else 90, 12 if smoke else 110, seed=1)
    out = {"deterministic": torch.are_deterministic_algorithms_enabled()}
    with torch.no_grad():
        sampler.generate([prompts], params, [list(range(B))], pad_id=0, dtype="bf16")  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        ro = sampler.generate([prompts], params, [list(range(B))], pad_id=0, dtype="bf16")[0]
        _sync(device)
        t_roll = time.perf_counter() - t0
        t0 = time.perf_counter()
        sampler.replay([ro])
        _sync(device)
        t_rep = time.perf_counter() - t0
    out.update(rollout_tokens_per_s=round(ro.num_completion_tokens() / t_roll, 1),
               rollout_positions_per_s=round(B * ro.schedule.num_steps / t_roll, 1),
               replay_over_rollout=round(t_rep / t_roll, 3))
    # the learner: B=8 sequences of T positions
    learn_prompts = _ragged_prompts(LB, cfg.vocab_size, 8, 16, seed=2)
    lp = SamplingParams(Processing(temperature=1.0), max_new_tokens=T - 16)
    with torch.no_grad():
        learn = sampler.generate([learn_prompts], lp, [list(range(LB))], pad_id=0, dtype="bf16")[0]
        replayed = sampler.replay([learn])[0]
    for name in ("dense", "hybrid"):
        for _ in range(2):  # warm-up, then the measured one
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _sync(device)
            t0 = time.perf_counter()
            logp = dense_logprobs(model, learn)
            if name == "hybrid":
                logp = hybrid_logprobs(logp, replayed)
            logp[learn.mask].sum().backward()
            _sync(device)
            dt = time.perf_counter() - t0
        out[f"{name}_learner_tokens_per_s"] = round(LB * learn.schedule.num_steps / dt, 1)
        if device.type == "cuda":
            out[f"{name}_learner_peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["learner_shape"] = [LB, learn.schedule.num_steps]
    return {"status": "ok", **out}


def part_fused_cuda_graph(smoke: bool) -> dict:
    """train.cuda_graphs: the fused decoder's training step captured as CUDA graphs against the
    eager fused step and the module path (tools/gpu/cuda_graphs.py, which prints one JSON object;
    without CUDA it reports "skipped: no CUDA", so the smoke mode runs the wiring too)."""
    import subprocess

    args = ["--d-model", "64", "--layers", "2", "--seq-len", "16", "--repeats", "1"] if smoke else FUSED_GRAPH_ARGS
    done = subprocess.run([sys.executable, str(FUSED_GRAPH_CHECK), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": f"fail: exit {done.returncode}", "stderr": done.stderr[-2000:]}
    return {"status": result.get("status", "ok" if done.returncode == 0 else f"fail: exit {done.returncode}"),
            **result}


def run_part(name: str, smoke: bool) -> dict:
    from rlt_mega import determinism

    determinism.configure(name != "bench_loose")  # first: before any CUDA work (CUBLAS_WORKSPACE_CONFIG)
    fn = globals()["part_" + ("bench" if name == "bench_loose" else name)]
    t0 = time.perf_counter()
    try:
        out = fn(smoke)
    except Exception as exc:  # reported in the summary; the other parts run on
        out = {"status": f"fail: {type(exc).__name__}: {str(exc)[:300]}", "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def summarise(directory: Path, mode: str, budgets: dict, names: list[str]) -> dict:
    parts = {}
    for name in names:
        f = directory / f"{name}.json"
        if f.exists():
            parts[name] = json.loads(f.read_text())
        else:
            parts[name] = {"status": f"fail: no result (killed, or over its {budgets.get(name, '?')} s budget)"}
    failed = [n for n, p in parts.items() if str(p.get("status", "")).startswith("fail")]
    return {"mode": mode, "ok": not failed, "failed": failed,
            "seconds": round(sum(float(p.get("seconds", 0)) for p in parts.values()), 1), "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=PARTS)
    ap.add_argument("--mode", choices=["gpu", "smoke"], default="gpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarise", type=Path, help="a directory of part results -> the summary")
    ap.add_argument("--budgets", default="{}", help="JSON {part: seconds}, for the summary's messages")
    ap.add_argument("--parts", default=" ".join(PARTS), help="the parts the summary expects")
    args = ap.parse_args()
    if args.summarise:
        summary = summarise(args.summarise, args.mode, json.loads(args.budgets), args.parts.split())
        text = json.dumps(summary, indent=1)
        if args.out:
            args.out.write_text(text)
        print(text)
        return
    result = run_part(args.part, args.mode == "smoke")
    args.out.write_text(json.dumps(result))
    print(f"{args.part}: {result['status']} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
