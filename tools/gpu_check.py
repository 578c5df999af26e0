"""The parts of tools/gpu_check.sh, one per subprocess (``--part NAME --budget S``), and the
summary (``--summarise DIR``). Each part writes {"status": "ok" | "fail: ..." | "skipped: ...",
...} as JSON; a CUDA-only part reports "skipped: no CUDA" on a machine without one. ``--mode
smoke`` runs every part at tiny shapes on whatever device there is (the CPU test of this script).

Parts, most important first (PARTS): exactness (replay torch.equal to mu), grpo_onpolicy (one
GRPO step's on-policy max |ratio - 1| exactly 0), fused_cuda_graph (train.cuda_graphs captured,
deterministic kernels on and off: tools/gpu/cuda_graphs.py), world_of_one (NCCL, megatron-core,
DeepSpeed ZeRO-1 bf16, checkpoint and exact resume, GRPO: tools/gpu/world_of_one.py under
torchrun), sdpa (every backend at the model's own masked shapes), sync_audit (host syncs of the
row schedule and a dense step, against stated limits), gradients (bit-identical across
checkpointing modes and runs), qwen2 (an imported random Qwen2's logits), versions (and the
determinism flags a run sets), then bench / bench_loose (grpo_gsm8k-size figures, deterministic
kernels on / off; only when named). Each part's verdict is a pure function of what it measured
(the *_verdict functions); GPU_CHECK_INJECT=PART perturbs what PART compares by one ulp (or adds
a sync, a NaN figure, a 0.1% gradient for the tolerance checks) and the part must then fail
(tests/e2e/test_gpu_check.py).
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

START = time.time()  # this process's start (near enough): the budget counts from here
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# In order of importance: a run that is cut short loses the last ones. bench / bench_loose (figures)
# and calibrate (the planner's decoder tick against a measured one) run only when
# GPU_CHECK_PARTS names them.
PARTS = ["exactness", "grpo_onpolicy", "fused_cuda_graph", "world_of_one", "sdpa", "sync_audit", "gradients", "qwen2",
         "versions", "calibrate", "bench", "bench_loose"]
DEFAULT_PARTS = PARTS[:-3]
# The fused decoder's CUDA-graph capture check (train.cuda_graphs); it prints one JSON line.
FUSED_GRAPH_CHECK = ROOT / "tools" / "gpu" / "cuda_graphs.py"
FUSED_GRAPH_ARGS = ["--seq-len", "64", "--repeats", "3"]  # inside the part's budget on one H200
WORLD_OF_ONE = ROOT / "tools" / "gpu" / "world_of_one.py"
NO_CUDA = "skipped: no CUDA"
INJECT_ENV = "GPU_CHECK_INJECT"  # the self-test (tests/e2e/test_gpu_check.py): a part name -> that part must fail
DEADLINE_ENV = "GPU_CHECK_DEADLINE"  # time.time() after which a part runs no further cases (its budget's margin)


def _inject(part: str) -> bool:
    return os.environ.get(INJECT_ENV) == part


def _over_budget() -> bool:
    """Past this part's deadline: the remaining cases are listed as over budget, not run (the
    driver's time-out would otherwise kill the part and lose what it found)."""
    deadline = os.environ.get(DEADLINE_ENV)
    return deadline is not None and time.time() > float(deadline)


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
    return {"status": versions_verdict(out), **out}


# The model's SDPA calls (model/attention.py, schedule/prompt_pack.py, model/documents.py); the
# decoder's own attentions are the decoder step's kernels (model/kernels.py), not SDPA.
# name: (B, heads, kv heads, query length, key length, head_dim, mask kind, training shape)
SDPA_SHAPES = {
    "encoder_causal_gqa_hd64": (8, 14, 2, 512, 512, 64, "causal", True),  # pretraining / the learner's encoder
    "encoder_causal_mha_hd128": (1, 16, 16, 2048, 2048, 128, "causal", True),  # rlt_48x48
    "encoder_documents_gqa_hd64": (4, 14, 2, 512, 512, 64, "documents", True),  # packed SFT: a bool mask per row
    "prompt_pack_rows_gqa_hd64": (8, 14, 2, 24, 64 + 24, 64, "prompt_pack", True),  # GRPO's learner: rows over a shared prompt
    "encoder_chunk_after_prefix_hd64": (64, 14, 2, 16, 256 + 16, 64, "chunk", False),  # the rollout's encoder calls
}
SDPA_SMOKE_SHAPES = {"encoder_causal": (2, 4, 2, 16, 16, 8, "causal", True),
                     "encoder_documents": (2, 4, 2, 16, 16, 8, "documents", True),
                     "prompt_pack_rows": (3, 4, 2, 4, 10, 8, "prompt_pack", True),
                     "chunk_after_prefix": (2, 4, 2, 4, 12, 8, "chunk", False)}


