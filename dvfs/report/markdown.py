"""A `Document` as Markdown (CommonMark with pipe tables), for wikis and pull requests.

Markdown viewers rarely show data: images, so the figures are files in a folder next to the
page, linked relatively: `render_markdown` returns the text and the files to write. Text from
the cube is escaped, so a drafter named `*x*` or `a|b` cannot change the page's structure.
"""

from __future__ import annotations

import re
from urllib.parse import quote

from dvfs.report.model import (
    Block,
    Code,
    Document,
    Facts,
    Figure,
    Finding,
    Paragraph,
    Table,
)

#: Characters that can start markup anywhere in a line (parentheses only matter after `]`).
_SPECIAL = re.compile(r"([\\`*_{}\[\]<>|~])")
#: An `&` that would start an entity reference (`&lt;`): written as `&amp;` to stay literal.
_ENTITY = re.compile(r"&(?=#?[A-Za-z0-9]+;)")
#: What starts a heading, list, rule or setext underline at the start of a line.
_LINE_START = re.compile(r"^(#{1,6}(?=\s|$)|[-+](?=\s|$)|[-=]+\s*$|\d{1,9}(?=[.)](?:\s|$)))")


def md_escape(text: str) -> str:
    """Inline text on one line with Markdown's markup characters made literal."""
    flat = _ENTITY.sub("&amp;", " ".join(text.split()))
    escaped = _SPECIAL.sub(r"\\\1", flat)
    return _LINE_START.sub(lambda m: m[0] + "\\" if m[0][0].isdigit() else "\\" + m[0], escaped, 1)


def _table(table: Table) -> list[str]:
    lines = [f"**{md_escape(table.title)}**", ""]
    lines.append("| " + " | ".join(md_escape(h) for h in table.header) + " |")
    lines.append("|" + "|".join("---" for _ in table.header) + "|")
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in table.rows]
    return [*lines, ""]


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks inside the text."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


class _Figures:
    """Figures met while rendering: their relative link and the bytes to write there."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.files: dict[str, bytes] = {}

    def link(self, figure: Figure) -> str:
        stem = figure.name.rsplit(".", 1)[0].replace("/", "_")
        name = f"{len(self.files) + 1:02d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', stem)}"
        path = f"{self.folder}/{name}.{figure.extension}"
        self.files[path] = figure.data
        return f"![{md_escape(figure.caption)}]({quote(path)})"


def _block(block: Block, figures: _Figures) -> list[str]:
    if isinstance(block, Paragraph):
        lead = {"note": "> **Note:** ", "warning": "> **Warning:** "}.get(block.tone, "")
        return [lead + md_escape(block.text), ""]
    if isinstance(block, Facts):
        return [*(f"- **{md_escape(k)}:** {md_escape(v)}" for k, v in block.pairs), ""]
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Code):
        fence = _fence(block.text)
        return [f"**{md_escape(block.title)}**", "", fence, block.text, fence, ""]
    if isinstance(block, Figure):
        return [figures.link(block), "", f"*{md_escape(block.caption)}*", ""]
    assert isinstance(block, Finding)
    lines = [f"**{md_escape(block.headline)}**", ""]
    if block.details:
        lines += [*(f"- {md_escape(d)}" for d in block.details), ""]
    for figure in block.figures:
        lines += _block(figure, figures)
    return lines


def render_markdown(doc: Document, figure_folder: str) -> tuple[str, dict[str, bytes]]:
    """The page and {relative path: bytes} of the figures it links (under `figure_folder`)."""
    figures = _Figures(figure_folder)
    lines = [f"# {md_escape(doc.title)}", "", md_escape(doc.subtitle), ""]
    lines += [f"- [{md_escape(s.title)}](#{s.anchor})" for s in doc.sections]
    lines.append("")
    for section in doc.sections:
        lines += [f"## {md_escape(section.title)}", ""]
        for block in section.blocks:
            lines += _block(block, figures)
    return "\n".join(lines).rstrip("\n") + "\n", figures.files
