"""The cost model against what really happens on this CPU: parameter counts against the
real module (and megatron-core's own tensor-parallel shards), FLOPs against
torch.utils.flop_counter, peak memory against torch's MemTracker, ZeRO partitions and peaks
against DeepSpeed on two gloo ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig
from rlt_mega.model import kernels as fused_kernels, run_buffers
from rlt_mega.model.decoder import DecoderRun
from rlt_mega.model.stack import WeightGrads
from rlt_mega.model.workspace import WORKSPACE
from rlt_mega.model.rlt import build_model
from rlt_mega.cost.fused_memory import fused_weight_bytes, run_buffer_bytes, run_scratch_bytes
from rlt_mega.cost.comm import bubble_fraction, comm_per_step, ring_ticks
from rlt_mega.cost.costmodel import estimate, format_report
from rlt_mega.cost.flops import flop_rows, sdpa_rows, summarize
from rlt_mega.cost.layout import Layout
from rlt_mega.parallel.dims import free_port
from rlt_mega.cost.measure import count_flops, peak_step_memory
from rlt_mega.cost.memory import estimate_memory
from rlt_mega.cost.params import rank_param_counts, rank_tensor_numels, stage_layers

CONFIGS = {
    "tiny": dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
    "gqa_bias": dict(vocab_size=100, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, qkv_bias=True,
                     memory_block=3, max_seq_len=64),
    "tied_unshared": dict(vocab_size=90, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, tie_embeddings=True,
                          share_weights=False, ffn_hidden=80, max_seq_len=64),
    "small": dict(vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, memory_block=4,
                  max_seq_len=64),
}


def group_of(name: str) -> str:
    """The cost model's parameter group of a real parameter name."""
    head = name.split(".")[0]
    return {"blocks": "blocks", "dec_blocks": "decoder_blocks", "cross": "cross", "embed": "embed",
            "lm_head": "lm_head", "recur_norm": "recurrence", "recur_proj": "recurrence",
            "z_init": "recurrence", "memory_norm": "memory", "null_memory": "memory",
            "final_norm": "final_norm"}[head]


# ---------------------------------------------------------------- parameters
@pytest.mark.parametrize("name", list(CONFIGS))
def test_param_counts_equal_the_module(name):
    cfg = ModelConfig(**CONFIGS[name])
    model = build_model(cfg, device="meta")
    real = dict.fromkeys(rank_param_counts(cfg), 0)
    for pname, p in model.named_parameters():  # tied weights appear once
        real[group_of(pname)] += p.numel()
    real["total"] = sum(p.numel() for p in model.parameters())
    assert rank_param_counts(cfg) == real
    assert sorted(rank_tensor_numels(cfg)) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,pp,split", [("small", 2, None), ("small", 2, [3, 1]), ("gqa_bias", 3, None),
                                          ("tied_unshared", 2, None)])
def test_pipeline_stage_shares(name, pp, split):
    """Assign the real parameters to stages by docs/design.md, "Parallel layout" and count."""
    cfg = ModelConfig(**CONFIGS[name])
    model = build_model(cfg, device="meta")
    layers = stage_layers(cfg.n_layers, pp, split)
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        real = 0
        for pname, p in model.named_parameters():
            head = pname.split(".")[0]
            if head in ("blocks", "dec_blocks", "cross"):
                real += p.numel() if int(pname.split(".")[1]) in layers[s] else 0
            elif head in ("embed", "recur_norm", "recur_proj", "z_init"):
                real += p.numel() if first else 0
            elif head in ("memory_norm", "final_norm", "lm_head"):
                real += p.numel() if last else 0
            elif head == "null_memory":
                real += p.numel()  # every stage
        if last and cfg.tie_embeddings and pp > 1:
            real += model.embed.weight.numel()  # the last stage's copy of the tied matrix
        assert rank_param_counts(cfg, 1, pp, s, split)["total"] == real
        assert sum(rank_tensor_numels(cfg, 1, pp, s, split)) == real