def _sdpa_mask(kind: str, B: int, Tq: int, Tk: int, device, g):
    """The attn_mask the model passes for this kind of call (bool, True: attend), or None (is_causal)."""
    torch = _torch()
    if kind == "causal":
        return None
    q_pos = torch.arange(Tk - Tq, Tk, device=device)
    causal = torch.arange(Tk, device=device)[None, :] <= q_pos[:, None]  # (Tq, Tk)
    if kind == "chunk":
        return causal
    if kind == "documents":  # two or three documents per row, causal within each
        cuts = torch.randint(1, Tk, (B, 2), generator=g, device=g.device).to(device).sort(-1).values
        doc = (torch.arange(Tk, device=device)[None, None, :] >= cuts[:, :, None]).sum(1)  # (B, Tk)
        return (causal[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, T, T)
    # prompt_pack: each row sees the shared prompt (Tk - Tq keys) and its own tokens causally; some padded
    own = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=device) & causal
    lens = torch.randint(1, Tq + 1, (B,), generator=g, device=g.device).to(device)
    pad = torch.arange(Tq, device=device)[None, :] >= lens[:, None]  # padded queries see the prompt only
    own[:, 0] &= ~(pad[:, :, None] & (torch.arange(Tk, device=device)[None, None, :] >= Tk - Tq))
    return own


def part_sdpa(smoke: bool) -> dict:
    """Every SDPA backend at the model's own calls (SDPA_SHAPES: causal, packed documents,
    prompt-pack rows and a rollout chunk, with their masks), fp32 and bf16, with and without
    grad: supported, bit-stable (two runs torch.equal), the distance to math; which backend the
    default dispatch uses (the one it equals bit for bit). Fails when a backend is not
    bit-stable, or when no non-math backend is bit-stable and within SDPA_TOLERANCE of math for a
    training shape in bf16 with grad (the run would fall back to math, or drift)."""
    torch = _torch()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = _device()
    if device.type != "cuda" and not smoke:
        return {"status": NO_CUDA}
    shapes = SDPA_SMOKE_SHAPES if smoke else SDPA_SHAPES
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    results, uses, skipped = {}, {}, []
    g = torch.Generator(device=device).manual_seed(0)
    for shape_name, (B, H, Hkv, Tq, Tk, Dh, kind, training) in shapes.items():
        mask = _sdpa_mask(kind, B, Tq, Tk, device, g)
        for dtype in (torch.bfloat16, torch.float32):
            if _over_budget():
                skipped.append(f"{shape_name}/{str(dtype)[6:]}")
                continue
            q0 = torch.randn(B, H, Tq, Dh, generator=g, device=device).to(dtype)
            k0 = torch.randn(B, Hkv, Tk, Dh, generator=g, device=device).to(dtype)
            v0 = torch.randn(B, Hkv, Tk, Dh, generator=g, device=device).to(dtype)
            for grad in ((True, False) if training else (False,)):
                case = f"{shape_name}/{str(dtype)[6:]}/{'grad' if grad else 'nograd'}"
                firsts = {}

                def run(backend):
                    q, k, v = (x.clone().requires_grad_(grad) for x in (q0, k0, v0))
                    with torch.set_grad_enabled(grad), (sdpa_kernel([backend]) if backend is not None else _null()):
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                             enable_gqa=H != Hkv)
                        if grad:
                            out.float().square().sum().backward()
                    return [out.detach()] + ([q.grad, k.grad, v.grad] if grad else [])

                for name, backend in backends.items():
                    key = f"{case}/{name}"
                    try:
                        first = run(backend)
                        _sync(device)
                        t0 = time.perf_counter()
                        second = run(backend)
                        _sync(device)
                        ms = 1000 * (time.perf_counter() - t0)
                    except RuntimeError as exc:
                        results[key] = {"supported": False, "why": str(exc).splitlines()[0][:200]}
                        continue
                    firsts[name] = first
                    results[key] = {"supported": True, "bit_stable": all(torch.equal(a, b) for a, b in
                                                                         zip(first, second)), "ms": round(ms, 3)}
                for name, first in firsts.items():
                    if "math" in firsts:
                        diff = max(float((a.float() - m.float()).abs().max() / m.float().abs().max().clamp_min(1e-30))
                                   for a, m in zip(first, firsts["math"]))
                        results[f"{case}/{name}"]["rel_diff_vs_math"] = diff
                default = run(None)
                uses[case] = next((n for n, f in firsts.items() if all(torch.equal(a, b) for a, b in
                                                                        zip(default, f))), "none of them")
    status = sdpa_verdict(results, uses, [n for n, s in shapes.items() if s[-1]], require_non_math=device.type == "cuda")
    return {"status": status, "backends_checked": list(backends), "uses": uses, "results": results,
            "over_budget": skipped}


