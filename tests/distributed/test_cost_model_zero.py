"""The cost model's ZeRO memory against DeepSpeed itself on two gloo ranks (mp.spawn of
rlt_mega.cost.measure.zero_probe; tests/unit/test_costmodel.py: the rest of the cost model)."""

import os

import pytest

from rlt_mega.config import CheckpointingConfig, ModelConfig
from rlt_mega.parallel.dims import free_port
from rlt_mega.cost.layout import Layout, ZeroBuckets
from rlt_mega.cost.measure import zero_probe
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.cost.params import rank_tensor_numels

CPU = dict(fused_rms_norm=False, foreach_optimizer=False)  # as tests/unit/test_costmodel.py


def test_zero_stages_with_dp2_against_deepspeed():
    """Two gloo ranks, DeepSpeed ZeRO-1/2/3 around torch AdamW: the Adam moments and fp32
    master partition each rank holds equal the prediction exactly (padding included: this
    model's 124,902 parameters are not a multiple of 2 x dp), and the per-rank peak of a
    step is within 15%."""
    import torch.multiprocessing as mp

    model_cfg = dict(vocab_size=260, d_model=54, n_layers=2, n_heads=3, n_kv_heads=1, max_seq_len=64)
    buckets = {"reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
               "stage3_prefetch_bucket_size": 20000, "stage3_param_persistence_threshold": 0}
    cases = [dict(zero_stage=1, checkpointing={}, batch=4, seq_len=8, buckets=buckets),
             dict(zero_stage=2, checkpointing={"decoder": "step"}, batch=4, seq_len=8, buckets=buckets),
             dict(zero_stage=3, checkpointing={"decoder": "every_k", "decoder_k": 3, "encoder": True},
                  batch=4, seq_len=8, buckets=buckets)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(zero_probe, args=(2, free_port(), model_cfg, cases, results), nprocs=2)
    cfg = ModelConfig(**model_cfg)
    assert sum(rank_tensor_numels(cfg)) % 4 == 2  # exercises the 2 x dp padding
    model_buckets = ZeroBuckets(reduce_bucket_size=20000, allgather_bucket_size=20000,
                                stage3_prefetch_bucket_size=20000)
    for i, case in enumerate(cases):
        layout = Layout(seq_len=case["seq_len"], micro_batch_size=case["batch"], dp=2,
                        zero_stage=case["zero_stage"], checkpointing=CheckpointingConfig(**case["checkpointing"]),
                        buckets=model_buckets, **CPU)
        predicted = estimate_memory(cfg, layout, 0)
        for rank in range(2):
            got = results[rank][i]
            assert got["moments_numel"] == predicted.optimizer_state_numel, (case, got)
            assert got["master_numel"] == predicted.master_numel, (case, got)
            assert predicted.peak == pytest.approx(got["peak"], rel=0.15), (case, got, predicted.phases)
