"""Tensor parallelism on two gloo ranks against one process (tests/distributed/scenarios.py):
logits and every gathered gradient equal the single-process model's, with qkv biases, tied
embeddings and unshared decoder blocks too."""

import pytest

TP2 = [("gradients_vs_reference", {"parallel": {"tp": 2}, "with_logits": True}),
       ("gradients_vs_reference", {"model": {"qkv_bias": True, "tie_embeddings": True, "share_weights": False},
                                   "parallel": {"tp": 2}, "with_logits": True})]
SCENARIOS = {2: TP2}


@pytest.mark.parametrize("name,args", TP2)
def test_tensor_parallel_logits_and_gradients_equal_one_process(ranks, name, args):
    for r in ranks(2).each(name, args):
        assert r["logits_diff"] < 1e-5
        assert r["grad_diff"] < 1e-5, r["grad_worst"]
        assert abs(r["loss"] - r["ref_loss"]) < 1e-5