SDPA_TOLERANCE = 2e-2  # relative to math's largest magnitude, bf16 (outputs and input gradients)


def sdpa_verdict(results: dict, uses: dict, training: list[str], require_non_math: bool) -> str:
    """Pure: the SDPA part's status from its results. Fails on a backend that is supported and
    not bit-stable, and (on CUDA) on a training shape whose bf16 grad case has no non-math
    backend that is bit-stable and within SDPA_TOLERANCE of math, or whose default dispatch
    uses none of the stable ones."""
    unstable = [k for k, r in results.items() if r.get("supported") and not r["bit_stable"]]
    if unstable:
        return f"fail: not bit-stable under deterministic mode: {unstable}"
    if require_non_math:
        for name in training:
            case = f"{name}/bfloat16/grad"
            good = [k.rsplit("/", 1)[1] for k, r in results.items() if k.startswith(case + "/") and
                    not k.endswith("/math") and r.get("supported") and r["bit_stable"] and
                    r.get("rel_diff_vs_math", 1.0) <= SDPA_TOLERANCE]
            if not good:
                return f"fail: {case}: no non-math backend is bit-stable and within {SDPA_TOLERANCE} of math"
            if uses.get(case) not in good:
                return f"fail: {case}: the default dispatch uses {uses.get(case)}, not one of {good}"
    return "ok"


def _null():
    import contextlib

    return contextlib.nullcontext()


