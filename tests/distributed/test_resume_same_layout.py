"""A checkpoint saved on four ranks, the processes stopped, and the run resumed in new processes on
the same layout (PP=2 x DP=2 ZeRO-1, TP=2 x DP=2 ZeRO-3, TP=2 x PP=2 ZeRO-2) ends with
parameters equal to the uninterrupted run's (torch.equal, per rank); the checkpoint holds the
consolidated weights, the engine state and, under ZeRO, the optimizer shards."""

import pytest

from tests.distributed.conftest import fill
from tests.distributed.launch import result, run_ranks

LAYOUTS = [{"pp": 2, "zero_stage": 1, "micro_batches": 2}, {"tp": 2, "zero_stage": 3},
           {"tp": 2, "pp": 2, "zero_stage": 2}]


def resume_args(i, layout, phase):
    return {"parallel": layout, "phase": phase, "ckpt": f"{{shared}}/resume/layout{i}", "steps_before": 2,
            "steps_after": 2}


SCENARIOS = {4: [("resume", resume_args(i, lay, "save")) for i, lay in enumerate(LAYOUTS)]}


@pytest.fixture(scope="module")
def resumed(ranks, shared_dir, tmp_path_factory):
    ranks(4)  # the saving processes ended
    loads = [("resume", fill(resume_args(i, lay, "load"), shared_dir)) for i, lay in enumerate(LAYOUTS)]
    return run_ranks(4, loads, tmp_path_factory.mktemp("resumed"), timeout=600)


@pytest.mark.parametrize("i,layout", list(enumerate(LAYOUTS)))
def test_resume_on_the_same_layout_is_exact(ranks, resumed, shared_dir, i, layout):
    saved = ranks(4).one("resume", resume_args(i, layout, "save"), 0)
    assert "model.safetensors" in saved["files"] and "engine.pt" in saved["files"]
    assert saved["consolidated"]  # model.safetensors holds exactly the gathered fp32 weights
    assert any(f.startswith("deepspeed/") and "optim_states" in f for f in saved["files"]) == \
        (layout["zero_stage"] > 0)
    for rank in range(4):
        r = result(resumed, "resume", fill(resume_args(i, layout, "load"), shared_dir), rank)
        assert r["start"] == 2
        assert r["equal"], r["max_diff"]
