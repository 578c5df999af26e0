"""Spawns N ranks (one subprocess each, torchrun's environment variables, a free port, a hard
timeout) that each run a list of scenarios from ``tests/distributed/scenarios.py`` in order and
write one JSON file of results per rank. A scenario that raises records its traceback and the
worker moves on (a scenario that hangs is killed with the whole launch at the timeout; the
per-rank files then show where each rank stopped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlt_mega.parallel.dims import free_port

ROOT = Path(__file__).resolve().parents[2]


# Every tag 0 (parallel/p2p.py): gloo then pairs point-to-point messages by order alone, as NCCL
# does. The two-rank launches run this way, the four-rank launch with one tag per stream.
ORDER_ONLY = {"RLT_P2P_TAGS": "order"}


def run_ranks(nprocs: int, scenarios: list[tuple[str, dict]], out_dir: Path, timeout: float = 600.0,
              env: dict | None = None) -> list[dict]:
    """Runs the scenarios on ``nprocs`` ranks (``env``: extra environment variables); returns each
    rank's {scenario_key: result}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("rank*"):
        old.unlink()
    spec = out_dir / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    port = free_port()
    procs = []
    extra = dict(env or {})
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RLT_LOG_LEVEL="WARNING",
                   PYTHONWARNINGS="ignore", **extra)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.distributed.worker", str(spec), str(out_dir)],
                                       cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    # Wait for all; as soon as one rank fails (or the time is up) the others are killed, since
    # they may be blocked in a collective with it.
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p, _ in procs):
        if any(p.returncode not in (None, 0) for p, _ in procs):
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.2)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for _, log in procs:
        log.close()
    results = []
    for rank in range(nprocs):
        path = out_dir / f"rank{rank}.json"
        res = json.loads(path.read_text()) if path.exists() else {}
        res["_exitcode"] = procs[rank][0].returncode
        res["_timed_out"] = timed_out
        res["_log"] = (out_dir / f"rank{rank}.log").read_text()[-4000:]
        results.append(res)
    return results


def key(name: str, args: dict) -> str:
    return name + ":" + json.dumps(args, sort_keys=True)


def result(results: list[dict], name: str, args: dict, rank: int) -> dict:
    """One rank's result of one scenario; fails with the rank's traceback or log tail."""
    res = results[rank]
    k = key(name, args)
    if k not in res:
        where = "timed out" if res["_timed_out"] else f"exit code {res['_exitcode']}"
        raise AssertionError(f"rank {rank} has no result for {k} ({where}); log tail:\n{res['_log']}")
    out = res[k]
    if "error" in out:
        raise AssertionError(f"rank {rank} failed in {k}:\n{out['error']}")
    return out