def _ragged_prompts(B: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (B,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def part_exactness(smoke: bool) -> dict:
    """Replay torch.equal to mu, twice, per case: the model's decoder step at B in {64, 8, 1}
    (ragged prompts), C in {16, 1}, top_p in {0.95, 1}, bf16 and fp32; the reference decoder
    (rlt_mega/reference.py) at B=8 (grpo_gsm8k widths, L=4). Most telling cases first: a part cut
    by its deadline lists the cases it did not run."""
    torch = _torch()
    from rlt_mega.model.rlt import build_model
    from rlt_mega.reference import ReferenceDecoder
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    device = _device()
    batch_sizes, Cs, new = ((3, 1), (2, 1), 6) if smoke else ((64, 8, 1), (16, 1), 24)
    cases, failed, skipped = {}, [], []
    models = {C: build_model(_model_cfg(smoke, n_layers=2 if smoke else 4, memory_block=C), device, seed=0) for C in Cs}
    # the step at every C and B, then the reference; top-p on in bf16 and off in fp32 (both
    # dtypes and both processings at every shape, in half the cases)
    for fused in (True, False):
        for C in Cs:
            model = models[C]
            for B in (batch_sizes if fused else batch_sizes[1:2]):
                prompts = _ragged_prompts(B, model.cfg.vocab_size, 3, 12 if smoke else 40, seed=B)
                for dtype, top_p in (("bf16", 0.95), ("fp32", 1.0)):
                    key = f"C={C}/B={B}/top_p={top_p}/{dtype}/{'step' if fused else 'reference'}"
                    if _over_budget():
                        skipped.append(key)
                        continue
                    sampler = Sampler(model, decoder=None if fused else ReferenceDecoder())
                    params = SamplingParams(Processing(temperature=1.0, top_p=top_p), max_new_tokens=new,
                                            stop_token_ids=(7,))
                    with torch.no_grad():
                        ro = sampler.generate([prompts], params, [list(range(B))], pad_id=0, dtype=dtype)[0]
                        mu = ro.mu.clone()
                        if _inject("exactness") and not cases:  # one ulp off in one recorded log-prob
                            flat = mu.view(-1)
                            i = int(ro.mask.reshape(-1).nonzero()[0])
                            flat[i] = torch.nextafter(flat[i], torch.tensor(-float("inf"), dtype=flat.dtype, device=device))
                        equal = [bool(torch.equal(sampler.replay([ro])[0], mu)) for _ in range(2)]
                    cases[key] = {"equal": equal, "tokens": ro.num_completion_tokens(),
                                  "steps": ro.schedule.num_steps}
                    if not all(equal):
                        failed.append(key)
    status = "ok" if not failed else f"fail: replay differs from mu in {failed}"
    return {"status": status, "cases": cases, "over_budget": skipped}


def onpolicy_verdict(devs: dict) -> str:
    """Pure: {dtype: the first minibatch's max |ratio - 1|} -> status (exactly 0, or fail)."""
    bad = {k: v for k, v in devs.items() if v != 0.0}
    return "ok" if not bad else f"fail: an on-policy ratio is not exactly 1: max |ratio - 1| = {bad}"


def part_grpo_onpolicy(smoke: bool) -> dict:
    """One GRPO step of the trainer on this device: the first minibatch's max |ratio - 1| must
    be exactly 0 (the second is off-policy)."""
    torch = _torch()
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
    devs = {k: v["onpolicy_max_dev"] for k, v in out.items()}
    if _inject("grpo_onpolicy"):  # one ulp: a ratio of nextafter(1, 2)
        devs["fp32"] = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))) - 1.0
    return {"status": onpolicy_verdict(devs), **out}


def part_gradients(smoke: bool) -> dict:
    """Dense-schedule gradients bit-identical across checkpointing modes (none, step, every_k,
    with and without the encoder) and across two runs, fp32 and bf16 autocast."""
    torch = _torch()
    import torch.nn.functional as F

    from rlt_mega.config import CheckpointingConfig
    from rlt_mega.model.rlt import build_model
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
        if _inject("gradients"):  # one ulp off in one element of the second run's gradients
            g0 = grads["none_again"][0].view(-1)
            g0[0] = torch.nextafter(g0[0], torch.tensor(float("inf"), dtype=g0.dtype, device=g0.device))
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
    from rlt_mega.model.rlt import RLT

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
    if _inject("qwen2"):  # a logit 1% of the logits' scale off
        diff += 1e-2 * max(scale, 1.0)
    ok = diff < 1e-3 * max(scale, 1.0)
    return {"status": "ok" if ok else f"fail: logits differ by {diff}", "max_abs_diff": diff, "logit_std": scale}


# Host synchronisations the sampler and the learner may make (stated limits; tools/gpu_check.sh
# fails above them). The steady state of the sampler's loop: none per decoder step between checks,
# SYNCS_PER_CHECK at a check (the finish flags' read). A rollout with events (shared prompts
# forked, rows leaving at checks, slots refilled): SYNCS_PER_STEP on average over its decoder
# steps, set-up and end included. One dense training step: DENSE_STEP_SYNCS.
SYNCS_PER_CHECK = 1
SYNCS_PER_STEP = 1.0
DENSE_STEP_SYNCS = 8


def sync_verdict(steady: dict, events: dict, dense: int) -> str:
    """Pure: steady = {"syncs_short", "syncs_long", "steps_extra", "checks_extra"} (two rollouts
    that differ only in length), events = {"syncs", "steps"}, dense = the dense step's syncs."""
    problems = []
    per_step = (steady["syncs_long"] - steady["syncs_short"] - SYNCS_PER_CHECK * steady["checks_extra"])
    if per_step > 0:
        problems.append(f"{per_step} syncs in {steady['steps_extra']} steady-state decoder steps beyond "
                        f"{SYNCS_PER_CHECK} per check (limit 0)")
    if events["syncs"] > SYNCS_PER_STEP * events["steps"]:
        problems.append(f"{events['syncs']} syncs in a rollout of {events['steps']} decoder steps with events "
                        f"(limit {SYNCS_PER_STEP} per step)")
    if dense > DENSE_STEP_SYNCS:
        problems.append(f"{dense} syncs in one dense training step (limit {DENSE_STEP_SYNCS})")
    return "ok" if not problems else "fail: " + "; ".join(problems)


