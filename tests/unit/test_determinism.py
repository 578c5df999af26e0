"""train.deterministic and device handling: deterministic kernels change no CPU result (a
training step with checkpointing, a top-k/top-p rollout, its replay and the learner's
log-probs, bit for bit); the environment CUDA and NCCL read is set; train.device=cuda:N without
CUDA, several ranks without LOCAL_RANK, a backend that does not fit the device, and bf16 fp32
accumulation without ZeRO are clear errors before any process group exists."""

import os

import pytest
import torch
import torch.distributed as dist

from rlt_mega import determinism
from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from rlt_mega.learner.logprob import dense_logprobs
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import ParallelDims, init_distributed, local_rank, rank_device, resolve_layout
from rlt_mega.parallel.engine import EngineConfig, LocalEngine
from rlt_mega.parallel.grads import split_fp32
from rlt_mega.rollout import Processing, SamplingParams, generate, replay

CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=2, max_seq_len=32,
                  init_std=0.1)


@pytest.fixture
def mode():
    """Restores the suite's deterministic mode (tests/conftest.py) after the test."""
    yield
    torch.use_deterministic_algorithms(True)


def _everything() -> dict:
    """A checkpointed training step, a sampled rollout, its replay, the dense log-probs' gradient."""
    model = build_model(CFG, seed=1)
    checkpointing = CheckpointingConfig(decoder="every_k", decoder_k=2, encoder=True)  # the engine sets it
    engine = LocalEngine(model, ParallelDims.single(CFG, "cpu"), OptimConfig(lr=1e-2, warmup_steps=0),
                         EngineConfig(total_steps=2, micro_batch_size=3, grad_accum=1, checkpointing=checkpointing))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 48, (3, 9), generator=g)
    stats = engine.train_step([{"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}])
    params = SamplingParams(Processing(temperature=0.8, top_k=20, top_p=0.9), max_new_tokens=7, stop_token_ids=(5,))
    rollout = generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], params, seeds=[3, 4], pad_id=0)
    logp = dense_logprobs(model, rollout)
    (grad,) = torch.autograd.grad(logp[rollout.mask].sum(), [model.blocks[0].attn.q.weight])
    return {"loss": torch.tensor(stats.loss), "norm": torch.tensor(stats.grad_norm), "tokens": rollout.tokens,
            "mu": rollout.mu, "replay": replay(model, rollout), "grad": grad,
            **{n: p.detach().clone() for n, p in model.named_parameters()}}


def test_deterministic_mode_changes_no_cpu_result(mode):
    determinism.configure(False)
    assert not torch.are_deterministic_algorithms_enabled()
    loose = _everything()
    determinism.configure(True)  # warn_only=False: an op without a deterministic kernel would raise
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    strict = _everything()
    assert loose.keys() == strict.keys()
    for name in loose:
        assert torch.equal(loose[name], strict[name]), name
    assert torch.equal(strict["replay"], strict["mu"])


def test_configure_sets_what_cublas_and_nccl_read(mode, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    determinism.configure(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert torch.backends.cudnn.deterministic
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG=':0:0'"):
        determinism.configure(True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cuda"])
def test_a_cuda_device_without_cuda_is_a_clear_error(device, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=f"train.device={device} but CUDA is not available"):
        init_distributed(device=device)
    assert not dist.is_initialized()  # refused before any process group
    with pytest.raises(ConfigError, match=f"train.device={device} but CUDA is not available"):
        ParallelDims.single(CFG, device)  # one process: the same rule


def test_several_ranks_without_local_rank_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK is not set but WORLD_SIZE=2"):
        init_distributed(device="cpu")
    assert not dist.is_initialized()
    assert local_rank(1) == 0  # one process needs none
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match="LOCAL_RANK='x' is not an integer"):
        local_rank(2)


def test_each_rank_takes_its_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("auto", 0) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="train.device=cuda:1 puts every rank of this node on GPU 1"):
        rank_device("cuda:1", 0)
    with pytest.raises(ConfigError, match="2 GPU\\(s\\) are visible"):
        rank_device("cuda", 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rank_device("cuda:1", 0) == torch.device("cuda", 1)  # one rank on this node: pinned
    assert rank_device("cpu", 1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="distributed runs use cpu"):
        rank_device("mps", 0)


def test_a_backend_that_does_not_fit_the_device_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA devices"):
        init_distributed("nccl", device="cpu")
    assert not dist.is_initialized()


def test_fp32_accumulation_of_bf16_needs_zero():
    model = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4)
    train = TrainConfig(dtype="bf16", micro_batch_size=2)
    with pytest.raises(ConfigError, match="parallel.grad_accum_dtype=fp32 with train.dtype=bf16 needs ZeRO"):
        resolve_layout(ParallelConfig(zero_stage=0, grad_accum_dtype="fp32"), model, 2, train)
    resolve_layout(ParallelConfig(zero_stage=1, grad_accum_dtype="fp32"), model, 2, train)
    resolve_layout(ParallelConfig(zero_stage=0), model, 2, train)  # null: bf16 there, as DeepSpeed can


def test_three_bf16_parts_hold_an_fp32_gradient_exactly():
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 100_000)
    parts = split_fp32(g, torch.bfloat16, 3)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = torch.zeros_like(g)
    for p in parts:  # as DeepSpeed's fp32 accumulator adds them
        total += p.float()
    assert torch.equal(total, g)
    assert not torch.equal(split_fp32(g, torch.bfloat16, 1)[0].float(), g)
