"""Reads the built site in headless Chromium, as a user would, and lists what a reader would see
wrong. Every page is loaded from a local HTTP server with the network cut off (any host other
than the server's fails to resolve, and any request to one is itself a fault), at two widths:

- desktop (1280 px): a code block or table wider than the content column (it would be cut off or
  need a scroll), a Mermaid diagram drawn wider than the column and shrunk below 75 %;
- phone (390 px): a code block or table wider than the column that does not scroll visibly;

and at either: a Mermaid block not rendered to SVG, a literal ``\\|`` or a raw Sphinx role
(``:class:``) in the text, a list rendered as a paragraph of "- " lines, a broken image, a link
to a page or anchor the site lacks, a script error or an error logged to the console, a request
that left the machine or failed; and the site's search, for a few queries a reader makes
(``SEARCHES``), lists the page they want first.

    npm ci --prefix tools/docs && mkdocs build --strict --site-dir /tmp/site
    python tools/docs/browser_check.py /tmp/site            # prints the faults, exits 1 if any

Chromium: ``RLT_CHROMIUM`` (a binary), else the chromium-headless-shell that
tools/docs/install_chromium.sh put in ``RLT_CHROMIUM_DIR`` (default: the venv's ``chromium``).
Talks the DevTools protocol over aiohttp's websocket client.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.server
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}
SHRINK = 0.75  # a diagram drawn wider than the column may be shrunk to this, no further
# Generous limits, not measurements: on a machine shared by many jobs a start or a page can take long
START_S = 120  # Chromium's start
CALL_S = 300  # one DevTools call (a page's check waits for its diagrams inside it)

# Runs in the page once it has loaded: waits for the diagrams, then measures. Returns a list of
# faults (strings) and the page's links and anchors for the link check.
PAGE_CHECK = r"""
async (width, shrink, waitMs) => {
  const faults = [];
  const t0 = Date.now();
  const diagrams = () => [...document.querySelectorAll('.mermaid')];
  const svgOf = (e) => (e.shadowRoot && e.shadowRoot.querySelector('svg')) || e.querySelector('svg');
  while (diagrams().some((e) => !svgOf(e)) && Date.now() - t0 < waitMs)
    await new Promise((r) => setTimeout(r, 25));
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  const column = document.querySelector('.md-content__inner');
  const colWidth = column ? column.getBoundingClientRect().width : innerWidth;
  const where = (e) => (e.textContent || '').trim().replace(/\s+/g, ' ').slice(0, 70);
  for (const e of diagrams()) {
    const svg = svgOf(e);
    if (!svg) { faults.push('Mermaid block not rendered to SVG: ' + where(e)); continue; }
    const drawn = svg.viewBox && svg.viewBox.baseVal && svg.viewBox.baseVal.width;
    const shown = svg.getBoundingClientRect().width;
    if (shown > colWidth + 1) faults.push(`diagram ${Math.round(shown)} px wide in a ${Math.round(colWidth)} px column`);
    if (width === 'desktop' && drawn && shown < shrink * drawn)
      faults.push(`diagram drawn ${Math.round(drawn)} px wide, shrunk to ${Math.round(shown)} px (text at ${Math.round(100 * shown / drawn)} %)`);
  }
  const blocks = [...document.querySelectorAll('.md-typeset pre > code')].map((e) => ['code block', e, e])
    .concat([...document.querySelectorAll('.md-typeset__scrollwrap')].map((e) => ['table', e, e.querySelector('table') || e]));
  for (const [kind, e, shownEl] of blocks) {
    if (e.scrollWidth <= e.clientWidth + 1) continue;
    const s = getComputedStyle(e);
    const scrolls = ['auto', 'scroll'].includes(s.overflowX) && s.scrollbarWidth !== 'none';
    const text = (shownEl.innerText || '').split('\n').reduce((a, b) => (b.length > a.length ? b : a), '');
    if (width === 'desktop' || !scrolls)
      faults.push(`${kind} ${e.scrollWidth} px wide in a ${e.clientWidth} px column` +
                  (scrolls ? '' : ' with no visible scroll') + ': ' + text.trim().slice(0, 70));
  }
  if (document.documentElement.scrollWidth > innerWidth + 1)
    faults.push(`the page is ${document.documentElement.scrollWidth} px wide in a ${innerWidth} px window`);
  const text = (document.querySelector('article') || document.body).innerText;
  for (const m of text.matchAll(/.{0,30}\\\|.{0,30}/g)) faults.push('literal \\| in the text: ' + m[0]);
  for (const m of text.matchAll(/.{0,30}:(?:py:)?(?:class|func|meth|attr|mod|obj|exc|data):`?.{0,30}/g))
    faults.push('raw Sphinx role in the text: ' + m[0]);
  for (const p of document.querySelectorAll('article p'))
    if (/(^|\n)\s*[-*] \S/.test(p.textContent)) faults.push('a list rendered as a paragraph: ' + p.innerText.slice(0, 60));
  for (const img of document.images)
    if (!img.complete || img.naturalWidth === 0) faults.push('broken image: ' + img.getAttribute('src'));
  const links = [...document.querySelectorAll('a[href]')].map((a) => a.href);
  const ids = [...document.querySelectorAll('[id]')].map((e) => e.id);
  return {faults, links, ids};
}
"""


OPEN_SHADOW = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: 'open'}); };
"""


# Searches a reader makes, the page each must rank first or second, and pages it must rank above.
SEARCHES = [("grpo_gsm8k", "guide/cluster/", []), ("grpo", "guide/grpo/", ["performance/", "reference/api/"]),
            ("sbatch", "guide/cluster/", [])]
SEARCH = r"""
async (q) => {
  const input = document.querySelector('.md-search__input');
  input.focus(); input.value = q;
  input.dispatchEvent(new Event('input', {bubbles: true}));
  input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true, key: q.slice(-1)}));
  const t0 = Date.now();
  let pages = [];
  while (Date.now() - t0 < 10000) {
    await new Promise((r) => setTimeout(r, 50));
    pages = [...document.querySelectorAll('.md-search-result__item > a')].map((a) => new URL(a.href).pathname);
    const meta = document.querySelector('.md-search-result__meta');
    if (pages.length || (meta && /No matching/.test(meta.textContent))) break;
  }
  return [...new Set(pages)];
}
"""


class Server:
    """The built site on 127.0.0.1, served from a thread."""

    def __init__(self, root: Path):
        handler = functools.partial(_Quiet, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def chromium_binary() -> tuple[str, dict]:
    """The Chromium to run and the environment it needs; a one-line error if there is none."""
    env = dict(os.environ)
    if os.environ.get("RLT_CHROMIUM"):
        return os.environ["RLT_CHROMIUM"], env
    root = Path(os.environ.get("RLT_CHROMIUM_DIR") or Path(sys.prefix) / "chromium")
    binary = root / "usr" / "lib" / "chromium" / "chromium-headless-shell"
    if not binary.is_file():
        raise FileNotFoundError(f"no headless Chromium at {binary}: run `bash tools/docs/install_chromium.sh {root}` "
                                "(launch/test.sh does), or set RLT_CHROMIUM to a Chromium binary")
    libs = (root / "ld_library_path").read_text().strip()
    env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return str(binary), env


class Browser:
    """One headless Chromium and one tab, driven over the DevTools protocol."""

    def __init__(self, proc, ws):
        self.proc, self.ws = proc, ws
        self.next_id = 0
        self.pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self.session = None
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, profile: str, allow_host: str):
        import aiohttp

        binary, env = chromium_binary()
        proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars=false",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "--disable-background-networking",
             f"--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE {allow_host}", "about:blank"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
        lines: queue.Queue = queue.Queue()  # its stderr, read in a thread: a hung start cannot block

        def drain():
            for line in proc.stderr:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        url, seen, deadline = None, [], time.monotonic() + START_S
        while url is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                proc.kill()
                raise RuntimeError(f"Chromium did not start in {START_S} s:\n" + "".join(seen[-20:]))
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            url = m.group(1) if m else None
        http_session = aiohttp.ClientSession()
        ws = await http_session.ws_connect(url, max_msg_size=0)
        self = cls(proc, ws)
        self.http_session = http_session
        target = await self.send("Target.createTarget", url="about:blank")
        self.session = (await self.send("Target.attachToTarget", targetId=target["targetId"], flatten=True))["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.send(f"{domain}.enable", session=True)
        # the theme draws each diagram into a closed shadow root: open it, so the check can see the SVG
        await self.send("Page.addScriptToEvaluateOnNewDocument", session=True, source=OPEN_SHADOW)
        return self

    async def _read(self):
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            elif "method" in data:
                self.events.append(data)

    async def send(self, method: str, session: bool = False, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        await self.ws.send_str(json.dumps(msg))
        data = await asyncio.wait_for(fut, CALL_S)
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data["result"]

    async def resize(self, width: str) -> None:
        w, h = WIDTHS[width]
        await self.send("Emulation.setDeviceMetricsOverride", session=True, width=w, height=h,
                        deviceScaleFactor=1, mobile=width == "phone")

    async def load(self, url: str) -> None:
        self.events.clear()
        await self.send("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + CALL_S
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not load in {CALL_S} s")
            await asyncio.sleep(0.01)

    async def measure(self, url: str, width: str, wait_ms: int) -> dict:
        expression = f"({PAGE_CHECK})({json.dumps(width)}, {SHRINK}, {wait_ms})"
        result = await self.send("Runtime.evaluate", session=True, expression=expression,
                                 awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page check failed on {url}: {result['exceptionDetails']}")
        return result["result"]["value"]

    async def search(self, query: str) -> list[str]:
        """The pages the site's search lists for a query, best first (paths from the site's root)."""
        result = await self.send("Runtime.evaluate", session=True, expression=f"({SEARCH})({json.dumps(query)})",
                                 awaitPromise=True, returnByValue=True)
        return [p.lstrip("/") for p in result["result"]["value"]]

    async def close(self):
        self.reader.cancel()
        await self.ws.close()
        await self.http_session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def event_faults(events: list[dict], base: str) -> list[str]:
    """Script errors, console errors and requests that failed or left the machine."""
    out = []
    for e in events:
        m, p = e["method"], e.get("params", {})
        if m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append("script error: " + (d.get("exception", {}).get("description") or d.get("text", "")).splitlines()[0])
        elif m == "Runtime.consoleAPICalled" and p.get("type") == "error":
            out.append("console error: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])[:200])
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append("logged error: " + p["entry"]["text"][:200] + " " + p["entry"].get("url", ""))
        elif m == "Network.requestWillBeSent":
            url = p["request"]["url"]
            if not (url.startswith(base) or url.startswith(("data:", "blob:", "about:"))):
                out.append("fetched from the network: " + url)
    return out


def site_pages(site: Path) -> list[str]:
    """Every page of the built site (its index.html files), as paths relative to the site."""
    return sorted(str(p.relative_to(site)) for p in site.rglob("index.html")
                  if not p.relative_to(site).parts[0].startswith(("assets", "search")))


def link_faults(links: list[str], base: str, site: Path, ids_of: dict[str, set]) -> list[str]:
    """Links within the site that name a missing file, or an anchor the target page lacks."""
    out = []
    for link in links:
        if not link.startswith(base):
            continue
        parts = urlsplit(link)
        path = unquote(parts.path).lstrip("/")
        target = site / path
        if target.is_dir() or path == "" or path.endswith("/"):
            target = target / "index.html"
        if not target.is_file():
            out.append("broken link: " + link[len(base) - 1:])
            continue
        if parts.fragment and target.name == "index.html":
            page = str(target.relative_to(site))
            if page in ids_of and unquote(parts.fragment) not in ids_of[page]:
                out.append("broken anchor: " + link[len(base) - 1:])
    return out


async def check_site(site: Path, pages: list[str] | None = None, wait_ms: int = 10000,
                     searches=SEARCHES) -> dict[str, list[str]]:
    """{page: [fault, ...]} for every page (only those with faults; "search" for the searches).
    ``wait_ms``: how long a page's diagrams may take to be drawn."""
    site = Path(site).resolve()
    pages = pages or site_pages(site)
    faults: dict[str, list[str]] = {}
    links_of: dict[str, list[str]] = {}
    ids_of: dict[str, set] = {}
    with Server(site) as server, tempfile.TemporaryDirectory() as profile:
        browser = await Browser.start(profile, "127.0.0.1")
        try:
            for page in pages:  # loaded once at desktop width, then measured at each width
                url = server.base + page.removesuffix("index.html")
                await browser.resize("desktop")
                await browser.load(url)
                for width in WIDTHS:
                    if width != "desktop":
                        await browser.resize(width)
                    found = await browser.measure(url, width, wait_ms)
                    for f in found["faults"]:
                        faults.setdefault(page, []).append(f"[{width}] {f}" if width != "desktop" else f)
                    links_of[page], ids_of[page] = found["links"], set(found["ids"])
                for f in event_faults(browser.events, server.base):
                    faults.setdefault(page, []).append(f)
            await browser.resize("desktop")
            await browser.load(server.base)
            for query, best, below in searches:
                found = await browser.search(query)
                rank = {page: i for i, page in reversed(list(enumerate(found)))}
                if best not in found[:2]:
                    faults.setdefault("search", []).append(f"{query!r} lists {found[:3]} first, not {best}")
                for other in below:
                    if other in rank and rank[other] < rank.get(best, len(found)):
                        faults.setdefault("search", []).append(f"{query!r} ranks {other} above {best}")
        finally:
            await browser.close()
    for page, links in links_of.items():
        faults.setdefault(page, []).extend(link_faults(sorted(set(links)), server.base, site, ids_of))
    return {p: list(dict.fromkeys(f)) for p, f in faults.items() if f}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="the built site (mkdocs build --site-dir)")
    ap.add_argument("pages", nargs="*", help="only these pages (e.g. guide/grpo/index.html)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    faults = asyncio.run(check_site(args.site, args.pages or None))
    for page, found in faults.items():
        print(page)
        for f in found:
            print("   ", f)
    n = len(args.pages or site_pages(args.site.resolve()))
    print(f"{sum(map(len, faults.values()))} faults on {len(faults)} of {n} pages, "
          f"{time.monotonic() - t0:.1f} s")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
