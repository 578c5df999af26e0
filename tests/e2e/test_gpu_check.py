"""tools/gpu_check.sh in its CPU smoke mode, and that every part can fail.

The driver runs every default part in its own subprocess under the smoke budgets (the CUDA-only
checks reporting "skipped: no CUDA"), prints one line per part and writes the JSON summary where
--out says. That run injects a one-ulp difference into world_of_one's resumed weights: the part
must fail with that reason (the rest of its phases having run), the others pass, the script exit 1.
Every other part is made to fail the same way (GPU_CHECK_INJECT, or its pure verdict fed what a
GPU would measure where the CPU cannot: a sync per step, an unstable backend). And
tools/gpu_check_multi.sh's roles check, on two CPU ranks; its pool form's items and arguments
(it needs 4 GPUs: its gloo twin is tests/distributed/test_async_roles.py's dp=2 launch)."""

import importlib.util
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
from helpers import launcher_run  # noqa: E402
from rlt_mega.parallel.dims import free_port  # noqa: E402

_spec = importlib.util.spec_from_file_location("gpu_cuda_graphs", ROOT / "tools" / "gpu" / "cuda_graphs.py")
cuda_graphs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_graphs)


def test_the_smoke_run_passes_every_part_and_reports_an_injected_failure(tmp_path):
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", GPU_CHECK_INJECT="world_of_one")
    env.pop("GPU_CHECK_PARTS", None)
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["mode"] == "smoke" and list(summary["parts"]) == gpu_check.DEFAULT_PARTS
    assert summary["failed"] == ["world_of_one"]
    lines = done.stdout.splitlines()
    assert [l.split(":")[0] for l in lines[:len(gpu_check.DEFAULT_PARTS)]] == gpu_check.DEFAULT_PARTS
    w1 = summary["parts"]["world_of_one"]
    assert "resumed run's step-3 weights differ" in w1["status"] and "GRPO" not in w1["status"]
    assert w1["phases"]["init"]["megatron_initialized"] and w1["phases"]["channels_and_objects"]["channel_groups"] == 13
    assert w1["phases"]["grpo_step"]["onpolicy_max_dev"] == 0.0
    assert "world_of_one: failed (" in done.stdout
    for name, part in summary["parts"].items():
        if name == "world_of_one":
            continue
        status = part["status"]
        if name == "sync_audit" and not torch.cuda.is_available():
            assert status.startswith("skipped: no CUDA"), part
        else:
            assert status == "ok", (name, part)
        assert part["wall_seconds"] < summary["budgets"][name], (name, part["wall_seconds"])
    assert summary["parts"]["fused_cuda_graph"]["check"] == "cuda_graphs"  # tools/gpu/cuda_graphs.py answered
    assert all(all(c["equal"]) for c in summary["parts"]["exactness"]["cases"].values())
    missing = gpu_check.summarise(tmp_path, "smoke", {"qwen2": 30}, ["qwen2"])
    assert not missing["ok"] and "over its 30 s budget" in missing["parts"]["qwen2"]["status"]


