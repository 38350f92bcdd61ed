"""The documentation: the MkDocs site builds with no warning, reads as a reference, and
needs no network; the README is a front page.

`mkdocs build --strict` fails on a broken link or anchor between pages, a page missing
from the nav, and an API reference (mkdocstrings) that cannot be rendered from the
docstrings (mkdocs.yml). Its tools come with the test extra (setup.cfg). The site is
built once (the module's `site` fixture) and read by the tests that need the HTML.

The rest is read from the Markdown alone: no page cites the project's issue numbers
(history belongs in git), every page has one H1, and every command a page quotes
(`python -m experiments.X ...`, `python -m mgloop.X ...`) names a module
that exists and flags that it defines.
"""

import glob
import os
import re
import subprocess
import sys
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MATHJAX = os.path.join(DOCS, "javascripts", "vendor", "mathjax")
# One test process builds the site once (the `site` fixture) for every test here.
pytestmark = pytest.mark.xdist_group("docs")

QUICK_START = ("pip install -e . && python -m mgloop.train",
               "pip install -e '.[test]' && python -m pytest")
# The site is built as if served under a sub-path (mkdocs.yml's site_url), as a project's
# pages often are: the 404 page must load its assets from there.
SITE_URL = "https://example.org/sub/mgloop/"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once by `mkdocs build --strict`, served at SITE_URL."""
    site_dir = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", MGLOOP_SITE_URL=SITE_URL)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return site_dir


def test_the_site_builds_strict(site):
    assert (site / "index.html").exists()
    assert (site / "api" / "aggregation" / "index.html").exists()


def _html_pages(site):
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def test_the_site_loads_nothing_from_outside(site):
    """No script, stylesheet or font from the network: the math renders offline
    (MathJax is vendored) and the theme fetches no web fonts (`theme.font: false`)."""
    assert os.path.isfile(os.path.join(MATHJAX, "tex-svg.js"))
    assert os.path.isfile(os.path.join(MATHJAX, "LICENSE"))
    tag = re.compile(r"<(script|link)\b[^>]*>", re.I)
    external = re.compile(r"""\b(src|href)\s*=\s*["']?(https?:)?//""", re.I)
    found = []
    for page in _html_pages(site):
        for match in tag.finditer(page.read_text(encoding="utf-8")):
            element = match.group(0)
            if match.group(1).lower() == "link" and not re.search(
                    r"rel\s*=\s*[\"']?(stylesheet|preload|preconnect|modulepreload)", element, re.I):
                continue  # a canonical or alternate link is not loaded
            if external.search(element):
                found.append(f"{page.relative_to(site)}: {element}")
    assert found == []
    math_page = (site / "methods" / "link-model" / "index.html").read_text(encoding="utf-8")
    assert "javascripts/vendor/mathjax/tex-svg.js" in math_page


def test_the_404_page_loads_its_assets_from_the_sites_path(site):
    """The 404 page answers any missing address, at any depth, so its links cannot be
    relative: they start with the path of the site's URL (mkdocs.yml's site_url), not /."""
    page = (site / "404.html").read_text(encoding="utf-8")
    path = urllib.parse.urlsplit(SITE_URL).path
    links = re.findall(r"""\b(?:src|href)\s*=\s*["']([^"']*)""", page)
    assert any(link.startswith(path + "assets/") for link in links), links
    assert [link for link in links if link.startswith("/") and not link.startswith(path)] == []


def test_no_api_page_prints_an_import_rule(site):
    """A package's "May import" rule is for the code (tests/test_layout.py), not for the
    reader: docs/_griffe/plain_docstrings.py leaves it out of the API pages."""
    pages = sorted((site / "api").rglob("*.html"))
    assert pages
    assert [page.relative_to(site) for page in pages
            if "May import" in page.read_text(encoding="utf-8")] == []


def test_every_page_has_one_h1(site):
    """One H1 per page (its title), in the Markdown and in the built page."""
    two = []
    for path in _markdown_pages():
        text = _outside_code(_read(path))
        h1 = re.findall(r"^# \S", text, re.M)
        if len(h1) > 1:
            two.append(f"{os.path.relpath(path, ROOT)}: {len(h1)} H1 lines")
    for page in _html_pages(site):
        count = len(re.findall(r"<h1\b", page.read_text(encoding="utf-8")))
        if count != 1:
            two.append(f"site/{page.relative_to(site)}: {count} <h1>")
    assert two == []


def _read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _readme() -> str:
    return _read(README)


