"""A MkDocs hook (mkdocs.yml ``hooks:``): the site serves what its pages load instead of fetching it
from a CDN, so it renders the same on an offline or air-gapped machine. Mermaid (the diagrams) is
installed from npm with a lockfile (tools/docs/package.json, package-lock.json) by
``npm ci --prefix tools/docs`` (launch/test.sh does it when tools/docs/node_modules is missing) and
added to the site as ``assets/vendor/mermaid.min.js``; a page with a diagram loads it before the
theme's script, which then uses it instead of fetching its own copy from unpkg.com (pages without
one do not load its 3.5 MB). The theme's web fonts are off (``theme.font: false``): the system's
fonts are used."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = ROOT / "tools" / "docs" / "node_modules"
# site path -> the installed file it is copied from
ASSETS = {"assets/vendor/mermaid.min.js": NODE_MODULES / "mermaid" / "dist" / "mermaid.min.js"}


MERMAID = "assets/vendor/mermaid.min.js"
THEME_SCRIPT = re.compile(r'<script src="([^"]*)assets/javascripts/bundle\.[0-9a-f]+\.min\.js"></script>')


def on_config(config):
    if config["theme"]["font"] is not False:
        raise PluginError("mkdocs.yml: theme.font must be false (the theme would fetch Google Fonts)")
    return config


def on_post_page(output, page, config):
    """A page with a diagram loads the site's Mermaid just before the theme's script."""
    if 'class="mermaid"' not in output:
        return output
    m = THEME_SCRIPT.search(output)
    if not m:
        raise PluginError(f"{page.file.src_uri}: the theme's script tag was not found: tools/docs/offline_assets.py "
                          "cannot load Mermaid before it")
    return output[:m.start()] + f'<script src="{m.group(1)}{MERMAID}"></script>' + output[m.start():]


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, src in ASSETS.items():
        if not src.is_file():
            raise PluginError(f"{src.relative_to(ROOT)} is missing: run `npm ci --prefix tools/docs` "
                              "(the site serves Mermaid itself; launch/test.sh runs it when missing)")
        files.append(File.generated(config, uri, abs_src_path=str(src)))
    return files