class _FakeGroup:
    """Stands in for a tensor-parallel process group: megatron-core sizes its shards from
    group.size() and group.rank() only."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def single_rank_gloo():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name,tp", [("tiny", 2), ("gqa_bias", 2), ("small", 2), ("tiny", 4)])
def test_tensor_parallel_shares_equal_megatron(name, tp, single_rank_gloo):
    """Builds each rank's layers with megatron-core's parallel layers, following the table of
    docs/design.md, "Parallel layout", and counts what megatron allocates."""
    import warnings

    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    cfg = ModelConfig(**CONFIGS[name])
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_hidden
    mp_cfg = ModelParallelConfig(use_cpu_initialization=True, tensor_model_parallel_size=tp)
    init = torch.nn.init.zeros_
    warnings.filterwarnings("ignore")
    for rank in range(tp):
        group = _FakeGroup(tp, rank)

        def col(n_in, n_out, bias=False):
            return ColumnParallelLinear(n_in, n_out, config=mp_cfg, init_method=init, bias=bias,
                                        gather_output=False, tp_group=group)

        def row(n_in, n_out):
            return RowParallelLinear(n_in, n_out, config=mp_cfg, init_method=init, bias=False,
                                     input_is_parallel=True, skip_bias_add=False, tp_group=group)

        def numel(*modules):
            return sum(p.numel() for m in modules for p in m.parameters())

        block = numel(col(d, q, cfg.qkv_bias), col(d, kv, cfg.qkv_bias), col(d, kv, cfg.qkv_bias), row(q, d),
                      col(d, f), col(d, f), row(f, d)) + 2 * d  # + attn_norm, mlp_norm
        cross = numel(col(d, q), col(d, kv), col(d, kv), row(q, d)) + d
        vocab = numel(VocabParallelEmbedding(cfg.vocab_size, d, init_method=init, config=mp_cfg, tp_group=group))
        predicted = rank_param_counts(cfg, tp=tp)
        assert predicted["blocks"] == cfg.n_layers * block
        assert predicted["cross"] == cfg.n_layers * cross
        assert predicted["embed"] == vocab
        assert predicted["lm_head"] == (0 if cfg.tie_embeddings else vocab)


def test_bad_layouts_are_refused_with_the_trainers_messages():
    """The cost model's layouts follow the trainer's rules (parallel/dims.py), messages and all;
    an uneven split is a layout the trainer runs (earlier stages take the remainder)."""
    cfg = ModelConfig(**CONFIGS["small"])
    with pytest.raises(ConfigError, match="is not divisible by parallel.tp=3: tensor parallelism splits it"):
        rank_param_counts(cfg, tp=3)
    with pytest.raises(ConfigError, match="some stages would have no layers"):
        rank_param_counts(cfg, pp=cfg.n_layers + 1)
    with pytest.raises(ConfigError, match="sums to 2 but model.n_layers"):
        rank_param_counts(cfg, pp=2, pp_split=[1, 1])
    uneven = [rank_param_counts(cfg, pp=3, stage=s)["blocks"] for s in range(3)]
    assert uneven == [2 * uneven[2], uneven[2], uneven[2]] and cfg.n_layers == 4  # layers [0, 1], [2], [3]
    with pytest.raises(ConfigError, match="zero_stage"):
        Layout(seq_len=8, zero_stage=4)


# ---------------------------------------------------------------- FLOPs
FLOP_CASES = [("tiny", "none", False), ("gqa_bias", "none", False), ("gqa_bias", "step", True),
              ("tied_unshared", "every_k", False), ("small", "every_k", True)]


@pytest.mark.parametrize("name,mode,enc", FLOP_CASES)
def test_flops_equal_flop_counter(name, mode, enc):
    """With the math SDPA backend every matmul is visible to flop_counter, including the
    decoder self-attention's custom autograd Function (torch.matmul -> bmm) and the
    checkpoint recomputation. Norms, RoPE, softmax and the loss are not matmuls: excluded
    on both sides."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = ModelConfig(**CONFIGS[name])
    ck = CheckpointingConfig(decoder=mode, decoder_k=3, encoder=enc)
    model = build_model(cfg, seed=0)
    model.set_checkpointing(ck)
    B, T = 2, 11
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    predicted = summarize(flop_rows(cfg, T, ck, kernel="math"), T)
    with sdpa_kernel(SDPBackend.MATH):
        forward = count_flops(lambda: model(tokens))
        step = count_flops(lambda: F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward())
    assert forward == pytest.approx(B * predicted["forward"], rel=0.05)
    assert step == pytest.approx(B * predicted["hardware"], rel=0.05)


