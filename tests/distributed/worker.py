"""Entry point of one rank: runs the scenarios listed in a JSON file, in order. A scenario is a
function of tests/distributed/scenarios.py, or ``module.function`` for another module of
tests/distributed/."""

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from tests.distributed import scenarios
from tests.distributed.launch import key


def resolve(name: str):
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(f"tests.distributed.{module}") if module else scenarios, function)


def main() -> None:
    spec, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    import torch

    torch.use_deterministic_algorithms(True)  # as the suite (tests/conftest.py) and train.deterministic

    rank = int(os.environ["RANK"])
    results, seconds = {}, {}
    results["_seconds"] = seconds  # each scenario's wall time on this rank (what a launch spends where)
    out = out_dir / f"rank{rank}.json"
    for name, args in json.loads(spec.read_text()):
        start = time.perf_counter()
        try:
            results[key(name, args)] = resolve(name)(**args)
            seconds[key(name, args)] = round(time.perf_counter() - start, 2)
        except Exception:  # recorded; the test that reads it fails with this traceback
            results[key(name, args)] = {"error": traceback.format_exc()}
            out.write_text(json.dumps(results))
            # The other ranks may now wait in a collective for this one: stop, and the launcher
            # stops them (the scenarios after this one report that they did not run).
            sys.stdout.flush()
            os._exit(1)
        out.write_text(json.dumps(results))
    scenarios.shutdown()


if __name__ == "__main__":
    main()
