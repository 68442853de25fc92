"""Analyses as documents: stable JSON (for scripts and `dvfs cap plan`) and Markdown tables.

JSON schemas are versioned by their "schema" key: "dvfs.headroom/1" (`headroom`) and
"dvfs.compare/4" (`compare`); `common` holds the NaN->null rule and formatting both share.
"""

from __future__ import annotations

from dvfs.report.common import json_safe, markdown_table, reference_text
from dvfs.report.compare import (
    COMPARE_SCHEMA,
    compare_document,
    compare_markdown,
    compare_notes,
    compare_tables,
)
from dvfs.report.headroom import (
    HEADROOM_SCHEMA,
    headroom_document,
    headroom_markdown,
    headroom_notes,
    headroom_table_rows,
)

__all__ = [
    "COMPARE_SCHEMA",
    "HEADROOM_SCHEMA",
    "compare_document",
    "compare_markdown",
    "compare_notes",
    "compare_tables",
    "headroom_document",
    "headroom_markdown",
    "headroom_notes",
    "headroom_table_rows",
    "json_safe",
    "markdown_table",
    "reference_text",
]
