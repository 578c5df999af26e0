"""A MkDocs hook (mkdocs.yml ``hooks:``, after the hooks that generate tables): a Markdown table
too wide for the content column is split into several tables of the same rows, each repeating
the first column (the row's name), so every column is read without a sideways scroll at any
width the theme shows both sidebars at. A table's width is estimated from its cells: a column
is at least as wide as its longest word (the browser wraps at spaces, never inside a word),
plus the cell's padding, and no narrower than the theme's
least header width; tools/docs/browser_check.py measures the result in Chromium.

    python tools/docs/split_tables.py docs/state_tracking.md   # prints the page, tables split
"""

from __future__ import annotations

import re
import sys

# Measured in Chromium (tools/docs/browser_check.py) with the theme's sizes: 1 rem = 20 px,
# table text 0.64 rem = 12.8 px
COLUMN_PX = 712  # a table's room in the content column with both sidebars (1280 px window)
CHAR_PX = 8.0  # a character of a bold header of 12.8 px, a little above its mean width
CODE_CHAR_PX = 7.0  # a character of code in a table (0.85 em, monospace), plus its padding below
CODE_PAD_PX = 6
CODE_MIN_CHARS = 12  # code breaks anywhere, but a column narrower than this reads badly
PAD_PX = 32  # a cell's left and right padding (1.25 em each)
MIN_COLUMN_PX = 106  # the theme's least header width (5 rem) and its borders, as measured
FENCE = re.compile(r"^\s*(```|~~~)")
ROW = re.compile(r"^\s*\|.*\|\s*$")
RULE = re.compile(r"^\s*\|(\s*:?-{3,}:?\s*\|)+\s*$")


def cells(row: str) -> list[str]:
    """A row's cells, split at unescaped pipes outside code spans."""
    out, cur, code, i, s = [], "", False, 0, row.strip()[1:-1] if row.strip().endswith("|") else row.strip()[1:]
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            cur += s[i:i + 2]
            i += 2
            continue
        if c == "`":
            code = not code
        if c == "|" and not code:
            out.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur.strip())
    return out


def word_px(cell: str) -> float:
    """The width of a cell's widest piece the browser cannot break: a run of text without a
    space (code spans and the text touching them included). Code breaks anywhere (the theme's
    rule), so it counts for at most CODE_MIN_CHARS, except code with <wbr> break points (config
    keys), which breaks only there."""
    best = 0.0
    cell = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell)  # a link's text
    cell = re.sub(r"<code>(.*?)</code>", lambda m: "`" + m.group(1).replace("<wbr>", "\0") + "`", cell)
    cell = re.sub(r"<(?!wbr)[^>]+>|\*\*|\\", "", cell).replace("<wbr>", " ")
    for word in re.split(r"\s+", cell):
        px, parts = 0.0, re.split(r"(`[^`]*`)", word)
        for part in parts:
            if part.startswith("`"):
                pieces = part.strip("`").split("\0")
                n = max(map(len, pieces)) if len(pieces) > 1 else min(len(pieces[0]), CODE_MIN_CHARS)
                px += n * CODE_CHAR_PX + CODE_PAD_PX
            else:
                px += len(part) * CHAR_PX
        best = max(best, px)
    return best


def width(table: list[list[str]]) -> list[float]:
    return [max(MIN_COLUMN_PX, max(word_px(row[c]) for row in table if c < len(row)) + PAD_PX)
            for c in range(len(table[0]))]


def split(table: list[list[str]], align: list[str]) -> list[tuple[list[list[str]], list[str]]]:
    """The table as pieces that fit the column: the first column, then as many of the others as fit."""
    w = width(table)
    if sum(w) <= COLUMN_PX or len(w) < 3:
        return [(table, align)]
    pieces, cols, used = [], [], w[0]
    for c in range(1, len(w)):
        if cols and used + w[c] > COLUMN_PX:
            pieces.append(cols)
            cols, used = [], w[0]
        cols.append(c)
        used += w[c]
    pieces.append(cols)
    return [([[row[0]] + [row[c] if c < len(row) else "" for c in cols] for row in table],
             [align[0]] + [align[c] for c in cols]) for cols in pieces]


def render(table: list[list[str]], align: list[str]) -> list[str]:
    return ["| " + " | ".join(table[0]) + " |", "|" + "|".join(align) + "|"] + \
           ["| " + " | ".join(row) + " |" for row in table[1:]]


def split_tables(markdown: str) -> str:
    lines, out, i, fenced = markdown.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and ROW.match(line) and i + 1 < len(lines) and RULE.match(lines[i + 1]):
            j = i + 2
            while j < len(lines) and ROW.match(lines[j]):
                j += 1
            table = [cells(line)] + [cells(r) for r in lines[i + 2:j]]
            align = [a.strip() for a in cells(lines[i + 1])]
            indent = line[:len(line) - len(line.lstrip())]
            for k, (piece, al) in enumerate(split(table, align)):
                out += ([""] if k else []) + [indent + r for r in render(piece, al)]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    return split_tables(markdown)


if __name__ == "__main__":
    sys.stdout.write(split_tables(open(sys.argv[1]).read()))
