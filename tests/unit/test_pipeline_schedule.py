"""The ring schedule and the stage interface in one process: message order of every stage
pair (the gloo/NCCL matching contract), deadlock freedom, the bubble on a model clock, and the
ring on one stage against the dense model (float64, both BPTT paths through the cuts)."""

import pytest
import torch
import torch.nn.functional as F

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from rlt_mega.loss import LM_LOSS, WHOLE_VOCAB
from rlt_mega.model.rlt import build_model
from rlt_mega.parallel.dims import micro_batch_plan, resolve_layout, split_layers
from rlt_mega.parallel.engine import param_groups as local_param_groups
from rlt_mega.parallel.grads import ShadowGrads
from rlt_mega.parallel.pipeline import P2P, RingSchedule, simulate, stage_program
from rlt_mega.parallel.stage import RLTStage, prune_to_stage
from rlt_mega.parallel.zero import param_groups


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 5])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_every_pair_matches_its_messages_and_nothing_waits_forever(P, M, T):
    # simulate() raises if a receive would be matched with a message of another stream,
    # micro-batch or position (P=2: previous and next stage are the same peer), or on deadlock.
    for backward in (False, True):
        simulate(P, M, T, backward=backward)


@pytest.mark.parametrize("P,M", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_ring_bubble_is_the_ideal_one_when_enough_micro_batches_are_in_flight(P, M):
    T = 6
    forward = simulate(P, M, T, backward=False)
    assert forward["bubble"] == pytest.approx((P - 1) / (M * T + P - 1))
    # The decoder work of every stage is M*T steps, one tick each.
    assert forward["busy"] == [M * T] * P


def test_ring_stalls_with_fewer_micro_batches_than_stages():
    # With M < P only M items circulate in the ring of P stages: each stage idles 1 - M/P.
    r = simulate(4, 1, 8, backward=False)
    assert r["bubble"] > 0.7


def test_backward_runs_decreasing_positions_on_every_stage():
    ops = [op for op in stage_program(1, 3, 2, 4, backward=True) if op.kind == "dec_bwd"]
    ts = [op.t for op in ops]
    assert ts == sorted(ts, reverse=True) and len(ops) == 8


def _dense_loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") / y.numel()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_kw,ckpt", [
    (dict(), "none"),
    (dict(memory_block=1, qkv_bias=True), "step"),
    (dict(memory_block=3, share_weights=False, tie_embeddings=True), "every_k"),
])
def test_one_stage_ring_equals_the_dense_schedule(model_kw, ckpt):
    cfg = ModelConfig(**{**dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                memory_block=2, max_seq_len=16), **model_kw})
    ref = build_model(cfg, seed=5).double()
    model = build_model(cfg, seed=5).double()
    model.set_checkpointing(CheckpointingConfig(decoder=ckpt, encoder=ckpt != "none"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (3, 7), generator=g), torch.randint(0, 32, (3, 7), generator=g)
    ref_loss, ref_grads = _dense_loss_and_grads(ref, x, y)
    stage = RLTStage(model, range(2), is_first_stage=True, is_last_stage=True, vocab=WHOLE_VOCAB)
    ring = RingSchedule(stage, P2P([0], 0, torch.device("cpu")), 0, 1)
    shadows = ShadowGrads(model)
    with shadows.active():  # M = 3 micro-batches of one row each, in flight together
        loss_sum = ring.run([{"inputs": x[i:i + 1], "targets": y[i:i + 1]} for i in range(3)], 1.0 / y.numel(),
                            backward=True, loss=LM_LOSS)
    grads = {n: shadows.grads()[p] for n, p in model.named_parameters()}
    assert float(loss_sum) / y.numel() == pytest.approx(ref_loss, abs=1e-12)
    assert all(p.grad is None for p in model.parameters())  # real parameters untouched
    for name, ref_g in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_g, atol=1e-12, rtol=0, msg=name)


def test_shadow_grads_accumulate_low_precision_gradients_in_fp32():
    lin = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    shadows = ShadowGrads(lin)
    x = torch.full((1, 4), 1.0, dtype=torch.bfloat16)
    with shadows.active():
        for _ in range(300):  # 300 * 1.0 in bf16 steps of 1 would stall at 256
            lin(x).sum().backward()
    (g,) = shadows.grads().values()
    assert g.dtype == torch.float32 and torch.equal(g, torch.full((1, 4), 300.0))


def test_split_layers():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError, match="some stages would have no layers"):
        split_layers(2, 3)
    with pytest.raises(ConfigError, match="sums to 3"):
        split_layers(4, 2, [2, 1])
    with pytest.raises(ConfigError, match="at least one layer"):
        split_layers(4, 2, [4, 0])


@pytest.mark.parametrize("parallel,model,world,match", [
    (dict(tp=2, pp=2), {}, 6, "does not divide the world size 6"),
    (dict(tp=2, dp=3), {}, 4, "set parallel.dp=2"),
    (dict(tp=4), dict(n_heads=2, d_model=32), 4, "model.n_heads=2 is not divisible"),
    (dict(tp=2), dict(vocab_size=33), 2, "e.g. 34"),
    (dict(tp=2), dict(ffn_hidden=63), 2, "model.ffn_hidden=63"),
    (dict(pp=2, zero_stage=3), {}, 2, "zero_stage=3 with parallel.pp > 1 is not supported"),
    (dict(pp=3), dict(n_layers=2), 3, "some stages would have no layers"),
])
def test_bad_layouts_are_rejected_before_any_process_group(parallel, model, world, match):
    m = ModelConfig(**{**dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4), **model})
    with pytest.raises(ConfigError, match=match):
        resolve_layout(ParallelConfig(**parallel), m, world)


def test_micro_batch_plan():
    assert micro_batch_plan(1, 8, 8) == (1, 1)  # the cluster config: one round of 8
    assert micro_batch_plan(4, 4, 2) == (1, 2)  # two rounds of 2 micro-batches
    assert micro_batch_plan(4, 1, 4) == (4, 1)  # one micro-batch cut into 4
    assert micro_batch_plan(4, 2, 4) == (2, 1)
    with pytest.raises(ConfigError, match="not a multiple of parallel.micro_batches=3"):
        micro_batch_plan(4, 4, 3)
    with pytest.raises(ConfigError, match="cannot be formed"):
        micro_batch_plan(3, 1, 2)
    with pytest.raises(ConfigError, match="cannot be formed"):
        resolve_layout(ParallelConfig(pp=2, micro_batches=3), ModelConfig(n_layers=2), 2,
                       TrainConfig(micro_batch_size=4))


@pytest.mark.parametrize("tie", [False, True])
def test_weight_decay_groups_follow_the_local_engine_and_keep_tied_copies_together(tie):
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, tie_embeddings=tie)
    model = build_model(cfg, seed=0)
    ours, local = param_groups(model, 0.1), local_param_groups(model, 0.1)
    assert [{id(p) for p in g["params"]} for g in ours] == [{id(p) for p in g["params"]} for g in local]
    last = prune_to_stage(build_model(cfg, seed=0), range(1, 2), is_first_stage=False, is_last_stage=True)
    no_decay = {id(p) for p in param_groups(last, 0.1)[1]["params"]}
    assert (id(last.lm_head.weight) in no_decay) == tie  # the tied copy is the embedding