def _markdown_pages() -> list:
    return sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def _outside_code(text: str) -> str:
    """The Markdown without its fenced and indented code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"^(?: {4}|\t)(?![-*] |\d+\. ).*$", "", text, flags=re.M)


def test_no_page_cites_an_issue_number():
    """A reference, not a diary: no "issue 14" (nor "issue #14", "issues 14 and 27", an
    anchor made from such a heading) in docs/ or the README."""
    cite = re.compile(r"\bissues?[\s#-]*#?\d", re.I)
    found = []
    for path in _markdown_pages() + [README]:
        for number, line in enumerate(_read(path).splitlines(), 1):
            if cite.search(line):
                found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()[:100]}")
    assert found == []


def test_no_stale_command_notes():
    """Each figure shows its current command only, not a deleted script's with a note."""
    stale = re.compile(r"is gone[;:,]|\(Now:", re.I)
    found = [f"{os.path.relpath(path, ROOT)}:{number}"
             for path in _markdown_pages() + [README]
             for number, line in enumerate(_read(path).splitlines(), 1)
             if stale.search(line)]
    assert found == []


# --- every quoted command names a script or module that exists, and flags it defines.

ABSL_FLAGS = {"flagfile", "undefok", "help", "helpfull", "helpshort", "helpxml", "only_check_args",
              "logtostderr", "alsologtostderr", "log_dir", "verbosity", "v", "stderrthreshold",
              "showprefixforinfo", "logger_levels", "run_with_pdb", "pdb", "run_with_profiling",
              "use_cprofile_for_profiling", "profile_file"}
COMMAND = re.compile(r"python3?\s+(-m\s+(?:mgloop|experiments)(?:\.\w+)+)([^`\n]*)")
FLAG = re.compile(r"(?<![\w-])--([a-zA-Z][\w]*)")
DEFINE = re.compile(r"""DEFINE_\w+\(\s*["'](\w+)["']|add_argument\(\s*["']--(\w+)["']""")


def _quoted_commands() -> list:
    """(page, target, the rest of the line) for every command in docs/ and the README."""
    commands = []
    for path in _markdown_pages() + [README]:
        text = re.sub(r"\\\n\s*", " ", _read(path))  # a command continued over lines
        for match in COMMAND.finditer(text):
            commands.append((os.path.relpath(path, ROOT), re.sub(r"\s+", " ", match.group(1)),
                             match.group(2)))
    return commands


def _defined(text: str) -> set:
    """The flag names absl (`flags.DEFINE_*("name", ...)`) or argparse defines in a source."""
    return {absl or argparse for absl, argparse in DEFINE.findall(text)}


def _config_flags() -> set:
    """The flag names of Config's settings (every part's fields; importing the config
    loads no TensorFlow)."""
    from mgloop import settings
    from mgloop.runs import config
    return {settings.flag_name(field) for field in config.setting_fields()}


def _experiment_flags(script: str, seen=None) -> set:
    """The flags a script under experiments/ defines, with those of the experiments/
    modules it imports (and Config's, if it defines mgloop's run flags)."""
    seen = set() if seen is None else seen
    if script in seen:
        return set()
    seen.add(script)
    text = _read(script)
    names = _defined(text)
    if "define_flags" in text:
        names |= _config_flags()
    folder = os.path.dirname(script)
    for module in re.findall(r"^\s*from\s+experiments\s+import\s+(\w+)", text, re.M):
        path = os.path.join(folder, module + ".py")
        if os.path.isfile(path):
            names |= _experiment_flags(path, seen)
    return names


def _entry_flags(module: str) -> set:
    """The flag names of an entry point's own options (launch's, sweep's: made from their
    fields by runs/flags.py; importing them loads no TensorFlow)."""
    import dataclasses
    from mgloop import settings
    from mgloop.cluster.launch_options import LaunchOptions
    from mgloop.runs.sweep.options import SweepOptions
    options = {"mgloop.launch": LaunchOptions, "mgloop.sweep": SweepOptions}.get(module)
    return {settings.flag_name(field) for field in dataclasses.fields(options)} if options \
        else set()


def _module_flags(module: str) -> set:
    names = _defined(_read(_module_path(module))) | _entry_flags(module)
    if module in ("mgloop.train", "mgloop.launch"):
        names |= _config_flags()
    return names


