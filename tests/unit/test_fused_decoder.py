"""The decoder step's training form (model/decoder.py, model/dense_decode.py) against the executable
reference (rlt_mega/reference.py: the modules and plain autograd), same weights: loss and every
parameter's gradient in float64 (1e-12) and fp32 (1e-5 relative, norm-wise) for every model
variant, bf16 within bf16 rounding, central finite differences on each gradient path,
bit-identical gradients across checkpointing modes, the capture-ready (static) form and the
CUDA-graph orchestration on the CPU, a GRPO step's gradient, and the buffers' reuse across steps."""

import pytest
import torch

from rlt_mega.config import CheckpointingConfig, ConfigError, ModelConfig, load_config
from rlt_mega.learner.grpo import group_advantages, grpo_loss
from rlt_mega.learner.logprob import dense_inputs, dense_logprobs, dense_logprobs_from_logits
from rlt_mega.model import kernels as fused, run_buffers
from rlt_mega.model.rlt import build_model
from rlt_mega.model.dense_decode import Decoder
from rlt_mega.parallel.cuda_graphs import GraphedDecoder, install_cuda_graphs
from rlt_mega.reference import ReferenceDecoder, reference_forward
from rlt_mega.rollout import Processing, SamplingParams, generate, replay

V = 29


def cfg_of(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, memory_block=3,
                max_seq_len=64, init_std=0.1)
    base.update(kw)
    return ModelConfig(**base)