def part_sync_audit(smoke: bool) -> dict:
    """torch.cuda.set_sync_debug_mode("warn") over (1) the row schedule's steady state: two
    rollouts of 8 rows that differ only in length (16 and 48 new tokens, a check every 8 steps),
    whose difference is the loop's per-step syncs; (2) the row schedule GRPO runs, with events:
    groups of 4 rows sharing a prompt (forked), per-row budgets (rows leave at checks), 4 slots
    for 8 rows (waiting rows take freed slots); (3) one dense training step. Limits: sync_verdict.
    Without CUDA the same runs happen with no counter (the code paths, not the counts)."""
    torch = _torch()
    from rlt_mega.config import OptimConfig
    from rlt_mega.model.rlt import build_model
    from rlt_mega.schedule.rows import RowSwitches
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.engine import EngineConfig, LocalEngine
    from rlt_mega.rollout import Processing, Sampler, SamplingParams

    device = _device()
    cuda = device.type == "cuda"
    if not cuda and not smoke:
        return {"status": NO_CUDA}
    cfg = _model_cfg(smoke, n_layers=2 if smoke else 4)
    model = build_model(cfg, device, seed=0)
    every = 8

    def audit(fn) -> list[str]:
        if not cuda:
            fn()
            return []
        _sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchron" in str(w.message).lower()]

    def rollout(sampler, prompts, params):
        box = []
        gen = audit(lambda: box.append(sampler.generate([prompts], params, [list(range(len(prompts)))], pad_id=0,
                                                        dtype="bf16")[0]))
        if _inject("sync_audit") and cuda:  # a host read per decoder step
            gen = gen + ["injected"] * box[0].schedule.num_steps
        return gen, box[0]

    out = {}
    with torch.no_grad():
        prompts = _ragged_prompts(8, cfg.vocab_size, 10, 20, seed=0)
        plain = Sampler(model, check_every=every)
        short_new, long_new = 16, 48
        rollout(plain, prompts, SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=long_new))  # warm-up
        s_short, ro_s = rollout(plain, prompts, SamplingParams(Processing(temperature=1.0, top_p=0.95),
                                                               max_new_tokens=short_new))
        s_long, ro_l = rollout(plain, prompts, SamplingParams(Processing(temperature=1.0, top_p=0.95),
                                                              max_new_tokens=long_new))
        steps_s, steps_l = ro_s.schedule.num_steps, ro_l.schedule.num_steps
        steady = {"syncs_short": len(s_short), "syncs_long": len(s_long), "steps_extra": steps_l - steps_s,
                  "checks_extra": steps_l // every - steps_s // every, "long_sites": sorted(set(s_long) - set(s_short))}
        shared = [p for p in _ragged_prompts(2, cfg.vocab_size, 10, 20, seed=1) for _ in range(4)]
        rows = Sampler(model, check_every=every, rows=RowSwitches(slots=4))
        budgets = tuple(8 + 5 * i for i in range(8))
        params = SamplingParams(Processing(temperature=1.0, top_p=0.95), max_new_tokens=48, row_budgets=budgets)
        rollout(rows, shared, params)  # warm-up
        ev, ro_e = rollout(rows, shared, params)
        events = {"syncs": len(ev), "steps": ro_e.schedule.num_steps, "sites": sorted(set(ev))}
    engine = LocalEngine(model, ParallelDims.single(cfg, device), OptimConfig(lr=1e-5, min_lr=1e-6),
                         EngineConfig(total_steps=3, micro_batch_size=2, grad_accum=1, dtype="bf16"))
    batch = torch.randint(0, cfg.vocab_size, (2, 65), device=device)
    step = lambda: engine.train_step([{"inputs": batch[:, :-1], "targets": batch[:, 1:]}])  # noqa: E731
    step()  # warm-up (the optimizer's state)
    dense = audit(step)
    out.update(steady_state=steady, events=events, dense_step_syncs=len(dense), dense_sites=sorted(set(dense)),
               limits={"per_step_between_checks": 0, "per_check": SYNCS_PER_CHECK, "per_step_with_events": SYNCS_PER_STEP,
                       "dense_step": DENSE_STEP_SYNCS})
    status = sync_verdict(steady, events, len(dense))
    if not cuda:
        status = "skipped: no CUDA (the rollouts and the dense step ran; no sync counter on the CPU)"
    return {"status": status, **out}


def part_bench(smoke: bool) -> dict:
    """grpo_gsm8k size, bf16: rollout tokens/s at B=64, replay / rollout time, the dense and the
    hybrid learner's tokens/s and peak memory at B=8, T=512."""
    torch = _torch()
    from rlt_mega.learner.logprob import dense_logprobs, hybrid_logprobs
    from rlt_mega.model.rlt import build_model
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
    if _inject("bench"):
        out["replay_over_rollout"] = float("nan")
    return {"status": bench_verdict(out), **out}


def _json_tail(done) -> dict:
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": f"fail: exit {done.returncode}: {(done.stderr or '').strip().splitlines()[-1:]}",
                "stderr": (done.stderr or "")[-3000:]}