def _module_path(module: str):
    base = os.path.join(ROOT, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def test_every_quoted_command_names_a_script_and_flags_that_exist():
    scripts = [f"{os.path.relpath(path, ROOT)}:{number}" for path in _markdown_pages() + [README]
               for number, line in enumerate(_read(path).splitlines(), 1)
               if re.search(r"python3?\s+experiments/", line)]
    assert scripts == [], "experiments/ runs as a package: python -m experiments.ENTRY"
    commands = _quoted_commands()
    assert len(commands) > 20, "the command extraction found almost nothing"
    wrong = []
    for page, target, rest in commands:
        module = target.split()[-1]
        path = _module_path(module)
        if path is None:
            known = None
        elif module.startswith("experiments."):
            known = _experiment_flags(path)
        else:
            known = _module_flags(module)
        if known is None:
            wrong.append(f"{page}: {target} does not exist")
            continue
        for flag in FLAG.findall(rest):
            if flag in known or flag in ABSL_FLAGS or (flag.startswith("no") and flag[2:] in known):
                continue
            wrong.append(f"{page}: {target} defines no --{flag}")
    assert wrong == []


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


def test_the_home_page_has_the_readmes_feature_table():
    """docs/index.md carries the README's "What is in it" table, its links made relative
    to docs/."""
    readme = _readme()
    table = readme[readme.index("## What is in it"):readme.index("## Documentation")].strip()
    home = _read(os.path.join(DOCS, "index.md"))
    assert table.replace("](docs/", "](") in home


# Tags a page may hold: HTML's, SVG's (icons, MathJax) and the theme's custom elements.
HTML_TAGS = set("""a abbr address area article aside audio b base bdi bdo blockquote body br
    button canvas caption cite code col colgroup data datalist dd del details dfn dialog div dl
    dt em embed fieldset figcaption figure footer form h1 h2 h3 h4 h5 h6 head header hgroup hr
    html i iframe img input ins kbd label legend li link main map mark menu meta meter nav
    noscript object ol optgroup option output p param picture pre progress q rp rt ruby s samp
    script search section select slot small source span strong style sub summary sup table
    tbody td template textarea tfoot th thead time title tr track u ul var video wbr svg path g
    use symbol defs circle rect line polyline polygon clippath mask lineargradient stop text
    tspan""".split())
# Placeholders that are also HTML tags, as a docstring would write them: `task:<i>`, `seed=<s>`.
PLACEHOLDER_TAGS = re.compile(r"<(i|s|b|u|q|var|time|data|output|select|input)>")


def test_no_placeholder_vanishes_as_an_html_tag(site):
    """A docstring's `<logdir>/summary.json` outside backticks reaches the API page as an
    unknown HTML tag, and the browser shows nothing of it: placeholders go in backticks."""
    found = []
    for page in _html_pages(site):
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"</?([A-Za-z_][\w.-]*)(?=[\s>/])", text):
            name = match.group(1).lower()
            if name not in HTML_TAGS and not name.startswith(("mjx-", "md-")):
                found.append(f"{page.relative_to(site)}: {text[match.start() - 40:match.end() + 20]!r}")
        found += [f"{page.relative_to(site)}: {m.group(0)}" for m in PLACEHOLDER_TAGS.finditer(text)]
    assert found == []


COPY_LINES = 4  # a run of this many prose lines of one page found in another is a copy


def _prose_blocks(text: str) -> list:
    """A page's prose as blocks of consecutive non-blank lines, each line's whitespace
    collapsed: no fenced or indented code, no $$ math, table rows, headings or HTML
    comments (each ends a block)."""
    blocks, block, fence = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if fence:  # inside a fenced block: until its closing fence
            fence = None if stripped.startswith(fence) else fence
            continue
        opens = re.match(r"```|~~~|\$\$", stripped)
        one_line_math = (opens and opens.group(0) == "$$" and len(stripped) > 2
                         and stripped.endswith("$$"))
        if opens and not one_line_math:
            fence = opens.group(0)
        if (opens or not stripped or stripped.startswith(("#", "|", "<!--"))
                or (not block and line.startswith(("    ", "\t")))):  # an indented code block
            if block:
                blocks.append(block)
            block = []
            continue
        block.append(" ".join(stripped.split()))
    return blocks + [block] if block else blocks


def test_no_paragraph_is_copied_between_pages():
    """Each paragraph lives on one page and the others link to it: no run of COPY_LINES
    consecutive prose lines of one page of docs/ appears in another (whitespace and line
    breaks aside; code, math, tables and headings are not compared)."""
    pages = {os.path.relpath(path, DOCS): _prose_blocks(_read(path))
             for path in _markdown_pages()}
    prose = {name: " " + " ".join(" ".join(block) for block in blocks) + " "
             for name, blocks in pages.items()}
    found = set()
    for name, blocks in pages.items():
        for block in blocks:
            for start in range(len(block) - COPY_LINES + 1):
                run = " ".join(block[start:start + COPY_LINES])
                found |= {f"{name} -> {other}: {block[start][:60]}..."
                          for other, text in prose.items() if other != name and run in text}
    assert sorted(found) == []


def test_a_copied_paragraph_is_found_whatever_its_wrapping():
    page = "A first line of prose\nthat runs on\nfor four\nlines in all.\n\n| a | table |\n"
    blocks = _prose_blocks(page + "```\ncode\n```\n    indented code\n\n$$\nx\n$$\n# Heading\n")
    assert blocks == [["A first line of prose", "that runs on", "for four", "lines in all."]]
    rewrapped = _prose_blocks("A first line\nof prose that runs on for\nfour lines in all.\n")
    assert " ".join(blocks[0]) == " ".join(rewrapped[0])
