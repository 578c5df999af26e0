"""What makes an export a Hugging Face model directory as well (issue 14, deliverable 1).

An export holds, beside rlt_mega's own files:

- ``configuration_rlt.py`` and ``modeling_rlt.py`` (``hf_code/``: torch and transformers only,
  never rlt_mega), with ``auto_map`` and ``architectures`` in config.json, so that
  ``AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)`` builds the model;
- the tokenizer files ``AutoTokenizer`` reads: the source's own (an imported Llama/Qwen2 keeps
  its tokenizer, chat template included), or, for rlt_mega's byte tokenizer and for a bare
  ``tokenizer.json``, that tokenizer.json plus a tokenizer_config.json naming its special
  tokens;
- ``generation_config.json`` with the end-of-text, padding and start tokens (the source's
  own when it has one), so that ``generate()`` stops where ``rlt-mega generate`` stops.

config.json keeps every ModelConfig field under its own name; ``HF_CONFIG_KEYS`` are the
keys transformers adds, which rlt_mega's strict reader (export.read_config) sets aside.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from rlt_mega.config import ModelConfig
from rlt_mega.data.tokenizer import Tokenizer, TokenizerError, byte_level, load_tokenizer
from rlt_mega.checkpoint_tools.files import copy_files, write_json
from rlt_mega.log import get_logger

log = get_logger(__name__)

CODE_DIR = Path(__file__).parent / "hf_code"
CODE_FILES = ("configuration_rlt.py", "modeling_rlt.py")
AUTO_MAP = {"AutoConfig": "configuration_rlt.RLTConfig", "AutoModelForCausalLM": "modeling_rlt.RLTForCausalLM"}
ARCHITECTURE = "RLTForCausalLM"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
# Keys of config.json that are transformers', not ModelConfig's.
HF_CONFIG_KEYS = ("architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
                  "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version", "use_cache")


def hf_config(cfg: ModelConfig, special: dict[str, Any], dtype: Optional[torch.dtype]) -> dict:
    """The transformers keys of config.json. tie_word_embeddings is false even for a tied model:
    RLTForCausalLM ties lm_head to embed itself (the tied head is stored once, as embed.weight)."""
    out: dict[str, Any] = {"architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP), "tie_word_embeddings": False,
                           "use_cache": True, **special}
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        out["dtype"] = out["torch_dtype"] = name  # transformers 5 reads dtype, 4 torch_dtype
    return out


def write_code(out_dir: Path) -> list[str]:
    for name in CODE_FILES:
        shutil.copyfile(CODE_DIR / name, out_dir / name)
    return list(CODE_FILES)


def _tokenizer_config(tok: Tokenizer, cfg: ModelConfig) -> dict:
    """tokenizer_config.json for a tokenizer.json that has none: the special tokens by name,
    no spaces cleaned up on decode (rlt_mega's decode is exact)."""
    name = tok.tok.id_to_token
    data: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                            "clean_up_tokenization_spaces": False, "eos_token": name(tok.eos_id),
                            "pad_token": name(tok.pad_id)}
    if tok.bos_id is not None:
        data["bos_token"] = name(tok.bos_id)
    return data


def write_tokenizer(tokenizer: Optional[str | Path], out_dir: Path, cfg: ModelConfig) -> tuple[Any, Optional[Tokenizer]]:
    """Writes the tokenizer files -> (the manifest's "tokenizer" entry, the tokenizer as
    rlt_mega reads it, or None). ``tokenizer``: None (none known), "byte", a directory with
    Hugging Face tokenizer files, or a tokenizers ``tokenizer.json``."""
    if tokenizer is None:
        return None, None
    if str(tokenizer) == "byte":
        tok = byte_level()
        tok.save(out_dir)
        write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tok, cfg))
        return "byte", tok
    src = Path(tokenizer)
    if src.is_file():
        shutil.copyfile(src, out_dir / "tokenizer.json")
        copied = ["tokenizer.json"]
    elif src.is_dir():
        copied = copy_files(src, list(TOKENIZER_FILES), out_dir)
        if not copied:
            raise FileNotFoundError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        copy_files(src, [GENERATION_CONFIG], out_dir)  # an imported model keeps its generation defaults
    else:
        raise FileNotFoundError(f"{src}: tokenizer not found (give a directory, a tokenizer.json or 'byte')")
    if "tokenizer.json" not in copied:  # e.g. a sentencepiece-only directory: copied, but rlt_mega cannot read it
        log.warning("%s has no tokenizer.json: copied %s for transformers; rlt_mega itself reads tokenizer.json only",
                    src, ", ".join(copied))
        return copied, None
    try:
        tok = load_tokenizer(str(out_dir))
        if tok.chat_template is not None:  # generation also stops at the end of the assistant's turn
            tok = load_tokenizer(str(out_dir), chat_template=True)
    except TokenizerError as exc:  # e.g. no end-of-text token rlt_mega knows: transformers may still load it
        log.warning("tokenizer %s: %s; copied as it is", src, exc)
        return copied, None
    if "tokenizer_config.json" not in copied:
        write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tok, cfg))
        copied.append("tokenizer_config.json")
    return copied, tok


def special_token_ids(tok: Optional[Tokenizer]) -> dict[str, Any]:
    """bos/eos/pad ids; eos is a list [end of turn, end of text] for a chat tokenizer."""
    if tok is None:
        return {}
    eos = tok.stop_ids
    return {"bos_token_id": tok.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            "pad_token_id": tok.pad_id}


def write_generation_config(out_dir: Path, special: dict[str, Any]) -> None:
    """generation_config.json, unless the tokenizer's source brought its own."""
    if special and not (out_dir / GENERATION_CONFIG).is_file():
        write_json(out_dir / GENERATION_CONFIG, {**special, "_from_model_config": False})


def check_vocab(tok: Optional[Tokenizer], cfg: ModelConfig, where: str) -> None:
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        log.warning("%s: the tokenizer has %d tokens but model.vocab_size is %d: ids past %d have no embedding",
                    where, tok.vocab_size, cfg.vocab_size, cfg.vocab_size - 1)
