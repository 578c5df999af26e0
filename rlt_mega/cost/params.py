"""Parameter counts by group, for the whole model and for one rank of a TP x PP layout.

Sharding follows docs/design.md, "Parallel layout" (Megatron conventions): self- and
cross-attention q/k/v and the MLP gate/up are column-parallel (weights and biases split by output), o and down
row-parallel (split by input; they have no bias), embed and lm_head vocab-parallel; norms,
``recur_proj`` (d x d, small), ``z_init`` and ``null_memory`` are replicated. Pipeline stage s
owns a contiguous block of layers (the trainer's split: L/P each, earlier stages one more when
P does not divide L, or ``pp_split``); stage 0 also embed and the recurrence input
(recur_norm, recur_proj, z_init), the last stage memory_norm, final_norm and lm_head (a copy
of embed when tied and P > 1, its gradient all-reduced with stage 0's as Megatron does). Every
stage holds null_memory: it feeds the null slot of the stage's own cross-attention K/V.
This is what ``parallel/tp.py`` and ``parallel/stage.py`` build.

model.arch dense / looped (model/baselines.py): embed, the blocks, final_norm and lm_head, sharded
by the same plan; these models run without pipeline parallelism (parallel.dims refuses pp > 1).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from rlt_mega.config import ConfigError, LoraConfig, ModelConfig
from rlt_mega.model.rlt import param_counts
from rlt_mega.parallel.dims import check_tp, split_layers


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows of the vocab-parallel embedding and head. The trainer does not pad
    (``check_tp`` asks for a vocabulary divisible by tp), so this is ``vocab_size``."""
    return -(-vocab_size // tp) * tp


def stage_layers(n_layers: int, pp: int, pp_split: Optional[Sequence[int]] = None) -> list[range]:
    """Layer indices of each pipeline stage: the trainer's own split (parallel.dims.split_layers:
    contiguous, earlier stages take the remainder of an uneven split, or ``pp_split``)."""
    return list(_stage_layers(n_layers, pp, None if pp_split is None else tuple(pp_split)))


@functools.lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, pp: int, pp_split: Optional[tuple[int, ...]]) -> tuple[range, ...]:
    return tuple(split_layers(n_layers, pp, None if pp_split is None else list(pp_split)))


def block_params(cfg: ModelConfig, tp: int = 1) -> int:
    """One shared block (attn_norm, q/k/v/o, mlp_norm, gate/up/down) on one TP rank."""
    d, q, kv, f = cfg.d_model, cfg.n_heads * cfg.head_dim // tp, cfg.n_kv_heads * cfg.head_dim // tp, \
        cfg.ffn_hidden // tp
    bias = q + 2 * kv if cfg.qkv_bias else 0
    return 2 * d + d * q + 2 * d * kv + q * d + bias + 3 * d * f


