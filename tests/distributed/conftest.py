"""One launch of gloo ranks per rank count, shared by the feature files of this tier.

A launch costs every rank the imports of torch, megatron-core and DeepSpeed, so the scenarios
(scenarios.py and the other *_scenarios modules, run by worker.py) of every collected test
module run in one launch per rank count. A test module declares what it needs as

    SCENARIOS = {2: [(name, args), ...], 4: [...]}

and reads its results through the ``ranks`` fixture: ``ranks(2).each(name, args)`` is every
rank's result of that scenario. Scenario arguments may hold ``{shared}``, a session directory
(for scenarios that leave files to a later launch).

The two-rank launch runs with every point-to-point tag 0 (launch.ORDER_ONLY: gloo then pairs
messages by order alone, as NCCL does), the four-rank launch with one tag per stream."""

from __future__ import annotations

import json

import pytest

from tests.distributed.launch import ORDER_ONLY, result, run_ranks

_PLAN = pytest.StashKey[dict]()
TIMEOUT_S = {2: 1500, 4: 1200}  # per launch; a launch that hangs is killed and its tests fail
ENV = {2: ORDER_ONLY}  # extra environment of a launch, per rank count


def fill(args: dict, shared: str) -> dict:
    """``args`` with every ``{shared}`` replaced by the session directory."""
    return json.loads(json.dumps(args).replace("{shared}", shared))


@pytest.hookimpl(trylast=True)  # after -k / -m deselected: launch only what the selected tests need
def pytest_collection_modifyitems(config, items):
    plan: dict[int, list] = {}
    for module in dict.fromkeys(item.module for item in items if getattr(item, "module", None) is not None):
        for nprocs, scenarios in getattr(module, "SCENARIOS", {}).items():
            wanted = plan.setdefault(nprocs, [])
            wanted += [s for s in scenarios if s not in wanted]
    config.stash[_PLAN] = plan
    # The first test to ask for a launch waits for all of it: its time limit covers the launches.
    for item in items:
        if getattr(getattr(item, "module", None), "SCENARIOS", None):
            item.add_marker(pytest.mark.timeout(sum(TIMEOUT_S.values()) + 300))


class Launch:
    def __init__(self, results: list[dict], nprocs: int, shared: str) -> None:
        self.results, self.nprocs, self.shared = results, nprocs, shared

    def one(self, name: str, args: dict, rank: int) -> dict:
        return result(self.results, name, fill(args, self.shared), rank)

    def each(self, name: str, args: dict) -> list[dict]:
        return [self.one(name, args, rank) for rank in range(self.nprocs)]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shared"))


@pytest.fixture(scope="session")
def ranks(request, tmp_path_factory, shared_dir):
    plan, launches = request.config.stash[_PLAN], {}

    def launched(nprocs: int) -> Launch:
        if nprocs not in launches:
            scenarios = [(name, fill(args, shared_dir)) for name, args in plan.get(nprocs, [])]
            out = run_ranks(nprocs, scenarios, tmp_path_factory.mktemp(f"ranks{nprocs}"), timeout=TIMEOUT_S[nprocs],
                            env=ENV.get(nprocs))
            launches[nprocs] = Launch(out, nprocs, shared_dir)
        return launches[nprocs]

    return launched
