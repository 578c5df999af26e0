"""The generated state-tracking tasks (data/state_tasks.py): each generator's labels against a
brute-force computation written here from the task's definition, the seeding, and the per-length
evaluation on a model that is perfect by construction and on one that is constant."""

import numpy as np
import pytest
import torch

from rlt_mega.config import STATE_TASKS, ConfigError, StateTaskConfig, load_config
from rlt_mega.data.state_tasks import (PERMUTATIONS, SEQUENCE_ACCURACY, TOKEN_ACCURACY, LengthEval, StateTaskBatches,
                                       generate, num_symbols)
from rlt_mega.loss import IGNORE, WHOLE_VOCAB
from rlt_mega.cost.sweep_stats import accuracy_table

TASK = StateTaskConfig(modulus=7, p_write=0.2, p_read=0.3, num_eval=10, eval_batch=4)


def brute_labels(name: str, xs: list[int]) -> list[int]:
    """The targets of one sequence from the task's definition, one position at a time."""
    out = []
    if name == "parity":
        return [sum(xs[:i + 1]) % 2 for i in range(len(xs))]
    if name == "modsum":
        return [sum(xs[:i + 1]) % TASK.modulus for i in range(len(xs))]
    if name == "s5":
        state = tuple(range(5))  # the images of 0..4 under the composition so far
        for x in xs:
            perm = PERMUTATIONS[x]
            state = tuple(perm[state[j]] for j in range(5))  # apply the earlier ones, then this one
            out.append(PERMUTATIONS.index(state))
        return out
    if name == "flipflop":
        memory = None
        for x in xs:
            if x in (0, 1):  # W0, W1
                memory = x
            out.append(memory if x == 4 else IGNORE)  # R reads; I0, I1 and writes have no target
        return out
    raise AssertionError(name)


@pytest.mark.parametrize("name", STATE_TASKS)
def test_each_generator_against_brute_force_labels(name):
    inputs, targets = generate(name, 20, 40, np.random.default_rng(3), TASK)
    assert inputs.shape == targets.shape == (20, 40)
    assert 0 <= inputs.min() and inputs.max() < num_symbols(name, TASK)
    for xs, ys in zip(inputs.tolist(), targets.tolist()):
        assert ys == brute_labels(name, xs)
    if name == "flipflop":
        assert (inputs[:, 0] <= 1).all() and (inputs[:, -1] == 4).all()  # starts with a write, ends with a read
        middle = inputs[:, 1:-1]
        kinds = np.bincount(np.where(middle <= 1, 0, np.where(middle <= 3, 1, 2)).ravel(), minlength=3)
        assert kinds[0] > 0 and kinds[2] > 0 and kinds[1] > kinds[0]  # writes, reads and more ignores
    else:
        assert len(np.unique(inputs)) == num_symbols(name, TASK)  # every symbol drawn


def test_training_stream_is_seeded_resumable_and_differs_by_seed_and_rank():
    cfg = load_config(None, ["data.train=generated:s5", "data.seq_len=12", "train.micro_batch_size=3",
                             "train.grad_accum=2"])
    first = StateTaskBatches(cfg, dp_rank=0)
    a = first.next_batches() + first.next_batches()
    resumed = StateTaskBatches(cfg, dp_rank=0)
    resumed.load_state_dict({"index": 2})
    assert [b["inputs"].shape for b in a] == [torch.Size([3, 12])] * 4
    assert all(torch.equal(x["inputs"], y["inputs"]) and torch.equal(x["targets"], y["targets"])
               for x, y in zip(a[2:], resumed.next_batches()))
    assert not torch.equal(a[0]["inputs"], StateTaskBatches(cfg, dp_rank=1).next_batches()[0]["inputs"])
    reseeded = load_config(None, ["data.train=generated:s5", "data.seq_len=12", "train.micro_batch_size=3",
                                  "train.grad_accum=2", "train.seed=5"])
    assert not torch.equal(a[0]["inputs"], StateTaskBatches(reseeded, dp_rank=0).next_batches()[0]["inputs"])