def cross_params(cfg: ModelConfig, tp: int = 1) -> int:
    """One cross block (cross_norm, q/k/v/o) on one TP rank."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim // tp, cfg.n_kv_heads * cfg.head_dim // tp
    return d + d * q + 2 * d * kv + q * d


def rank_param_counts(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                      pp_split: Optional[Sequence[int]] = None) -> dict[str, int]:
    """Parameters held by one rank of pipeline stage ``stage`` in a tp x pp layout, by group.
    With tp = pp = 1 this is :func:`rlt_mega.model.rlt.param_counts`."""
    check_tp(cfg, tp)
    layers = stage_layers(cfg.n_layers, pp, pp_split)
    if not 0 <= stage < pp:
        raise ConfigError(f"stage {stage} is outside 0..{pp - 1}")
    num_local_layers = len(layers[stage])
    first, last = stage == 0, stage == pp - 1
    d = cfg.d_model
    vocab_rows = padded_vocab(cfg.vocab_size, tp) // tp
    lm_head_here = last and (not cfg.tie_embeddings or pp > 1)
    if cfg.arch != "rlt":
        counts = {"embed": vocab_rows * d if first else 0, "lm_head": vocab_rows * d if lm_head_here else 0,
                  "blocks": num_local_layers * block_params(cfg, tp), "final_norm": d if last else 0}
        counts["total"] = sum(counts.values())
        return counts
    counts = {
        "embed": vocab_rows * d if first else 0,
        "lm_head": vocab_rows * d if lm_head_here else 0,
        "blocks": num_local_layers * block_params(cfg, tp),
        "decoder_blocks": 0 if cfg.share_weights else num_local_layers * block_params(cfg, tp),
        "cross": num_local_layers * cross_params(cfg, tp),
        "recurrence": (2 * d + d * d) if first else 0,  # recur_norm, z_init, recur_proj
        "memory": d + (d if last else 0),  # null_memory everywhere, memory_norm on the last stage
        "final_norm": d if last else 0,
    }
    counts["total"] = sum(counts.values())
    return counts


def model_param_counts(cfg: ModelConfig) -> dict[str, int]:
    """The whole model, by group (the model's own closed form)."""
    return param_counts(cfg)


def rank_tensor_numels(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                       pp_split: Optional[Sequence[int]] = None) -> list[int]:
    """Sizes of the individual parameter tensors on one rank, in model order (ZeRO-3 pads
    and partitions each tensor separately). Sums to ``rank_param_counts(...)["total"]``."""
    check_tp(cfg, tp)
    layers = stage_layers(cfg.n_layers, pp, pp_split)[stage]
    first, last = stage == 0, stage == pp - 1
    d, f = cfg.d_model, cfg.ffn_hidden // tp
    q, kv = cfg.n_heads * cfg.head_dim // tp, cfg.n_kv_heads * cfg.head_dim // tp
    vocab_rows = padded_vocab(cfg.vocab_size, tp) // tp
    bias = [q, kv, kv] if cfg.qkv_bias else []
    block = [d, d * q, d * kv, d * kv, q * d, *bias, d, d * f, d * f, f * d]
    cross = [d, d * q, d * kv, d * kv, q * d]
    if cfg.arch != "rlt":  # the order of model/baselines.py's parameters
        sizes = ([vocab_rows * d] if first else []) + block * len(layers) + ([d] if last else [])
        if last and (not cfg.tie_embeddings or pp > 1):
            sizes.append(vocab_rows * d)
        return sizes
    sizes = [d]  # null_memory
    if first:
        sizes += [d, vocab_rows * d]  # z_init, embed
    sizes += block * len(layers)
    if not cfg.share_weights:
        sizes += block * len(layers)
    sizes += cross * len(layers)
    if first:
        sizes += [d, d * d]  # recur_norm, recur_proj
    if last:
        sizes += [d, d]  # memory_norm, final_norm
        if not cfg.tie_embeddings or pp > 1:
            sizes.append(vocab_rows * d)
    return sizes


def rank_adapter_numels(cfg: ModelConfig, tp: int = 1, pp: int = 1, stage: int = 0,
                        pp_split: Optional[Sequence[int]] = None) -> list[int]:
    """Sizes of the low-rank adapter tensors (model.lora: A and B of each target) on one rank of
    pipeline stage ``stage``, split like their layers (column-parallel: A replicated, B split;
    row-parallel: A split, B replicated). Empty without adapters; with tp = pp = 1 they sum to
    ``adapter_param_count``."""
    lora = cfg.lora
    if not lora.enabled:
        return []
    check_tp(cfg, tp)
    layers = stage_layers(cfg.n_layers, pp, pp_split)[stage]
    r, d, f = lora.rank, cfg.d_model, cfg.ffn_hidden
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    column = {"q": (q, d), "k": (kv, d), "v": (kv, d), "gate": (f, d), "up": (f, d),
              "cross_q": (q, d), "cross_k": (kv, d), "cross_v": (kv, d)}
    row = {"o": (d, q), "down": (d, f), "cross_o": (d, q)}
    per_layer = []
    for t in lora.targets:
        if t in column:
            out, inp = column[t]
            per_layer += [r * inp, out // tp * r]
        elif t in row:
            out, inp = row[t]
            per_layer += [r * (inp // tp), out * r]
        if t in ("q", "k", "v", "o", "gate", "up", "down") and not cfg.share_weights:
            per_layer += per_layer[-2:]  # the decoder's own blocks carry their own adapters
    numels = per_layer * len(layers)
    if stage == 0 and "recur_proj" in lora.targets:
        numels += [r * d, d * r]
    return numels


def adapter_param_count(cfg: ModelConfig, lora: Optional[LoraConfig] = None) -> int:
    """Closed-form count of adapter parameters of an RLT of ModelConfig ``cfg`` (tested against
    the module): rank x (in + out) per target weight."""
    lora = cfg.lora if lora is None else lora
    if not lora.enabled:
        return 0
    d, Dh, F, L = cfg.d_model, cfg.head_dim, cfg.ffn_hidden, cfg.n_layers
    q_out, kv_out = cfg.n_heads * Dh, cfg.n_kv_heads * Dh
    shapes = {"q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d), "o": (d, q_out), "gate": (F, d), "up": (F, d),
              "down": (d, F)}
    per_block = sum(sum(shapes[t]) for t in lora.targets if t in shapes)
    blocks = L * (1 if cfg.share_weights else 2)
    cross = sum(sum(shapes[t.removeprefix("cross_")]) for t in lora.targets if t.startswith("cross_"))
    recur = 2 * d if "recur_proj" in lora.targets else 0
    return lora.rank * (blocks * per_block + L * cross + recur)
