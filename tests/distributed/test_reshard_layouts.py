"""Resuming on another layout with the optimizer state (issue 43), one 4-rank launch for all of it
(tests/distributed/reshard_scenarios.py). Every layout of {tp=2 pp=2 ZeRO-1, tp=1 pp=4 ZeRO-2,
tp=4 ZeRO-3, dp=4 ZeRO-1, one process} trains 4 steps from the same start on the same global
batches (the uninterrupted runs; a checkpoint at step 2), and one engine per target layout B
resumes from every source A's step 2 in turn and trains 2 more steps:

* fp32: every ordered pair (A, B), 20;
* bf16: every ordered pair, 20, and tp=2 pp=2 without ZeRO (DeepSpeed's unfused bf16 optimizer)
  into and out of tp=2 pp=2 ZeRO-1 and one process, 4;
* one pair with adapters (model.lora), one through ``rlt-mega reshard``, and an asynchronous GRPO
  run (its checkpoint queues a sample of an older policy on each of its 2 data-parallel replicas)
  moved from pp=2 dp=2 ZeRO-1 to tp=4 ZeRO-3 (one replica) and, through ``rlt-mega reshard``, to
  dp=4 ZeRO-1 (the queue re-split into the new replicas' shares).

Compared through the layout-free state (every parameter's fp32 master and Adam moments, full
tensors):

* the state a resumed run writes back right after loading is the source's, bit for bit;
* after step 4 the resumed run is the run it came from continued (relative difference below the
  cross-layout tolerance of the layout tests, 1e-5 in fp32, 1e-1 in bf16; bf16 without ZeRO:
  ``continues``) and no farther from the
  uninterrupted run on its own layout than the two layouts' runs were at the resume (Adam turns
  the layouts' rounding differences into relative differences of ~1e-4 after two steps in fp32,
  ~0.4 in bf16, measured between the uninterrupted runs; the resume adds none). No pair of these
  layouts sums the same numbers in the same order, so none is bit for bit after a step;
* a reshard followed by the resume gives the same tensors as resuming directly (on a fresh
  engine: the engine that resumed directly had resumed from another source before, so this also
  shows that a load sets everything anew).
"""

import itertools
import math
import json

import pytest
import torch

from rlt_mega.parallel.reshard import KEYS, LayoutFreeState
from tests.distributed.launch import result, run_ranks

S = "reshard_scenarios."
LAYOUTS = ("tp2pp2z1", "pp4z2", "tp4z3", "dp4z1", "one")
PAIRS = {
    "fp32": list(itertools.permutations(LAYOUTS, 2)),
    # and tp=2 pp=2 without ZeRO into and out of two of them
    "bf16": list(itertools.permutations(LAYOUTS, 2)) + [(a, b) for x, y in (("tp2pp2z0", "tp2pp2z1"), ("tp2pp2z0", "one"))
                                                      for a, b in ((x, y), (y, x))],
}
RESHARDED = ("dp4z1", "pp4z2")  # through rlt-mega reshard: the direct resume's engine had two sources before
PAIR = ("tp2pp2z1", "tp4z3")  # adapters: pipeline + ZeRO-1 -> tensor parallel ZeRO-3
GRPO_SOURCE = "pp2dp2z1"  # asynchronous GRPO on 2 replicas, moved to 1 (tp4z3) and 4 (dp4z1, resharded)
GRPO_MOVES = {"moved": "whole", "resharded": "whole_dp4"}  # each moved run: the uninterrupted run on its layout
RESUMES = [(kind, a, b) for kind, pairs in PAIRS.items() for a, b in pairs]
# Relative to each tensor's largest entry. The continued run against the run it came from: two
# steps on another layout (the layout tests' cross-layout tolerance in fp32; bf16 rounds its
# weights and activations by layout, and Adam turns such differences into lr-sized steps).
CONTINUED = {"fp32": 1e-5, "lora": 1e-5, "bf16": 1e-1}