def tokens(B=3, T=11, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(cfg: ModelConfig, x: torch.Tensor, dtype=torch.float32, reference=False, ckpt=None,
                   autocast=False, static=False, graphs=False):
    model = build_model(cfg, seed=0).to(dtype)
    if ckpt is not None:
        model.set_checkpointing(CheckpointingConfig(**ckpt))
    if static:
        model.decoder = Decoder(static=True)
    if graphs:
        model.decoder = GraphedDecoder()  # on a CPU: the captured bodies are called, not replayed
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = reference_forward(model, x) if reference else model(x)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
    loss = (logits * w).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


@pytest.fixture(params=["mm", "onednn"])
def kernel(request, monkeypatch):
    """Both GEMM kernels of fused.Gemm (oneDNN normally serves only weights of d >= 192)."""
    if request.param == "onednn":
        if not fused._MKLDNN:
            pytest.skip("no oneDNN in this torch build")
        monkeypatch.setattr(fused, "MKLDNN_MIN_ELEMENTS", 0)
    return request.param


VARIANTS = {  # every T below is not a multiple of C
    "C1_gqa": dict(memory_block=1),
    "C3_mqa_qkv_bias": dict(memory_block=3, n_kv_heads=1, qkv_bias=True),
    "C4_tied_own_decoder_blocks": dict(memory_block=4, tie_embeddings=True, share_weights=False, n_kv_heads=4),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_equals_module_path_float64_and_fp32(variant, kernel):
    cfg, x = cfg_of(**VARIANTS[variant]), tokens(T=11)
    if kernel == "mm":  # fp64 runs torch.mm only
        ref_loss, ref = loss_and_grads(cfg, x, torch.float64, reference=True)
        loss, got = loss_and_grads(cfg, x, torch.float64)
        assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
        for n in ref:
            assert (got[n] - ref[n]).abs().max() <= 1e-12 * max(1.0, float(ref[n].abs().max())), n
    ref_loss, ref = loss_and_grads(cfg, x, reference=True)
    loss, got = loss_and_grads(cfg, x)
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for n in ref:
        assert rel(got[n], ref[n]) <= 1e-5, (n, rel(got[n], ref[n]))


@pytest.mark.parametrize("params", ["autocast", "bf16_parameters"])
def test_bf16_within_bf16_rounding_of_the_module_path(params):
    """Both paths in bf16 against the fp32 module path: the fused path's error is of the module
    path's size (bf16 rounding), and the two agree to bf16 precision."""
    cfg, x = cfg_of(memory_block=4), tokens(T=10)
    _, exact = loss_and_grads(cfg, x, reference=True)
    kw = dict(autocast=True) if params == "autocast" else dict(dtype=torch.bfloat16)
    _, ref = loss_and_grads(cfg, x, reference=True, **kw)
    _, got = loss_and_grads(cfg, x, **kw)
    worst_fused = max(rel(got[n], exact[n]) for n in exact)
    worst_module = max(rel(ref[n], exact[n]) for n in exact)
    assert worst_fused < 0.05 and worst_fused < 3 * worst_module + 1e-3, (worst_fused, worst_module)
    assert max(rel(got[n], ref[n]) for n in ref) < 0.05


# one parameter on each gradient path: the recurrence (recur_proj, z_init), the decoder's own K/V
# (its own blocks, share_weights=false), the encoder memory (cross k/v, memory_norm, null_memory)
FD_PARAMS = ["recur_proj.weight", "z_init", "dec_blocks.1.attn.k.weight", "dec_blocks.0.attn.v.weight",
             "cross.1.attn.k.weight", "cross.0.attn.v.weight", "memory_norm.weight", "null_memory"]


@pytest.mark.parametrize("name", FD_PARAMS)
def test_fused_gradient_matches_central_finite_differences(name):
    cfg = cfg_of(d_model=16, ffn_hidden=24, memory_block=2, share_weights=False)
    model = build_model(cfg, seed=0).double()
    x = tokens(B=2, T=7)
    w = torch.randn(2, 7, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    param = dict(model.named_parameters())[name]
    (grad,) = torch.autograd.grad((model(x) * w).sum(), [param])
    flat = param.data.view(-1)
    picks = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))[:4].tolist()
    eps = 1e-6
    for i in picks:
        orig = flat[i].item()
        with torch.no_grad():
            flat[i] = orig + eps
            up = float((model(x) * w).sum())
            flat[i] = orig - eps
            down = float((model(x) * w).sum())
            flat[i] = orig
        fd = (up - down) / (2 * eps)
        assert abs(fd - grad.view(-1)[i].item()) <= 1e-6 * max(1.0, abs(fd)), (name, i, fd)
    assert grad.abs().sum() > 0


MODES = [dict(decoder="step"), dict(decoder="every_k", decoder_k=2), dict(decoder="every_k", decoder_k=3),
         dict(decoder="every_k", decoder_k=7), dict(decoder="every_k", decoder_k=8),
         dict(decoder="every_k", decoder_k=40), dict(decoder="step", encoder=True)]


@pytest.mark.parametrize("form", ["eager", "static", "graphs"])
def test_checkpointing_modes_give_bit_identical_gradients(kernel, form, monkeypatch):
    """Saving everything against recomputing segments of k positions (attention included) from the
    stage inputs a checkpointed run keeps (model/decoder.py). T = 37 spans several K/V-gradient
    chunks (16) and, with 8-row weight-gradient flushes (W = 4 positions at B = 2), ten flushes
    through the ring: k = 1 and 2 (segments inside a flush chunk: a ring of W slots), 3 and 7
    (segments across flushes: W + k - 1 positions rounded to chunks), 8 (chunks inside a segment),
    40 (past the capacity: one segment)."""
    monkeypatch.setattr(run_buffers, "WGRAD_ROWS", 8)
    cfg, x = cfg_of(memory_block=3, max_seq_len=64), tokens(B=2, T=37)
    static, graphs = form == "static", form == "graphs"
    base_loss, base = loss_and_grads(cfg, x, static=static, graphs=graphs)
    for mode in MODES:
        loss, other = loss_and_grads(cfg, x, ckpt=mode, static=static, graphs=graphs)
        assert torch.equal(loss, base_loss), mode
        for n in base:
            assert torch.equal(other[n], base[n]), (mode, n)


@pytest.mark.parametrize("precision", ["bf16_weights", "bf16_autocast"])
@pytest.mark.parametrize("C", [1, 3])
def test_checkpointing_is_bit_identical_in_bf16(precision, C, monkeypatch):
    """The same in bf16 (bf16 weights and activations, or fp32 weights under autocast: the
    stream fp32, the products bf16), memory blocks of 1 and 3."""
    monkeypatch.setattr(run_buffers, "WGRAD_ROWS", 8)
    cfg, x = cfg_of(memory_block=C, max_seq_len=64), tokens(B=2, T=23)
    kw = dict(dtype=torch.bfloat16) if precision == "bf16_weights" else dict(autocast=True)
    base_loss, base = loss_and_grads(cfg, x, **kw)
    for mode in (dict(decoder="step"), dict(decoder="every_k", decoder_k=5)):
        loss, other = loss_and_grads(cfg, x, ckpt=mode, **kw)
        assert torch.equal(loss, base_loss), mode
        for n in base:
            assert torch.equal(other[n], base[n]), (mode, n)


def test_a_checkpointed_run_keeps_the_inputs_and_a_ring():
    """What recomputation saves: a checkpointed run's activations are a ring of whole flush chunks
    covering W + k - 1 positions, next to the stage inputs (T, B, d); "step" keeps the tensors
    only its own backward reads in one slot."""
    assert run_buffers.ring_slots(2, 37, None) == 37
    W = run_buffers.wgrad_positions(2, 37)  # 256 at the default 512 rows: capped at the capacity
    assert W == 37 and run_buffers.ring_slots(2, 37, 1) == 37
    assert run_buffers.wgrad_positions(16, 512) == 32
    assert [run_buffers.ring_slots(16, 512, k) for k in (1, 2, 16, 64, 33, 34, 600)] == [32, 32, 32, 64, 64, 96, 512]
    bufs = {b.name: b for b in run_buffers.run_buffers(range(1), 16, 512, 513, 8, 4, 2, 1, 12, grad=True,
                                                         with_input=True, checkpoint=1)}
    assert bufs["x"].shape == (512, 16, 8) and bufs["a10"].shape[0] == 32 and bufs["qk0"].shape[0] == 1
    assert bufs["f0"].shape[0] == 32 and bufs["a0"].shape[0] == 32 and bufs["du"].shape[0] == 512
    none = {b.name for b in run_buffers.run_buffers(range(1), 16, 512, 513, 8, 4, 2, 1, 12, grad=True,
                                                    with_input=True)}
    assert "x" not in none


@pytest.mark.parametrize("form", ["static", "graphs"])
def test_capture_ready_step_equals_the_module_path(form, kernel):
    """The capture-ready form (t a device tensor, full-capacity attention under masks, writes
    by index_copy_) and its CUDA-graph orchestration (model/cuda_graphs.py; on a CPU the captured
    bodies are called instead of replayed), checkpointed and not, against the module path."""
    cfg, x = cfg_of(memory_block=3, n_kv_heads=1, qkv_bias=True), tokens(T=13)
    for ckpt in (None, dict(decoder="every_k", decoder_k=4)):
        ref_loss, ref = loss_and_grads(cfg, x, reference=True, ckpt=ckpt)
        loss, got = loss_and_grads(cfg, x, ckpt=ckpt, static=form == "static", graphs=form == "graphs")
        assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss))
        for n in ref:
            assert rel(got[n], ref[n]) <= 1e-5, (form, ckpt, n)


