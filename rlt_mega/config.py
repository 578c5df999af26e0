"""Typed configuration: dataclasses with one source of defaults, strict YAML, dotted overrides.

A config file is a nested mapping whose sections mirror :class:`Config`. Loading is strict:
an unknown key is an error that names it and suggests the closest valid key (a typo such as
``train.stpes`` must never become a silent default), a value of the wrong type is an error
that names the expected type, and impossible combinations are rejected in ``__post_init__``
with a message that says how to fix them. Every such error is a :class:`ConfigError`.

Overrides on the command line use dotted paths: ``train.steps=100 model.memory_block=4``.
Values are parsed as YAML scalars (``true``, ``1e-3``, ``null``, ``[1, 2]``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem, with a message that says what is wrong and how to fix it."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _show(value: Any, limit: int = 60) -> str:
    """repr for an error message, cut short: a mistyped value may be a huge list."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + "...." + text[-1]


MAX_SEED = 2**32 - 1  # the data order seeds a generator with seed * 1_000_003 + epoch (< 2**64)
_DEVICE = re.compile(r"^(auto|cpu|meta|mps|(cuda|xpu|hpu|npu)(:\d+)?)$")


# What model.lora.targets may name: the shared blocks' projections (q, k, v, o, gate, up, down:
# one adapter per block, used by the encoder and the decoder alike), the cross-attention's
# (cross_q, cross_k, cross_v, cross_o) and the recurrence input's recur_proj.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "cross_q", "cross_k", "cross_v", "cross_o", "recur_proj")


