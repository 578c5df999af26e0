"""Import a dense Llama- or Qwen2-style Hugging Face checkpoint as an RLT (docs/design.md,
"The model").

A dense transformer converts exactly: encoder = decoder = its layers (share_weights), the
output projection ``o`` of every cross-attention = 0 and ``recur_proj`` = 0. Then the decoder
input is ``embed[x_t]``, every cross-attention adds exactly 0.0, and the decoder's layer i sees
the dense model's layer-i states through its own K/V: the RLT's logits are the dense model's.
The other RLT-only weights get the model's own seeded initialisation (cross q/k/v normal, norms
one, null_memory and z_init normal), so that training moves away from the dense model through
the zero-initialised projections with a useful gradient (the input of cross ``o`` is not 0).

Only what we can reproduce exactly is accepted; anything else is refused with the field that
causes it (RoPE scaling, sliding-window attention, biases on o_proj or the MLP, other
activations, another head_dim, quantized weights, other architectures).

With ``arch="dense"`` the checkpoint becomes the dense baseline itself (model.arch: dense,
model/baselines.py): the same tensors under the same names, nothing else, so it trains, exports and
compares as the model it is.

The HF config.json is read as plain JSON: the importer does not need transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from rlt_mega.config import ConfigError, ModelConfig
from rlt_mega.log import get_logger
from rlt_mega.precision import parse_storage_dtype as parse_dtype
from rlt_mega.checkpoint_tools.export import (
    CONFIG_NAME, DEFAULT_MAX_SHARD_SIZE, TOKENIZER_FILES, empty_model, export_state_dict, expected_shapes,
    tied_aliases,
)
from rlt_mega.checkpoint import check_output
from rlt_mega.checkpoint_tools.files import EXPORT, CheckpointFormatError, SafetensorsDir, read_json
from rlt_mega.checkpoint_tools.hf_dense import hf_names  # HF name -> model name, shared with the dense export

log = get_logger(__name__)

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a non-persistent buffer some old checkpoints hold


def _unsupported(file: Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file}: {problem}; the importer converts Llama/Qwen2 checkpoints that "
                                 "an RLT reproduces exactly, and refuses the rest")


def _rope_theta(hf: dict, file: Path) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``
    (older files); refuses any scaled or partial RoPE."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _unsupported(file, f"rope_parameters={params!r} is not a mapping")
    if any(isinstance(v, dict) for v in params.values()):
        raise _unsupported(file, "per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _unsupported(file, f"RoPE scaling rope_type={rope_type!r} is not supported (only plain RoPE; "
                                 "an RLT has no RoPE scaling)")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _unsupported(file, f"partial_rotary_factor={partial} is not supported (RoPE on the whole head)")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def _uses_sliding_window(hf: dict) -> bool:
    """Qwen2: layer i uses a sliding window when use_sliding_window and i >= max_window_layers
    (or when layer_types says so)."""
    if "sliding_attention" in (hf.get("layer_types") or []):
        return True
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        return hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
    return False


def hf_model_config(hf: dict, file: Path, memory_block: int = 1, max_seq_len: Optional[int] = None,
                    arch: str = "rlt") -> ModelConfig:
    """The ModelConfig of the RLT (or, arch "dense", the dense model) that reproduces the dense
    model described by ``hf``."""
    if arch not in ("rlt", "dense"):
        raise ConfigError(f"import as model.arch={arch!r}: a Llama/Qwen2 checkpoint becomes an rlt or a dense "
                          "model (a looped model has no checkpoint to import from)")
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in SUPPORTED:
        raise _unsupported(file, f"model_type={model_type!r} (architectures {archs}) is not supported; "
                                 f"supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED.items())}")
    if any(a != SUPPORTED[model_type] for a in archs):
        raise _unsupported(file, f"architectures {archs}: only {SUPPORTED[model_type]} (a model with its "
                                 "language-model head) can be imported")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int):
            raise CheckpointFormatError(f"{file}: '{key}' is missing or not an integer")
    if hf.get("quantization_config"):
        raise _unsupported(file, "quantized checkpoints (quantization_config) are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(file, f"hidden_act={hf['hidden_act']!r} (the RLT MLP is SwiGLU with silu)")
    d, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d:
        raise _unsupported(file, f"head_dim={head_dim} with num_attention_heads={n_heads} and hidden_size={d} "
                                 "(an RLT's head dim is hidden_size / num_attention_heads)")
    if model_type == "llama" and hf.get("attention_bias"):
        raise _unsupported(file, "attention_bias=true puts a bias on o_proj, which an RLT does not have")
    if hf.get("mlp_bias"):
        raise _unsupported(file, "mlp_bias=true (the RLT MLP has no biases)")
    if model_type == "qwen2" and _uses_sliding_window(hf):
        raise _unsupported(file, f"sliding-window attention is in use (use_sliding_window="
                                 f"{hf.get('use_sliding_window')}, sliding_window={hf.get('sliding_window')}, "
                                 f"max_window_layers={hf.get('max_window_layers')}); an RLT attends to all positions")
    try:
        return ModelConfig(
            arch=arch, vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads, ffn_hidden=hf["intermediate_size"],
            memory_block=memory_block, rope_theta=_rope_theta(hf, file), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            share_weights=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases, Llama (accepted) never
            init_std=float(hf.get("initializer_range", 0.02)),
            max_seq_len=max_seq_len or int(hf.get("max_position_embeddings", 2048)),
        )
    except ConfigError as exc:
        raise CheckpointFormatError(f"{file}: the RLT this would become is not valid: {exc}") from None


def check_hf_tensors(st: SafetensorsDir, cfg: ModelConfig, names: dict[str, str]) -> None:
    present = set(st.names())
    missing = [n for n in names if n not in present]
    if missing:
        raise CheckpointFormatError(f"{st.path}: missing tensors that the config requires, e.g. {missing[:5]} "
                                    f"(files: {[f.name for f in st.files()]})")
    extra = [n for n in present - set(names)
             if not n.endswith(_IGNORED_SUFFIXES) and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if extra:
        raise CheckpointFormatError(f"{st.file_of[sorted(extra)[0]]}: tensors the Llama/Qwen2 layout does not "
                                    f"have, e.g. {sorted(extra)[:5]}: an unsupported architecture variant")
    shapes = expected_shapes(cfg)
    for hf_name, rlt_name in names.items():
        if st.shape(hf_name) != shapes[rlt_name]:
            raise CheckpointFormatError(f"{st.file_of[hf_name]}: tensor '{hf_name}' has shape {st.shape(hf_name)}, "
                                        f"but config.json implies {shapes[rlt_name]}")


def convert_hf(hf_dir: str | Path, *, memory_block: int = 1, seed: int = 0,
               max_seq_len: Optional[int] = None, dtype: Optional[str | torch.dtype] = "auto",
               arch: str = "rlt") -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Reads a HF checkpoint directory -> (cfg, RLT state dict with tied aliases, source info).

    dtype "auto" keeps the checkpoint's dtype (the RLT-only weights are initialised in fp32
    and cast to it); imported tensors are copied bit for bit.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointFormatError(f"{hf_dir}: not a directory (expected a Hugging Face checkpoint "
                                    "directory with config.json and model.safetensors)")
    file = hf_dir / CONFIG_NAME
    hf = read_json(file, "a Hugging Face checkpoint directory holds config.json (the model config)")
    cfg = hf_model_config(hf, file, memory_block=memory_block, max_seq_len=max_seq_len, arch=arch)
    names = hf_names(cfg)
    with SafetensorsDir(hf_dir) as st:
        check_hf_tensors(st, cfg, names)
        out_dtype = parse_dtype(dtype) or st.dtype("model.embed_tokens.weight")
        if not out_dtype.is_floating_point:
            raise _unsupported(st.file_of["model.embed_tokens.weight"], f"weights of dtype {out_dtype}")
        # The RLT-only weights: the model's own initialisation, seeded, independent of the global RNG.
        model = empty_model(cfg)
        model.init_weights(seed)
        sd = {n: t.detach() for n, t in model.state_dict().items()}
        with torch.no_grad():
            if arch == "rlt":
                for i in range(cfg.n_layers):
                    sd[f"cross.{i}.attn.o.weight"].zero_()  # every cross-attention adds exactly 0
                sd["recur_proj.weight"].zero_()  # the decoder input is embed[x_t]
            sd = {n: t.to(out_dtype) for n, t in sd.items()}
            for hf_name, rlt_name in names.items():
                sd[rlt_name] = st.get(hf_name).to(out_dtype)
        for alias, stored in tied_aliases(cfg).items():
            sd[alias] = sd[stored]
    source = {"kind": "hf_import", "path": str(hf_dir.resolve()), "model_type": hf["model_type"],
              "architectures": hf.get("architectures"), "seed": seed,
              "zero_initialised": ["cross.*.attn.o.weight", "recur_proj.weight"] if arch == "rlt" else []}
    return cfg, sd, source


def import_hf(hf_dir: str | Path, out_dir: str | Path, *, memory_block: int = 1, seed: int = 0,
              max_seq_len: Optional[int] = None, dtype: Optional[str | torch.dtype] = "auto",
              tokenizer: Optional[str | Path] = "auto", max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              overwrite: bool = False, arch: str = "rlt") -> Path:
    """Converts a Llama/Qwen2 checkpoint directory into an RLT export directory.

    ``tokenizer``: "auto" copies the tokenizer files found in hf_dir (if any), None copies none,
    or a path as in :func:`export_state_dict`.
    """
    check_output(out_dir, [hf_dir], overwrite, kind=EXPORT)  # before the conversion's work
    cfg, sd, source = convert_hf(hf_dir, memory_block=memory_block, seed=seed, max_seq_len=max_seq_len,
                                 dtype=dtype, arch=arch)
    if tokenizer == "auto":
        has_tokenizer = any((Path(hf_dir) / n).is_file() for n in TOKENIZER_FILES)
        tokenizer = hf_dir if has_tokenizer else None
    out = export_state_dict(sd, cfg, out_dir, tokenizer=tokenizer, max_shard_size=max_shard_size,
                            source=source, overwrite=overwrite, inputs=[hf_dir])
    log.info("imported %s (%s, L=%d, d=%d) as model.arch=%s in %s", hf_dir, source["model_type"], cfg.n_layers,
             cfg.d_model, cfg.arch, out)
    return out