def test_default_cpu_attention_kernel_is_not_counted():
    """torch 2.13's flop_counter has no formula for the CPU flash kernel: on CPU it misses
    exactly the encoder and cross-attention scores (our decoder self-attention is counted)."""
    cfg = ModelConfig(**CONFIGS["gqa_bias"])
    model = build_model(cfg, seed=0)
    B, T = 2, 9
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    rows = flop_rows(cfg, T, None, kernel="math")
    visible = sum(r.forward for r in rows) - sum(r.forward for r in sdpa_rows(rows))
    assert count_flops(lambda: model(tokens)) == pytest.approx(B * visible, rel=0.05)


def test_flash_kernel_halves_causal_scores_and_recomputes_in_backward():
    cfg = ModelConfig(**CONFIGS["tiny"])
    T = 32
    flash = {(r.part, r.component): r for r in flop_rows(cfg, T, kernel="flash")}
    math_ = {(r.part, r.component): r for r in flop_rows(cfg, T, kernel="math")}
    enc = ("encoder", "self_attn_scores")
    assert flash[enc].forward == pytest.approx(math_[enc].forward * (T + 1) / (2 * T))
    assert flash[enc].backward == pytest.approx(2.5 * flash[enc].forward)
    assert flash[("decoder", "mlp")].forward == math_[("decoder", "mlp")].forward


# ---------------------------------------------------------------- memory
def _batch(cfg, B, T):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, cfg.vocab_size, (B, T), generator=gen),
            torch.randint(0, cfg.vocab_size, (B, T), generator=gen))


def _fresh_workspace(step):
    """step, with the fused decoder's workspace pool emptied first: a run's slab then counts as
    this step's memory (from the pool it would be an allocation MemTracker never saw)."""
    def run():
        WORKSPACE.clear()
        return step()
    return run


def _measure_engine_step(cfg, B, T, ck):
    """The trainer's own step (LocalEngine.train_step: loss, backward, clipping, AdamW)."""
    from rlt_mega.config import OptimConfig
    from rlt_mega.parallel.dims import ParallelDims
    from rlt_mega.parallel.engine import EngineConfig, LocalEngine

    model = build_model(cfg, seed=0)
    engine = LocalEngine(model, ParallelDims.single(cfg, "cpu"), OptimConfig(),
                         EngineConfig(total_steps=10, micro_batch_size=B, grad_accum=1, dtype="fp32", checkpointing=ck))
    inputs, targets = _batch(cfg, B, T)
    mb = {"inputs": inputs, "targets": targets}
    step = _fresh_workspace(lambda: engine.train_step([mb]))
    return peak_step_memory(step, model, engine.optimizer, inputs, targets)["Total"]


def _measure_forward_backward_bf16(cfg, B, T, ck):
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    model.set_checkpointing(ck)
    inputs, targets = _batch(cfg, B, T)

    def step():
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        for p in model.parameters():
            p.grad = None
    return peak_step_memory(_fresh_workspace(step), model, inputs, targets)["Total"]


# On CPU: RMSNorm decomposed (not the fused CUDA kernel) and the for-loop AdamW.
CPU = dict(fused_rms_norm=False, foreach_optimizer=False)
MEMORY_CASES = [("tiny", "none", False), ("tiny", "step", False), ("tiny", "every_k", True),
                ("small", "none", False), ("small", "step", True), ("small", "every_k", False)]


@pytest.mark.parametrize("name,mode,enc", MEMORY_CASES)
def test_peak_training_memory_fp32(name, mode, enc):
    """The trainer's whole step (forward, loss, backward, clipping, AdamW) at B T large
    enough that activations, not the optimizer, set the peak in most cases."""
    cfg = ModelConfig(**CONFIGS[name])
    ck = CheckpointingConfig(decoder=mode, decoder_k=3, encoder=enc)
    B, T = 8, 16
    measured = _measure_engine_step(cfg, B, T, ck)
    predicted = estimate_memory(cfg, Layout(seq_len=T, micro_batch_size=B, checkpointing=ck, **CPU), 0)
    assert predicted.peak == pytest.approx(measured, rel=0.15), predicted.phases