@dataclass
class LoraConfig:
    """Low-rank adapters (rlt_mega/model/lora.py): each target weight W runs as the merged
    W + (alpha / rank) B A, the base frozen, only A and B trained. rank 0: none (full weights)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0  # only 0: the step runs the merged weight, which has no dropout
    targets: list = field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        _check(self.rank >= 0, f"model.lora.rank={self.rank}: must be >= 0 (0: no adapters)")
        _check(self.alpha > 0, f"model.lora.alpha={self.alpha}: must be positive")
        _check(self.dropout == 0.0, f"model.lora.dropout={self.dropout}: adapters run merged into their base "
                                    "weight (exact replay), which has no dropout; set model.lora.dropout=0")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        _check(not bad, f"model.lora.targets: unknown {bad}; choose among {list(LORA_TARGETS)}")
        _check(self.rank == 0 or len(self.targets) > 0,
               f"model.lora.rank={self.rank} with no model.lora.targets: name at least one of {list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    """The RLT architecture (docs/design.md, "The model"). Encoder and decoder both have ``n_layers``.

    ``arch`` picks the family: ``rlt`` (the default), or one of the two baselines trained by the
    same code (rlt_mega/model/baselines.py): ``dense``, the Llama/Qwen2 layout (embed, the
    ``n_layers`` shared blocks, final_norm, lm_head), and ``looped``, the same blocks applied
    ``loops`` times per token with weights shared across loops (Ouro, Huginn). The RLT-only
    fields (memory_block, share_weights) mean nothing for the baselines."""

    arch: Literal["rlt", "dense", "looped"] = "rlt"
    loops: int = 1  # R: passes through the block stack per token (arch=looped only)
    vocab_size: int = 260
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: equal to n_heads (no GQA)
    ffn_hidden: Optional[int] = None  # None: SwiGLU 8/3 * d rounded up to a multiple of 64
    memory_block: int = 1  # C: memory is committed in blocks of C positions
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    share_weights: bool = True  # encoder block i and decoder block i share self-attn + MLP
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on self-attention q/k/v (Qwen2 layout)
    init_std: float = 0.02
    # Std of the token embeddings at init. None: 1.0 when untied, init_std when tied. The
    # decoder's only token input is embed[x_t] added to recur_proj(recur_norm(z_{t-1})):
    # embeddings at 0.02 are drowned by the recurrence, whose dynamics then fall into an
    # input-ignoring attractor (loss spikes above the uniform loss; see docs/stability.md).
    embed_init_std: Optional[float] = None
    max_seq_len: int = 2048
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters (off: rank 0)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 64 * ((8 * self.d_model // 3 + 63) // 64)
        _check(self.vocab_size >= 2, f"model.vocab_size={self.vocab_size}: must be at least 2")
        _check(self.d_model >= 1 and self.n_layers >= 1 and self.n_heads >= 1,
               "model.d_model, model.n_layers and model.n_heads must be positive")
        _check(self.d_model % self.n_heads == 0,
               f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}: "
               f"choose n_heads among the divisors of d_model (e.g. "
               f"{[h for h in (1, 2, 4, 8, 16, 32) if self.d_model % h == 0]})")
        _check((self.d_model // self.n_heads) % 2 == 0,
               f"head dim d_model/n_heads = {self.d_model // self.n_heads} must be even for RoPE: "
               "change model.d_model or model.n_heads")
        _check(self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
               f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads} (GQA)")
        _check(self.memory_block >= 1,
               f"model.memory_block (C) = {self.memory_block}: must be >= 1 (1 is dense memory)")
        _check(self.loops >= 1, f"model.loops={self.loops}: must be >= 1 (the passes through the blocks per token)")
        _check(self.arch == "looped" or self.loops == 1,
               f"model.loops={self.loops} with model.arch={self.arch}: only arch=looped repeats the blocks; "
               "set model.arch=looped or model.loops=1")
        _check(self.arch == "rlt" or self.share_weights,
               f"model.share_weights=false with model.arch={self.arch}: the decoder copies are RLT-only; "
               "set model.share_weights=true")
        _check(self.ffn_hidden >= 1, f"model.ffn_hidden={self.ffn_hidden}: must be positive")
        _check(self.rope_theta > 0, f"model.rope_theta={self.rope_theta}: must be positive")
        _check(self.norm_eps > 0, f"model.norm_eps={self.norm_eps}: must be positive")
        _check(self.max_seq_len >= 1, f"model.max_seq_len={self.max_seq_len}: must be positive")
        _check(self.arch == "rlt" or not self.lora.enabled,
               f"model.lora.rank={self.lora.rank} with model.arch={self.arch}: adapters are for the RLT; "
               "set model.lora.rank=0")
        _check(self.init_std > 0, f"model.init_std={self.init_std}: must be positive")
        if self.embed_init_std is None:
            self.embed_init_std = self.init_std if self.tie_embeddings else 1.0
        _check(self.embed_init_std > 0, f"model.embed_init_std={self.embed_init_std}: must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class GeneratedDataConfig:
    """Seeded arithmetic word problems in GSM8K format (rlt_mega.data.arithmetic)."""

    num_train: int = 20000
    num_eval: int = 200
    min_ops: int = 1
    max_ops: int = 2
    max_value: int = 20
    seed: int = 1234

    def __post_init__(self) -> None:
        _check(self.num_train >= 1 and self.num_eval >= 0, "data.generated: num_train >= 1, num_eval >= 0")
        _check(1 <= self.min_ops <= self.max_ops,
               f"data.generated: need 1 <= min_ops ({self.min_ops}) <= max_ops ({self.max_ops})")
        _check(self.max_value >= 2, f"data.generated.max_value={self.max_value}: must be >= 2")
        _check(0 <= self.seed <= MAX_SEED, f"data.generated.seed={self.seed}: must be in [0, {MAX_SEED}]")


STATE_TASKS = ("parity", "s5", "flipflop", "modsum")  # data.train=generated:<task> (rlt_mega/data/state_tasks.py)


@dataclass
class StateTaskConfig:
    """The generated state-tracking tasks, data.train=generated:<task> (rlt_mega/data/state_tasks.py):
    the training sequences have data.seq_len inputs; eval.lengths evaluates other lengths."""

    modulus: int = 5  # modsum: the running sum is taken modulo this
    p_write: float = 0.1  # flipflop: the chance of a write instruction at each position after the first
    p_read: float = 0.1  # flipflop: the chance of a read (the last position always reads)
    num_eval: int = 128  # sequences per evaluation length
    eval_batch: int = 64  # sequences per forward pass in evaluation
    seed: int = 0  # the evaluation sets' seed (the training stream is seeded by train.seed too)

    def __post_init__(self) -> None:
        _check(self.modulus >= 2, f"data.task.modulus={self.modulus}: must be >= 2")
        _check(0 <= self.p_write and 0 <= self.p_read and self.p_write + self.p_read <= 1,
               f"data.task: p_write={self.p_write} and p_read={self.p_read} must be >= 0 with a sum <= 1")
        _check(self.num_eval >= 1 and self.eval_batch >= 1,
               f"data.task: num_eval={self.num_eval} and eval_batch={self.eval_batch} must be >= 1")
        _check(0 <= self.seed <= MAX_SEED, f"data.task.seed={self.seed}: must be in [0, {MAX_SEED}]")


def state_task(source: Optional[str]) -> Optional[str]:
    """The task a data source names (``generated:parity`` -> ``parity``), None for any other source."""
    if source is None or not source.startswith("generated:"):
        return None
    return source.split(":", 1)[1]


@dataclass
class DataConfig:
    # "generated" (arithmetic problems), "generated:<task>" (a state-tracking task: parity, s5,
    # flipflop, modsum; parameters in data.task), a local .jsonl/.json/.txt file or directory, a hub name,
    # or (pretraining) the prefix of an indexed dataset written by `rlt-mega preprocess`
    # (PREFIX.bin + PREFIX.idx): memory-mapped, nothing tokenized at start-up. null with data.blend.
    train: Optional[str] = "generated"
    eval: Optional[str] = None  # None: a held-out split of the train source (a prefix works too)
    hub_config: Optional[str] = None  # e.g. "main" for openai/gsm8k
    text_field: Optional[str] = None  # None: "text", else question + answer for GSM8K records
    tokenizer: str = "byte"  # "byte", a tokenizers tokenizer.json, or a directory holding one
    # SFT/GRPO/generate/eval prompts through the tokenizer's chat template (data/chat.py)
    chat_template: bool = False
    seq_len: int = 128
    shuffle: bool = True
    # Pretraining on several indexed datasets in proportion to their weights, Megatron-LM's
    # --data-path layout: [w1, PREFIX1, w2, PREFIX2, ...] (weights need not sum to 1). Replaces
    # data.train, which is then null (or left at its default).
    blend: Optional[list] = None
    # Pretraining straight from data.train (a hub dataset or local files) with `datasets`
    # streaming: each data-parallel rank reads its own documents and packs them on the fly.
    streaming: bool = False
    # Streaming only: windows held in a seeded shuffle buffer (saved with the checkpoints, so a
    # resumed run sees the same order); 0 keeps the stream's order.
    shuffle_buffer: int = 0
    # SFT: several prompt/answer pairs packed (best-fit) into each row of data.seq_len positions,
    # instead of one pair a row padded to the longest (data/packing.py)
    pack: bool = False
    # Pretraining and packed SFT: a document boundary (pretraining: each end-of-text token; SFT:
    # each packed pair) resets the recurrent state to z_init, and attention and memory stay
    # within the document (model/documents.py)
    reset_at_document: bool = False
    generated: GeneratedDataConfig = field(default_factory=GeneratedDataConfig)
    task: StateTaskConfig = field(default_factory=StateTaskConfig)

    def __post_init__(self) -> None:
        task = state_task(self.train)
        _check(task is None or task in STATE_TASKS,
               f"data.train={_show(self.train)}: unknown generated task '{task}'; expected generated:<task> with "
               f"<task> one of {', '.join(STATE_TASKS)}")
        _check(task is None or self.eval is None,
               f"data.eval={_show(self.eval)} with data.train={self.train}: a generated task makes its own "
               "evaluation sets; set data.eval=null")
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len}: must be at least 2")
        _check(self.train is not None or self.blend is not None,
               "data.train is null: give a source (e.g. 'generated' or a dataset prefix), or a data.blend")
        for name in ("train", "tokenizer"):
            value = getattr(self, name)
            _check(value is None or bool(value.strip()), f"data.{name} is empty: give a source (e.g. 'generated')")
        _check(self.shuffle_buffer >= 0, f"data.shuffle_buffer={self.shuffle_buffer}: must be >= 0 (0: no shuffling)")
        if self.blend is not None:
            self._check_blend()
        _check(not (self.streaming and (self.train == "generated" or task is not None)),
               f"data.streaming=true streams data.train, which is '{self.train}': set data.train to a hub dataset "
               "or local file (e.g. HuggingFaceFW/fineweb-edu), or set data.streaming=false")

    def _check_blend(self) -> None:
        blend = self.blend
        example = "e.g. data.blend=[0.3, data/web, 0.7, data/code]"
        _check(len(blend) >= 2 and len(blend) % 2 == 0,
               f"data.blend={_show(blend)}: expected weight, prefix pairs, {example}")
        pairs = []
        for weight, prefix in zip(blend[::2], blend[1::2]):
            number = None
            if isinstance(weight, (int, float, str)) and not isinstance(weight, bool):
                try:  # PyYAML (YAML 1.1) reads 1e-3 as a string: accept it
                    number = float(weight)
                except ValueError:
                    pass
            _check(number is not None and math.isfinite(number) and number > 0,
                   f"data.blend: weight {_show(weight)} must be a positive number, {example}")
            _check(isinstance(prefix, str) and bool(prefix.strip()),
                   f"data.blend: {_show(prefix)} after weight {weight} must be a dataset prefix, {example}")
            pairs += [number, prefix]
        self.blend = pairs
        _check(self.train in (None, "generated"), f"data.blend and data.train={_show(self.train)} are both set: "
               "a blend replaces data.train; set data.train=null")
        self.train = None
        _check(not self.streaming, "data.blend reads indexed datasets and data.streaming=true streams data.train: "
               "set only one of them")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr={self.lr}: must be positive")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr}: must be in [0, optim.lr]")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps}: must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        _check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip}: must be >= 0 (0 disables)")
        _check(self.weight_decay >= 0 and self.eps > 0, "optim.weight_decay must be >= 0 and optim.eps > 0")


@dataclass
class CheckpointingConfig:
    """Activation checkpointing (docs/design.md, "Gradients"); recomputation is exact."""

    decoder: Literal["none", "step", "every_k"] = "none"
    decoder_k: int = 4  # steps per checkpointed segment when decoder == "every_k"
    encoder: bool = False  # checkpoint each encoder block
    # The learner's head (final norm, lm_head, the loss's processing) over this many positions at a
    # time, each chunk's fp32 logits recomputed in the backward (loss.py Logits): 0, all at once.
    head_chunk: int = 0

    def __post_init__(self) -> None:
        _check(self.decoder_k >= 1, f"train.checkpointing.decoder_k={self.decoder_k}: must be >= 1")
        _check(self.head_chunk >= 0, f"train.checkpointing.head_chunk={self.head_chunk}: must be >= 0 "
                                     "(positions per head chunk; 0 computes the head over all positions at once)")


@dataclass
class TrainConfig:
    steps: int = 200
    micro_batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast around the forward
    # How bf16 runs make the bf16 copy of the fp32 masters that the step and the sampler read
    # (rlt_mega/precision.py, docs/stability.md): "nearest" (round to nearest even) or
    # "stochastic" (unbiased; a hash of (master, train.seed, step): reproduced and resumed bit for bit).
    bf16_cast: Literal["nearest", "stochastic"] = "nearest"
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    resume: Optional[str] = None  # None, "auto" (latest checkpoint in checkpoint.dir) or a path
    # An export directory (rlt-mega export / rlt-mega import) to take the initial weights from:
    # weights only, no optimizer or data state. With resume="auto" it applies only to a fresh
    # start (no checkpoint found yet), so a restarted job continues from its own checkpoints.
    init_from: Optional[str] = None
    max_nonfinite_in_a_row: int = 5  # consecutive skipped non-finite steps before stopping
    # Stop this process after this many steps (a checkpoint is written), e.g. for time-limited
    # cluster jobs; the schedule still spans train.steps and train.resume=auto continues.
    stop_after: Optional[int] = None
    # The dense schedule's decoder positions as captured CUDA graphs of the fused step
    # (parallel/cuda_graphs.py: the same decoder step, captured): a GPU feature (the decoder is launch-bound there); off on a CPU.
    cuda_graphs: bool = False
    # Deterministic kernels (rlt_mega/determinism.py): torch.use_deterministic_algorithms,
    # CUBLAS_WORKSPACE_CONFIG, deterministic attention backward, NCCL_NVLS_ENABLE=0. Bit-exact
    # replays, checkpointing and resumes on CUDA need it; it costs some speed there.
    deterministic: bool = True

    def __post_init__(self) -> None:
        _check(self.steps >= 0, f"train.steps={self.steps}: must be >= 0")
        _check(self.micro_batch_size >= 1, f"train.micro_batch_size={self.micro_batch_size}: must be >= 1")
        _check(self.grad_accum >= 1, f"train.grad_accum={self.grad_accum}: must be >= 1")
        _check(self.log_every >= 1 and self.eval_every >= 0, "train.log_every >= 1, train.eval_every >= 0")
        _check(self.max_nonfinite_in_a_row >= 1, "train.max_nonfinite_in_a_row must be >= 1")
        _check(self.stop_after is None or self.stop_after >= 1, "train.stop_after must be >= 1 or null")
        _check(0 <= self.seed <= MAX_SEED, f"train.seed={self.seed}: must be in [0, {MAX_SEED}]")
        _check(bool(_DEVICE.match(self.device)),
               f"train.device={_show(self.device)}: expected auto, cpu, cuda or cuda:N (or mps, xpu:N)")
        _check(self.resume is None or bool(self.resume.strip()),
               "train.resume is empty: use null (fresh start), auto, or a checkpoint path")
        _check(not self.cuda_graphs or self.device == "auto" or self.device.startswith("cuda"),
               f"train.cuda_graphs=true with train.device={_show(self.device)}: CUDA graphs need a CUDA device; "
               "set train.device=cuda (or auto on a GPU machine), or train.cuda_graphs=false")
        _check(self.init_from is None or self.resume in (None, "auto"),
               f"train.init_from={self.init_from} and train.resume={self.resume}: resuming restores the "
               "weights from the checkpoint, so init_from would be ignored; set only one of them")


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: world_size // (tp * pp)
    zero_stage: int = 0  # 0: plain data parallel; 1, 2, 3: DeepSpeed ZeRO
    micro_batches: int = 1  # pipeline micro-batches in flight (M)
    pp_split: Optional[list] = None  # explicit layers per stage for uneven L, e.g. [3, 2]
    backend: Optional[str] = None  # None: nccl on CUDA, gloo on CPU
    # bf16 (train.dtype) under DeepSpeed: the dtype gradients accumulate in over a step's
    # micro-batches ("data_types.grad_accum_dtype") and the pipeline's fp32 accumulators keep
    # when handed to DeepSpeed. None: fp32 wherever DeepSpeed can (ZeRO 1-3); bf16 without ZeRO,
    # where DeepSpeed 0.19 has no fp32 accumulation ("fp32" is then an error).
    grad_accum_dtype: Optional[Literal["fp32", "bf16"]] = None
    # The dtype of the data-parallel gradient reduction (DeepSpeed's communication_data_type).
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        _check(self.tp >= 1 and self.pp >= 1, f"parallel.tp={self.tp}, parallel.pp={self.pp}: must be >= 1")
        _check(self.dp is None or self.dp >= 1, f"parallel.dp={self.dp}: must be >= 1 or null")
        _check(self.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        _check(self.micro_batches >= 1, f"parallel.micro_batches={self.micro_batches}: must be >= 1")
        _check(self.pp_split is None or all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                            for n in self.pp_split),
               f"parallel.pp_split={_show(self.pp_split)}: expected a list of positive layer counts, e.g. [3, 2]")
        _check(self.backend in (None, "nccl", "gloo"), f"parallel.backend={_show(self.backend)}: expected "
               "null (nccl on CUDA, gloo on CPU), nccl or gloo")


@dataclass
class CheckpointConfig:
    dir: str = "runs/default/checkpoints"
    every: int = 100  # steps between checkpoints; 0: only at the end
    keep: int = 3  # keep the last K checkpoints
    # Distributed runs: rank 0 also writes a consolidated model.safetensors (the single-device
    # layout) beside the per-rank shards. Gathering the whole model on one rank at every save
    # costs time and host memory on a large model; with false, `rlt-mega export` consolidates
    # offline from the shards instead.
    consolidate: bool = True
    # Every checkpoint also writes the layout-free state (state/: each trained parameter's fp32
    # master and both Adam moments, 12 bytes per parameter: the optimizer state a second time
    # beside the engine's own files), from which it resumes on another layout and which
    # `rlt-mega reshard` reads. false: not written (12 bytes per parameter less per checkpoint,
    # and no gathering at each save); the checkpoint then resumes on its own layout only.
    layout_free: bool = True

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every={self.every}: must be >= 0")
        _check(self.keep >= 1, f"checkpoint.keep={self.keep}: must be >= 1")
        _check(bool(self.dir.strip()), "checkpoint.dir is empty: give a directory for the checkpoints")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    prompt_field: str = "question"
    answer_field: str = "answer"
    # The environment whose written episodes the answers are (grpo.env's names: "calculator" for
    # GSM8K's <<48/2=24>>24): its observations are tokenized on their own, as a rollout appends
    # them, and carry no loss. null: plain answers.
    env: Optional[str] = None


@dataclass
class SamplingConfig:
    """Logits processing and stopping for ``generate`` and GRPO rollouts (``eval`` is greedy)."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    max_new_tokens: int = 256
    stop_strings: list = field(default_factory=list)  # besides the tokenizer's end-of-text token
    batch_size: int = 32  # prompts per call in ``generate`` and ``eval``
    # Decoder steps between the host's reads of the finish flags (rollout/ring.py): the per-step
    # loop never synchronises with the host otherwise; a finished row leaves the batch at the
    # next check.
    check_every: int = 8
    # Rows decoded at once per rollout call (schedule/rows.py; 0: one per row and shared prompt,
    # nobody waits); fewer, and a row waits for a freed slot (continuous batching). Replay
    # repeats whatever the rollout did.
    slots: int = 0

    def __post_init__(self) -> None:
        _check(self.check_every >= 1, f"sampling.check_every={self.check_every}: must be >= 1")
        _check(self.slots >= 0, f"sampling.slots={self.slots}: must be >= 0 (0: one slot per row, no waiting)")
        _check(self.temperature >= 0, f"sampling.temperature={self.temperature}: must be >= 0 (0 is greedy)")
        _check(self.top_k >= 0, f"sampling.top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        _check(0 < self.top_p <= 1, f"sampling.top_p={self.top_p}: must be in (0, 1] (1 disables top-p)")
        _check(self.max_new_tokens >= 1, f"sampling.max_new_tokens={self.max_new_tokens}: must be >= 1")
        _check(self.batch_size >= 1, f"sampling.batch_size={self.batch_size}: must be >= 1")
        _check(all(isinstance(s, str) and s for s in self.stop_strings),
               "sampling.stop_strings must be a list of non-empty strings")


@dataclass
class GRPOConfig:
    """GRPO (docs/design.md, "GRPO"). One step: prompts_per_step x group_size completions per
    data-parallel rank, then epochs x minibatches optimizer steps (train.steps counts GRPO
    steps). Each minibatch is sampled as train.grad_accum rollout batches (more when a
    pipeline keeps more than grad_accum in flight, parallel.micro_batches), each its own batch,
    so that its replay repeats the rollout's calls with the same batch composition
    (docs/design.md, "Granularity"); their gradients accumulate into the minibatch's one step.
    GRPO derives train.micro_batch_size (a minibatch's rows / grad_accum) and refuses another
    value set by the user (train/grpo.py, grpo_config)."""

    prompts_per_step: int = 8  # per data-parallel rank
    group_size: int = 8  # G completions per prompt
    minibatches: int = 1
    epochs: int = 1
    advantage: str = "grpo"  # "grpo" ((r - mean) / (std + eps)), "dr_grpo" (r - mean) or "rloo" (leave-one-out)
    advantage_eps: float = 1.0e-6
    # The policy loss (learner/policy_loss.py): "clip" (PPO's clipped surrogate, token ratios,
    # eps_low / eps_high, dual-clip clip_ratio_c) or "gspo" (one length-normalised ratio per
    # sequence, clipped to gspo_eps_low / gspo_eps_high).
    policy_loss: str = "clip"
    eps_low: float = 0.2
    eps_high: float = 0.2  # > eps_low: DAPO's clip-higher
    clip_ratio_c: Optional[float] = None  # dual-clip: the loss of a negative advantage is <= -A * c (c > 1, e.g. 3)
    gspo_eps_low: float = 3.0e-4  # the GSPO paper's clip range
    gspo_eps_high: float = 4.0e-4
    # How per-token losses become the step's loss (learner/aggregation.py), normalised over the
    # whole step: "token_mean", "seq_mean_token_mean", "seq_mean_token_sum" or
    # "seq_mean_token_sum_norm" (Dr.GRPO: divided by loss_agg_length per sequence).
    loss_agg: str = "token_mean"
    loss_agg_length: Optional[int] = None  # seq_mean_token_sum_norm's constant; null: sampling.max_new_tokens
    kl_coef: float = 0.0  # > 0: KL to a frozen copy of the initial model
    kl_estimator: str = "k3"  # "k1" (log ratio), "k2" (squared log ratio / 2) or "k3" (low variance, >= 0)
    kl_in_reward: bool = False  # true: r - kl_coef * sum_t KL(mu_t, ref_t) before the advantages, no KL loss
    entropy_coef: float = 0.0  # > 0: an entropy bonus, - entropy_coef * the policy's token entropy
    # DAPO's dynamic sampling: groups whose rewards are all equal carry no gradient; they are
    # dropped and more prompts sampled until prompts_per_step informative groups are kept
    # (per replica), in at most max_sampling_rounds rounds of prompts_per_step prompts each; a step
    # reserves all max_sampling_rounds rounds' prompts (unused ones are skipped), so its data never
    # depends on another step's rounds nor on which sampler ran it.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Overlong completions (cut at sampling.max_new_tokens): mask_truncated takes them out of
    # the loss; overlong_buffer > 0 is DAPO's soft penalty, which subtracts up to
    # overlong_penalty, linearly over the last overlong_buffer tokens of the budget.
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    reward: str = "gsm8k"  # "gsm8k" or "module:function" taking (completion text, answer record)
    # An environment inside the rollouts (rollout/env/, rollout/turns.py): null none, "calculator"
    # (GSM8K's <<expression=value>>), "chat" (scripted user turns, a record's "turns") or
    # "module:Class". Its observations are inserted after each trigger and forced (no loss); it
    # needs sampling.check_every: 1. Limits: turns per episode, observation tokens per turn and
    # per episode (cut beyond), seconds per call (past it: an error observation).
    env: Optional[str] = None
    max_turns: int = 8
    max_turn_tokens: int = 32
    max_episode_tokens: int = 256
    env_time_limit: float = 2.0
    # Faults of the environment's own code (an exception in start() or step(), a step() answering
    # with something other than a Turn, a non-str observation) are error observations, each kind
    # named once in the log and every one counted (env/faults); more than this many in one step
    # stop the run naming them (0: never stop).
    max_env_errors: int = 8
    # A NaN or infinite reward scores 0 (a failure) and is counted (reward/nonfinite); this many
    # steps in a row with one stop the run, naming the function (0: never stop).
    max_nonfinite_reward_steps: int = 3
    eval_every: int = 10  # GRPO steps between held-out greedy accuracy checks; 0: first and last only
    eval_size: int = 200  # held-out prompts in each check
    # The first minibatch of a step learns with the rollout's own parameters, so its replay is
    # mu bit for bit: skip_onpolicy_replay uses mu as the hybrid's value and skips that replay
    # (false: replay it anyway); verify_onpolicy replays it all the same and fails the run if it
    # is not torch.equal to mu (train/grpo.py, ``onpolicy_values``).
    skip_onpolicy_replay: bool = True
    verify_onpolicy: bool = False
    # Bounded staleness (train/async_grpo.py): step k learns from the samples of its data drawn
    # by the policy of step max(0, k - max_staleness), a fixed pipeline (reproducible, resumed
    # exactly: the queue is in every rank's checkpoint); 0 is synchronous GRPO, bit for bit.
    max_staleness: int = 0
    # Partial rollouts (train/async_grpo.py): 0 off; n >= 1: data step j's rollouts start under
    # policy version max(0, j - max_staleness - 1) and switch to max(0, j - max_staleness) before
    # decode step n rounded up to a multiple of model.memory_block (a memory-block boundary), so
    # a sampler starts before the newest weights exist; every token records its version.
    partial_rollouts: int = 0
    # Off-policy correction of stale samples (learner/correction.py): "none" (ratio against mu),
    # "token_tis" (ratio against the step's proximal policy, weight min(pi_old / mu, is_cap)),
    # "token_mask" (weight 0 where pi_old / mu leaves [is_band_low, is_band_high]) or
    # "seq_mask" (a row whose geometric-mean pi_old / mu leaves the band gets weight 0).
    is_correction: str = "none"
    is_cap: float = 2.0
    is_band_low: float = 0.5
    is_band_high: float = 2.0
    # Sampler and learner roles in one job (train/async_grpo.py, parallel/roles.py): the
    # learner's replica of tp x pp x dp ranks (any ZeRO stage) and sampler_replicas replicas of tp x
    # pp ranks sampling (weights sent to them, rollouts sent back, position for position), each
    # data step by the first replica that claims it, every learner data-parallel rank's share;
    # a lost replica's steps are redone by the others; 0: colocated.
    sampler_replicas: int = 0
    # Seconds a sampler replica's rank may go without a heartbeat (or a message of the roles may
    # take) before the replica counts as lost: the others redo its data steps (parallel/roles.py).
    sampler_timeout_s: float = 120.0
    # The sampler replicas are launched on their own and join (RLT_ROLES_JOIN=host:port of this
    # job's store): the job holds the learner alone, so a sampler that dies never stops it.
    samplers_join: bool = False
    # MiB of weights a learner rank holds gathered at once while it publishes a version to the
    # samplers (parallel/publication.py: gathered from the data-parallel ranks' partitions one
    # bucket at a time, sent, then freed).
    publish_bucket_mb: float = 64.0
    # On-policy distillation (learner/distill.py): an export directory (rlt-mega export, or an
    # imported Llama/Qwen2: rlt-mega import) whose model scores every sampled token in the
    # learner's replay pass; per-token advantage teacher_coef * (log teacher - log mu) +
    # (1 - teacher_coef) * the task advantage. null: no teacher.
    teacher: Optional[str] = None
    teacher_coef: float = 1.0
    # A forward-KL term on the teacher's top-k (learner/distill.py): k > 0 adds teacher_topk_coef *
    # sum_{teacher's k most probable tokens} p_T (log p_T - log p_student) at each sampled position
    # (p_T not renormalised over the k), aggregated as the policy loss. 0: none.
    teacher_topk: int = 0
    teacher_topk_coef: float = 1.0

    def __post_init__(self) -> None:
        self._check_objective()
        self._check_rollouts()

    def _check_objective(self) -> None:
        """The batch, the advantage, the loss and the teacher."""
        _check(self.teacher is None or bool(str(self.teacher).strip()),
               "grpo.teacher is empty: give an export directory (rlt-mega export / rlt-mega import), or null")
        _check(0.0 <= self.teacher_coef <= 1.0,
               f"grpo.teacher_coef={self.teacher_coef}: must be in [0, 1] (1: distillation alone, 0: the task reward alone)")
        _check(isinstance(self.teacher_topk, int) and self.teacher_topk >= 0,
               f"grpo.teacher_topk={self.teacher_topk}: must be an integer >= 0 (0: no forward-KL term; k: the "
               "teacher's k most probable tokens at each sampled position)")
        _check(self.teacher_topk == 0 or self.teacher is not None,
               f"grpo.teacher_topk={self.teacher_topk} needs grpo.teacher (the model whose top-k it reads): set "
               "grpo.teacher, or grpo.teacher_topk=0")
        _check(math.isfinite(self.teacher_topk_coef) and self.teacher_topk_coef >= 0,
               f"grpo.teacher_topk_coef={self.teacher_topk_coef}: must be a finite number >= 0 (the forward-KL "
               "term's weight)")
        _check(self.prompts_per_step >= 1, f"grpo.prompts_per_step={self.prompts_per_step}: must be >= 1")
        _check(self.group_size >= 2, f"grpo.group_size={self.group_size}: group advantages need >= 2")
        _check(self.minibatches >= 1 and self.epochs >= 1, "grpo.minibatches and grpo.epochs must be >= 1")
        rows = self.prompts_per_step * self.group_size
        _check(rows % self.minibatches == 0,
               f"grpo.minibatches={self.minibatches} does not divide prompts_per_step x group_size = {rows}: "
               f"choose among {[m for m in range(1, rows + 1) if rows % m == 0]}")
        _check(self.advantage in ("grpo", "dr_grpo", "rloo"),
               f"grpo.advantage={self.advantage!r}: expected 'grpo', 'dr_grpo' or 'rloo'")
        _check(self.policy_loss in ("clip", "gspo"),
               f"grpo.policy_loss={self.policy_loss!r}: expected 'clip' or 'gspo'")
        _check(0 <= self.eps_low < 1 and self.eps_high >= 0,
               f"grpo.eps_low={self.eps_low} must be in [0, 1) and grpo.eps_high={self.eps_high} >= 0")
        _check(0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0,
               f"grpo.gspo_eps_low={self.gspo_eps_low} must be in [0, 1) and "
               f"grpo.gspo_eps_high={self.gspo_eps_high} >= 0")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1,
               f"grpo.clip_ratio_c={self.clip_ratio_c}: the dual-clip bound must be > 1 (e.g. 3), or null for none")
        _check(self.clip_ratio_c is None or self.policy_loss == "clip",
               f"grpo.clip_ratio_c={self.clip_ratio_c} is the dual clip of grpo.policy_loss=clip; GSPO (verl's "
               "included) has no dual clip: set grpo.clip_ratio_c=null with grpo.policy_loss=gspo")
        modes = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
        _check(self.loss_agg in modes, f"grpo.loss_agg={self.loss_agg!r}: expected one of {', '.join(modes)}")
        _check(self.loss_agg_length is None or self.loss_agg_length >= 1,
               f"grpo.loss_agg_length={self.loss_agg_length}: must be >= 1, or null for sampling.max_new_tokens")
        _check(self.kl_coef >= 0, f"grpo.kl_coef={self.kl_coef}: must be >= 0")
        _check(self.kl_estimator in ("k1", "k2", "k3"),
               f"grpo.kl_estimator={self.kl_estimator!r}: expected 'k1', 'k2' or 'k3'")
        _check(not self.kl_in_reward or self.kl_coef > 0,
               "grpo.kl_in_reward=true needs grpo.kl_coef > 0 (the weight of the KL in the reward)")
        _check(self.entropy_coef >= 0, f"grpo.entropy_coef={self.entropy_coef}: must be >= 0")

    def _check_rollouts(self) -> None:
        """Sampling rounds, environments, staleness and its corrections, the roles and the limits."""
        _check(self.max_sampling_rounds >= 1, f"grpo.max_sampling_rounds={self.max_sampling_rounds}: must be >= 1")
        _check(self.overlong_buffer >= 0 and self.overlong_penalty >= 0,
               f"grpo.overlong_buffer={self.overlong_buffer} and grpo.overlong_penalty={self.overlong_penalty} "
               "must be >= 0")
        _check(self.eval_every >= 0 and self.eval_size >= 0, "grpo.eval_every and grpo.eval_size must be >= 0")
        _check(self.max_turns >= 1 and self.max_turn_tokens >= 1 and self.max_episode_tokens >= 1,
               f"grpo.max_turns={self.max_turns}, grpo.max_turn_tokens={self.max_turn_tokens} and "
               f"grpo.max_episode_tokens={self.max_episode_tokens} must be >= 1")
        _check(self.env_time_limit > 0, f"grpo.env_time_limit={self.env_time_limit}: must be > 0 seconds")
        _check(self.max_staleness >= 0, f"grpo.max_staleness={self.max_staleness}: must be >= 0 (0: synchronous)")
        corrections = ("none", "token_tis", "token_mask", "seq_mask")
        _check(self.is_correction in corrections,
               f"grpo.is_correction={self.is_correction!r}: expected one of {', '.join(corrections)}")
        _check(self.partial_rollouts >= 0,
               f"grpo.partial_rollouts={self.partial_rollouts}: must be >= 0 (0: off; n: the decode step before "
               "which the rollouts switch to the newer policy version, rounded up to a memory block)")
        _check(self.is_correction == "none" or self.max_staleness > 0 or self.partial_rollouts > 0,
               f"grpo.is_correction={self.is_correction!r} corrects stale samples, and grpo.max_staleness=0 without "
               "partial rollouts has none (the ratio against mu is exact): set grpo.max_staleness >= 1, "
               "grpo.partial_rollouts >= 1 or grpo.is_correction=none")
        _check(self.sampler_timeout_s > 0,
               f"grpo.sampler_timeout_s={self.sampler_timeout_s}: must be > 0 (the seconds before a silent "
               "sampler replica is lost)")
        _check(self.publish_bucket_mb > 0,
               f"grpo.publish_bucket_mb={self.publish_bucket_mb}: must be > 0 (MiB of weights gathered at once "
               "while publishing to the samplers)")
        _check(self.sampler_replicas >= 0,
               f"grpo.sampler_replicas={self.sampler_replicas}: must be >= 0 (0: colocated)")
        _check(not self.samplers_join or self.sampler_replicas >= 1,
               "grpo.samplers_join=true with grpo.sampler_replicas=0: set grpo.sampler_replicas to the replicas "
               "that join (the learner waits for them), or grpo.samplers_join=false")
        _check(self.is_cap > 0, f"grpo.is_cap={self.is_cap}: the truncation of the IS weight must be > 0")
        _check(0 < self.is_band_low <= 1 <= self.is_band_high,
               f"grpo.is_band_low={self.is_band_low}, grpo.is_band_high={self.is_band_high}: the band of kept "
               "ratios must hold 1 (0 < low <= 1 <= high)")
        _check(self.max_env_errors >= 0, f"grpo.max_env_errors={self.max_env_errors}: must be >= 0 (0: never stop)")
        _check(self.max_nonfinite_reward_steps >= 0,
               f"grpo.max_nonfinite_reward_steps={self.max_nonfinite_reward_steps}: must be >= 0 (0: never stop)")


