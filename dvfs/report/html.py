"""A `Document` as one self-contained HTML page: inline CSS, figures as data: URIs, no script.

The page's Content-Security-Policy forbids every fetch but data: images and its own inline
style, so a mailed report can neither phone home nor break when opened offline. Every piece of
text is escaped: names in a cube (drafters, corpora, campaign) are untrusted input.
"""

from __future__ import annotations

import base64
from html import escape

from dvfs.report.model import (
    Block,
    Code,
    Document,
    Facts,
    Figure,
    Paragraph,
    Section,
    Table,
)

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

CSS = """
:root { color-scheme: light; }
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d2430;
  margin: 0 auto; max-width: 1180px; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 1.7em; margin: 0 0 4px; }
h2 { font-size: 1.3em; margin: 36px 0 10px; padding-bottom: 4px; border-bottom: 2px solid #d8dee8; }
h3 { font-size: 1.05em; margin: 22px 0 6px; }
.subtitle { color: #4b5567; margin: 0 0 18px; }
nav ol { margin: 0; padding-left: 22px; columns: 2; }
div.table { overflow-x: auto; margin: 6px 0 16px; }
p.table-title { font-weight: 600; margin: 4px 0; }
table { border-collapse: collapse; font-size: 13.5px; }
th, td { border: 1px solid #d8dee8; padding: 3px 9px; text-align: left; vertical-align: top; }
th { background: #eef2f7; }
tbody tr:nth-child(even) td { background: #f8fafc; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 18px;
  margin: 8px 0 16px; }
dl.facts dt { font-weight: 600; color: #3a4456; }
dl.facts dd { margin: 0; overflow-wrap: anywhere; }
p.note { background: #eef5ff; border-left: 4px solid #4a7fd0; padding: 6px 12px; }
p.warning { background: #fff5e6; border-left: 4px solid #d08a1a; padding: 6px 12px; }
.finding { margin: 14px 0 26px; }
.finding > p.headline { font-weight: 600; margin-bottom: 4px; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid #e3e7ee; }
figcaption { color: #4b5567; font-size: 13px; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; font-size: 12.5px; }
details summary { cursor: pointer; font-weight: 600; }
footer { margin-top: 40px; color: #6a7385; font-size: 12.5px; }
@media print { body { max-width: none; } figure, table { break-inside: avoid; } }
"""


def data_uri(figure: Figure) -> str:
    return f"data:{figure.mime};base64,{base64.b64encode(figure.data).decode('ascii')}"


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return False
    return True


def _table(table: Table) -> str:
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in table.header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{escape(c)}</td>' if _is_number(c) else f"<td>{escape(c)}</td>"
            for c in row
        )
        + "</tr>"
        for row in table.rows
    )
    return (
        f'<div class="table"><p class="table-title">{escape(table.title)}</p>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def _figure(figure: Figure) -> str:
    return (
        f'<figure><img src="{data_uri(figure)}" alt="{escape(figure.caption)}">'
        f"<figcaption>{escape(figure.caption)} ({escape(figure.name)})</figcaption></figure>"
    )


def _block(block: Block) -> str:
    if isinstance(block, Paragraph):
        tone = f' class="{escape(block.tone)}"' if block.tone else ""
        return f"<p{tone}>{escape(block.text)}</p>"
    if isinstance(block, Facts):
        items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in block.pairs)
        return f'<dl class="facts">{items}</dl>'
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Code):
        if not block.folded:
            return f"<h3>{escape(block.title)}</h3><pre>{escape(block.text)}</pre>"
        return (
            f"<details><summary>{escape(block.title)}</summary>"
            f"<pre>{escape(block.text)}</pre></details>"
        )
    if isinstance(block, Figure):
        return _figure(block)
    details = "".join(f"<li>{escape(d)}</li>" for d in block.details)
    return (
        f'<div class="finding"><p class="headline">{escape(block.headline)}</p>'
        + (f"<ul>{details}</ul>" if details else "")
        + "".join(_figure(f) for f in block.figures)
        + "</div>"
    )


def _section(section: Section) -> str:
    body = "\n".join(_block(b) for b in section.blocks)
    return (
        f'<section id="{escape(section.anchor)}"><h2>{escape(section.title)}</h2>\n{body}</section>'
    )


def render_html(doc: Document) -> str:
    """The page, as text (UTF-8 when written)."""
    toc = "".join(
        f'<li><a href="#{escape(s.anchor)}">{escape(s.title)}</a></li>' for s in doc.sections
    )
    sections = "\n".join(_section(s) for s in doc.sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="dvfs report">
<link rel="icon" href="data:,">
<title>{escape(doc.title)}</title>
<style>{CSS}</style>
</head>
<body>
<header><h1>{escape(doc.title)}</h1><p class="subtitle">{escape(doc.subtitle)}</p>
<nav><ol>{toc}</ol></nav></header>
<main>
{sections}
</main>
<footer>Made by dvfs report: one self-contained file; figures are embedded.</footer>
</body>
</html>
"""
