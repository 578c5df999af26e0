"""Tokenizers through the HF ``tokenizers`` library.

The default is byte-level: the 256 bytes (through ``tokenizers``' ByteLevel alphabet, so any
UTF-8 text round-trips) plus three special tokens, 259 ids in all. Any ``tokenizer.json``
works too (``rlt-mega tokenizer train`` makes byte-level BPE ones, data/tokenizer_train.py);
its end-of-text and padding tokens are found by their usual names. A tokenizer directory may
carry a chat template (data/chat.py), applied to SFT/GRPO prompts with data.chat_template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from rlt_mega.data.chat import ChatTemplateError, read_chat_template, render, split_pair

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
_EOS_NAMES = (EOS, "<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")
_PAD_NAMES = (PAD, "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
_BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<bos>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used, with what to do about it."""


class Tokenizer:
    """A thin wrapper that knows the special ids the trainers need.

    With ``use_chat_template`` (data.chat_template), prompts and answers are laid out by the
    tokenizer's chat template (pairs.prompt_ids / pair_ids), and generation also stops at the
    token that ends the assistant's turn (``stop_ids``)."""

    def __init__(self, tok: HFTokenizer, name: str, chat_template: Optional[str] = None,
                 use_chat_template: bool = False) -> None:
        self.tok, self.name = tok, name
        self.eos_id = _find(tok, _EOS_NAMES)
        if self.eos_id is None:
            raise TokenizerError(f"tokenizer {name}: no end-of-text token found (looked for {', '.join(_EOS_NAMES)}); "
                             "add one to the tokenizer's special tokens")
        pad = _find(tok, _PAD_NAMES)
        self.pad_id = self.eos_id if pad is None else pad
        self.bos_id = _find(tok, _BOS_NAMES)
        self.chat_template = chat_template
        if use_chat_template and chat_template is None:
            raise TokenizerError(f"data.chat_template is true but tokenizer {name} has no chat template (a "
                                 "'chat_template' in its tokenizer_config.json, or chat_template.jinja): set "
                                 "data.chat_template=false, or train one with `rlt-mega tokenizer train --chat-template`")
        self.use_chat_template = use_chat_template
        self.turn_end_id: Optional[int] = self._turn_end() if use_chat_template else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Where generation stops: end-of-text, and the end of the assistant's turn in chat mode."""
        if self.turn_end_id is None or self.turn_end_id == self.eos_id:
            return (self.eos_id,)
        return (self.turn_end_id, self.eos_id)

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, pad_token by name (what a chat template may refer to)."""
        names = {"eos_token": self.eos_id, "pad_token": self.pad_id, "bos_token": self.bos_id}
        return {k: self.tok.id_to_token(v) for k, v in names.items() if v is not None}

    def chat_prompt(self, question: str) -> str:
        return render(self.chat_template, [{"role": "user", "content": question}], True, self.special_tokens)

    def chat_texts(self, question: str, answer: str) -> tuple[str, str]:
        """The template's text of [user: question, assistant: answer], cut where the answer's
        turn begins: (prompt, the rest)."""
        return split_pair(self.chat_template, question, answer, self.special_tokens)

    def chat_pair(self, question: str, answer: str) -> tuple[list[int], list[int]]:
        """Prompt ids and answer ids of [user: question, assistant: answer]; the answer ends
        with the token that ends the turn."""
        prompt, rest = self.chat_texts(question, answer)
        ids = self.encode(rest)
        end = self.turn_end_id
        return self.encode(prompt), (ids[:ids.index(end) + 1] if end in ids else ids + [self.eos_id])

    def chat_turn(self, role: str, content: str) -> str:
        """What the template puts after an assistant's turn-end token (which the model wrote) up
        to the next assistant answer: the rest of that turn, a ``role`` turn holding ``content``
        (an environment's user or tool turn) and the generation prompt."""
        st, first = self.special_tokens, [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        before = render(self.chat_template, first, False, st)
        after = render(self.chat_template, first + [{"role": role, "content": content}], True, st)
        end = self.tok.id_to_token(self.turn_end_id)
        if not after.startswith(before) or end not in before:
            raise TokenizerError(f"tokenizer {self.name}: its chat template does not append a {role!r} turn after "
                                 "an assistant's turn-end token; multi-turn environments need one that does")
        return before[before.rindex(end) + len(end):] + after[len(before):]

    def _turn_end(self) -> int:
        """The first special token the template puts after an assistant's answer (e.g.
        <|im_end|>); end-of-text when it puts none."""
        try:
            _, rest = split_pair(self.chat_template, "1", "2", self.special_tokens)
        except ChatTemplateError as exc:
            raise TokenizerError(f"tokenizer {self.name}: {exc}") from None
        specials = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        for i in self.encode(rest):
            if self.tok.id_to_token(i) in specials:
                return i
        return self.eos_id

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


def byte_level(chat_template: bool = False) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    return Tokenizer(tok, "byte", use_chat_template=chat_template)


def load_tokenizer(spec: str, chat_template: bool = False) -> Tokenizer:
    """``"byte"``, a ``tokenizer.json`` path, or a directory that holds one (and maybe a chat
    template). chat_template: lay prompts out with the tokenizer's chat template
    (data.chat_template)."""
    if spec == "byte":
        return byte_level(chat_template)
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec}: no tokenizer.json there; set data.tokenizer to 'byte', to a "
                             "tokenizers tokenizer.json or to a directory holding one (`rlt-mega tokenizer train "
                             "--data SOURCE --vocab-size N OUT` makes one)")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on a malformed file
        raise TokenizerError(f"tokenizer {path}: cannot be read by the tokenizers library ({exc})") from None
    try:
        template = read_chat_template(path.parent)
    except ChatTemplateError as exc:
        raise TokenizerError(f"tokenizer {path}: {exc}") from None
    return Tokenizer(tok, str(path), template, chat_template)


def check_same_tokenizer(tokenizer: Tokenizer, directory: str | Path, setting: str) -> None:
    """A model directory (an export given as ``setting``, e.g. train.init_from) that carries its
    own tokenizer.json was trained with it: running it with another vocabulary feeds it
    meaningless ids, so that is an error naming the fix. (Directories without one pass.)"""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return
    try:
        theirs = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # not readable here; loading the model reports what is wrong with the directory
    if not isinstance(theirs, dict) or "model" not in theirs:
        return  # not a tokenizers file: nothing to compare with
    ours = json.loads(tokenizer.tok.to_str())
    same = (theirs.get("model", {}).get("vocab") == ours.get("model", {}).get("vocab")
            and [t.get("content") for t in theirs.get("added_tokens", [])]
            == [t.get("content") for t in ours.get("added_tokens", [])])
    if not same:
        raise TokenizerError(f"{setting}={directory} was exported with its own tokenizer ({path}), but "
                             f"data.tokenizer={tokenizer.name} is another one: "
                             f"set data.tokenizer={directory}")