@pytest.mark.parametrize("name", ["exactness", "grpo_onpolicy", "gradients", "qwen2", "versions", "fused_cuda_graph"])
def test_an_injected_difference_fails_the_part(name, monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_CHECK_TMP", str(tmp_path))
    monkeypatch.setenv(gpu_check.INJECT_ENV, name)
    try:
        result = gpu_check.run_part(name, smoke=True)
    finally:
        torch.use_deterministic_algorithms(True)  # the suite's mode (the versions injection turns warn_only on)
    assert result["status"].startswith("fail"), result


def test_the_cuda_only_verdicts_fail_on_what_a_gpu_could_measure():
    clean = {"syncs_short": 10, "syncs_long": 14, "steps_extra": 32, "checks_extra": 4}
    events, steps = {"syncs": 30, "steps": 60}, 60
    assert gpu_check.sync_verdict(clean, events, 3) == "ok"
    assert gpu_check.sync_verdict({**clean, "syncs_long": 15}, events, 3).startswith("fail: 1 syncs in 32")
    assert gpu_check.sync_verdict(clean, {"syncs": steps + 1, "steps": steps}, 3).startswith("fail")
    assert gpu_check.sync_verdict(clean, events, gpu_check.DENSE_STEP_SYNCS + 1).startswith("fail")
    stable = {"supported": True, "bit_stable": True, "rel_diff_vs_math": 1e-3}
    results = {"enc/bfloat16/grad/efficient": stable, "enc/bfloat16/grad/math": stable}
    uses = {"enc/bfloat16/grad": "efficient"}
    assert gpu_check.sdpa_verdict(results, uses, ["enc"], True) == "ok"
    unstable = {**results, "enc/bfloat16/grad/efficient": {**stable, "bit_stable": False}}
    assert gpu_check.sdpa_verdict(unstable, uses, ["enc"], True).startswith("fail: not bit-stable")
    math_only = {**results, "enc/bfloat16/grad/efficient": {"supported": False, "why": "mask"}}
    assert "no non-math backend" in gpu_check.sdpa_verdict(math_only, {"enc/bfloat16/grad": "math"}, ["enc"], True)
    assert "default dispatch uses math" in gpu_check.sdpa_verdict(results, {"enc/bfloat16/grad": "math"}, ["enc"], True)
    assert gpu_check.bench_verdict({"rollout_tokens_per_s": float("nan")}).startswith("fail")
    assert cuda_graphs.verdict({"graphs_vs_module": 0.0, "graphs_vs_fused": 2e-5, "checkpointed_vs_not": 0.0}) \
        .startswith("fail: graphs_vs_fused")
    assert cuda_graphs.verdict({"graphs_vs_module": float("nan"), "graphs_vs_fused": 0.0,
                                "checkpointed_vs_not": 0.0}).startswith("fail")


def test_the_multi_gpu_check_of_the_roles_passes_on_the_cpu(tmp_path):
    """tools/gpu/roles.py, tools/gpu_check_multi.sh's roles item, with --smoke (two gloo ranks):
    the sampler and learner roles against the colocated run, s=0 and s=1 with partial rollouts."""
    out = tmp_path / "roles.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tools" / "gpu" / "roles.py"), "--out", str(out), "--smoke"]
    launcher_run(cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"))
    summary = json.loads(out.read_text())
    assert summary["status"] == "ok", summary
    arms = summary["ranks"][0]
    assert all(arms[a]["parameters_equal"] and arms[a]["losses_equal"] for a in ("s=0", "s=1 partial"))
    assert arms["s=1 partial"]["staleness_max"] == [0.0, 1.0, 2.0]
    assert arms["s=1 partial"]["onpolicy_max_dev"] == [0.0, 0.0, 0.0]


def test_the_multi_gpu_check_lists_the_roles_pool_on_four_gpus_and_checks_its_arguments():
    """tools/gpu_check_multi.sh --list: the roles' NCCL pool form (roles_pool, 4 processes) runs on
    a node of 4 GPUs or more, not on 2; a bad argument or a launch of the wrong size is refused in
    one line naming the fix."""
    script = str(ROOT / "tools" / "gpu_check_multi.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0

    def items(gpus: int) -> list[str]:
        done = subprocess.run(["bash", script, "--list", str(gpus)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert items(4) == ["tp=2:2", "pp=2:2", "dp=2:2", "tp=2,pp=2:4", "roles:2", "roles_pool:4"]
    assert "roles_pool:4" not in items(2) and "roles:2" in items(2)
    bad = subprocess.run(["bash", script, "--list"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--list needs a number of GPUs" in bad.stderr
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", PYTHONPATH=str(ROOT))
    wrong = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "roles.py"), "--pool", "--out", "x.json"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert wrong.returncode == 2 and "WORLD_SIZE=2: run under torchrun --nproc_per_node 4" in wrong.stderr, wrong.stderr
