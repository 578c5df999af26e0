"""Training stability of the recurrence (docs/stability.md): with embeddings at GPT-2's 0.02
the decoder's token input is drowned by recur_proj(recur_norm(z)) and the recurrence falls
into an input-ignoring attractor: the loss jumps above the uniform loss and back, and a run
at lr 3e-3 does not learn. With the default initialisation the same run has no spike.
(`python tools/bench/stability.py` runs both initialisations side by side.) An 80-step training run
of the engine on real data: this tier, not the unit tier."""

import math

from rlt_mega.config import load_config
from rlt_mega.data.datasets import BatchIterator, DataStats, pack, text_of, train_eval_records
from rlt_mega.data.tokenizer import byte_level
from rlt_mega.loss import shift
from rlt_mega.parallel.dims import ParallelDims
from rlt_mega.train.builders import build_engine


def training_losses(steps: int = 80, lr: float = 3e-3, overrides: tuple = ()) -> list[float]:
    cfg = load_config("configs/tiny_cpu.yaml", [
        "data.seq_len=64", f"optim.lr={lr}", "optim.warmup_steps=10", f"train.steps={steps}",
        "model.memory_block=4", *overrides])
    texts, _ = train_eval_records(cfg.data, text_of(None), ["text"], DataStats(), seed=0)
    batches = BatchIterator(pack(texts, byte_level(), cfg.data.seq_len), 16, seed=0)
    engine = build_engine(cfg, ParallelDims.single(cfg.model, cfg.train.device))
    out = []
    for _ in range(steps):
        inputs, targets = shift(next(batches))
        out.append(engine.train_step([{"inputs": inputs, "targets": targets}]).loss)
    return out


def test_no_loss_spike_with_the_default_initialisation():
    curve = training_losses()
    assert curve[0] > math.log(260) - 0.5  # starts at the uniform loss
    jumps = [b - a for a, b in zip(curve[15:], curve[16:])]
    assert max(jumps) < 0.5, f"the loss jumped by {max(jumps):.2f}: {[round(x, 2) for x in curve]}"
    assert curve[-1] < 1.5, curve[-1]
