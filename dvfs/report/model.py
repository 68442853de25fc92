"""The report as plain data: sections of blocks, which each renderer (HTML, Markdown) draws.

Everything here is already text (numbers formatted, units stated), so the renderers only
escape and lay out: the two formats cannot disagree about a value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paragraph:
    """A sentence or two; `tone` "note" or "warning" asks the renderer to set it apart."""

    text: str
    tone: str = ""


@dataclass(frozen=True)
class Facts:
    """Label-value pairs (what was measured, data quality)."""

    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Code:
    """Verbatim text: a command, or the campaign file (`folded` where the format can fold)."""

    title: str
    text: str
    folded: bool = False


@dataclass(frozen=True)
class Figure:
    """An image file's bytes: embedded by the HTML renderer, written beside the Markdown."""

    name: str
    caption: str
    data: bytes
    mime: str

    @property
    def extension(self) -> str:
        return {"image/png": "png", "image/svg+xml": "svg"}.get(self.mime, "bin")


@dataclass(frozen=True)
class Finding:
    """One thing the campaign shows, and the figures that show it."""

    headline: str
    details: tuple[str, ...]
    figures: tuple[Figure, ...]


Block = Paragraph | Facts | Table | Code | Figure | Finding


@dataclass(frozen=True)
class Section:
    title: str
    anchor: str
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Document:
    title: str
    subtitle: str
    sections: tuple[Section, ...]