def test_a_captured_run_is_reused_across_steps_with_the_current_weights():
    cfg = cfg_of()
    model = build_model(cfg, seed=0)
    model.decoder = GraphedDecoder()
    ref = build_model(cfg, seed=0)
    for step in range(3):
        x = tokens(seed=step)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            (m(x) if m is model else reference_forward(m, x)).square().mean().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel(p.grad, q.grad) <= 1e-5, (step, n)
        with torch.no_grad():  # an optimizer step: the next forward must see these weights
            for m in (model, ref):
                for p in m.parameters():
                    p.add_(p.grad, alpha=-0.1)
    assert sum(len(runs) for runs in model.decoder.graphs.runs.values()) == 1


def test_gradients_of_one_step_survive_the_next():
    """The step's buffers come from a reused workspace slab: nothing handed to autograd (or
    kept by the caller) may alias it."""
    model = build_model(cfg_of(), seed=0)
    x = tokens()
    emb = model.embed(x).detach().requires_grad_(True)
    with torch.no_grad():
        m = model.memory_norm(model.encode(model.embed(x)))
    m.requires_grad_(True)
    z = model.decode_dense(emb, model.memory_kv(m))
    z.sum().backward()
    kept = [emb.grad.clone(), m.grad.clone()]
    held = [emb.grad, m.grad]
    for seed in range(3):  # more steps of the same shape take the slab back
        model(tokens(seed=seed + 1)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(held, kept))


