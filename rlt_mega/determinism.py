"""Deterministic kernels (``train.deterministic``, on by default).

Exactness (replay torch.equal to the recorded mu), "gradients bit-identical across
checkpointing modes" and "resume continues bit for bit" all assume that running the same
computation twice gives the same bits. On a CPU that holds without help. On CUDA it does not:

- cuBLAS picks reduction strategies per call unless its workspace is pinned:
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (read when a cuBLAS handle is first used, so it is set
  here, before any CUDA work);
- several kernels accumulate with atomics (index_add, scatter_add, the backward of flash and
  memory-efficient attention): ``torch.use_deterministic_algorithms(True, warn_only=False)``
  switches them to deterministic versions and makes every op without one raise, instead of
  silently differing. The training backward's attention then runs flash attention (bf16) or
  memory-efficient attention (fp32) with their deterministic backward; cuDNN's attention is
  switched off (torch gives no determinism guarantee for its backward), the math backend stays
  the fallback. tools/gpu_check.sh's SDPA probe checks every backend at the model's shapes;
- a floating-point ``cumsum`` on CUDA is a nondeterministic CUB scan for a single row (and
  raises in deterministic mode): the sampler's prefix sums run over fixed-point integers
  (rollout/processing.py), exact on every device;
- NCCL's NVLS all-reduce (NVSwitch systems) can return different bits for the same inputs
  (NVIDIA/nccl#1497): ``NCCL_NVLS_ENABLE=0`` before the first communicator, so the tensor-parallel
  all-reduces of a rollout and its replay agree (parallel/dims.py sets it before
  init_process_group).

What it costs (GPU_CHECK_PARTS="bench bench_loose" tools/gpu_check.sh measures it on a GPU): the
deterministic attention backward and index/scatter kernels are slower, the pinned cuBLAS
workspace can rule out a faster GEMM algorithm, and without NVLS an all-reduce on an NVSwitch
system uses the ring/tree algorithms. A run that does not need bit-exact reproducibility can set
``train.deterministic=false``; replay exactness then still holds wherever the kernels happen to
be deterministic, which CUDA does not promise.
"""

from __future__ import annotations

import os

import torch

from rlt_mega.log import get_logger

log = get_logger(__name__)

CUBLAS_WORKSPACE = ":4096:8"
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def configure(enabled: bool) -> None:
    """Sets this process's kernels to deterministic (or back to torch's defaults). Call before
    any CUDA work and before the process group exists (the environment variables are read when
    cuBLAS and NCCL start)."""
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled and torch.backends.cudnn.benchmark
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(not enabled)
    if not enabled:
        return
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if workspace not in _DETERMINISTIC_CUBLAS:
        raise RuntimeError(f"CUBLAS_WORKSPACE_CONFIG={workspace!r} is not one of the deterministic settings "
                           f"{list(_DETERMINISTIC_CUBLAS)}: unset it (train.deterministic sets {CUBLAS_WORKSPACE}) "
                           "or set train.deterministic=false")
    set_nccl_environment()


def set_nccl_environment() -> None:
    """NCCL_NVLS_ENABLE=0 unless the user chose otherwise (it is read when a communicator is
    created)."""
    if os.environ.setdefault("NCCL_NVLS_ENABLE", "0") != "0":
        log.warning("NCCL_NVLS_ENABLE=%s with train.deterministic: NVLS all-reduces can differ between calls "
                    "(NVIDIA/nccl#1497), so a tensor-parallel replay may not equal its rollout",
                    os.environ["NCCL_NVLS_ENABLE"])


def enabled() -> bool:
    return torch.are_deterministic_algorithms_enabled()
