"""A Griffe extension for the API reference: mgloop's docstrings are plain prose.

They index with brackets (`g[t][v]`: tower t's gradient of variable v), which Markdown
reads as a reference link `[t][v]` and mkdocs-autorefs then reports as a missing
cross-reference. This escapes `][` outside code (backtick spans and indented blocks)
when the docstring is rendered; the source is not changed.
"""

from __future__ import annotations

import re

import griffe

_CODE_SPAN = re.compile(r"(`+)(.*?)\1", re.S)


def _escape(text: str) -> str:
    out, last = [], 0
    for span in _CODE_SPAN.finditer(text):
        out.append(text[last:span.start()].replace("][", "]\\["))
        out.append(span.group(0))
        last = span.end()
    out.append(text[last:].replace("][", "]\\["))
    return "".join(out)


def plain(value: str) -> str:
    lines = []
    for line in value.split("\n"):
        lines.append(line if line.startswith("    ") else _escape(line))
    return "\n".join(lines)


class PlainDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
