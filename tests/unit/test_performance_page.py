"""docs/performance.md's tables are rendered from the benchmarks' JSON, never typed: the committed
page equals what tools/docs/render_performance.py renders from docs/bench/*.json, and a
benchmark's results (tools/bench/harness.py ``Results``) carry the machine and the date the
rendered table shows."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load("tools/docs/render_performance.py")
harness = load("tools/bench/harness.py")


def test_performance_page_is_current():
    assert render.main(["--check"]) == 0, "run python tools/docs/render_performance.py"


def test_results_json_renders_with_its_machine(tmp_path):
    parser = argparse.ArgumentParser()
    harness.add_json_arg(parser)
    args = parser.parse_args(["--json", str(tmp_path / "b.json")])
    res = harness.Results("toy", args)
    res.row("speeds", C=1, **{"tok/s": 10.5})
    res.row("speeds", C=16, **{"tok/s": 21.0})
    res.target("speed-up", ">= 1.8x", "2.00x", True)
    res.write()
    data = json.loads((tmp_path / "b.json").read_text())
    m = data["machine"]
    assert m["cores"] >= 1 and m["torch"] and m["cpu"] and m["date"].endswith("UTC")
    text = render.render_tables(render.load_results([tmp_path / "b.json"]))
    assert f"Measured on {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}" in text
    assert "| 16 | 21.0 |" in text and "| toy | speed-up | >= 1.8x | 2.00x | met |" in text


def test_a_file_that_is_not_a_result_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"tables": {}}))
    with pytest.raises(SystemExit, match="no 'bench'"):
        render.load_results([tmp_path / "x.json"])


def bench_module(name: str):
    """A benchmark script as a module (they import ``harness`` as scripts do: tools/bench on the path)."""
    import sys
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    try:
        return load(f"tools/bench/{name}.py")
    finally:
        sys.path.remove(str(ROOT / "tools" / "bench"))


def written(tmp_path, name: str, build) -> tuple[dict, str]:
    """Runs ``build(res)`` on a Results of ``name`` with --json -> (the JSON written, its rendered tables)."""
    path = tmp_path / f"{name}.json"
    res = harness.Results(name, argparse.Namespace(json=str(path), repeats=1))
    build(res)
    res.write()
    data = json.loads(path.read_text())
    assert data["bench"] == name and data["args"] == {"repeats": 1} and data["machine"]["date"].endswith("UTC")
    return data, render.render_tables(render.load_results([path]))


def test_slow_benchmarks_results_render(tmp_path):
    """The benchmarks too slow (compiled_step), multi-process (rollout_parallel, async_grpo) or heavy
    (data) for the unit tier: their result-building functions, on given figures, write JSON that
    renders into docs/performance.md's tables."""
    compiled = bench_module("compiled_step")
    _, text = written(tmp_path, "compiled_step", lambda res: compiled.report(
        res, {"eager fused (oneDNN products)": 2.0, "capture-ready, plain mm, compiled": 1.0}, 41.0, "d=512, B=8"))
    assert "### compiled_step: decoder forward + backward, d=512, B=8" in text
    assert "| capture-ready, plain mm, compiled | 1.0 | 0.5 | 41 |" in text

    parallel = bench_module("rollout_parallel")
    layouts = [("TP=2 step", {"tp": 2}, 1, None), ("TP=2 reference", {"tp": 2}, 1, object())]
    data, text = written(tmp_path, "rollout_parallel", lambda res: parallel.report(
        res, layouts, {"TP=2 step": (1.0, 0.5), "TP=2 reference": (3.0, 1.5)}, {"TP=2 step": 300, "TP=2 reference": 300},
        {"TP=2 step": True, "TP=2 reference": True}))
    assert "| TP=2 reference | reference | 100.0 | 0.5 | 66.7 | True |" in text
    assert "| rollout_parallel | TP=2 sampler: decoder step against the reference arm | rollout + replay tok/s >= 1.5x " \
           "| 3.00x | met |" in text

    agrpo = bench_module("async_grpo")
    arm = {"seconds": 4.0, "steps": 2, "learner_idle": 0.25, "sampler_idle": 0.5, "sync_s": 0.002, "length": 12.0,
           "stopped": 0.75}
    args = argparse.Namespace(config="configs/tiny_cpu.yaml", tp=2, prompts=2, group=2, steps=3, max_new_tokens=32,
                              stops=4, partial=8)
    _, text = written(tmp_path, "async_grpo", lambda res: agrpo.report(res, args, {
        "colocated s=0": {**arm, "seconds": 8.0}, "roles s=0": arm, "roles s=0 partial": {**arm, "learner_idle": 0.1},
        "roles s=1": {**arm, "seconds": 2.0}, "roles s=1 partial": {**arm, "seconds": 1.6, "learner_idle": 0.01}}))
    assert "### async_grpo: asynchronous GRPO, configs/tiny_cpu.yaml, tp 2, 2 x 2 rows, 3 steps" in text
    assert "| roles s=1 | 1.0 | 25.0% | 50.0% | 2.0 | 12.0 | 75% |" in text
    assert "| roles s=1 partial | 1.25 | 1.0% | 50.0% | 2.0 | 12.0 | 75% |" in text
    assert "| roles s=1 / roles s=0 | 2.00x |" in text
    assert "| roles s=1 partial / roles s=1 | 1.25x |" in text
    assert ("| async_grpo | learner idle fraction, s=1 with partial rollouts, tp 2 | <= 15% (colocated: 25.0%) | 1.0% "
            "| met |") in text

    data_bench = bench_module("data")

    def build(res):
        data_bench.report_preprocess(res, {1: [(10.0, 9.0, 9.0, 2**21, "throughput: x")], 2: [(5.0, 9.5, 4.5, 2**22, "?")]},
                                     20.0)
        data_bench.report_startup(res, {"in memory": [(8.0, 2**22)], "indexed": [(2.0, 2**21)]}, "configs/tiny_cpu.yaml")

    _, text = written(tmp_path, "data", build)
    assert "| 2 | 5.0 | 4.0 | 9.5 | 4.5 | 4.44 | 4 |" in text
    assert "### data: rlt-mega pretrain (configs/tiny_cpu.yaml), process start to the first step" in text
    assert "| indexed | 2.0 | 2 |" in text
