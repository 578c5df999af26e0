"""The position-chunked head (train.checkpointing.head_chunk, loss.Logits): the language-model
loss and the GRPO objective over chunks of positions, each chunk's logits recomputed in the
backward, against the same chunks kept (bit for bit: the recomputation is exact) and against the
whole head at once (to rounding: the head's GEMM sums in an order that depends on its number of
rows, and a summed loss and the head's weight gradients add the chunks' parts); and the head's
peak memory (MemTracker) down to one chunk's."""

import pytest
import torch

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig
from rlt_mega.cost.layout import Layout
from rlt_mega.cost.measure import _PeakTracker
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.learner.grpo import group_advantages
from rlt_mega.learner.logprob import replay_logprobs
from rlt_mega.learner.objective import GRPOObjective, GRPOPart, grpo_batch
from rlt_mega.loss import LM_LOSS, WHOLE_VOCAB, Logits
from rlt_mega.model.rlt import build_model
from rlt_mega.precision import precision
from rlt_mega.rollout import Processing, SamplingParams, generate
from rlt_mega.schedule.dense import DenseRows


def tiny(vocab: int = 64):
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=2,
                      max_seq_len=64, init_std=0.1)
    return build_model(cfg, seed=0)


def grads(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(whole: dict, chunked: dict, dtype: str) -> bool:
    """Every gradient within rounding of the whole head's: fp32 to 1e-5 of the largest, bf16 (whose
    head GEMM rounds its logits to bf16, and whose chunked weight gradients add bf16 parts) to 2e-2."""
    tol = 1e-5 if dtype == "fp32" else 2e-2
    scale = max(float(g.abs().max()) for g in whole.values())
    return sorted(whole) == sorted(chunked) and all(
        float((whole[n] - chunked[n]).abs().max()) <= tol * scale for n in whole)


def equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_chunked_language_model_loss(dtype):
    model = tiny()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (3, 12), generator=g), torch.randint(0, 64, (3, 12), generator=g)
    y[0, 5:] = -100
    batch = {"inputs": x, "targets": y}

    def loss(chunk: int, recompute: bool = True):
        with precision(dtype, "cpu"):
            if not chunk:
                return LM_LOSS.logits_loss(model(x), batch, WHOLE_VOCAB)
            return LM_LOSS.logits_loss(Logits(model(x, hidden=True), model.head, chunk, recompute), batch,
                                       WHOLE_VOCAB)

    whole = loss(0)
    g_whole = grads(model, whole)
    for chunk in (5, 36, 100):  # a ragged last chunk, exactly the positions, more than them
        chunked, kept = loss(chunk), loss(chunk, recompute=False)
        assert torch.equal(chunked, kept)
        g_kept = grads(model, kept)
        assert equal(grads(model, chunked), g_kept)
        assert torch.allclose(chunked, whole, rtol=1e-5 if dtype == "fp32" else 1e-2), (chunk, chunked, whole)
        assert close(g_whole, g_kept, dtype)


def rollout_of(model, dtype: str):
    return generate(model, [[1, 2, 3], [6, 7, 8, 9, 10], [1, 2, 3], [4, 4]],
                    SamplingParams(Processing(temperature=0.7, top_k=20), max_new_tokens=7), seeds=[1, 2, 3, 4],
                    pad_id=0, dtype=dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_chunked_grpo_objective_equals_the_whole_head(dtype):
    """The dense schedule with compaction and shared prompts (rows.head picks the positions the loss
    reads; the chunks pick the same ones), the entropy bonus on: the loss equal, the gradients as
    above, and the hybrid's value the replay, equal to mu."""
    model = tiny()
    ro = rollout_of(model, dtype)
    part = GRPOPart(ro, replay_logprobs(model, ro), group_advantages(torch.tensor([1.0, 0.0, 0.5, 1.0]), 4))
    assert torch.equal(part.replay[ro.mask.bool()], ro.mu[ro.mask.bool()])
    batch = grpo_batch([part])
    rows: DenseRows = batch["dense_rows"]

    def loss(chunk: int, recompute: bool = True):
        objective = GRPOObjective()
        objective.settings = type(objective.settings)(entropy_coef=0.01)
        with precision(ro.schedule.dtype, "cpu"):
            z = model(batch["inputs"], rows=rows, hidden=True)
            logits = Logits(z, model.head, chunk, recompute) if chunk else rows.head(model.head, z)
            out = objective.logits_loss(logits, batch, WHOLE_VOCAB)
        return out, objective.records[0]

    whole, record = loss(0)
    g_whole = grads(model, whole)
    for chunk in (3, 1000):
        (chunked, chunked_record), (kept, kept_record) = loss(chunk), loss(chunk, recompute=False)
        assert torch.equal(chunked, kept) and chunked_record == kept_record
        g_kept = grads(model, kept)
        assert equal(grads(model, chunked), g_kept)
        assert torch.allclose(chunked, whole, rtol=1e-5 if dtype == "fp32" else 1e-2)
        assert close(g_whole, g_kept, dtype)
    # the hybrid's value is the replay whatever the head: its ratios to mu are exactly 1
    assert record["ratio_min"] == record["ratio_max"] == chunked_record["ratio_max"] == 1.0


def head_peak(model, z: torch.Tensor, batch: dict, chunk: int) -> int:
    """Peak bytes above the start of the head's forward and backward over z (MemTracker)."""
    class Head(torch.nn.Module):  # MemTracker follows modules from one root call
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, z):
            logits = Logits(z, model.head, chunk) if chunk else model.head(z)
            return LM_LOSS.logits_loss(logits, batch, WHOLE_VOCAB)

    tracker = _PeakTracker()
    tracker.track_external(model, z)
    with tracker:
        start = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        root = Head()
        root(z).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak - start


