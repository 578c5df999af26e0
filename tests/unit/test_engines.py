"""The engine side of the loss contract on one process: the engine divides the step's summed loss
by the step's count, and the count is the loss's (a per-sequence loss fits without touching the
engine); the single-process launch builds the local engine without a process group; GRPO derives
its engine config in one place and refuses a train.micro_batch_size it would overwrite."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlt_mega.config import ConfigError, given, load_config, save_config
from rlt_mega.loss import IGNORE, LM_LOSS, LogitsLoss
from rlt_mega.parallel.engine import LocalEngine
from rlt_mega.parallel.launch import launch
from rlt_mega.train.builders import build_engine
from rlt_mega.train.grpo import batches_per_minibatch, engine_config, grpo_config

MODEL = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "model.n_layers=1",
         "model.vocab_size=40", "data.seq_len=8", "train.device=cpu", "optim.grad_clip=0"]


def batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (3, 2):
        x = torch.randint(0, 40, (rows, 6), generator=g)
        y = torch.randint(0, 40, (rows, 6), generator=g)
        y[0, 4:] = IGNORE  # the batches count different numbers of tokens
        out.append({"inputs": x, "targets": y})
    return out


class RowMeanLoss(LogitsLoss):
    """A per-sequence loss: the sum over rows of each row's mean token loss, counted in rows."""

    def logits_loss(self, logits, batch, vocab):
        per_token = F.cross_entropy(logits.transpose(1, 2), batch["targets"], ignore_index=IGNORE, reduction="none")
        mask = batch["targets"] != IGNORE
        return ((per_token * mask).sum(1) / mask.sum(1)).sum()

    def count(self, batch):
        return batch["targets"].shape[0]


def by_hand(model, loss_of_row):
    """The step's loss computed outside the engine: the mean of ``loss_of_row`` over what it counts."""
    with torch.no_grad():
        return loss_of_row([(model(b["inputs"]), b["targets"]) for b in batches()])


@pytest.mark.parametrize("loss", [LM_LOSS, RowMeanLoss()])
def test_the_engine_divides_the_steps_sum_by_the_count_the_loss_defines(loss):
    with launch(load_config(None, MODEL)) as dims:
        engine = build_engine(load_config(None, MODEL), dims)
        assert isinstance(engine, LocalEngine) and not dims.distributed and not dist.is_initialized()
        if loss is LM_LOSS:
            def want(outs):  # every target token of the step weighs the same
                total = sum(F.cross_entropy(o.transpose(1, 2), y, ignore_index=IGNORE, reduction="sum")
                            for o, y in outs)
                return float(total) / sum(int((y != IGNORE).sum()) for _, y in outs)
            count = 3 * 6 + 2 * 6 - 2 * 2
        else:
            def want(outs):  # every row weighs the same, whatever its number of tokens
                rows = [F.cross_entropy(o[b], y[b], ignore_index=IGNORE) for o, y in outs for b in range(len(y))]
                return float(sum(rows)) / len(rows)
            count = 5
        expected = by_hand(engine.module, want)
        stats = engine.train_step(batches(), loss)
        assert stats.loss == pytest.approx(expected, rel=1e-6) and stats.num_tokens == count
        assert engine.eval_loss(batches(), loss) < stats.loss  # an optimizer step on these batches


def grpo_cfg(*overrides):
    return load_config(None, [*MODEL, "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.minibatches=2",
                              "train.grad_accum=2", "train.steps=3", "grpo.epochs=2", *overrides])


def test_grpo_derives_its_engine_config_in_one_place():
    cfg = grpo_config(grpo_cfg())
    assert cfg.train.micro_batch_size == 4  # 4 x 4 rows / 2 minibatches / grad_accum 2
    engine = engine_config(cfg)
    assert (engine.total_steps, engine.micro_batch_size, engine.grad_accum) == (3 * 2 * 2, 4, 2)
    assert cfg.train.steps == 3  # train.steps keeps counting GRPO steps
    assert batches_per_minibatch(cfg) == 2
    assert batches_per_minibatch(grpo_config(grpo_cfg("parallel.micro_batches=4"))) == 4  # each cut in 2


def test_grpo_refuses_a_micro_batch_size_it_would_overwrite(tmp_path):
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=3: GRPO derives it, .* = 4; remove the setting"):
        grpo_config(grpo_cfg("train.micro_batch_size=3"))
    assert grpo_config(grpo_cfg("train.micro_batch_size=4")).train.micro_batch_size == 4  # nothing overwritten
    with pytest.raises(ConfigError, match="train.grad_accum=3 does not divide a GRPO minibatch of 8 rows"):
        grpo_config(grpo_cfg("train.grad_accum=3"))
    with pytest.raises(ConfigError, match=r"cannot be formed .*\(under GRPO train.micro_batch_size is derived"):
        grpo_config(grpo_cfg("parallel.micro_batches=3"))
    # The config a GRPO run saves (config.yaml) holds the derived value and loads again.
    save_config(grpo_config(grpo_cfg()), tmp_path / "config.yaml")
    saved = load_config(tmp_path / "config.yaml")
    assert "train.micro_batch_size" in given(saved) and grpo_config(saved).train.micro_batch_size == 4


def test_given_keys_are_what_the_file_and_the_overrides_set():
    cfg = load_config("configs/demo_grpo.yaml", ["train.seed=3", "train.checkpointing.decoder=step"])
    keys = given(cfg)
    assert {"train.seed", "train.steps", "train.checkpointing.decoder", "grpo.group_size"} <= keys
    assert "train.micro_batch_size" not in keys and "parallel.tp" not in keys
    assert given(dataclasses.replace(cfg)) == frozenset()  # a config changed in code sets nothing
