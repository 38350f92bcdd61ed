"""A Griffe extension for the API reference: mgloop's docstrings are plain prose.

They index with brackets (`g[t][v]`: tower t's gradient of variable v), which Markdown
reads as a reference link `[t][v]` and mkdocs-autorefs then reports as a missing
cross-reference. This escapes `][` outside code (backtick spans and indented blocks)
when the docstring is rendered; the source is not changed.

A package's docstring ends with its import rule ("May import: ..."), which
tests/test_layout.py reads and enforces: a rule for the code, not for the reader of the
API pages, so it is left out of the rendered text (from "May import" to the end of its
paragraph).
"""

from __future__ import annotations

import re

import griffe

_CODE_SPAN = re.compile(r"(`+)(.*?)\1", re.S)
# "May import" (a paragraph's start or a sentence's) to the end of its paragraph
_IMPORT_RULE = re.compile(r"(^|(?<=[.:)] ))May import\b.*?(?=\n[ \t]*\n|\Z)", re.S | re.M)


def _escape(text: str) -> str:
    out, last = [], 0
    for span in _CODE_SPAN.finditer(text):
        out.append(text[last:span.start()].replace("][", "]\\["))
        out.append(span.group(0))
        last = span.end()
    out.append(text[last:].replace("][", "]\\["))
    return "".join(out)


def without_import_rule(value: str) -> str:
    """The docstring without its "May import" rule (and without a paragraph it empties)."""
    return re.sub(r"\n{3,}", "\n\n", _IMPORT_RULE.sub("", value)).rstrip()


def plain(value: str) -> str:
    value = without_import_rule(value)
    lines = []
    for line in value.split("\n"):
        lines.append(line if line.startswith("    ") else _escape(line))
    return "\n".join(lines)


class PlainDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
