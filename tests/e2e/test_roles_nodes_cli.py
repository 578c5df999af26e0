"""`rlt-mega grpo` with the roles across two "nodes" of this machine: two torchrun agents
joined by a c10d rendezvous (as launch/torchrun.sh runs on each node of a cluster), two
processes each: whichever node the rendezvous orders first holds the learner of dp=2 (ZeRO-1),
the other two sampler replicas; every rank takes its role from the config. Both agents end
cleanly and the learner logs every step, fed by both samplers. A launch whose world does not
fit the roles is refused on every rank with one line naming the numbers. Samplers launched on
their own (grpo.samplers_join) join the learner's job, and one killed costs time, never the
run."""

import os
import signal
import subprocess
import sys

from helpers import ROOT, launched, write_prompts
from rlt_mega.metrics import read_metrics
from rlt_mega.parallel.dims import free_port

STEPS = 3


def args(tmp_path) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 40)
    return ["grpo", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.ffn_hidden=64", "model.memory_block=2", "model.max_seq_len=48", f"data.train={prompts}",
            "data.seq_len=32", "train.log_every=1", "optim.warmup_steps=0", "logging.progress=false",
            "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.eval_size=2", "grpo.eval_every=0",
            "grpo.reward=tests.distributed.grpo_scenarios:odd", "sampling.max_new_tokens=6",
            f"train.steps={STEPS}", "parallel.dp=2", "parallel.zero_stage=1", "grpo.sampler_replicas=2",
            "grpo.max_staleness=1", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'tb'}"]


def finish(procs: list) -> list[tuple[str, str]]:
    """Each launch's (stdout, stderr); a launch still running after 10 minutes is killed with its
    whole process group."""
    try:
        return [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def test_a_learner_node_and_a_sampler_node_under_a_c10d_rendezvous(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLT_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "roles_nodes", "-m", "rlt_mega",
           *args(tmp_path)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    outs = finish(nodes)
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-4000:]
    logged = [r for r in read_metrics(tmp_path / "tb") if "train/loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(r["async/samplers_alive"] == 2.0 for r in logged)
    assert {r["async/sampler_replica"] for r in logged} <= {0.0, 1.0}


def test_a_launch_that_does_not_fit_the_roles_is_refused(tmp_path):
    proc = launched(3, args(tmp_path), check=False, timeout=300)
    assert proc.returncode != 0
    line = ("grpo.sampler_replicas=2 with parallel.tp=1, pp=1, dp=2 runs on 4 processes (the learner's tp x pp x "
            "dp = 2, then 2 sampler replicas of tp x pp = 1), but the launcher started 3")
    assert line in proc.stderr + proc.stdout, proc.stderr[-3000:]


def test_samplers_launched_on_their_own_join_and_one_killed_costs_time_never_the_run(tmp_path):
    """grpo.samplers_join: torchrun launches the learner alone (dp=2, ZeRO-1), two more launches
    one sampler replica each (RLT_ROLES_JOIN: the learner's store; the learner waits for both
    to join); the first sampler kills itself (SIGKILL) as it begins its first data step: its
    torchrun fails, the learner's job goes on with the other sampler and ends with the
    parameters and losses of the colocated dp=2 run."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    driver = str(Path(__file__).resolve().parents[1] / "crash_driver.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", RLT_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore")
    port = free_port()
    common = [*args(tmp_path / "pool"), "grpo.samplers_join=true", "grpo.sampler_timeout_s=30"]

    def run(nproc, extra_env, script_args, master_port):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(master_port), driver, *script_args]
        return subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra_env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    join = {"RLT_ROLES_JOIN": f"127.0.0.1:{port}"}
    jobs = [run(2, {}, common, port), run(1, {**join, "RLT_CRASH_GRPO_KILL": "0:1"}, common, free_port()),
            run(1, join, common, free_port())]
    outs = finish(jobs)
    assert jobs[0].returncode == 0, outs[0][1][-4000:]
    assert jobs[1].returncode != 0 and "exitcode: -9" in outs[1][1], outs[1][1][-3000:]
    assert jobs[2].returncode == 0, outs[2][1][-4000:]
    logged = [r for r in read_metrics(tmp_path / "pool" / "tb") if "train/loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) and logged[-1]["async/samplers_alive"] == 1.0
    colocated = [a for a in args(tmp_path / "colocated") if not a.startswith("grpo.sampler_replicas")]
    launched(2, colocated, timeout=600)
    final = f"step_{STEPS:08d}"
    a = load_file(tmp_path / "pool" / "ckpt" / final / "model.safetensors")
    b = load_file(tmp_path / "colocated" / "ckpt" / final / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = [r["train/loss"] for r in read_metrics(tmp_path / "colocated" / "tb") if "train/loss" in r]
    assert [r["train/loss"] for r in logged] == want