@pytest.mark.parametrize("mode,enc", [("none", False), ("step", True)])
def test_peak_forward_backward_memory_bf16(mode, enc):
    """bf16 weights and activations (fp32 norms, softmax, logits and decoder K/V gradients,
    as the model computes them). The optimizer is left out: the model's bf16 optimizer
    (fp32 master + moments) is DeepSpeed's, not a torch AdamW on bf16 tensors."""
    cfg = ModelConfig(**CONFIGS["tiny"])
    ck = CheckpointingConfig(decoder=mode, decoder_k=3, encoder=enc)
    B, T = 8, 16
    measured = _measure_forward_backward_bf16(cfg, B, T, ck)
    rep = estimate_memory(cfg, Layout(seq_len=T, micro_batch_size=B, checkpointing=ck, dtype="bf16", **CPU), 0)
    backward = max(rep.phases[k] for k in ("head_backward", "decoder_backward", "encoder_backward"))
    predicted = backward - rep.master_weights - rep.optimizer_states
    assert predicted == pytest.approx(measured, rel=0.15), rep.phases


# The fused decoder (the default): its slab, weight copies and accumulators (cost/fused_memory.py).
FUSED_CASES = [("tiny", "none", False, 8, 16), ("gqa_bias", "step", False, 8, 16),
               ("tied_unshared", "every_k", True, 8, 16),
               ("small", "step", False, 16, 48)]  # T > W = 32: the checkpointed slots shrink


@pytest.mark.parametrize("name,mode,enc,B,T", FUSED_CASES)
def test_peak_training_memory_fp32_fused(name, mode, enc, B, T):
    cfg = ModelConfig(**{**CONFIGS[name], "max_seq_len": max(64, T)})
    ck = CheckpointingConfig(decoder=mode, decoder_k=3, encoder=enc)
    measured = _measure_engine_step(cfg, B, T, ck)
    layout = Layout(seq_len=T, micro_batch_size=B, checkpointing=ck, onednn_weights=True, **CPU)
    predicted = estimate_memory(cfg, layout, 0)
    assert predicted.peak == pytest.approx(measured, rel=0.15), predicted.phases


@pytest.mark.parametrize("mode,enc", [("none", False), ("step", True)])
def test_peak_forward_backward_memory_bf16_fused(mode, enc):
    cfg = ModelConfig(**CONFIGS["tiny"])
    ck = CheckpointingConfig(decoder=mode, decoder_k=3, encoder=enc)
    B, T = 8, 16
    measured = _measure_forward_backward_bf16(cfg, B, T, ck)
    rep = estimate_memory(cfg, Layout(seq_len=T, micro_batch_size=B, checkpointing=ck, dtype="bf16",
                                      onednn_weights=True, **CPU), 0)
    backward = max(rep.phases[k] for k in ("head_backward", "decoder_backward", "encoder_backward"))
    assert backward - rep.master_weights - rep.optimizer_states == pytest.approx(measured, rel=0.15), rep.phases


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("name,dtype", [("tiny", "fp32"), ("tiny", "bf16"), ("small", "fp32"), ("small", "bf16")])
def test_checkpointed_step_peak_within_5_percent(name, dtype, k, monkeypatch):
    """The checkpointed decoder's peak (the kept inputs, the recomputation ring of whole flush
    chunks, the K/V) against MemTracker: with flushes of 32 rows (W = 4 positions at B = 8) the
    ring (4, 4 and 16 slots) is shorter than the T = 32 positions."""
    monkeypatch.setattr(run_buffers, "WGRAD_ROWS", 32)
    cfg = ModelConfig(**CONFIGS[name])
    ck = CheckpointingConfig(decoder="step" if k == 1 else "every_k", decoder_k=k)
    B, T = 8, 32
    layout = Layout(seq_len=T, micro_batch_size=B, checkpointing=ck, onednn_weights=True, dtype=dtype, **CPU)
    assert run_buffers.ring_slots(B, T, k) == {1: 4, 4: 4, 16: 16}[k]
    if dtype == "fp32":
        assert estimate_memory(cfg, layout, 0).peak == pytest.approx(_measure_engine_step(cfg, B, T, ck), rel=0.05)
        return
    rep = estimate_memory(cfg, layout, 0)
    backward = max(rep.phases[p] for p in ("head_backward", "decoder_backward", "encoder_backward"))
    predicted = backward - rep.master_weights - rep.optimizer_states
    assert predicted == pytest.approx(_measure_forward_backward_bf16(cfg, B, T, ck), rel=0.05), rep.phases


