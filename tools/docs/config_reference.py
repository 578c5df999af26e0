"""The configuration reference, generated from rlt_mega/config.py: every key of :class:`Config`
with its type, its default and the words written beside it (the field's comments, the section's
docstring), so the keys are described once, in the code.

As a MkDocs hook (mkdocs.yml ``hooks:``) it adds the page ``reference/config.md`` to every build;
as a script it prints the same page:

    python tools/docs/config_reference.py > /tmp/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import html
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/config.md"


def _config_module():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's rlt_mega, not another installed one
    from rlt_mega import config

    return config


def _field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> its comment: the comment lines right above the field and the one after
    it on the same line, joined."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, line = [], item.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            parts = above + ([comments[item.lineno]] if item.lineno in comments else [])
            out[(node.name, item.target.id)] = " ".join(parts)
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(tp)
        names = [_type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | None" if type(None) in args else "")
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    """Text for a table cell: a pipe outside code is escaped; a code span holding one becomes
    HTML code with the pipe as an entity (Markdown would show a code span's ``\\|`` as is)."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text.replace("\n", " "))):
        if i % 2 == 0:
            out.append(part.replace("|", "\\|"))
        elif "|" in part:
            out.append("<code>" + html.escape(part[1:-1]).replace("|", "&#124;") + "</code>")
        else:
            out.append(part)
    return "".join(out)


def _key(path: str) -> str:
    """A key as code that breaks only after a dot in a narrow column, never inside a name."""
    return "<code>" + path.replace(".", ".<wbr>") + "</code>"


def keys(cls=None, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """Every leaf key of the config as (dotted path, owning dataclass, field)."""
    config = _config_module()
    cls = cls or config.Config
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += keys(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", cls, f))
    return out


def render() -> str:
    config = _config_module()
    comments = _field_comments(Path(config.__file__).read_text())
    lines = [
        "# Configuration reference",
        "",
        "Every key of a config file, generated from the dataclasses in `rlt_mega/config.py` (their",
        "docstrings and the comments beside each field) by `tools/docs/config_reference.py` when the",
        "site is built: edit the code, not this page. A key is set in a YAML file (`section: {key: value}`)",
        "or on the command line as `section.key=value`; an unknown key, a wrong type or an impossible",
        "combination stops the run with a message naming the key.",
        "",
    ]
    sections: dict[str, list] = {}  # one section per dataclass, in order of first appearance
    for path, cls, f in keys():
        sections.setdefault(path.rsplit(".", 1)[0], []).append((path, cls, f))
    for head, fields in sections.items():
        cls = fields[0][1]
        lines += ["", f"## `{head}`", ""]
        doc = cls.__doc__ or ""
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for path, cls, f in fields:
            hint = typing.get_type_hints(cls)[f.name]
            default = _default(f)
            shown = "required" if default is dataclasses.MISSING else f"`{default!r}`"
            lines.append(f"| {_key(path)} | {_cell('`' + _type_name(hint) + '`')} | {_cell(shown)} | "
                         f"{_cell(comments.get((cls.__name__, f.name), ''))} |")
    return "\n".join(lines) + "\n"


def on_files(files, config):  # the MkDocs hook
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    sys.stdout.write(render())
