"""train.bf16_cast (rlt_mega/precision.py, the local engine's copy in parallel/engine.py): the
stochastic cast is unbiased (a statistical test with a fixed seed, and a biased cast that the
same test rejects), reproducible and keyed by (master, seed, step) only; a bf16 run with it
reproduces and resumes bit for bit; precision/stale_fraction and precision/copy_lag equal an
independent computation from the masters and copies read off the run."""

import math

import pytest
import torch

from rlt_mega.config import ConfigError, ModelConfig, OptimConfig, TrainConfig, from_dict
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.parallel.engine import EngineConfig, LocalEngine
from rlt_mega.model.rlt import build_model
from rlt_mega.precision import CopyLag, bf16_copy, cast_key, stochastic_bf16

CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, memory_block=2, max_seq_len=32,
                  init_std=0.1)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values on either side of each fp32 x: its magnitude truncated, and one bf16
    step further from zero (independent of precision.py: plain bit arithmetic)."""
    bits = x.view(torch.int32)
    low = bits & ~0xFFFF
    return low.view(torch.float32), (low + 0x10000).view(torch.float32)


def _bias_z(cast, x: torch.Tensor, num_keys: int) -> float:
    """max over the elements of x of |mean(cast(x, key) - x)| / its standard error over
    num_keys keys, the error's variance that of an unbiased rounding between the neighbours:
    step^2 f (1 - f), f the fraction of the step x lies beyond the truncated value."""
    lo, hi = (v.double() for v in _neighbours(x))
    step = (hi - lo).abs()
    f = (x.double() - lo).abs() / step
    errs = torch.stack([cast(x, k).double() - x.double() for k in range(num_keys)])  # (K, n)
    sem = step * torch.sqrt(f * (1 - f) / num_keys)
    mean = errs.mean(0)
    z = torch.where(sem > 0, mean.abs() / sem.clamp_min(1e-300), torch.where(mean == 0, 0.0, math.inf))
    return float(z.max())


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # an exact bf16 value plus a quarter, a half, a tenth, 0.9 of its step; random values
    base = torch.tensor([1.0, -3.0, 0.015625, 1024.0])
    step = base.abs() * 2.0 ** -7
    crafted = torch.cat([base + f * step * torch.sign(base) for f in (0.25, 0.5, 0.1, 0.9)])
    return torch.cat([crafted, torch.randn(24, generator=g) * 10.0 ** torch.randint(-4, 3, (24,), generator=g)]).float()


def test_stochastic_cast_is_unbiased_and_the_test_rejects_a_biased_cast():
    x = _values()
    key = lambda k: cast_key(7, k)  # noqa: E731
    # 4000 draws per element: an unbiased cast stays within 4.5 standard errors on all 40
    # elements (a false alarm has probability < 1e-3 with a correct cast)
    assert _bias_z(lambda v, k: stochastic_bf16(v, key(k)).float(), x, 4000) < 4.5
    # the same test rejects a cast biased by 5% of a bf16 step (the stochastic cast of x
    # moved a twentieth of a step away from zero first)
    lo, hi = _neighbours(x)
    nudged = x + 0.05 * (hi - lo)
    assert _bias_z(lambda v, k: stochastic_bf16(nudged, key(k)).float(), x, 4000) > 4.5
    # round-to-nearest: the crafted quarter steps are always lost
    assert _bias_z(lambda v, k: v.to(torch.bfloat16).float(), x[:4], 4000) > 4.5


def test_stochastic_cast_rounds_to_a_neighbour_and_keeps_bf16_values():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    y = stochastic_bf16(x, cast_key(0, 3)).float()
    lo = torch.where(x.to(torch.bfloat16).float() <= x, x.to(torch.bfloat16).float(),
                     torch.nextafter(x.to(torch.bfloat16), torch.full_like(x, -math.inf).to(torch.bfloat16)).float())
    hi = torch.nextafter(lo.to(torch.bfloat16), torch.full_like(x, math.inf).to(torch.bfloat16)).float()
    assert bool(((y == lo) | (y == hi)).all())
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(stochastic_bf16(exact, cast_key(0, 3)).float(), exact)  # bf16 values stay
    special = torch.tensor([math.inf, -math.inf, 0.0, -0.0])
    assert torch.equal(stochastic_bf16(special, 5).float(), special)


def test_stochastic_cast_is_a_function_of_master_seed_and_step():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    a, b = stochastic_bf16(x, cast_key(1, 4)), stochastic_bf16(x.clone(), cast_key(1, 4))
    assert torch.equal(a, b)
    # position-free: the same value anywhere (another partition, another rank) rounds alike
    perm = torch.randperm(5000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(stochastic_bf16(x[perm], cast_key(1, 4)), a[perm])
    assert not torch.equal(stochastic_bf16(x, cast_key(1, 5)), a)  # another step, other draws
    assert not torch.equal(stochastic_bf16(x, cast_key(2, 4)), a)  # another seed
    assert torch.equal(bf16_copy(x, "nearest", 0), x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="train.bf16_cast='up'"):
        bf16_copy(x, "up", 0)


def _engine(cast: str, steps: int = 6, lr: float = 1e-3) -> LocalEngine:
    model = build_model(CFG, seed=1)
    return LocalEngine(model, ParallelDims.single(CFG, "cpu"), OptimConfig(lr=lr, min_lr=0.0, warmup_steps=0),
                       EngineConfig(total_steps=steps, micro_batch_size=3, grad_accum=1, dtype="bf16",
                                    bf16_cast=cast, seed=11))


def _batch(i: int) -> list[dict]:
    t = torch.randint(0, 48, (3, 9), generator=torch.Generator().manual_seed(100 + i))
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]}]


def _params(engine: LocalEngine) -> dict:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("cast", ["nearest", "stochastic"])
def test_metrics_equal_an_independent_computation(cast):
    engine = _engine(cast)
    for i in range(2):
        engine.train_step(_batch(i))
    masters0 = [m.detach().double().clone() for m in engine.masters.masters]
    copies0 = [p.detach().to(torch.bfloat16).double() for p in engine.masters.params]
    stats = engine.train_step(_batch(2))
    masters1 = [m.detach().double() for m in engine.masters.masters]
    copies1 = [p.detach().to(torch.bfloat16).double() for p in engine.masters.params]
    moved = stale = lag = upd = 0.0
    for m0, m1, c0, c1 in zip(masters0, masters1, copies0, copies1):
        mv = m1 != m0
        moved += float(mv.sum())
        stale += float((mv & (c1 == c0)).sum())
        lag += float(((m1 - c1) ** 2).sum())
        upd += float(((m1 - m0) ** 2).sum())
    assert moved > 0
    assert stats.precision["precision/stale_fraction"] == pytest.approx(stale / moved, abs=0, rel=1e-12)
    assert stats.precision["precision/copy_lag"] == pytest.approx(math.sqrt(lag) / math.sqrt(upd), rel=1e-12)
    if cast == "stochastic":  # the module holds the copy: bf16 values, never the masters
        for p, m in zip(engine.masters.params, engine.masters.masters):
            assert torch.equal(p.detach(), p.detach().to(torch.bfloat16).float())
            assert torch.equal(p.detach().to(torch.bfloat16), stochastic_bf16(m.detach(), cast_key(11, 3)))


def test_a_small_update_is_swallowed_by_nearest_and_not_by_stochastic():
    """lr 1e-5 on weights ~0.1: each update is far below half a bf16 step (~2e-4). nearest keeps
    almost every copy; stochastic redraws each copy every step (a new key), so a copy moves
    with probability 2 f (1 - f) whatever the update: about a third of them."""
    near, stoch = _engine("nearest", lr=1e-5), _engine("stochastic", lr=1e-5)
    n = [near.train_step(_batch(i)).precision["precision/stale_fraction"] for i in range(3)]
    s = [stoch.train_step(_batch(i)).precision["precision/stale_fraction"] for i in range(3)]
    assert min(n) > 0.85 and max(s) < 0.75, (n, s)


def test_stochastic_run_reproduces_and_resumes_bit_for_bit(tmp_path):
    a = _engine("stochastic")
    for i in range(4):
        a.train_step(_batch(i))
    full = _params(a)
    b = _engine("stochastic")
    for i in range(2):
        b.train_step(_batch(i))
    (tmp_path / "ck").mkdir()
    b.save(tmp_path / "ck")
    c = _engine("stochastic")
    c.load(tmp_path / "ck")
    assert all(torch.equal(x, y) for x, y in zip(_params(b).values(), _params(c).values()))
    for m1, m2 in zip(b.masters.masters, c.masters.masters):
        assert torch.equal(m1, m2)  # the checkpoint holds the masters, not the copy
    for i in range(2, 4):
        c.train_step(_batch(i))
    for name, value in _params(c).items():
        assert torch.equal(value, full[name]), name
    again = _engine("stochastic")
    for i in range(4):
        again.train_step(_batch(i))
    assert all(torch.equal(x, full[n]) for n, x in _params(again).items())


def test_config_refuses_an_unknown_cast():
    assert TrainConfig().bf16_cast == "nearest"
    with pytest.raises(ConfigError, match="bf16_cast"):
        from_dict({"train": {"bf16_cast": "up"}})
