"""Griffe extension: memwise's reStructuredText-isms in docstrings, as Markdown.

memwise's docstrings are Google style (``Args:``, ``Returns:``, ``Raises:``) with two
Sphinx habits that Markdown does not know:

* roles such as ``:func:`scan``` and ``:class:`~memwise.tiling.Tiling```: rendered as
  code, linked to the object's API entry when the site documents it (an *optional*
  cross-reference: one the site does not document stays plain code, with no warning);
* ``::`` literal blocks (``Example::`` followed by an indented block): rendered as a
  fenced code block, and a top-level ``Example::`` of doctest lines (``>>>``) as
  Griffe's ``Examples:`` section.

A section item whose description starts with ``>`` or ``<`` (``ridge: >= 0``) is
escaped, so that Markdown does not read a blockquote.

The source is left as it is (the doctests run on it); only the text the docs site
renders is rewritten, once per object, before Griffe parses it.
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const|ref):`(?P<body>[^`]+)`"
)
_EXAMPLE_HEADS = {"example", "examples"}


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as seen from ``obj``'s scope, or None if unknown."""
    target = target.lstrip(".")
    if target == "memwise" or target.startswith("memwise."):
        return target
    head, _, rest = target.partition(".")
    try:
        base = obj.resolve(head)
    except Exception:  # NameResolutionError, or an alias that cannot be resolved
        return None
    if not base.startswith("memwise"):
        return None
    return f"{base}.{rest}" if rest else base


def _role(obj: griffe.Object, match: re.Match) -> str:
    body = match["body"].strip()
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        target = body.lstrip("~")
        title = target.rsplit(".", 1)[-1] if body.startswith("~") else target
    code = f"<code>{html.escape(title)}</code>"
    identifier = _resolve(obj, target.lstrip("~"))
    if identifier is None:
        return code
    return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _literal_blocks(text: str) -> str:
    """``text::`` + an indented block -> ``text:`` + a fenced block (or an Examples section)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::") or stripped.lstrip().startswith((">>>", "...")):
            out.append(line)
            i += 1
            continue
        indent = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= indent:
            out.append(line)
            i += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        while end > j and not lines[end - 1].strip():
            end -= 1
        block = textwrap.dedent("\n".join(lines[j:end])).split("\n")
        pad = " " * indent
        head = stripped[:-2].rstrip()
        doctest = block[0].startswith(">>>")
        if indent == 0 and doctest and head.lower() in _EXAMPLE_HEADS:
            # Griffe's Examples section: the title, then the block indented, no blank line.
            out.append("Examples:")
            out += [f"    {b}" if b.strip() else "" for b in block]
        else:
            if head.strip():
                out += [f"{head}:", ""]
            language = "pycon" if doctest else "python"
            out.append(f"{pad}```{language}")
            out += [f"{pad}{b}" if b.strip() else "" for b in block]
            out.append(f"{pad}```")
        if end < len(lines):
            out.append("")
        i = end
    return "\n".join(out)


# An item of an Args/Returns/Raises section whose description starts with ">" or "<"
# (``ridge: >= 0, ...``): Markdown would read a blockquote or an HTML tag.
_ITEM_STARTING_WITH_BRACKET = re.compile(r"^(\s+\*{0,2}\w+(?: \([^)]*\))?: )([<>])", re.M)


def rewrite(obj: griffe.Object, text: str) -> str:
    """The Markdown the site renders for ``obj``'s docstring ``text``."""
    text = _literal_blocks(text)
    text = _ITEM_STARTING_WITH_BRACKET.sub(lambda m: f"{m[1]}\\{m[2]}", text)
    # Roles outside code fences only.
    parts = re.split(r"(```.*?```)", text, flags=re.S)
    for k in range(0, len(parts), 2):
        parts[k] = _ROLE.sub(lambda m: _role(obj, m), parts[k])
    return "".join(parts)


class SphinxToMarkdown(griffe.Extension):
    """Rewrites every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Griffe 2 calls this once the package is loaded."""
        seen: set[int] = set()
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj, obj.docstring.value)
                obj.docstring.__dict__.pop("parsed", None)
            stack.extend(m for m in obj.members.values() if not m.is_alias)

    def on_package_loaded(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Griffe 1 calls this once the package is loaded."""
        self.on_package(pkg=pkg, **kwargs)