def _step(root, step):
    return root / f"step_{step:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    scenarios = [(S + "matrix", {"root": str(root / kind), "dtype": kind, "pairs": pairs,
                                 "layouts": list(dict.fromkeys(x for pair in pairs for x in pair))})
                 for kind, pairs in PAIRS.items()]
    lora = {"dtype": "fp32", "lora": True}
    scenarios += [(S + "run", {"root": str(root / "lora" / PAIR[0]), "layout": PAIR[0], **lora}),
                  (S + "run", {"root": str(root / "lora" / "_to_".join(PAIR)), "layout": PAIR[1], **lora,
                               "resume_from": str(_step(root / "lora" / PAIR[0], 2))})]
    a, b = RESHARDED
    scenarios.append((S + "reshard_then_run", {"root": str(root / "resharded"), "layout": b,
                                                "checkpoint": str(_step(root / "fp32" / a, 2))}))
    g = root / "grpo"
    queued = str(_step(g / "source" / "ckpt", 1))
    scenarios += [(S + "grpo", {"root": str(g / "whole"), "layout": "tp4z3", "train": {}}),
                  (S + "grpo", {"root": str(g / "whole_dp4"), "layout": "dp4z1", "train": {}}),
                  (S + "grpo", {"root": str(g / "source"), "layout": GRPO_SOURCE, "train": {}}),
                  (S + "grpo", {"root": str(g / "moved"), "layout": "tp4z3", "train": {"resume": queued}}),
                  (S + "grpo_resharded", {"root": str(g / "resharded"), "layout": "dp4z1", "checkpoint": queued})]
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


def continues(source, reloaded, resumed, came_from, kind, uninterrupted=None, at_resume=None,
              bf16_grads: bool = False) -> None:
    """The checks of a resume (the module's docstring). ``bf16_grads``: one of the layouts sums
    its gradients in bf16 (bf16 without ZeRO, parallel/zero.py grad_accum_dtype), so its runs part
    from the others' by far more than rounding (exp_avg_sq of the norms by 100 %): the resumed
    run's fp32 masters are then held to stay with the run they came from, closer to it than to the
    uninterrupted run on the new layout (measured: 0.11-0.13 against 0.71-0.76)."""
    assert all(float(v["exp_avg_sq"].abs().max()) > 0 for v in source.values())  # moments, not zeros
    assert equal(reloaded, source)  # loaded on the new layout and written back: the very same numbers
    if bf16_grads:
        masters = lambda x: {n: {"fp32": v["fp32"]} for n, v in x.items()}  # noqa: E731
        assert worst(masters(resumed), masters(came_from))[0] < worst(masters(resumed), masters(uninterrupted))[0]
        return
    continued, where = worst(resumed, came_from)
    assert continued < CONTINUED[kind], (continued, where)
    if uninterrupted is not None:  # no farther from the run on the new layout than at the resume
        assert worst(resumed, uninterrupted)[0] <= worst(source, at_resume)[0]


@pytest.mark.parametrize("kind,a,b", RESUMES)
def test_a_resume_on_another_layout_carries_the_state_and_continues_the_run(runs, kind, a, b):
    r = runs / kind
    continues(state_of(_step(r / a, 2)), state_of(r / f"{a}_to_{b}" / "reloaded"),
              state_of(r / f"{a}_to_{b}" / "final"), state_of(r / a / "final"), kind,
              state_of(r / b / "final"), state_of(_step(r / b, 2)), bf16_grads="tp2pp2z0" in (a, b))


def test_adapters_resume_on_another_layout_with_their_optimizer_state(runs):
    a, b = PAIR
    r = runs / "lora"
    resumed = state_of(_step(r / f"{a}_to_{b}", 4))
    continues(state_of(_step(r / a, 2)), state_of(_step(r / f"{a}_to_{b}" / "reloaded", 2)), resumed,
              state_of(_step(r / a, 4)), "lora")
    assert all(n.endswith(("lora_A", "lora_B")) for n in resumed)  # the adapters only, the base frozen


def test_a_reshard_then_the_resume_equals_resuming_directly(runs):
    a, b = RESHARDED
    assert equal(state_of(_step(runs / "resharded", 4)), state_of(runs / "fp32" / f"{a}_to_{b}" / "final"))
    assert equal(state_of(runs / "resharded" / "resharded"), state_of(_step(runs / "fp32" / a, 2)))


def _logged(root) -> list[dict]:
    lines = (root / "log" / "metrics.jsonl").read_text().splitlines()
    return [x for x in map(json.loads, lines) if "train/loss" in x]


