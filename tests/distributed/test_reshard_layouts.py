"""Resuming on another layout with the optimizer state (issue 43), one 4-rank launch for all of it
(tests/distributed/reshard_scenarios.py). Every layout of {tp=2 pp=2 ZeRO-1, tp=1 pp=4 ZeRO-2,
tp=4 ZeRO-3, dp=4 ZeRO-1, one process} trains 4 steps from the same start on the same global
batches (the uninterrupted runs, saved at steps 2 and 4); the resumed runs start from another
layout's step 2 (a cycle through the five in fp32, one pair in bf16, one with adapters, one
through ``rlt-mega reshard``), save at once, and train 2 more steps. Compared through the
checkpoints' layout-free state (every parameter's fp32 master and Adam moments, full tensors):

* the state a resumed run writes back right after loading is the source's, bit for bit;
* after step 4 the resumed run is the run it came from continued (relative difference below the
  cross-layout tolerance of the layout tests, 1e-5 in fp32) and, in fp32, no farther from the
  uninterrupted run on its own layout than the two layouts' runs were at the resume (with lr
  1e-2 Adam turns the layouts' rounding differences into relative differences of ~1e-4 after
  two steps, measured between the uninterrupted runs; the resume adds none);
* a reshard followed by the resume gives the same tensors as resuming directly.
"""

import pytest
import torch

from rlt_mega.parallel.reshard import KEYS, LayoutFreeState
from tests.distributed.launch import result, run_ranks

S = "reshard_scenarios."
LAYOUTS = ("tp2pp2z1", "pp4z2", "tp4z3", "dp4z1", "one")
CYCLE = list(zip(LAYOUTS, LAYOUTS[1:] + LAYOUTS[:1]))  # every layout once a source, once a target
PAIR = ("tp2pp2z1", "tp4z3")  # bf16 and adapters: pipeline + ZeRO-1 -> tensor parallel ZeRO-3
RESUMES = [("fp32", a, b) for a, b in CYCLE] + [("bf16", *PAIR), ("lora", *PAIR)]
# Relative to each tensor's largest entry. The continued run against the run it came from: two
# steps on another layout (the layout tests' cross-layout tolerance in fp32; bf16 rounds its
# weights and activations by layout, and Adam turns such differences into lr-sized steps).
CONTINUED = {"fp32": 1e-5, "lora": 1e-5, "bf16": 1e-1}


def _step(root, name, step):
    return root / name / f"step_{step:08d}"


def _args(root, run, layout, kind, **extra):
    dtype = "bf16" if kind == "bf16" else "fp32"
    return {"root": str(root / run), "layout": layout, "dtype": dtype, **({"lora": True} if kind == "lora" else {}),
            **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    scenarios = [(S + "run", _args(root, f"fp32_{a}", a, "fp32")) for a in LAYOUTS]
    scenarios += [(S + "run", _args(root, f"{kind}_{PAIR[0]}", PAIR[0], kind)) for kind in ("bf16", "lora")]
    scenarios += [(S + "run", _args(root, f"{kind}_{a}_to_{b}", b, kind, resume_from=str(_step(root, f"{kind}_{a}", 2))))
                  for kind, a, b in RESUMES]
    a, b = CYCLE[0]
    scenarios.append((S + "reshard_then_run", {"root": str(root / "resharded"), "layout": b,
                                                "checkpoint": str(_step(root, f"fp32_{a}", 2))}))
    results = run_ranks(4, scenarios, root / "launch", timeout=900)
    for name, args in scenarios:
        result(results, name, args, 0)  # raises with the traceback of a failed scenario
    return root


def state_of(step_dir) -> dict[str, dict[str, torch.Tensor]]:
    state = LayoutFreeState.open(step_dir)
    return {n: {k: state.read(n, k, 1, 0) for k in KEYS} for n in state.names()}


def worst(a: dict, b: dict) -> tuple[float, str]:
    assert set(a) == set(b)
    out = (0.0, "")
    for name, ref in b.items():
        for key, r in ref.items():
            diff = float((a[name][key] - r).abs().max()) / max(float(r.abs().max()), 1e-30)
            out = max(out, (diff, f"{name} {key}"))
    return out


def equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n][k], b[n][k]) for n in b for k in KEYS)


@pytest.mark.parametrize("kind,a,b", RESUMES)
def test_a_resume_on_another_layout_carries_the_state_and_continues_the_run(runs, kind, a, b):
    source = state_of(_step(runs, f"{kind}_{a}", 2))
    assert all(float(v["exp_avg_sq"].abs().max()) > 0 for v in source.values())  # moments, not zeros
    # loaded on layout b and written back by it: the very same numbers
    assert equal(state_of(_step(runs / f"{kind}_{a}_to_{b}", "reloaded", 2)), source)
    resumed = state_of(_step(runs, f"{kind}_{a}_to_{b}", 4))
    continued, where = worst(resumed, state_of(_step(runs, f"{kind}_{a}", 4)))
    assert continued < CONTINUED[kind], (continued, where)
    if kind == "fp32":  # against the uninterrupted run on b: no farther than the two runs were at step 2
        to_b = worst(resumed, state_of(_step(runs, f"{kind}_{b}", 4)))[0]
        at_resume = worst(source, state_of(_step(runs, f"{kind}_{b}", 2)))[0]
        assert to_b <= at_resume, (to_b, at_resume)
    if kind == "lora":
        assert all(n.endswith(("lora_A", "lora_B")) for n in resumed)  # the adapters only, the base frozen


def test_a_reshard_then_the_resume_equals_resuming_directly(runs):
    a, b = CYCLE[0]
    direct = state_of(_step(runs, f"fp32_{a}_to_{b}", 4))
    assert equal(state_of(_step(runs, "resharded", 4)), direct)
    assert equal(state_of(runs / "resharded" / "resharded"), state_of(_step(runs, f"fp32_{a}", 2)))