@dataclass
class EvalConfig:
    """Sampled evaluation, beside the greedy accuracy (``rlt-mega eval`` and GRPO's periodic
    eval): n = samples completions per problem at ``temperature``, reported as pass@k (the
    unbiased estimator of Chen et al. 2021), maj@k (majority vote over the extracted answers)
    for each k in ``k``, and mean@n (the mean accuracy of a sample)."""

    samples: int = 0  # n per problem; 0: greedy accuracy only
    k: list = field(default_factory=lambda: [1])
    temperature: Optional[float] = None  # null: sampling.temperature
    # Length generalisation (data.train=generated:<task>): per-position and whole-sequence
    # accuracy on sequences of each length, logged as eval/token_acc@T and eval/seq_acc@T
    lengths: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.lengths)
               and len(set(self.lengths)) == len(self.lengths),
               f"eval.lengths={self.lengths}: expected distinct integers >= 1, e.g. [32, 64, 128, 256]")
        _check(self.samples >= 0, f"eval.samples={self.samples}: must be >= 0 (0: greedy accuracy only)")
        _check(bool(self.k) and all(isinstance(k, int) and k >= 1 for k in self.k),
               f"eval.k={self.k}: expected a non-empty list of integers >= 1")
        _check(self.samples > 0 or self.k == [1],
               f"eval.k={self.k} has no effect with eval.samples=0 (greedy accuracy only): set eval.samples to n "
               ">= every k for pass@k and maj@k, or leave eval.k out")
        _check(self.samples == 0 or max(self.k) <= self.samples,
               f"eval.k={self.k}: every k must be <= eval.samples={self.samples} (pass@k needs n >= k samples)")
        _check(self.temperature is None or self.temperature > 0,
               f"eval.temperature={self.temperature}: must be > 0 (the greedy accuracy is reported anyway)")