def part_fused_cuda_graph(smoke: bool) -> dict:
    """train.cuda_graphs: the fused decoder's training step captured as CUDA graphs against the
    eager fused step and the module path, with train.deterministic's kernels on and off
    (tools/gpu/cuda_graphs.py, which prints one JSON object). In smoke mode on the CPU it runs
    the comparison with the bodies uncaptured."""
    import subprocess

    args = ["--d-model", "32", "--layers", "2", "--batch", "2", "--seq-len", "12", "--repeats", "1"] if smoke \
        else FUSED_GRAPH_ARGS
    args += ["--smoke"] if smoke and not _torch().cuda.is_available() else []
    args += ["--inject"] if _inject("fused_cuda_graph") else []
    done = subprocess.run([sys.executable, str(FUSED_GRAPH_CHECK), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    return _json_tail(done)


def part_calibrate(smoke: bool) -> dict:
    """tools/gpu/calibrate.py: the captured decoder tick, forward and backward, measured beside the
    planner's prediction (B in {1, 4, 16, 64, 256}, n_kv_heads 16 and 2; its --smoke form on the
    CPU); the ratios are written next to the summary (calibration.json: ``rlt-mega plan
    --calibration``)."""
    import subprocess

    out = Path(os.environ.get("GPU_CHECK_TMP", ".")) / "calibration.json"
    args = ["--out", str(out)] + (["--smoke"] if smoke else [])
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "calibrate.py"), *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    result = _json_tail(done)
    if "decoder_efficiency" in result:
        result["status"] = "ok"
        result["rows"] = json.loads(out.read_text())["rows"]
    return result


def part_world_of_one(smoke: bool) -> dict:
    """A cluster run's start-up on a world of one (tools/gpu/world_of_one.py under torchrun, one
    process): NCCL with device_id, megatron-core, the pipeline channel groups warmed up, object
    collectives, DeepSpeed ZeRO-1 bf16 steps with a checkpoint and an exact resume, one GRPO step
    with on-policy ratio 1. Smoke mode on the CPU: the same with gloo."""
    import subprocess

    from rlt_mega.parallel.dims import free_port

    torch = _torch()
    if not torch.cuda.is_available() and not smoke:
        return {"status": NO_CUDA}
    out = Path(os.environ.get("GPU_CHECK_TMP", "/tmp")) / f"world_of_one_{os.getpid()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORLD_OF_ONE), "--out", str(out)]
    cmd += ["--smoke"] if smoke else []
    cmd += ["--inject"] if _inject("world_of_one") else []
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    if not out.exists():
        return {"status": f"fail: exit {done.returncode}, no result", "stderr": done.stderr[-3000:]}
    return json.loads(out.read_text())


def versions_verdict(flags: dict) -> str:
    """Pure: the settings a real run (train.deterministic=true) has before its first CUDA work."""
    wrong = []
    if not flags["deterministic"] or flags["warn_only"]:
        wrong.append("torch's deterministic algorithms are not on (warn_only=False)")
    if flags["env"].get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        wrong.append(f"CUBLAS_WORKSPACE_CONFIG={flags['env'].get('CUBLAS_WORKSPACE_CONFIG')!r}")
    if flags["env"].get("NCCL_NVLS_ENABLE") != "0":
        wrong.append(f"NCCL_NVLS_ENABLE={flags['env'].get('NCCL_NVLS_ENABLE')!r}, not '0'")
    return "ok" if not wrong else "fail: " + "; ".join(wrong)


def bench_verdict(figures: dict) -> str:
    """Pure: every figure finite and positive (a figure that is not is a broken measurement)."""
    bad = [k for k, v in figures.items() if isinstance(v, float) and not (v > 0 and v < float("inf"))]
    return "ok" if not bad else f"fail: figures not finite and positive: {bad}"


def run_part(name: str, smoke: bool, budget: float = 0.0) -> dict:
    """One part, in this process. ``budget`` (seconds, the driver's time-out): its cases stop
    at 80% of it less 3 s (start-up included), the rest listed as over budget."""
    from rlt_mega import determinism

    if budget:
        os.environ[DEADLINE_ENV] = str(START + 0.8 * budget - 3)
    determinism.configure(name != "bench_loose")  # first: before any CUDA work (CUBLAS_WORKSPACE_CONFIG)
    if name != "bench_loose":
        determinism.set_nccl_environment()
    if _inject("versions"):
        _torch().use_deterministic_algorithms(True, warn_only=True)
    fn = globals()["part_" + ("bench" if name == "bench_loose" else name)]
    t0 = time.perf_counter()
    try:
        out = fn(smoke)
    except Exception as exc:  # reported in the summary; the other parts run on
        out = {"status": f"fail: {type(exc).__name__}: {str(exc)[:300]}", "traceback": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["wall_seconds"] = round(time.time() - START, 1)  # start-up (imports) included
    return out


def line(name: str, part: dict, budget) -> str:
    """The one line the driver prints per part: passed / failed (reason) / skipped (why)."""
    status = str(part.get("status", "fail: no status"))
    took = f"{part.get('wall_seconds', part.get('seconds', '?'))} s of {budget} s"
    over = part.get("over_budget") or []
    note = f"; {len(over)} cases not run (over budget): {over[:4]}" if over else ""
    if status == "ok":
        return f"{name}: passed ({took}{note})"
    if status.startswith("skipped"):
        return f"{name}: skipped ({status.split(':', 1)[1].strip()}; {took})"
    return f"{name}: failed ({status.split(':', 1)[-1].strip()}; {took})"


def summarise(directory: Path, mode: str, budgets: dict, names: list[str]) -> dict:
    parts = {}
    for name in names:
        f = directory / f"{name}.json"
        if f.exists():
            parts[name] = json.loads(f.read_text())
        else:
            parts[name] = {"status": f"fail: no result (killed, or over its {budgets.get(name, '?')} s budget)"}
    failed = [n for n, p in parts.items() if str(p.get("status", "")).startswith("fail")]
    return {"mode": mode, "ok": not failed, "failed": failed, "budgets": budgets,
            "seconds": round(sum(float(p.get("wall_seconds", p.get("seconds", 0))) for p in parts.values()), 1),
            "lines": [line(n, p, budgets.get(n, "?")) for n, p in parts.items()], "parts": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=PARTS)
    ap.add_argument("--mode", choices=["gpu", "smoke"], default="gpu")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarise", type=Path, help="a directory of part results -> the summary")
    ap.add_argument("--budgets", default="{}", help="JSON {part: seconds}, for the summary's messages")
    ap.add_argument("--parts", default=" ".join(DEFAULT_PARTS), help="the parts the summary expects")
    ap.add_argument("--budget", type=float, default=0.0, help="the part's time-out in seconds (its deadline)")
    args = ap.parse_args()
    if args.summarise:
        summary = summarise(args.summarise, args.mode, json.loads(args.budgets), args.parts.split())
        args.out.write_text(json.dumps(summary, indent=1))
        print("\n".join(summary["lines"]))
        print(f"gpu_check ({args.mode}): {'passed' if summary['ok'] else 'FAILED: ' + ' '.join(summary['failed'])}; "
              f"{summary['seconds']} s in parts; JSON: {args.out}")
        return
    result = run_part(args.part, args.mode == "smoke", args.budget)
    args.out.write_text(json.dumps(result, default=str))
    print(line(args.part, result, args.budget or "?"), flush=True)


if __name__ == "__main__":
    main()
