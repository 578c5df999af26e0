"""A MkDocs hook (mkdocs.yml ``hooks:``): docstrings written with Sphinx roles (:class:`Config`,
:func:`load_exported`, :meth:`get`) render in the Python API as code, linked to the object's entry
when the page has exactly one entry of that name, instead of showing the raw ``:class:`` markup.
Markdown turns the role into ``:class:<code>Config</code>``; this rewrites the page's HTML."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|obj|exc|data|const):<code>~?([^<]+)</code>")
IDS = re.compile(r'\bid="([A-Za-z_][\w.]*)"')


def rewrite(html: str) -> str:
    ids = IDS.findall(html)

    def link(m: re.Match) -> str:
        name = m.group(1).strip()
        short = name.rsplit(".", 1)[-1]
        hits = sorted({i for i in ids if i == name or i.endswith("." + name)})
        code = f"<code>{short if '~' in m.group(0) else name}</code>"
        return f'<a href="#{hits[0]}">{code}</a>' if len(hits) == 1 else code

    return ROLE.sub(link, html)


def on_page_content(html, page, config, files):
    return rewrite(html)