@pytest.mark.parametrize("moved", GRPO_MOVES)
def test_asynchronous_grpo_moves_to_another_data_parallel_size_with_its_queue(runs, moved):
    """Saved after step 1 on pp=2 dp=2 ZeRO-1 (the checkpoint queues data step 1, sampled by
    version 0, on each replica), resumed on tp=4 ZeRO-3 (one replica) or, through rlt-mega
    reshard, on dp=4 ZeRO-1: step 2 learns the queued samples, re-split into the new replicas'
    shares (staleness 1): the very samples the uninterrupted run on that layout draws (a row's
    seed is the same on every layout), with its loss; it ends where the run it came from ends
    (within the cross-layout tolerance) and no farther from the uninterrupted run on its layout
    than the two layouts' runs end apart."""
    g = runs / "grpo"
    ckpt = lambda name, step: state_of(_step(g / name / "ckpt", step))  # noqa: E731
    whole = GRPO_MOVES[moved]
    logged, uninterrupted = _logged(g / moved), _logged(g / whole)
    assert [x["async/staleness_max"] for x in logged] == [1.0] == [x["async/staleness_max"] for x in uninterrupted[1:]]
    assert logged[0]["reward/mean"] == uninterrupted[1]["reward/mean"]  # the queued samples themselves
    assert logged[0]["train/loss"] == pytest.approx(uninterrupted[1]["train/loss"], rel=1e-4, abs=1e-6)
    source, resumed = ckpt("source", 1), ckpt(moved, 2)
    assert all(float(v["exp_avg_sq"].abs().max()) > 0 for v in source.values())  # moments, not zeros
    continued, where = worst(resumed, ckpt("source", 2))
    assert continued < CONTINUED["fp32"], (continued, where)
    to_b = worst(resumed, ckpt(whole, 2))[0]
    assert to_b <= worst(ckpt("source", 2), ckpt(whole, 2))[0], to_b


def test_a_reshard_carries_the_per_rank_files_as_written_with_their_layout(runs):
    """The queue (job_rank<r>.pt) and RNG streams of the 4 ranks of pp=2 dp=2, byte for byte,
    recorded as that layout's (the resume on dp=4 above re-split the queue from them)."""
    g = runs / "grpo"
    out, src = g / "resharded" / "resharded", _step(g / "source" / "ckpt", 1)
    assert json.loads((out / "manifest.json").read_text())["rank_files_layout"] == \
        json.loads((src / "manifest.json").read_text())["layout"]
    names = sorted(f.name for f in src.glob("*_rank*.pt"))
    assert names == sorted(f.name for f in out.glob("*_rank*.pt")) and len(names) == 8
    assert all((out / n).read_bytes() == (src / n).read_bytes() for n in names)
    from rlt_mega.checkpoint_tools.inspect_ckpt import inspect_path

    queue = inspect_path(out)["queue"]  # rlt-mega inspect says the queue moves, and how
    assert queue.startswith("1 data step sampled ahead (grpo.max_staleness=1) on each of 2 data-parallel replicas")
    assert "it moves to any layout" in queue and "grpo.prompts_per_step x parallel.dp = 4" in queue


@pytest.mark.parametrize("a", [a for a in LAYOUTS if a != "dp4z1"])
def test_a_resume_reads_each_byte_of_the_state_once_per_data_parallel_group(runs, a):
    """On dp=4 each replica reads a quarter of every slice's rows and the group all-gathers them
    (a tensor of fewer rows than replicas is read by each): together the ranks read the state
    once, where each used to read all of it."""
    r = runs / "fp32"
    state = LayoutFreeState.open(_step(r / a, 2))
    whole = sum(12 * math.prod(state.full_shape(n)) for n in state.names())
    small = sum(12 * math.prod(s) for s in map(state.full_shape, state.names()) if not s or s[0] < 4)
    read = [int((r / f"{a}_to_dp4z1" / "read" / f"rank{rank}").read_text()) for rank in range(4)]
    assert sum(read) == whole + 3 * small
    first = small + sum(12 * -(-s[0] // 4) * math.prod(s[1:]) for s in map(state.full_shape, state.names())
                        if s and s[0] >= 4)  # rank 0's share: the first ceil(rows / 4) rows of each
    assert read[0] == first < whole / 3


def test_a_reshard_output_exports_the_weights_of_its_distributed_input(runs, tmp_path):
    """The dp=4 ZeRO-1 checkpoint exports from its DeepSpeed shards (no consolidated file); its
    reshard for tp=1 pp=4 (the layout-free state only) from the state's fp32 masters: the same
    tensors."""
    from rlt_mega.checkpoint_tools.commands import export_path
    from rlt_mega.checkpoint_tools.export import load_exported

    a, _ = RESHARDED
    original = export_path(_step(runs / "fp32" / a, 2), tmp_path / "original")
    resharded = export_path(runs / "resharded" / "resharded", tmp_path / "resharded")
    (_, want), (_, got) = load_exported(original), load_exported(resharded)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
