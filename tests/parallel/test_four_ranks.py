"""Four gloo ranks against the single-process reference: PP=4 (L=4) with M = 1, 2, 4;
TP=2 x PP=2; PP=2 x DP=2 with ZeRO-1/2 and an uneven split; TP=2 x DP=2 with ZeRO-3; and a
checkpoint saved on four ranks, the processes stopped, and the run resumed in new processes on
the same layout, ending with parameters equal to the uninterrupted run's (torch.equal); a GRPO
step under TP=2 x PP=2 (with the KL reference) and PP=2 x DP=2 ZeRO-2 against one process; the
messages a four-stage sampler and training ring post against the descriptions the NCCL simulation
checks. Tags: one per stream (the two-rank launches run with every tag 0)."""

import pytest

from tests.parallel.launch import result, run_ranks
from tests.parallel.ring_checks import check_ring_messages
from tests.parallel.test_grpo_distributed import check_grpo_step

L4 = {"n_layers": 4}
PP4 = [("gradients_vs_reference", {"model": L4, "parallel": {"pp": 4, "micro_batches": m}}) for m in (1, 2, 4)]
TP2PP2 = [("gradients_vs_reference", {"model": {"tie_embeddings": True, "qkv_bias": True},
                                      "parallel": {"tp": 2, "pp": 2, "micro_batches": 2}}),
          ("steps_vs_reference", {"parallel": {"tp": 2, "pp": 2, "micro_batches": 2},
                                  "optim": {"lr": 1e-3, "grad_clip": 0.5}}),
          ("steps_vs_reference", {"parallel": {"tp": 2, "pp": 2, "micro_batches": 2, "zero_stage": 2},
                                  "model": {"tie_embeddings": True}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})]
PP2DP2 = [("gradients_vs_reference", {"model": L4, "parallel": {"pp": 2, "pp_split": [3, 1], "micro_batches": 2}})] + \
         [("steps_vs_reference", {"parallel": {"pp": 2, "zero_stage": z, "micro_batches": 2},
                                  "optim": {"lr": 1e-3, "grad_clip": 0.3}, "train": {"grad_accum": 2}})
          for z in (1, 2)]
TP2DP2 = [("steps_vs_reference", {"parallel": {"tp": 2, "zero_stage": 3}, "optim": {"lr": 1e-3, "grad_clip": 0.5}})]
GRPO = [("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"tp": 2, "pp": 2, "zero_stage": 1, "micro_batches": 2},
                                                   "train": {"grad_accum": 2}, "grpo": {"kl_coef": 0.1}}),
        ("grpo_scenarios.grpo_step_vs_reference", {"parallel": {"pp": 2, "zero_stage": 2, "micro_batches": 2},
                                                   "train": {"grad_accum": 2}})]
# The middle stages take the finish flags at checks only (rollout/ring.py).
MESSAGES = [("nccl_scenarios.ring_messages", {"parallel": {"pp": 4}, "model": L4})]
RESUME_LAYOUTS = [{"pp": 2, "zero_stage": 1, "micro_batches": 2}, {"tp": 2, "zero_stage": 3},
                  {"tp": 2, "pp": 2, "zero_stage": 2}]


def resume_args(i, layout, phase, root):
    return {"parallel": layout, "phase": phase, "ckpt": str(root / f"layout{i}"), "steps_before": 2, "steps_after": 2}


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("four_ranks_ckpt")


@pytest.fixture(scope="module")
def results(tmp_path_factory, ckpt_root):
    saves = [("resume", resume_args(i, lay, "save", ckpt_root)) for i, lay in enumerate(RESUME_LAYOUTS)]
    return run_ranks(4, PP4 + TP2PP2 + PP2DP2 + TP2DP2 + GRPO + MESSAGES + saves, tmp_path_factory.mktemp("four_ranks"),
                     timeout=900)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, ckpt_root, results):  # new processes, after the saving ones ended
    loads = [("resume", resume_args(i, lay, "load", ckpt_root)) for i, lay in enumerate(RESUME_LAYOUTS)]
    return run_ranks(4, loads, tmp_path_factory.mktemp("four_ranks_resume"), timeout=600)


def each_rank(results, name, args):
    return [result(results, name, args, rank) for rank in range(4)]


@pytest.mark.parametrize("name,args", PP4 + TP2PP2[:1] + PP2DP2[:1])
def test_pipeline_loss_and_gradients_equal_one_process(results, name, args):
    for r in each_rank(results, name, args):
        assert abs(r["loss"] - r["ref_loss"]) < 1e-6
        assert r["grad_diff"] < 1e-6, r["grad_worst"]
        if "tied_diff" in r:
            assert r["tied_diff"] == 0.0


@pytest.mark.parametrize("name,args", TP2PP2[1:] + PP2DP2[1:] + TP2DP2)
def test_optimizer_steps_equal_one_process(results, name, args):
    for r in each_rank(results, name, args):
        assert r["ref_norm"][0] > args["optim"]["grad_clip"]  # clipping acts
        for norm, ref in zip(r["norm"], r["ref_norm"]):
            assert norm == pytest.approx(ref, rel=1e-5)
        assert r["param_moved"] > 1e-3
        assert r["param_diff"] < 1e-5, r["param_worst"]


@pytest.mark.parametrize("i,layout", list(enumerate(RESUME_LAYOUTS)))
def test_resume_on_the_same_layout_is_exact(results, resumed, ckpt_root, i, layout):
    saved = result(results, "resume", resume_args(i, layout, "save", ckpt_root), 0)
    assert "model.safetensors" in saved["files"] and "engine.pt" in saved["files"]
    assert saved["consolidated"]  # model.safetensors holds exactly the gathered fp32 weights
    assert any(f.startswith("deepspeed/") and "optim_states" in f for f in saved["files"]) == \
        (layout["zero_stage"] > 0)
    for rank in range(4):
        r = result(resumed, "resume", resume_args(i, layout, "load", ckpt_root), rank)
        assert r["start"] == 2
        assert r["equal"], r["max_diff"]


@pytest.mark.parametrize("name,args", GRPO)
def test_a_grpo_step_matches_one_process(results, name, args):
    for r in each_rank(results, name, args):
        check_grpo_step(r, args)


@pytest.mark.parametrize("name,args", MESSAGES)
def test_four_stage_rings_post_the_messages_the_nccl_simulation_checks(results, name, args):
    for r in each_rank(results, name, args):
        check_ring_messages(r)
