"""The documentation: the MkDocs site builds with no warning, and the README is a front page.

`mkdocs build --strict` fails on a broken link or anchor between pages, a page missing
from the nav, and an API reference (mkdocstrings) that cannot be rendered from the
docstrings (mkdocs.yml). Its tools come with the test extra (setup.cfg).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
QUICK_START = ("pip install -e . && python -m mgloop.train",
               "pip install -e '.[test]' && python -m pytest")


def test_the_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "api" / "aggregation" / "index.html").exists()


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def test_the_readme_is_a_front_page_with_the_two_commands():
    text = _readme()
    assert len(text.splitlines()) <= 200
    lines = [line.strip() for line in text.splitlines()]
    for command in QUICK_START:
        assert command in lines, f"the quick start line {command!r} is not in README.md"


def test_every_relative_link_in_the_readme_exists():
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _readme())
    assert targets, "README.md links nowhere"
    missing = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the README itself
        path = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(target)
    assert missing == []
