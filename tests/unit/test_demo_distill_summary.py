"""launch/demo_distill_curves.py --seeds: the seeds' accuracy by step per arm and the issue's
target (the distilled student reaches the GRPO-alone student's final mean accuracy in at most half
the steps), met, met late, or missed by the distilled arm's best mean's shortfall; and
launch/demo_precision_curves.py --summary, the bf16 study's table and its fp32-spread check."""

import importlib.util
import json
import sys

import pytest

from helpers import ROOT

_spec = importlib.util.spec_from_file_location("demo_distill_curves", ROOT / "launch" / "demo_distill_curves.py")
curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curves)


def _run(tmp_path, name, grpo, distill, teacher=0.9):
    path = tmp_path / f"{name}.json"
    arm = lambda accs: {"eval_accuracy": [[5 * i, a] for i, a in enumerate(accs)]}  # noqa: E731
    path.write_text(json.dumps({"run": f"--distill train.seed={name}", "teacher_accuracy": teacher,
                                "grpo": arm(grpo), "distill": arm(distill)}))
    return str(path)


def _summary(tmp_path, *paths):
    """main --seeds PATHS --json: the summary it writes."""
    argv, sys.argv = sys.argv, ["demo_distill_curves.py", "--seeds", *paths, "--json", str(tmp_path / "s.json")]
    try:
        curves.main()
    finally:
        sys.argv = argv
    return json.loads((tmp_path / "s.json").read_text())


@pytest.mark.parametrize("distill,reached,met,shortfall", [
    ([0.2, 0.5, 0.6, 0.6, 0.7], 5, True, 0.0),    # the GRPO final mean 0.5 at step 5 <= 10
    ([0.2, 0.3, 0.4, 0.5, 0.6], 15, False, 0.0),  # reached, but at step 15 > 10
    ([0.2, 0.3, 0.3, 0.4, 0.45], None, False, 0.05)])
def test_the_target_is_met_late_or_missed_by_the_shortfall(tmp_path, capsys, distill, reached, met, shortfall):
    a = _run(tmp_path, "0", [0.2, 0.3, 0.4, 0.45, 0.5], distill)
    b = _run(tmp_path, "1", [0.2, 0.3, 0.4, 0.45, 0.5], distill, teacher=0.8)
    s = _summary(tmp_path, a, b)
    out = capsys.readouterr().out
    t = s["target"]
    assert (t["grpo_final_step"], t["grpo_final_mean"], t["half_steps"]) == (20, 0.5, 10)
    assert (t["distill_first_step_reaching_it"], t["met"]) == (reached, met)
    assert t["shortfall"] == pytest.approx(shortfall) and s["teacher_accuracy"] == [0.9, 0.8]
    assert ("not met" in out) != met


def test_the_mean_is_over_the_seeds_and_a_step_not_every_seed_reached_is_left_out(tmp_path):
    a = _run(tmp_path, "0", [0.2, 0.4, 0.6], [0.2, 0.6, 0.7])
    b = _run(tmp_path, "1", [0.4, 0.6], [0.4, 0.8])  # stopped after step 5
    s = _summary(tmp_path, a, b)
    assert s["grpo"] == [[0, [0.2, 0.4], 0.3], [5, [0.4, 0.6], 0.5]]
    assert s["distill"][1] == [5, [0.6, 0.8], 0.7] and s["target"]["distill_first_step_reaching_it"] == 5


_spec = importlib.util.spec_from_file_location("demo_precision_curves", ROOT / "launch" / "demo_precision_curves.py")
precision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precision)


def test_the_bf16_studys_summary_and_the_fp32_spread(tmp_path):
    """launch/demo_precision_curves.py --summary: per cast the mean over the seeds by step, and
    whether a bf16 cast's mean accuracy stays within the fp32 seeds' [min, max] at every evaluation."""
    def curve(name, accs, stale=()):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"run": name, "eval_accuracy": [[5 * i, a] for i, a in enumerate(accs)],
                                    "stale_fraction": [[i + 1, x] for i, x in enumerate(stale)],
                                    "copy_lag": [[i + 1, 10 * x] for i, x in enumerate(stale)]}))
        return str(path)

    groups = {"fp32": [curve("f0", [0.3, 0.6]), curve("f1", [0.4, 0.8])],
              "nearest": [curve("n0", [0.3, 0.5], [0.5, 0.9]), curve("n1", [0.3, 0.55], [0.7, 0.9])],
              "stochastic": [curve("s0", [0.35, 0.7], [0.4, 0.6])]}
    out = precision.summary(groups)
    assert out["fp32"]["eval_accuracy"] == [[0, [0.3, 0.4], 0.35], [5, [0.6, 0.8], pytest.approx(0.7)]]
    assert out["nearest"]["stale_fraction"] == [[1, [0.5, 0.7], pytest.approx(0.6)], [2, [0.9, 0.9], 0.9]]
    assert out["nearest"]["within_fp32_spread"] == {"steps_outside": [5], "met": False}
    assert out["stochastic"]["within_fp32_spread"] == {"steps_outside": [], "met": True}
