"""Generated state-tracking tasks (``data.train=generated:<task>``, parameters in ``data.task``):
what recurrence over time buys. Each sequence presents inputs alone; the target at a position is
the state after that position's input, and no label is ever fed back (a label written into the
sequence would make the state a rule over the two previous tokens, which every family learns in
distribution). Position t's logits are scored against targets[t]; positions without a target
hold IGNORE, so the loss and the accuracy read the targets only.

========= ======================================= ==========================================
task      inputs (token ids)                      target at each position
========= ======================================= ==========================================
parity    bits 0, 1                               the parity of the bits so far (0, 1)
modsum    residues 0 .. m - 1 (data.task.modulus) the running sum modulo m
s5        permutations of 5 elements, 0 .. 119    the running composition (S5 word problem)
flipflop  W0 W1 I0 I1 R = 0 1 2 3 4              at reads R only: the last written bit
========= ======================================= ==========================================

Token ids are the symbols themselves (byte ids under the byte tokenizer). A flip-flop sequence
starts with a write and ends with a read; writes and reads follow at data.task.p_write and
p_read, ignores fill the rest. The training stream is seeded by (data.task.seed, train.seed,
data-parallel rank, batch index): fresh sequences every step, the same ones after a resume.
Each evaluation length has its own set, seeded by (data.task.seed, length), the same for every
run and family, so runs are compared on the same sequences.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import numpy as np
import torch

from rlt_mega.config import Config, ConfigError, StateTaskConfig, state_task
from rlt_mega.loss import IGNORE, Logits, LogitsLoss, Vocab

PERMUTATIONS = list(itertools.permutations(range(5)))  # S5: token id i is PERMUTATIONS[i]
_PERM_INDEX = {p: i for i, p in enumerate(PERMUTATIONS)}
# COMPOSE[a, b]: the permutation "apply a, then b" (x -> b[a[x]])
COMPOSE = np.array([[_PERM_INDEX[tuple(b[a[x]] for x in range(5))] for b in PERMUTATIONS] for a in PERMUTATIONS])
W0, W1, I0, I1, READ = range(5)  # flip-flop instructions


def num_symbols(name: str, task: StateTaskConfig) -> int:
    """The token ids a task uses (inputs and targets): 0 .. num_symbols - 1."""
    return {"parity": 2, "modsum": task.modulus, "s5": len(PERMUTATIONS), "flipflop": 5}[name]


def generate(name: str, num: int, length: int, rng: np.random.Generator,
             task: StateTaskConfig) -> tuple[np.ndarray, np.ndarray]:
    """``num`` sequences of ``length`` inputs and their targets, both (num, length) int64."""
    if name in ("parity", "modsum"):
        m = 2 if name == "parity" else task.modulus
        inputs = rng.integers(0, m, size=(num, length))
        return inputs, np.cumsum(inputs, axis=1) % m
    if name == "s5":
        inputs = rng.integers(0, len(PERMUTATIONS), size=(num, length))
        targets = np.empty_like(inputs)
        state = inputs[:, 0]
        targets[:, 0] = state
        for t in range(1, length):  # (num,) the composition of the first t + 1 permutations
            state = COMPOSE[state, inputs[:, t]]
            targets[:, t] = state
        return inputs, targets
    if name == "flipflop":
        u = rng.random((num, length))
        kind = np.where(u < task.p_write, 0, np.where(u < task.p_write + task.p_read, 2, 1))  # 0 write 1 ignore 2 read
        kind[:, 0], kind[:, -1] = 0, 2
        bits = rng.integers(0, 2, size=(num, length))
        inputs = np.where(kind == 0, W0 + bits, np.where(kind == 1, I0 + bits, READ))
        # the last write at or before each position (position 0 always writes)
        last_write = np.maximum.accumulate(np.where(kind == 0, np.arange(length), 0), axis=1)
        stored = np.take_along_axis(bits, last_write, axis=1)
        return inputs, np.where(kind == 2, stored, IGNORE)
    raise ConfigError(f"unknown state-tracking task '{name}'")


def task_batch(inputs: np.ndarray, targets: np.ndarray) -> dict:
    return {"inputs": torch.from_numpy(inputs).long(), "targets": torch.from_numpy(targets).long()}


def check_task(cfg: Config) -> str:
    """The task of ``cfg.data.train`` after checking its symbols fit the model's vocabulary."""
    name = state_task(cfg.data.train)
    symbols = num_symbols(name, cfg.data.task)
    if symbols > cfg.model.vocab_size:
        raise ConfigError(f"data.train={cfg.data.train} uses {symbols} token ids but model.vocab_size="
                          f"{cfg.model.vocab_size}: set model.vocab_size >= {symbols}")
    return name