def _engine_eval_loss(logits_fn):
    """An engine's eval_loss (summed loss over the summed count) over a logits function of the inputs."""
    def eval_loss(batches, loss):
        total = sum(float(loss.logits_loss(logits_fn(b["inputs"]), b, WHOLE_VOCAB)) for b in batches)
        return total / sum(loss.count(b) for b in batches)
    return eval_loss


@pytest.mark.parametrize("name", ["parity", "flipflop"])
def test_length_eval_of_an_oracle_and_of_a_constant_model(name):
    vocab = 260
    cfg = load_config(None, [f"data.train=generated:{name}", "data.seq_len=8", "eval.lengths=[8, 16, 48]",
                             "data.task.num_eval=30", "data.task.eval_batch=7", f"model.vocab_size={vocab}"])
    evaluate = LengthEval(cfg)

    def oracle(inputs):  # recomputes the labels from the inputs alone: perfect by construction
        labels = torch.tensor([[y if y != IGNORE else 0 for y in brute_labels(name, xs)] for xs in inputs.tolist()])
        return torch.nn.functional.one_hot(labels, vocab).float() * 5.0

    perfect = evaluate(_engine_eval_loss(oracle))
    assert perfect == {f"eval/{k}@{n}": 1.0 for n in (8, 16, 48) for k in ("token_acc", "seq_acc")}

    def constant(inputs):  # always predicts 0
        logits = torch.zeros(*inputs.shape, vocab)
        logits[..., 0] = 1.0
        return logits

    got = evaluate(_engine_eval_loss(constant))
    for n, batches in evaluate.sets.items():
        targets = torch.cat([b["targets"] for b in batches])
        valid = targets != IGNORE
        assert got[f"eval/token_acc@{n}"] == pytest.approx(float(((targets == 0) & valid).sum() / valid.sum()))
        all_zero = ((targets == 0) | ~valid).all(dim=1).float().mean()
        assert got[f"eval/seq_acc@{n}"] == pytest.approx(float(all_zero))
        assert 0.3 < got[f"eval/token_acc@{n}"] < 0.7 and len(targets) == 30
    if name == "parity":
        assert got["eval/seq_acc@48"] == 0.0  # a constant guess never gets 48 running parities right here


def test_accuracy_losses_count_targets_and_sequences():
    targets = torch.tensor([[1, IGNORE, 0], [1, 1, IGNORE]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 0, 1], [1, 1, 0]]), 4).float()
    batch = {"inputs": torch.zeros(2, 3, dtype=torch.long), "targets": targets}
    assert float(TOKEN_ACCURACY.logits_loss(logits, batch, WHOLE_VOCAB)) == 3 and TOKEN_ACCURACY.count(batch) == 4
    assert float(SEQUENCE_ACCURACY.logits_loss(logits, batch, WHOLE_VOCAB)) == 1 and SEQUENCE_ACCURACY.count(batch) == 2


def test_accuracy_table_shows_mean_and_spread_over_seeds():
    rows = [{"point": "p", "label": "rlt", "family": "rlt", "arch": "rlt", "budget_flops": 1.0, "params": 1,
             "flops_per_token": 1.0, "status": "ok", "token_acc@32": acc, "seq_acc@32": 0.0}
            for acc in (0.9, 1.0)]
    table = accuracy_table(rows)
    assert "| rlt | 2 | 0.950 +- 0.071 | 0.000 +- 0.000 |" in table  # sample std of (0.9, 1.0): 0.05 * sqrt(2)


@pytest.mark.parametrize("overrides, message", [
    (["data.train=generated:parityy"], "unknown generated task 'parityy'"),
    (["eval.lengths=[32, 64]"], "set data.train=generated:<task>"),
    (["data.train=generated:parity", "eval.lengths=[32, 600]"], "raise model.max_seq_len to >= 600"),
    (["data.train=generated:parity", "eval.lengths=[32, 32]"], "distinct integers"),
    (["data.train=generated:modsum", "data.task.modulus=1"], "data.task.modulus=1"),
    (["data.train=generated:parity", "data.eval=x.jsonl"], "set data.eval=null"),
])
def test_bad_task_configs_say_what_to_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("+", r"\+")):
        load_config(None, ["model.max_seq_len=512"] + overrides)
