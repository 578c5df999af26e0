"""An export of a ``model.arch: dense`` model is a standard Hugging Face Llama/Qwen2 checkpoint.

The dense baseline (model/baselines.py) is exactly the Llama layout (Qwen2's with q/k/v biases), so
its export directory is what transformers writes for one: ``config.json`` with model_type
``llama`` or ``qwen2`` and ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, the tensors under the
Hugging Face names (``model.layers.i.self_attn.q_proj.weight`` ...), the tokenizer files and
generation_config.json. ``AutoModelForCausalLM.from_pretrained(EXPORT)`` loads it without
``trust_remote_code``, and ``rlt-mega import`` reads it like any other Llama/Qwen2 checkpoint.

It stays an rlt_mega export too: ``rlt_export.json`` (checksums, under the file's names) and
config.json's ``rlt_mega`` entry, the full ModelConfig (transformers ignores the key), so
``train.init_from``, ``rlt-mega export`` and ``inspect`` read it back exactly.

The looped baseline has no transformers equivalent (no Llama applies its layers twice): its
export is rlt_mega's own format, without modeling code (export.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from rlt_mega.config import ModelConfig

RLT_KEY = "rlt_mega"  # config.json: the ModelConfig of the export


def hf_model_type(cfg: ModelConfig) -> str:
    """Qwen2 is Llama with q/k/v biases (and no o bias); Llama has neither."""
    return "qwen2" if cfg.qkv_bias else "llama"


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> model name, every stored tensor (a tied head is stored once as the
    embedding). The one mapping both the export and the importer (hf_import.py) use."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        names[hf + "input_layernorm.weight"] = ours + "attn_norm.weight"
        names[hf + "post_attention_layernorm.weight"] = ours + "mlp_norm.weight"
        for x in "qkvo":
            names[hf + f"self_attn.{x}_proj.weight"] = ours + f"attn.{x}.weight"
        if cfg.qkv_bias:
            for x in "qkv":
                names[hf + f"self_attn.{x}_proj.bias"] = ours + f"attn.{x}.bias"
        for x in ("gate", "up", "down"):
            names[hf + f"mlp.{x}_proj.weight"] = ours + f"mlp.{x}.weight"
    return names


def file_names(cfg: ModelConfig) -> dict[str, str]:
    """Model name -> the name stored in the export's safetensors files (identity unless dense)."""
    if cfg.arch != "dense":
        return {}
    return {ours: hf for hf, ours in hf_names(cfg).items()}


def hf_dense_config(cfg: ModelConfig, special: dict[str, Any], dtype: Optional[torch.dtype]) -> dict:
    """config.json of a dense export: the transformers Llama/Qwen2 config, plus the ModelConfig."""
    model_type = hf_model_type(cfg)
    out: dict[str, Any] = {
        "model_type": model_type,
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "use_cache": True,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    out.update(special)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        out["dtype"] = out["torch_dtype"] = name  # transformers 5 reads dtype, 4 torch_dtype
    out[RLT_KEY] = dataclasses.asdict(cfg)
    return out
