"""``rlt-mega tokenizer train``: a byte-level BPE tokenizer trained with HF ``tokenizers``.

    rlt-mega tokenizer train --data data/gsm8k --vocab-size 1024 runs/tokenizers/gsm8k_1k
    rlt-mega sft --config configs/demo_sft.yaml data.tokenizer=runs/tokenizers/gsm8k_1k model.vocab_size=1024

Why: the decoder is sequential, so every token is a step; the byte tokenizer spends one step
per byte, a BPE tokenizer trained on the domain far fewer (the command prints the tokens per
byte on the training text and on the source's held-out split).

The tokenizer is GPT-2's byte-level scheme: text is split by GPT-2's pre-tokenisation regex,
each byte mapped to one of 256 printable characters, then merged by the learned BPE. Every
byte is in the base alphabet, so any UTF-8 text round-trips exactly; there is no normaliser.
Special tokens: pad, bos, eos (ids 0, 1, 2), plus a chat template's own (``--chat-template``).

OUT is a directory: tokenizer.json (what rlt_mega reads: data.tokenizer=OUT) and
tokenizer_config.json (what transformers' AutoTokenizer reads, with the chat template).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterable, Optional

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlt_mega.checkpoint import OutputKind, check_output
from rlt_mega.config import DataConfig
from rlt_mega.data.chat import CHATML, CHATML_TOKENS
from rlt_mega.data.datasets import DataError, DataStats, load_records, text_of
from rlt_mega.data.tokenizer import BOS, EOS, PAD, Tokenizer, TokenizerError, load_tokenizer
from rlt_mega.log import get_logger

log = get_logger(__name__)

TOKENIZER = OutputKind("a tokenizer directory", "tokenizer.json")  # what --overwrite may replace
HELP = "train a byte-level BPE tokenizer (HF tokenizers) on a dataset"
NUM_BYTES = 256


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              extra_special: tuple[str, ...] = ()) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (special tokens and the 256 bytes included)."""
    special = [PAD, BOS, EOS, *extra_special]
    if vocab_size < NUM_BYTES + len(special):
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least the 256 bytes and "
                             f"{len(special)} special tokens ({NUM_BYTES + len(special)} ids)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokens_per_byte(tokenizer: Tokenizer, texts: list[str]) -> float:
    """Tokens over UTF-8 bytes of ``texts`` (the byte tokenizer: 1.0)."""
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    num_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    return num_tokens / max(1, num_bytes)


def save(tok: HFTokenizer, out_dir: str | Path, chat_template: Optional[str] = None,
         model_max_length: Optional[int] = None) -> Path:
    """Writes tokenizer.json and tokenizer_config.json into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def _chat_template(arg: Optional[str]) -> tuple[Optional[str], tuple[str, ...]]:
    """--chat-template: None, "chatml" (and its two special tokens), or a Jinja file."""
    if arg is None:
        return None, ()
    if arg == "chatml":
        return CHATML, CHATML_TOKENS
    path = Path(arg)
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {arg}: expected 'chatml' or a Jinja template file")
    return path.read_text(), ()


def _texts(source: str, split: str, text_field: Optional[str], limit: int, stats: DataStats,
           hub_config: Optional[str] = None) -> list[str]:
    records = load_records(source, split, DataConfig(train=source, hub_config=hub_config), text_of(text_field),
                           ["text"], stats)
    texts = records["text"]
    return texts[:limit] if limit else texts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="directory to write tokenizer.json and tokenizer_config.json into")
    p.add_argument("--data", required=True,
                   help="training text: 'generated', a .jsonl/.json/.txt file or directory (its train split), "
                        "or a hub dataset (as data.train)")
    p.add_argument("--vocab-size", type=int, required=True, help="ids in all: 256 bytes, merges, special tokens")
    p.add_argument("--hub-config", default=None, help="the hub dataset's configuration (e.g. main for openai/gsm8k)")
    p.add_argument("--text-field", default=None, help="record field holding the text (default: text, or "
                                                      "question + answer for GSM8K records)")
    p.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")
    p.add_argument("--limit", type=int, default=0, help="train on the first N records only (0: all)")
    p.add_argument("--chat-template", default=None,
                   help="'chatml' (adds <|im_start|>, <|im_end|>) or a Jinja file, stored for data.chat_template")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds an earlier tokenizer (never the data, nor a directory of other files)")


def run(a: argparse.Namespace) -> str:
    out = Path(a.out_dir)
    inputs = [p for p in (a.data, a.chat_template) if p is not None and Path(p).exists()]  # local files only
    check_output(out, inputs, a.overwrite, kind=TOKENIZER)
    template, extra = _chat_template(a.chat_template)
    stats = DataStats()
    train = _texts(a.data, "train", a.text_field, a.limit, stats, a.hub_config)
    tok = train_bpe(train, a.vocab_size, a.min_frequency, extra)
    save(tok, out, template)
    tokenizer = load_tokenizer(str(out))
    lines = [f"wrote {out / 'tokenizer.json'}: {tokenizer.vocab_size} tokens (pad {tokenizer.pad_id}, bos "
             f"{tokenizer.bos_id}, eos {tokenizer.eos_id}{', chat template' if template else ''}), trained on "
             f"{len(train)} records of {a.data} [train]" + (f"; {stats.summary()}" if stats.total else ""),
             f"tokens per byte: {tokens_per_byte(tokenizer, train):.4f} on {a.data} [train]"]
    held_out = []
    if not Path(a.data).is_file():  # generated, a directory or a hub dataset: its own held-out split
        try:
            held_out = _texts(a.data, "eval", a.text_field, 0, DataStats(), a.hub_config)
        except DataError:
            pass  # none (a directory without a test file, a hub dataset without a test split)
    if held_out:
        lines.append(f"tokens per byte: {tokens_per_byte(tokenizer, held_out):.4f} on {a.data} [eval]")
    lines.append(f"use it with data.tokenizer={out} model.vocab_size={tokenizer.vocab_size}")
    return "\n".join(lines)


def register(subparsers, wrap=lambda fn: fn) -> argparse.ArgumentParser:
    """Adds ``tokenizer train`` to an argparse subparsers object; the handler is
    ``args.fn = wrap(run)`` (the CLI prints what ``run`` returns)."""
    parser = subparsers.add_parser("tokenizer", help="tokenizer tools: train", description="tokenizer tools")
    sub = parser.add_subparsers(dest="tokenizer_command", required=True)
    train = sub.add_parser("train", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(train)
    train.set_defaults(fn=wrap(run))
    return parser
