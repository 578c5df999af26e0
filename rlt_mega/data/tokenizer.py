"""Tokenizers through the HF ``tokenizers`` library.

The default is byte-level: the 256 bytes (through ``tokenizers``' ByteLevel alphabet, so any
UTF-8 text round-trips) plus three special tokens, 259 ids in all. Any ``tokenizer.json``
works too; its end-of-text and padding tokens are found by their usual names.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
_EOS_NAMES = (EOS, "<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")
_PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<bos>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used, with what to do about it."""


class Tokenizer:
    """A thin wrapper that knows the special ids the trainers need."""

    def __init__(self, tok: HFTokenizer, name: str) -> None:
        self.tok, self.name = tok, name
        self.eos_id = _find(tok, _EOS_NAMES)
        if self.eos_id is None:
            raise TokenizerError(f"tokenizer {name}: no end-of-text token found (looked for {', '.join(_EOS_NAMES)}); "
                             "add one to the tokenizer's special tokens")
        pad = _find(tok, _PAD_NAMES)
        self.pad_id = self.eos_id if pad is None else pad
        self.bos_id = _find(tok, _BOS_NAMES)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "tokenizer.json"
        self.tok.save(str(path))
        return path


def _find(tok: HFTokenizer, names: tuple[str, ...]) -> int | None:
    for name in names:
        idx = tok.token_to_id(name)
        if idx is not None:
            return idx
    return None


def byte_level() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    return Tokenizer(tok, "byte")


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"``, a ``tokenizer.json`` path, or a directory that holds one."""
    if spec == "byte":
        return byte_level()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec}: no tokenizer.json there; set data.tokenizer to 'byte' "
                                "or to a tokenizers tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on a malformed file
        raise TokenizerError(f"tokenizer {path}: cannot be read by the tokenizers library ({exc})") from None
    return Tokenizer(tok, str(path))
