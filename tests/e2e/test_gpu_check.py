"""tools/gpu_check.sh in its CPU smoke mode: the driver runs parts in their own subprocesses
and writes the JSON summary (two cheap parts, a missing one reported), and every part's code
runs end to end at tiny shapes on the CPU, the CUDA-only parts reporting "skipped: no CUDA"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def test_the_driver_runs_parts_in_subprocesses_and_summarises(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, GPU_CHECK_PARTS="gradients fused_cuda_graph", PYTHON=sys.executable, OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["mode"] == "smoke" and summary["ok"] and set(summary["parts"]) == {"gradients", "fused_cuda_graph"}
    assert summary["parts"]["gradients"]["status"] == "ok"
    assert summary["parts"]["fused_cuda_graph"]["status"].startswith("skipped")
    assert summary["parts"]["fused_cuda_graph"]["check"] == "cuda_graphs"  # tools/gpu/cuda_graphs.py answered
    missing = gpu_check.summarise(tmp_path, "smoke", {"qwen2": 30}, ["qwen2"])
    assert not missing["ok"] and "over its 30 s budget" in missing["parts"]["qwen2"]["status"]


@pytest.mark.parametrize("name", [p for p in gpu_check.PARTS if p not in ("gradients", "fused_cuda_graph")])
def test_every_part_runs_at_tiny_shapes(name, monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_CHECK_TMP", str(tmp_path))
    try:
        result = gpu_check.run_part(name, smoke=True)
    finally:
        torch.use_deterministic_algorithms(True)  # the suite's mode (bench_loose turns it off)
    status = result["status"]
    assert status == "ok" or status.startswith("skipped"), result
    if name in ("sync_audit",) and not torch.cuda.is_available():
        assert status == "skipped: no CUDA"
    if name == "versions":
        assert result["deterministic"] is True  # run_part set train.deterministic's kernels first
    if name == "exactness":
        assert all(all(c["equal"]) and len(c["equal"]) == 3 for c in result["cases"].values())
        assert len(result["cases"]) == 2 * 2 * 2 * 2 * 2  # C, B, top_p, dtype, decoder path
    if name == "grpo_onpolicy":
        assert result["fp32"]["onpolicy_max_dev"] == 0.0 and result["bf16"]["onpolicy_max_dev"] == 0.0
