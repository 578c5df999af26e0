"""The built documentation read in headless Chromium (tools/docs/browser_check.py; the browser is
installed by launch/test.sh, tools/docs/install_chromium.sh): every page renders offline with its
diagrams drawn, no code block or table wider than the content column (a phone-width one scrolls
visibly), no literal `\\|` or raw `:class:`, no broken image, link or anchor, no script error and
nothing fetched from the network, and the search lists the page a reader wants first. A page
made with each fault shows the check finds it."""

import asyncio
import importlib.util
import time

from unit.test_docs import ROOT, site  # noqa: F401 (the built site, a fixture; tests/ is on sys.path)

spec = importlib.util.spec_from_file_location("browser_check", ROOT / "tools" / "docs" / "browser_check.py")
browser_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(browser_check)


def test_every_page_reads_right_in_a_browser(site):  # noqa: F811
    t0 = time.monotonic()
    faults = asyncio.run(browser_check.check_site(site))
    pages = browser_check.site_pages(site)
    print(f"browser check: {len(pages)} pages in {time.monotonic() - t0:.1f} s")
    assert len(pages) > 20 and "guide/cluster/index.html" in pages
    assert not faults, "what a reader would see wrong:\n" + "\n".join(
        f"{page}\n" + "\n".join(f"    {f}" for f in found) for page, found in faults.items())


BAD_PAGE = """<!doctype html><html><head><meta charset="utf-8"><style>
.md-content__inner { width: 600px } pre > code { display: block; overflow-x: hidden; white-space: pre }
</style></head><body><article class="md-content__inner md-typeset">
<pre class="mermaid"><code>flowchart LR
  A --> B</code></pre>
<pre><code>{long}</code></pre>
<p>the type is int \\| None, see :class:`Config`</p>
<p>Parameters
- embed
- lm_head</p>
<img src="missing.png" alt="">
<a href="../nowhere/">a page that is not there</a> <a href="#no-such-anchor">an anchor</a>
<script>throw new Error("boom")</script>
<script src="https://cdn.example.org/mermaid.min.js"></script>
</article></body></html>
"""


def test_the_check_finds_each_fault(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.html").write_text(BAD_PAGE.replace("{long}", "rlt-mega grpo " + "x.y=1 " * 40))
    faults = asyncio.run(browser_check.check_site(tmp_path, wait_ms=300, searches=[]))["bad/index.html"]
    text = "\n".join(faults)
    for expected in ("Mermaid block not rendered to SVG", "code block", "with no visible scroll",
                     "literal \\| in the text", "raw Sphinx role", "a list rendered as a paragraph",
                     "broken image: missing.png", "broken link: /nowhere/", "broken anchor: /bad/#no-such-anchor",
                     "script error: Error: boom", "fetched from the network: https://cdn.example.org/mermaid.min.js"):
        assert expected in text, f"the check missed: {expected}\n{text}"