def test_the_heads_peak_memory_is_one_chunks():
    """The head's forward and backward over 1 and 4 rows of 64 positions, a 2048-word vocabulary:
    whole, the peak grows by the fp32 logits and their gradients (>= 2 x 4 V bytes a position);
    chunked by 16 positions, only by what is d wide (z's gradient: <= 4 x 4 d bytes a position),
    and 4 rows chunked peak below 1 row whole."""
    model = tiny(vocab=2048)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 2048, (4, 64), generator=g)
    batch = {"inputs": x, "targets": torch.randint(0, 2048, (4, 64), generator=g)}
    z = model(x, hidden=True).detach()

    def peak(rows: int, chunk: int) -> int:
        return head_peak(model, z[:rows].clone().requires_grad_(True), {k: v[:rows] for k, v in batch.items()}, chunk)

    more = 3 * 64  # positions from 1 row to 4
    whole, chunked = (peak(1, 0), peak(4, 0)), (peak(1, 16), peak(4, 16))
    assert whole[1] - whole[0] >= 2 * 4 * 2048 * more, whole
    assert chunked[1] - chunked[0] <= 4 * 4 * 32 * more, chunked
    assert chunked[1] < whole[0], (chunked, whole)


def test_the_planners_chunked_head_peak_against_memtracker():
    """The trainer's step (LocalEngine.train_step) with the head chunked, where the head's backward
    is the step's peak (an 8192-word vocabulary over 128 positions in chunks of 96 and 32: the
    last chunk's recomputation beside the head weight's gradient of the first): cost/memory.py's
    head_backward within 5% of MemTracker (+0.4%)."""
    from tests.unit.test_costmodel import CONFIGS, CPU, _measure_engine_step

    cfg = ModelConfig(**{**CONFIGS["tiny"], "vocab_size": 8192})
    ck = CheckpointingConfig(decoder="step", head_chunk=96)
    predicted = estimate_memory(cfg, Layout(seq_len=16, micro_batch_size=8, checkpointing=ck, onednn_weights=True,
                                            **CPU), 0)
    assert predicted.peak_phase == "head_backward"
    assert predicted.peak == pytest.approx(_measure_engine_step(cfg, 8, 16, ck), rel=0.05), predicted.phases


def test_the_planners_head_recomputation_is_what_flop_counter_counts():
    """The chunked head's backward runs each chunk's lm_head GEMM once more: cost/flops.py's head
    row prices it as recomputation, and flop_counter counts exactly that much more."""
    from rlt_mega.cost.flops import flop_rows
    from rlt_mega.cost.measure import count_flops

    model = tiny(vocab=512)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    batch = {"inputs": x, "targets": x}
    z = model(x, hidden=True).detach().requires_grad_(True)

    def flops(chunk: int) -> int:
        def step():
            logits = Logits(z, model.head, chunk) if chunk else model.head(z)
            LM_LOSS.logits_loss(logits, batch, WHOLE_VOCAB).backward()
        return count_flops(step)

    head = [r for r in flop_rows(model.cfg, 24, CheckpointingConfig(head_chunk=10)) if r.part == "head"]
    assert len(head) == 1 and head[0].recompute == head[0].forward > 0
    assert flops(10) - flops(0) == 2 * head[0].recompute  # 2 rows of 24 positions


def test_a_loss_that_reads_no_position_reads_an_empty_chunk():
    z = torch.randn(2, 3, 8, requires_grad=True)
    head = torch.nn.Linear(8, 5)
    for chunk in (0, 2):
        out = Logits(z, head, chunk).map(lambda x: x.sum(-1), torch.zeros(0, dtype=torch.long))
        assert len(out) == 1 and out[0].shape == (0,)


def test_a_negative_head_chunk_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.checkpointing\.head_chunk=-1.*0 computes the head"):
        CheckpointingConfig(head_chunk=-1)
