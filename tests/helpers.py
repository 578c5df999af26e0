"""What several test files share (tests/ is on sys.path: ``from helpers import TINY``)."""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

from rlt_mega.config import ModelConfig
from rlt_mega.parallel.dims import ParallelDims, free_port
from rlt_mega.rollout.env import Chat

ROOT = Path(__file__).resolve().parents[1]

# CLI overrides of a very small pretraining run on generated problems (with configs/tiny_cpu.yaml).
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "model.n_layers=2",
        "model.memory_block=2", "data.seq_len=24", "data.generated.num_train=400", "data.generated.num_eval=20",
        "train.micro_batch_size=4", "train.eval_every=0", "train.log_every=1", "logging.progress=false",
        "optim.warmup_steps=2", "optim.lr=5e-3"]


def emit_seven(completion: str, answer) -> float:
    """A learnable GRPO reward (grpo.reward=helpers:emit_seven): the fraction of the completion
    that is the token '7'."""
    return sum(c == "7" for c in completion) / max(len(completion), 1)


def write_prompts(path: Path, n: int) -> Path:
    """n GRPO prompt records {"question": "q<i>", "answer": "#### <i>"} as jsonl at ``path``."""
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(n)))
    return path


def gsm8k_dir() -> Path:
    """GSM8K in the repository (tests/data/gsm8k, MIT: the whole test split and the first 2,000
    records of the train split), so the tests that read real GSM8K always run."""
    return ROOT / "tests" / "data" / "gsm8k"


def launched(nproc: int, args: list, launcher: str = "torchrun", check: bool = True, timeout: float = 600,
             script: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``rlt-mega ARGS`` (or ``script ARGS``, e.g. tests/crash_driver.py) on ``nproc`` processes
    under torchrun or the deepspeed launcher (gloo); ``env``: extra environment."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RLT_LOG_LEVEL="WARNING", PYTHONPATH=str(ROOT),
               PYTHONWARNINGS="ignore", **(env or {}))
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port,
               *([script] if script else ["-m", "rlt_mega"]), *args]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(nproc), "--master_port",
               port, "--no_local_rank", *([script] if script else ["--module", "rlt_mega"]), *args]
    code, out, err = launcher_run(cmd, env, timeout, check)
    return subprocess.CompletedProcess(cmd, code, out, err)


def launcher_run(cmd: list, env: dict, timeout: float = 600, check: bool = True) -> tuple[int, str, str]:
    """A launcher command (torchrun, deepspeed) in its own session, so that a hang is cleaned up
    with every rank, not only the launcher -> (return code, stdout, stderr); ``check``: it must
    succeed."""
    import pytest

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{Path(cmd[0]).name} {' '.join(cmd[1:4])} ... did not finish in {timeout} s:\n{err[-5000:]}")
    if check:
        assert proc.returncode == 0, out[-2000:] + err[-5000:]
    return proc.returncode, out, err


# A pretraining run of tiny_cpu small enough for two to four CPU ranks.
DIST_TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_hidden=64", "model.n_layers=2",
             "model.memory_block=2", "data.seq_len=16", "data.generated.num_train=300", "data.generated.num_eval=10",
             "train.micro_batch_size=4", "train.eval_every=0", "train.log_every=1", "logging.progress=false",
             "optim.warmup_steps=2", "optim.lr=5e-3"]


def pretrain_launched(tmp_path, name, nproc, *overrides, launcher="torchrun", check=True):
    """``rlt-mega pretrain`` of DIST_TINY into tmp_path/name on ``nproc`` launched processes."""
    args = ["pretrain", "--config", "configs/tiny_cpu.yaml", *DIST_TINY, f"checkpoint.dir={tmp_path / name / 'ckpt'}",
            f"logging.dir={tmp_path / name / 'tb'}", *overrides]
    return launched(nproc, args, launcher, check)


# ------------------------------------------------------------------------------ pretraining data
WORDS = ["alpha", "beta", "gamma", "delta", "€uro", "ünï", "x"]


def write_corpus(path, num_docs, seed=0, letter=None, bad_lines=True):
    """A jsonl corpus of documents of varied length (a few bad lines among them)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_docs):
            text = letter * rng.randint(5, 80) if letter else f"doc {i}: " + " ".join(
                rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
            f.write(json.dumps({"text": text}) + "\n")
            if bad_lines and i % 97 == 13:
                f.write("{not json\n\n")
    return path


def make_prefix(tmp_path, name, num_docs=300, workers=1, **kwargs):
    """``rlt-mega preprocess`` of a write_corpus corpus -> (the dataset prefix, the corpus)."""
    from rlt_mega.data.preprocess import preprocess

    corpus = write_corpus(Path(tmp_path) / f"{name}.jsonl", num_docs, **kwargs)
    preprocess(str(corpus), "byte", str(Path(tmp_path) / "data" / name), workers=workers, chunk=37, progress=False)
    return str(Path(tmp_path) / "data" / name), corpus


def dp_layout(rank=0, world=1):
    """Data-parallel rank ``rank`` of ``world`` as the data path sees it, on one process (no
    process group: ``gather_over_dp`` is this rank's state alone)."""
    return dataclasses.replace(ParallelDims.single(ModelConfig(), "cpu"), dp=world, dp_rank=rank,
                               dp_ranks=list(range(world)))


def docs_in(windows):
    """The documents of a rank's byte-level windows, read in order: its stream, split at
    end-of-text (the first and the last may be cut, and are left out)."""
    import torch

    from rlt_mega.data.tokenizer import byte_level

    stream = torch.cat([w.reshape(-1) for w in windows]).tolist()
    text = byte_level().tok.decode(stream, skip_special_tokens=False)
    return [d for d in text.split("<|eos|>")[1:-1]]


class FrequentChat(Chat):
    """The built-in chat environment (its user turns scripted by each prompt record's ``turns``)
    whose model turn a random byte-level model ends often (grpo.env=helpers:FrequentChat): four
    characters, or a space, end it."""

    def triggered(self, text):
        return len(text) >= 4 or " " in text


class BrokenStep(FrequentChat):
    """A user environment with a bug in step (grpo.env=helpers:BrokenStep): every call raises."""

    def step(self, state, text):
        raise ZeroDivisionError("division by zero")


class BrokenStart(FrequentChat):
    """A user environment with a bug in start (grpo.env=helpers:BrokenStart) and answers of the
    wrong type: a str for a Turn."""

    def start(self, record):
        if record["question"].endswith("1"):
            raise KeyError("turns")
        return super().start(record)

    def step(self, state, text):
        return "more"


def own_turn_and_seven(completion: str, answer) -> float:
    """A GRPO reward for FrequentChat runs on records {"answer": "#### <i>", "turns": ["s<i>", ...]}:
    1 when the completion holds its own prompt's first scripted user turn, -1 when it holds another
    prompt's, else 0; plus emit_seven (so that groups differ)."""
    own = answer.split("####")[-1].strip()
    seen = re.findall(r"User: s(\d+)\n", completion)
    return (0.0 if not seen else 1.0 if set(seen) == {own} else -1.0) + emit_seven(completion, answer)


def nan_on_odd(completion: str, answer) -> float:
    """A broken GRPO reward (grpo.reward=helpers:nan_on_odd): NaN for answers ending in an odd digit."""
    return float("nan") if int(str(answer)[-1]) % 2 else 0.5


def inf_reward(completion: str, answer) -> float:
    """A broken GRPO reward (grpo.reward=helpers:inf_reward): +inf for every completion."""
    return float("inf")