@pytest.mark.parametrize("name,dtype,mode,pp,stage", [
    ("tiny", "fp32", "none", 1, 0), ("gqa_bias", "bf16", "step", 1, 0), ("small", "fp32", "step", 2, 1),
    ("tied_unshared", "fp32", "every_k", 2, 0)])
def test_fused_run_buffers_equal_the_model(name, dtype, mode, pp, stage, monkeypatch):
    """The slab of the run a stage builds, purpose by purpose, and the accumulators, oneDNN
    forms and transposed copies of its stack, exactly (T > W: the checkpointed slots differ from the positions)."""
    monkeypatch.setattr(fused_kernels, "MKLDNN_MIN_ELEMENTS", 5000)  # (tiny: some weights reordered, some not)
    cfg = ModelConfig(**{**CONFIGS[name], "max_seq_len": 96})
    B, T = 16, 40
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(cfg, seed=0).to(torch_dtype)
    layers = stage_layers(cfg.n_layers, pp)[stage]
    spec, weights = model.decoder.weights(model, layers, stage == 0)
    stack = model.decoder.stack(model, spec, weights, B, True, torch_dtype, torch_dtype)
    h_kv, Dh = cfg.n_kv_heads, cfg.head_dim
    memory = [(torch.zeros(B, h_kv, 1 + T, Dh, dtype=torch_dtype),) * 2 for _ in layers]
    checkpoint = {"none": None, "step": 1, "every_k": 3}[mode]
    grads = WeightGrads(spec, weights)
    run = DecoderRun(stack, B, T, memory, grads=grads, checkpoint=checkpoint)
    layout = Layout(seq_len=T, micro_batch_size=B, pp=pp, dtype=dtype, onednn_weights=True,
                    checkpointing=CheckpointingConfig(decoder=mode, decoder_k=3), **CPU)
    assert run_buffer_bytes(cfg, layout, stage) == run.buffer_bytes()
    assert run_scratch_bytes(cfg, layout, stage) == run.scratch_bytes()
    copies = fused_weight_bytes(cfg, layout, stage)
    assert copies["accumulators"] == sum(a.numel() * a.element_size() for a in grads.acc.values())
    gemms = [getattr(g, n) for g in stack.layers.values() for n in ("qkv", "o", "cross_q", "cross_o", "gate_up",
                                                                     "down")] + [stack.recur] * (stage == 0)
    reordered = sum(2 * g.w.numel() * g.w.element_size() for g in gemms if g.mkldnn)
    assert reordered > 0 or (dtype == "bf16" and not fused_kernels.MKLDNN_BF16)  # (an AVX2-only CPU: bf16 on torch.mm)
    transposed = sum(g.wt.numel() * g.wt.element_size() for g in gemms if g.wt.data_ptr() != g.w.data_ptr())
    assert transposed == sum(g.w.numel() * g.w.element_size() for g in gemms if not g.mkldnn)  # torch.mm's copy
    fused = sum(4 * w.numel() for w in weights)  # the fused weights, fp32 at least
    assert copies["weights"] - fused - reordered - transposed == pytest.approx(
        _fold_and_cast_bytes(weights, spec, torch_dtype))


def _fold_and_cast_bytes(weights, spec, dtype) -> float:
    """What the fold's mul saves besides the parameters (the concatenated qkv and gate_up, the
    scaled cross query; every wide copy in bf16) and the products' bf16 copies, read off the
    autograd graph of the fused weights."""
    total = 0
    for (layer, name), w in zip(spec.keys, weights):
        if name in ("qkv", "cross_q", "gate_up") or (name == "recur" and dtype != torch.float32):
            total += 4 * w.numel()
        if dtype != torch.float32:
            total += w.numel() * torch.empty((), dtype=dtype).element_size()
    return total


