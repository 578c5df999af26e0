"""A pool of sampler replicas that may fail (grpo.sampler_replicas, parallel/roles.py): one of
two sampler replicas is killed (SIGKILL) when it is about to sample data step 3 of 7 (it holds
the claim), the learner marks it lost (its weights' send fails, or its heartbeat stops for
grpo.sampler_timeout_s), gives its data step back, the other replica redoes it, and a
replacement started once it is dead (a launch of its own, RLT_ROLES_JOIN) rejoins the pool and
samples data steps; the run ends with the parameters and every logged loss of the run without
the failure (the colocated run of the same config, which the roles equal bit for bit:
tests/distributed/test_async_roles.py). A 3-process launch of its own and the replacement's:
the suite's launcher stops every rank once one fails, which is what this test must not do. And
a replica that hangs (SIGSTOP: no message fails) is lost by its heartbeat alone."""

import json
import os
import subprocess
import sys
import time

import torch

from rlt_mega.parallel.dims import free_port
from tests.distributed.launch import ROOT, key
from tests.distributed.test_async_roles import colocated, final_params, logged


def spawn(rank: int, nprocs: int, port: int, spec, out_dir, env: dict | None = None):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               RLT_LOG_LEVEL="WARNING", PYTHONWARNINGS="ignore", **(env or {}))
    log = open(out_dir / f"rank{rank}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "tests.distributed.worker", str(spec), str(out_dir)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT), log


def outcome(proc, log, out_dir, rank: int, scenario) -> dict:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()
    path = out_dir / f"rank{rank}.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    return {"exitcode": proc.returncode, "result": res.get(key(*scenario)),
            "log": (out_dir / f"rank{rank}.log").read_text()[-3000:]}


def launch_with_losses(nprocs: int, scenario: tuple[str, dict], out_dir, timeout: float, dies: int,
                       replace: bool = False) -> list[dict]:
    """Runs the scenario on ``nprocs`` ranks and waits for every one of them (a rank that dies
    does not stop the others; the time limit does, and rank ``dies`` is killed once the others
    are done) -> per rank {"exitcode", "result", "log"}; ``replace``: once rank ``dies`` has died,
    a replacement sampler replica starts, a launch of its own (one process, RLT_ROLES_JOIN: the
    learner's store), whose outcome comes last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "scenarios.json"
    spec.write_text(json.dumps([scenario]))
    port = free_port()
    procs = [spawn(rank, nprocs, port, spec, out_dir) for rank in range(nprocs)]
    joiner, joiner_dir = None, out_dir / "joiner"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (any(p.poll() is None for p, _ in procs)
                                           or (joiner is not None and joiner[0].poll() is None)):
        if replace and joiner is None and procs[dies][0].poll() is not None:
            joiner_dir.mkdir()
            joiner = spawn(0, 1, free_port(), spec, joiner_dir, {"RLT_ROLES_JOIN": f"127.0.0.1:{port}"})
        if all(p.poll() is not None for r, (p, _) in enumerate(procs) if r != dies) and (
                joiner is None or joiner[0].poll() is not None):
            break  # the others are done: a rank that hangs (SIGSTOP) is killed below
        time.sleep(0.2)
    out = [outcome(p, log, out_dir, rank, scenario) for rank, (p, log) in enumerate(procs)]
    return out + ([outcome(*joiner, joiner_dir, 0, scenario)] if joiner is not None else [])


def test_a_killed_sampler_costs_time_never_the_run_and_a_restarted_one_rejoins(tmp_path):
    """Replica 1 dies at data step 3 (of 7) holding it; the others redo it and the run equals the
    colocated one. A replacement (replica 2) starts once it is dead, joins the pool (admitted at
    a publication or while the learner waits, with every version from the oldest a data step
    still to be learned needs) and samples data steps the learner learns. (An earlier form of this
    test deadlocked under load: replica 0 waited for the joiner without a bound, the joiner for
    a version that needed the lost step. Now the joiner can redo any step the learner waits for,
    and replica 0's wait for it is bounded and ends as soon as a step behind it is given back.)"""
    grpo = {"max_staleness": 1, "sampler_timeout_s": 10.0}
    args = {"grpo": grpo, "train": {"steps": 7}, "out_dir": str(tmp_path / "roles"), "samplers": 2,
            "kill_replica": 1, "kill_at": 3, "joiner": True}
    ranks = launch_with_losses(3, ("async_scenarios.pool_run", args), tmp_path / "ranks", 600, dies=2, replace=True)
    assert ranks[2]["exitcode"] == -9, ranks[2]  # the replica died holding a data step >= 3
    for r in (0, 1, 3):
        assert ranks[r]["exitcode"] == 0 and "error" not in ranks[r]["result"], ranks[r]
    assert ranks[0]["result"]["step"] == 7 and ranks[1]["result"]["role"] == "sampler"
    assert ranks[3]["result"]["role"] == "sampler", ranks[3]  # the replacement ended cleanly
    lines = logged(tmp_path / "roles")
    assert len(lines) == 7
    replicas = [x["async/sampler_replica"] for x in lines]
    assert 1.0 not in replicas[3:], replicas  # step 3 redone by another replica
    # the replacement sampled data steps the learner learned (the lost step 3 itself, when it was
    # admitted while the learner waited for it: as likely as a later one, by timing)
    assert 2.0 in replicas[3:], replicas
    assert lines[0]["async/samplers_alive"] == 2.0 and lines[-1]["async/samplers_alive"] == 2.0
    colocated({"max_staleness": 1}, {"steps": 7}, tmp_path / "colocated")
    a, b = final_params(tmp_path / "roles"), final_params(tmp_path / "colocated")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert [x["train/loss"] for x in lines] == [x["train/loss"] for x in logged(tmp_path / "colocated")]


def test_a_hung_sampler_is_lost_by_its_heartbeat(tmp_path):
    """Replica 1 stops (SIGSTOP: its process, heartbeat thread included, hangs, its sockets stay
    open) holding data step 3 of 5: no message fails, the learner marks it lost when its heartbeat
    has been silent for grpo.sampler_timeout_s (5 s), replica 0 redoes the step, and the run
    equals the colocated one; the hung process is killed after the learner is done."""
    grpo = {"max_staleness": 1, "sampler_timeout_s": 5.0}
    args = {"grpo": grpo, "train": {"steps": 5}, "out_dir": str(tmp_path / "roles"), "samplers": 2,
            "kill_replica": 1, "kill_at": 3, "signal_name": "SIGSTOP"}
    ranks = launch_with_losses(3, ("async_scenarios.pool_run", args), tmp_path / "ranks", 600, dies=2)
    assert ranks[2]["exitcode"] == -9, ranks[2]  # hung until the launcher killed it
    for r in (0, 1):
        assert ranks[r]["exitcode"] == 0 and "error" not in ranks[r]["result"], ranks[r]
    lines = logged(tmp_path / "roles")
    assert len(lines) == 5 and lines[-1]["async/samplers_alive"] == 1.0
    assert all(x["async/sampler_replica"] == 0.0 for x in lines[3:])
    colocated({"max_staleness": 1}, {"steps": 5}, tmp_path / "colocated")
    a, b = final_params(tmp_path / "roles"), final_params(tmp_path / "colocated")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