def test_evaluation_forward_equals_the_training_forward():
    model = build_model(cfg_of(), seed=0)
    x = tokens()
    with_grad = model(x)
    with torch.no_grad():
        assert torch.equal(model(x), with_grad)


def test_a_grpo_step_gradient_equals_the_reference():
    """The learner's dense log-probs (the gradient side of the hybrid) through the decoder step,
    following the batch's rows (compaction, shared prompts): a GRPO loss's gradient within fp32
    tolerance of the reference's (every row at every position), same rollout."""
    cfg = cfg_of(vocab_size=48, memory_block=4, max_seq_len=48)
    prompts = [[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13], [1, 2, 3]]
    grads = {}
    rollout = None
    for reference in (True, False):
        model = build_model(cfg, seed=0)
        if rollout is None:
            rollout = generate(model, prompts, SamplingParams(Processing(temperature=0.7, top_p=0.9), max_new_tokens=8),
                               seeds=[1, 2, 3, 4], pad_id=0)
        if reference:
            logp = dense_logprobs_from_logits(reference_forward(model, dense_inputs(rollout)), rollout)
        else:
            logp = dense_logprobs(model, rollout)
        adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
        out = grpo_loss(logp, rollout.mu, adv, rollout.mask, eps_low=0.2, eps_high=0.28)
        (out.loss / rollout.num_completion_tokens()).backward()  # the engines' division (rlt_mega/loss.py)
        grads[reference] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, g in grads[True].items():
        assert rel(grads[False][n], g) <= 1e-5, n


def test_sampler_on_the_onednn_kernels_replays_bit_for_bit(monkeypatch):
    """The sampler's step is the training step's forward (kernels.Gemm): on oneDNN its replay
    equals its rollout bit for bit and it matches the reference decoder's rollout."""
    if not fused._MKLDNN:
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(fused, "MKLDNN_MIN_ELEMENTS", 0)
    model = build_model(cfg_of(vocab_size=48, max_seq_len=48), seed=0)
    prompts = [[1, 2, 3], [6, 7, 8, 9, 10], [3, 5, 7, 9, 11, 13]]
    params = SamplingParams(Processing(temperature=0.8), max_new_tokens=8)
    rollout = generate(model, prompts, params, seeds=[1, 2, 3], pad_id=0)
    assert rollout.schedule.decoder == "fused"
    assert torch.equal(replay(model, rollout), rollout.mu)
    slow = generate(model, prompts, params, seeds=[1, 2, 3], pad_id=0, decoder=ReferenceDecoder())
    both = rollout.mask & slow.mask & torch.isfinite(slow.mu) & torch.isfinite(rollout.mu)
    assert torch.equal(slow.tokens, rollout.tokens)
    assert both.sum() > 10 and (slow.mu - rollout.mu)[both].abs().max() < 1e-5