def test_memory_shrinks_with_checkpointing_and_sharding():
    cfg = ModelConfig(**CONFIGS["small"])
    base = Layout(seq_len=64, micro_batch_size=8)
    none = estimate_memory(cfg, base, 0).peak
    step = estimate_memory(cfg, base.replace(checkpointing=CheckpointingConfig(decoder="step")), 0).peak
    assert step < none
    tp2 = estimate_memory(cfg, base.replace(tp=2), 0).peak
    assert tp2 < none
    z1 = estimate_memory(cfg, base.replace(dp=4, zero_stage=1), 0)
    z0 = estimate_memory(cfg, base.replace(dp=4, zero_stage=0), 0)
    assert z1.optimizer_states < z0.optimizer_states


# ---------------------------------------------------------------- pipeline, communication
def _simulate_ring(T: int, M: int, P: int) -> int:
    """Ticks of the decoder ring, by brute force: at each tick every stage takes the
    oldest ready (micro-batch, position) whose previous stage (or, at stage 0, the previous
    position's last stage) finished at an earlier tick."""
    done = {}  # (m, t, s) -> tick it finished
    tick = 0
    while len(done) < M * T * P:
        for s in range(P):
            ready = []
            for m in range(M):
                for t in range(T):
                    if (m, t, s) in done:
                        continue
                    prev = (m, t, s - 1) if s > 0 else ((m, t - 1, P - 1) if t > 0 else None)
                    if prev is None or done.get(prev, tick) < tick:
                        ready.append((t, m))
                    break  # positions of one micro-batch go in order
            if ready:
                t, m = min(ready)
                done[(m, t, s)] = tick
        tick += 1
    return tick


@pytest.mark.parametrize("T,M,P", [(5, 4, 4), (6, 2, 4), (4, 6, 3), (3, 1, 1), (7, 3, 2)])
def test_ring_ticks_match_a_simulation(T, M, P):
    assert ring_ticks(T, M, P) == _simulate_ring(T, M, P)


def test_bubble_formula_of_the_design():
    T, M, P = 2048, 8, 4
    assert bubble_fraction(T, M, P) == pytest.approx((P - 1) / (M * T + P - 1))
    assert bubble_fraction(T, 1, 1) == 0


def test_communication_volumes():
    cfg = ModelConfig(**CONFIGS["small"])
    T, B = 16, 2
    lay = Layout(seq_len=T, micro_batch_size=B, tp=2, pp=2, dp=2, zero_stage=1)
    c = comm_per_step(cfg, lay, 1)
    n, d, a = 2, cfg.d_model, 4
    # decoder: 3 all-reduces per layer and position forward and backward, of B d fp32
    assert c["tp"]["messages"] >= 2 * 3 * n * T
    assert c["dp"]["bytes"] == pytest.approx(2 * 0.5 * rank_param_counts(cfg, 2, 2, 1)["total"] * 4)
    assert comm_per_step(cfg, lay.replace(tp=1, pp=1, dp=1), 0) == {
        "tp": {"bytes": 0.0, "messages": 0, "group_size": 1},
        "pp": {"bytes": 0.0, "messages": 0, "group_size": 1},
        "dp": {"bytes": 0.0, "messages": 0, "group_size": 1}}
    assert c["pp"]["bytes"] > 2 * T * B * d * a  # the ring carries z at every position


def test_estimate_is_json_and_renders():
    cfg = ModelConfig(**CONFIGS["gqa_bias"])
    lay = Layout(seq_len=12, micro_batch_size=2, micro_batches=3, tp=2, pp=3, dp=2, zero_stage=2,
                 dtype="bf16", checkpointing=CheckpointingConfig(decoder="every_k", decoder_k=4))
    rep = estimate(cfg, lay)
    assert json.loads(json.dumps(rep))["params"]["total"] == sum(
        p.numel() for p in build_model(cfg, device="meta").parameters())
    per_token = rep["flops"]["per_token"]
    assert per_token["decoder"]["forward"] > per_token["encoder"]["forward"]  # cross-attention
    text = format_report(rep)
    for needle in ("Parameters", "FLOPs per token", "Pipeline", "stage 2", "rollout", "communication"):
        assert needle in text
    assert dataclasses.asdict(lay)["tp"] == 2