class StateTaskBatches:
    """grad_accum fresh batches of micro_batch_size sequences per step (supervised.BatchSource)."""

    def __init__(self, cfg: Config, dp_rank: int) -> None:
        self.name, self.cfg, self.dp_rank = check_task(cfg), cfg, dp_rank
        self.index = 0

    def next_batches(self) -> list[dict]:
        out = []
        for _ in range(self.cfg.train.grad_accum):
            rng = np.random.default_rng([self.cfg.data.task.seed, self.cfg.train.seed, self.dp_rank, self.index])
            out.append(task_batch(*generate(self.name, self.cfg.train.micro_batch_size, self.cfg.data.seq_len, rng,
                                            self.cfg.data.task)))
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])


def eval_set(name: str, length: int, task: StateTaskConfig) -> list[dict]:
    """The evaluation sequences of one length, in batches of data.task.eval_batch."""
    inputs, targets = generate(name, task.num_eval, length, np.random.default_rng([task.seed, 1_000_003, length]),
                               task)
    return [task_batch(inputs[i:i + task.eval_batch], targets[i:i + task.eval_batch])
            for i in range(0, task.num_eval, task.eval_batch)]


# ------------------------------------------------------------------ accuracy as a loss of the logits
def _hits(logits: torch.Tensor, batch: dict, vocab: Vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T) correct, (b, T) has a target: greedy prediction over the whole vocabulary."""
    targets, logits = batch["targets"], Logits.of(logits)
    predicted = logits.map(lambda x: vocab.gather(x).argmax(-1))[0].view(logits.shape)
    predicted = predicted[:, :targets.shape[1]]  # a pipeline round may pad T
    valid = targets != IGNORE
    return (predicted == targets) & valid, valid


class TokenAccuracy(LogitsLoss):
    """The fraction of target positions predicted correctly (sum of hits over the target count):
    any engine evaluates it as it evaluates a loss, on any layout."""

    def logits_loss(self, logits: torch.Tensor, batch: dict, vocab: Vocab) -> torch.Tensor:
        return _hits(logits, batch, vocab)[0].sum().double()

    def count(self, batch: dict) -> float:
        return float((batch["targets"] != IGNORE).sum())


class SequenceAccuracy(LogitsLoss):
    """The fraction of sequences whose every target is predicted correctly."""

    def logits_loss(self, logits: torch.Tensor, batch: dict, vocab: Vocab) -> torch.Tensor:
        hits, valid = _hits(logits, batch, vocab)
        return (hits == valid).all(dim=1).sum().double()

    def count(self, batch: dict) -> float:
        return float(batch["targets"].shape[0])


TOKEN_ACCURACY, SEQUENCE_ACCURACY = TokenAccuracy(), SequenceAccuracy()
EvalLoss = Callable[[list, LogitsLoss], float]  # an engine's eval_loss(batches, loss)


class LengthEval:
    """eval.lengths: eval/token_acc@T and eval/seq_acc@T for each length T (the sets built once)."""

    def __init__(self, cfg: Config) -> None:
        name = check_task(cfg)
        self.sets = {length: eval_set(name, length, cfg.data.task) for length in cfg.eval.lengths}

    def __call__(self, eval_loss: EvalLoss) -> dict[str, float]:
        out: dict[str, float] = {}
        for length, batches in self.sets.items():
            out[f"eval/token_acc@{length}"] = eval_loss(batches, TOKEN_ACCURACY)
            out[f"eval/seq_acc@{length}"] = eval_loss(batches, SEQUENCE_ACCURACY)
        return out


def length_eval(cfg: Config) -> Optional[LengthEval]:
    return LengthEval(cfg) if cfg.eval.lengths else None


def state_task_data(cfg: Config, dp_rank: int) -> tuple[StateTaskBatches, Callable[[], list[dict]]]:
    """The training stream of this data-parallel rank and the held-out batches at the training
    length (their loss is eval/loss)."""
    held_out = eval_set(check_task(cfg), cfg.data.seq_len, cfg.data.task)
    return StateTaskBatches(cfg, dp_rank), lambda: held_out