@dataclass
class WandbConfig:
    """Weights & Biases, beside TensorBoard (metrics.py): on when ``project`` is set. The run's
    files go under logging.dir (wandb/); mode "offline" writes them without a network."""

    project: Optional[str] = None  # None: no wandb
    name: Optional[str] = None  # the run's display name (wandb picks one when null)
    mode: Literal["online", "offline", "disabled"] = "online"
    entity: Optional[str] = None  # team or user; null: the logged-in default

    def __post_init__(self) -> None:
        _check(self.project is None or bool(self.project.strip()),
               "logging.wandb.project is empty: give a project name, or null for no wandb")
        if self.enabled:
            import importlib.util

            _check(importlib.util.find_spec("wandb") is not None,
                   f"logging.wandb.project={self.project} but wandb is not installed: `pip install wandb`, or set "
                   "logging.wandb.project=null")

    @property
    def enabled(self) -> bool:
        return self.project is not None and self.mode != "disabled"


@dataclass
class LoggingConfig:
    dir: str = "runs/default/tb"  # TensorBoard event files
    progress: bool = True  # tqdm progress bar on rank 0
    level: str = "INFO"
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _check(bool(self.dir.strip()), "logging.dir is empty: give a directory for the metrics")
        _check(self.level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
               f"logging.level={_show(self.level)}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        _check(self.data.seq_len <= self.model.max_seq_len,
               f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}: "
               "raise model.max_seq_len or lower data.seq_len")
        if self.eval.lengths:
            _check(state_task(self.data.train) is not None,
                   f"eval.lengths={self.eval.lengths} evaluates a generated state-tracking task, but data.train="
                   f"{_show(self.data.train)}: set data.train=generated:<task> or eval.lengths=[]")
            _check(max(self.eval.lengths) <= self.model.max_seq_len,
                   f"eval.lengths={self.eval.lengths} reaches {max(self.eval.lengths)} positions, past "
                   f"model.max_seq_len={self.model.max_seq_len}: raise model.max_seq_len to >= "
                   f"{max(self.eval.lengths)} (positions beyond the training length must be allowed)")


