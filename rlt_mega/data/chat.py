"""Chat templates: the Jinja templates Hugging Face tokenizers carry (``chat_template`` in
tokenizer_config.json, or chat_template.jinja), rendered as ``transformers``'
``apply_chat_template`` renders them (a sandboxed environment with trim_blocks and
lstrip_blocks, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``, the
special tokens by name), so that ``data.chat_template: true`` gives SFT and GRPO the prompts
the model will see from transformers. tests/unit/test_tokenizers.py checks the text against
transformers itself.

An SFT pair becomes the conversation [user: question, assistant: answer]: the prompt is the
user turn plus the generation prompt, the answer is what the template appends after it, up to
and including the first special token (the end of the assistant's turn, e.g. ``<|im_end|>``),
which is also where generation stops.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Optional

# A ChatML template and its two special tokens (``rlt-mega tokenizer train --chat-template chatml``).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or rendered."""


def read_chat_template(directory: Path) -> Optional[str]:
    """The template of a tokenizer directory: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named "default")."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{config}: not valid JSON ({exc})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render(template: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str]) -> str:
    """The template's text for ``messages`` ([{"role", "content"}]); ``special_tokens``:
    bos_token, eos_token, ... by name, as transformers passes them."""
    import jinja2

    try:
        return _compile(template).render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from None


def split_pair(template: str, question: str, answer: str, special_tokens: dict[str, str]) -> tuple[str, str]:
    """(prompt text, answer text) of the conversation [user: question, assistant: answer]: the
    prompt as generation sees it (add_generation_prompt), the answer the rest of the rendered
    conversation."""
    user = [{"role": "user", "content": question}]
    prompt = render(template, user, True, special_tokens)
    full = render(template, user + [{"role": "assistant", "content": answer}], False, special_tokens)
    if not full.startswith(prompt):
        raise ChatTemplateError("the chat template renders a conversation that does not begin with its own "
                                f"generation prompt ({prompt[-40:]!r}), so the answer cannot be told from the prompt; "
                                "use a template whose prompt is a prefix of the conversation, or data.chat_template=false")
    return prompt, full[len(prompt):]
