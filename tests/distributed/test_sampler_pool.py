"""A pool of sampler replicas that may fail (grpo.sampler_replicas, parallel/roles.py): one of
two sampler replicas is killed (SIGKILL) when it is about to sample data step 3 of 6 (it holds
the claim), the learner marks it lost when its heartbeat stops (grpo.sampler_timeout_s), gives
its data step back, the other replica redoes it, and the run ends with the parameters and every
logged loss of the run without the failure (the colocated run of the same config, which the
roles equal bit for bit: tests/distributed/test_async_roles.py). A 3-process launch of its own:
the suite's launcher stops every rank once one fails, which is what this test must not do."""

import json
import os
import subprocess
import sys
import time

import torch

from rlt_mega.parallel.dims import free_port
from tests.distributed.launch import ROOT, key
from tests.distributed.test_async_roles import colocated, final_params, logged


def launch_with_losses(nprocs: int, scenario: tuple[str, dict], out_dir, timeout: float) -> list[dict]:
    """Runs the scenario on ``nprocs`` ranks and waits for every one of them (a rank that dies
    does not stop the others; the time limit does) -> per rank {"exitcode", "result", "log"}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "scenarios.json"
    spec.write_text(json.dumps([scenario]))
    port, procs = free_port(), []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RLT_LOG_LEVEL="WARNING", PYTHONWARNINGS="ignore")
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.distributed.worker", str(spec), str(out_dir)],
                                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    out = []
    for rank, (p, log) in enumerate(procs):
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
        path = out_dir / f"rank{rank}.json"
        res = json.loads(path.read_text()) if path.exists() else {}
        out.append({"exitcode": p.returncode, "result": res.get(key(*scenario)),
                    "log": (out_dir / f"rank{rank}.log").read_text()[-3000:]})
    return out


def test_a_killed_sampler_costs_time_never_the_run(tmp_path):
    grpo = {"max_staleness": 1, "sampler_timeout_s": 10.0}
    args = {"grpo": grpo, "train": {"steps": 6}, "out_dir": str(tmp_path / "roles"), "samplers": 2,
            "kill_replica": 1, "kill_at": 3}
    ranks = launch_with_losses(3, ("async_scenarios.pool_run", args), tmp_path / "ranks", timeout=600)
    assert ranks[2]["exitcode"] == -9, ranks[2]  # the replica died holding a data step >= 3
    for r in (0, 1):
        assert ranks[r]["exitcode"] == 0 and "error" not in ranks[r]["result"], ranks[r]
    assert ranks[0]["result"]["step"] == 6 and ranks[1]["result"]["role"] == "sampler"
    lines = logged(tmp_path / "roles")
    assert len(lines) == 6
    assert lines[0]["async/samplers_alive"] == 2.0 and lines[-1]["async/samplers_alive"] == 1.0
    assert all(x["async/sampler_replica"] == 0.0 for x in lines[3:])  # the survivor redid them
    colocated({"max_staleness": 1}, {"steps": 6}, tmp_path / "colocated")
    a, b = final_params(tmp_path / "roles"), final_params(tmp_path / "colocated")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert [x["train/loss"] for x in lines] == [x["train/loss"] for x in logged(tmp_path / "colocated")]