# ----------------------------------------------------------------------------------------
# Strict conversion of plain mappings into dataclasses
# ----------------------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _finite_float(value: Any, path: str) -> Optional[float]:
    """A number (or a string PyYAML left unparsed, as YAML 1.1 reads 1e-3) as a finite float;
    None if it is not a number; an infinity or NaN refused."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    if number is None:
        return None
    try:
        number = float(number)  # a huge int overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{path}: expected a finite number, got {_show(value)}")
    return number


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Checks ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")
    if origin is Literal:
        if isinstance(value, typing.Hashable) and value in typing.get_args(tp):
            return value
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{path}: expected null, got {_show(value)}")
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = _finite_float(value, path)
        if number is not None:
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
    else:  # pragma: no cover - an annotation this loader does not know is a programming error
        raise TypeError(f"unsupported config annotation {tp!r} at {path}")
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")


# Keys that chose between twin implementations of the decoder or the schedule, now one of each:
# a config that still sets one gets a line that says so instead of "unknown key".
REMOVED_KEYS = {
    "model.fused_decoder": "the decoder step is one implementation for every schedule (model/decoder.py)",
    "sampling.fast_decode": "the sampler runs the model's one decoder step (model/decoder.py)",
    "sampling.share_prompts": "a rollout always runs a shared prompt once and forks it (schedule/rows.py)",
    "sampling.compact": "a finished row always leaves the rollout's batch at the next check (schedule/rows.py)",
    "grpo.dense_compact": "the learner's decoder always runs only the positions each row needs (schedule/dense.py)",
    "grpo.dense_share_prompts": "the learner always runs a shared prompt once (schedule/dense.py, prompt_pack.py)",
}


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"{hint} Valid keys: {', '.join(sorted(valid))}"


def _from_dict(cls: type, data: Any, path: str = ""):
    if data is None:
        data = {}
    where = path or "the config"
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            if full in REMOVED_KEYS:
                raise ConfigError(f"{full} was removed: {REMOVED_KEYS[full]}; delete the key")
            raise ConfigError(f"unknown config key {_show(full, 80)}{_suggest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") if path and not str(exc).startswith(path) else exc


def from_dict(data: dict, cls: type = Config):
    """Builds ``cls`` from a plain mapping, strictly (see the module docstring). The dotted keys
    the mapping set are remembered (:func:`given`)."""
    cfg = _from_dict(cls, data)
    if isinstance(data, dict):
        cfg._given = frozenset(_dotted_keys(data))  # not a field: asdict, repr and == ignore it
    return cfg


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += _dotted_keys(value, name) if isinstance(value, dict) else [name]
    return out


def given(cfg: Any) -> frozenset:
    """The dotted keys a config file or an override set (``train.micro_batch_size``), so that a
    job that derives a value can refuse one the user gave instead of overwriting it silently.
    Empty for a config built in code or changed with dataclasses.replace."""
    return getattr(cfg, "_given", frozenset())


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {_show(item)} is not of the form section.key=value (e.g. train.steps=100)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {_show(item)}: empty key; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ConfigError(f"override {_show(item)}: cannot parse the value ({exc.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Writes dotted ``a.b=value`` overrides into a plain nested mapping."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {_show(item)}: {_show(part)} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently: a second ``train:`` section would reset the first one's keys)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merges are not duplicates
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    def __init__(self, key, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line naming the file and the line of a YAML syntax error."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return ConfigError(f"config file {path} is not valid YAML: {problem}")
    where = f"config file {path}, line {mark.line + 1}"
    if "'\\t'" in problem:
        return ConfigError(f"{where}: a tab in the indentation; YAML indents with spaces only")
    return ConfigError(f"{where}, column {mark.column + 1}: not valid YAML ({problem})")


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_bytes(), Loader=_StrictLoader)  # bytes: PyYAML detects the encoding itself
    except _DuplicateKey as exc:
        raise ConfigError(f"config file {path}: '{exc.key}' is given twice in the same section, on lines {exc.first} "
                          f"and {exc.second}: keep one") from None
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not valid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls: type = Config):
    """Reads a YAML file (or only defaults when ``path`` is None) and applies dotted overrides."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(data, cls)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
