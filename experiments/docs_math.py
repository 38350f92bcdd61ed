"""Does the documentation's math render offline? Builds the site, serves it on 127.0.0.1,
opens a page with formulas in headless Chromium that may reach nothing but that server,
and checks that MathJax (vendored in docs/javascripts/vendor/mathjax/) typeset it.

    python -m experiments.docs_math [--page=methods/local-updates/] [--screenshot=PATH]

Prints one line per check and exits non-zero if one fails: the number of MathJax
containers (`mjx-container`) in the rendered page (> 0), the arithmatex spans still
holding raw TeX delimiters (`\\(`, `\\[`: 0), every request Chromium made (all to the
local server: read from its network log, where Chromium's own
update and account services show their attempts, refused), and where the screenshot is. Chromium's
only way out is the local server: every other host name resolves to nothing and every
other address goes to a proxy that does not exist.

Needs `mkdocs` (the test extra) and Chromium; on Debian or Ubuntu, as root:
`apt-get update && apt-get install -y chromium`.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def build_site(site_dir: str) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "--site-dir", site_dir], cwd=ROOT, env=env, check=True)


def serve(site_dir: str) -> tuple[http.server.ThreadingHTTPServer, list[str]]:
    """A static server of site_dir on 127.0.0.1 (a free port), and the paths it served."""
    served = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            served.append(self.path)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=site_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, served


def chromium_args(browser: str, profile: str, net_log: str) -> list[str]:
    """Headless Chromium that can reach 127.0.0.1 only."""
    return [browser, "--headless=new", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-default-apps", "--disable-extensions",
            "--disable-domain-reliability", "--metrics-recording-only",
            "--allow-browser-signin=false", "--disable-client-side-phishing-detection",
            "--disable-features=NetworkTimeServiceQuerying,AutofillServerCommunication,"
            "OptimizationHints,MediaRouter,Translate,CertificateTransparencyComponentUpdater",
            # every host name but 127.0.0.1 resolves to nothing, every address but
            # loopback goes to a proxy on a closed port
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>;127.0.0.1",
            f"--log-net-log={net_log}", "--net-log-capture-mode=Default",
            "--window-size=1200,900", "--virtual-time-budget=20000"]


def requests(net_log: str) -> list[dict]:
    """Every http(s) request in Chromium's network log: its URL, initiator (the page's
    origin, or "not an origin" for Chromium's own services) and net error (None if none)."""
    with open(net_log, encoding="utf-8") as f:
        log = json.load(f)
    by_source = {}
    for event in log["events"]:
        params = event.get("params", {})
        request = by_source.setdefault(event["source"]["id"], {})
        if "url" in params and "url" not in request:
            request["url"] = params["url"]
        for key in ("initiator", "net_error"):
            if key in params:
                request[key] = params[key]
    by_url = {}  # a request shows under several sources (the job, the stream): one per URL
    for request in by_source.values():
        url = request.get("url", "")
        if url.startswith(("http:", "https:")):
            merged = by_url.setdefault(url, {"url": url})
            for key in ("initiator", "net_error"):
                if request.get(key) is not None:
                    merged[key] = request[key]
    return list(by_url.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", default="methods/local-updates/",
                        help="the page to open, as its path in the site")
    parser.add_argument("--screenshot", default=os.path.join(tempfile.gettempdir(),
                                                             "docs_math.png"),
                        help="where the screenshot of the page goes")
    args = parser.parse_args()

    browser = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if browser is None:
        print("no Chromium found; install it with: apt-get update && apt-get install -y chromium")
        return 2

    work = tempfile.mkdtemp(prefix="docs-math-")
    site_dir = os.path.join(work, "site")
    build_site(site_dir)
    server, served = serve(site_dir)
    url = f"http://127.0.0.1:{server.server_address[1]}/{args.page}"
    try:
        common = chromium_args(browser, os.path.join(work, "profile"),
                               os.path.join(work, "net-log.json"))
        dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True,
                             timeout=180).stdout
        subprocess.run(common[:-1] + ["--virtual-time-budget=20000",
                                      f"--screenshot={args.screenshot}", url],
                       capture_output=True, text=True, timeout=180)
    finally:
        server.shutdown()

    containers = len(re.findall(r"<mjx-container\b", dom))
    spans = re.findall(r'<(span|div) class="arithmatex">(.*?)</\1>', dom, re.S)
    raw = sum(1 for _, inner in spans if re.search(r"\\[(\[]", inner))
    seen = requests(os.path.join(work, "net-log.json"))
    local = "http://127.0.0.1:"
    outside = [r for r in seen if not r["url"].startswith(local)]
    by_page = [r for r in outside if str(r.get("initiator", "")).startswith(local)]
    reached = [r for r in outside if not r.get("net_error")]
    mathjax = any("vendor/mathjax/tex-svg.js" in path for path in served)

    checks = [
        (containers > 0, f"rendered math: {containers} mjx-container elements in {url}"),
        (raw == 0, f"raw TeX left: {raw} of {len(spans)} arithmatex elements"),
        (mathjax, "MathJax served by the local server: javascripts/vendor/mathjax/tex-svg.js"
                  + ("" if mathjax else " (not requested)")),
        (not by_page, f"requests by the page outside 127.0.0.1: {len(by_page)}"
                      + "".join(f"\n    {r['url'][:100]}" for r in by_page)),
        (not reached, f"requests outside 127.0.0.1 that got through: {len(reached)} "
                      f"(Chromium's own services tried {len(outside)}, all refused)"
                      + "".join(f"\n    {r['url'][:100]}" for r in reached)),
        (os.path.isfile(args.screenshot), f"screenshot: {args.screenshot}"),
    ]
    for ok, line in checks:
        print(("ok   " if ok else "FAIL ") + line)
    print(f"the local server served {len(served)} requests from {site_dir}")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