def test_cuda_graphs_settings_are_checked():
    with pytest.raises(ConfigError, match="train.cuda_graphs=true with train.device='cpu'"):
        load_config(None, ["train.cuda_graphs=true", "train.device=cpu"])
    with pytest.raises(ConfigError, match="model.fused_decoder was removed"):
        load_config(None, ["model.fused_decoder=false"])
    # every layout the planner ranks: TP (all-reduces inside the captured bodies), PP (a stage's
    # positions captured, sends and receives outside), both
    for layout in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"]):
        assert load_config(None, ["train.cuda_graphs=true", *layout]).train.cuda_graphs
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            install_cuda_graphs(build_model(cfg_of(), seed=0))


def test_a_graph_kept_after_its_backward_gives_its_buffers_back():
    """A graph that outlives its backward (DeepSpeed's hooks hold the last step's until the next
    backward) must not keep its run's buffers into the next forward; a retained graph keeps them
    for its second backward."""
    from rlt_mega.model.workspace import WORKSPACE

    model = build_model(cfg_of(), seed=0)
    held = model(tokens())  # kept alive, as DeepSpeed keeps it
    held.sum().backward(retain_graph=True)
    (ctx,) = [r() for r in model.decoder.graphs_alive]
    model(tokens(seed=1)).sum().backward()
    assert ctx.run is not None  # retained: a second backward may come
    held.sum().backward()  # that second backward, not retained
    WORKSPACE.clear()
    model(tokens(seed=2))  # the next forward frees the spent run: its slab is back in the pool
    assert ctx.run is None and WORKSPACE.free_bytes() > 0


@pytest.mark.parametrize("checkpoint", [None, 3])
def test_a_captured_stage_run_equals_the_eager_one(checkpoint, monkeypatch):
    """A pipeline stage's micro-batch on the capture-ready step (parallel/cuda_graphs.py
    CapturedStageRun: the bodies called directly on the CPU) against the eager run, position by
    position as the stage drives them: outputs, input gradients, memory and embedding gradients,
    and the weight gradients flushed into the round's accumulators."""
    from rlt_mega.model.decoder import DecoderRun
    from rlt_mega.model.stack import WeightGrads
    from rlt_mega.parallel.cuda_graphs import CapturedStageRun

    monkeypatch.setattr(run_buffers, "WGRAD_ROWS", 8)  # W = 4 positions at B = 2: flushes inside the run
    cfg, B, T = cfg_of(memory_block=3), 2, 11
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(3)
    spec, weights = model.decoder.weights(model, range(cfg.n_layers), True)
    stack = model.decoder.stack(model, spec, weights, B, True, torch.float32, torch.float32)
    memory = [(torch.randn(B, cfg.n_kv_heads, 1 + T, cfg.head_dim, generator=g),
               torch.randn(B, cfg.n_kv_heads, 1 + T, cfg.head_dim, generator=g)) for _ in range(cfg.n_layers)]
    e = torch.randn(T, B, cfg.d_model, generator=g)
    xs = torch.randn(T, B, cfg.d_model, generator=g)  # what arrives over the wire at each position
    gys = torch.randn(T, B, cfg.d_model, generator=g)
    mode = "save" if checkpoint is None else "checkpoint"
    results = []
    for captured in (False, True):
        grads = WeightGrads(spec, [w.detach() for w in weights])
        if captured:
            run = CapturedStageRun(stack, B, T, memory, grads, checkpoint, capture=False)
        else:
            run = DecoderRun(stack, B, T, memory, grads=grads, checkpoint=checkpoint, embeddings=e)
        ys = torch.stack([run.forward(t, xs[t], e[t], mode) for t in range(T)])
        gxs = torch.stack([run.backward(t, gys[t]) for t in reversed(range(T))])
        mem = [g for pair in run.memory_grads() for g in pair]
        results.append((ys, gxs, mem, run.input_grads(), grads.grads()))
    eager, graphed = results
    for a, b in zip(eager, graphed):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert rel(y, x) <= 1e-5
