"""`dvfs report`: the HTML page in a real headless Chromium (renders, every image loads, no
console error, no request leaves data:/file:), the Markdown twin, escaping, and one-line
errors. One small twin sweep (the session's) and one browser launch for the module."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import (
    MIXED_FLEET,
    SMALL_EXACT,
    TINY_EXACT,
    figures_drawn_only,
    made_once,
    pipe_output,
    replace_block,
    unsaved_figure,
)
from hypothesis import given
from hypothesis import strategies as st

from dvfs.analysis.targets import Target
from dvfs.cli import cli
from dvfs.report.document import ReportOptions, build_document, figure_caption
from dvfs.report.html import render_html
from dvfs.report.markdown import md_escape, render_markdown
from dvfs.report.model import Code, Document, Facts, Figure, Finding, Paragraph, Section, Table
from tests.bad_inputs import failing_writes
from tests.cubes import make_cube, one_usable_stock_repeat_cube

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The smallest valid PNG (1x1), for pages built by hand.
PIXEL = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201e2a8b4a50000000049454e44ae426082"
)
SECTIONS = [
    "What was measured",
    "Headroom",
    "Speculation vs no speculation",
    "Findings",
    "Recommended caps",
]


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def html_report(small_sweep: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML report of `small_sweep`, written once per session (`made_once`: the xdist
    workers share it), read-only. Written two folders deeper than any that exists, which the
    report makes as `dvfs plot` makes its own (test_the_output_folder_is_made_...)."""

    def make(folder: Path) -> None:
        out = folder / "new" / "deeper" / "report.html"
        assert not out.parent.parent.exists()
        result = run("report", str(small_sweep), "-o", str(out), "--slack", "5%")
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == f"wrote {out}"

    return made_once(tmp_path_factory, "report-html", make) / "new" / "deeper" / "report.html"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            f"headless Chromium is not installed at {CHROMIUM}: apt-get install -y chromium"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def open_in(browser: Any, page_file: Path, screenshot: Path | None = None) -> dict[str, Any]:
    """Load a page offline: what it showed, its images, its console errors, and every request
    that would have left data:/file: (aborted, never sent)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    remote: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def route(r: Any) -> None:
        if r.request.url.startswith(("data:", "file:")):
            r.continue_()
        else:
            remote.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(page_file.as_uri(), wait_until="load")
    seen = {
        "title": page.title(),
        "images": page.eval_on_selector_all(
            "img", "els => els.map(e => [e.complete, e.naturalWidth, e.src.slice(0, 22)])"
        ),
        "headroom_rows": page.locator("#headroom table tbody tr").count(),
        "headings": page.eval_on_selector_all("h2", "els => els.map(e => e.textContent)"),
        "errors": errors,
        "remote": remote,
    }
    if screenshot is not None:
        page.screenshot(path=str(screenshot), full_page=True)
    page.close()
    return seen


def test_the_report_opens_in_headless_chromium(
    browser: Any, html_report: Path, tmp_path: Path
) -> None:
    shot = tmp_path / "report.png"
    seen = open_in(browser, html_report, shot)
    assert seen["title"] == "DVFS report: small on NVIDIA H100 80GB HBM3 (twin)"
    assert seen["headings"] == SECTIONS
    assert seen["headroom_rows"] == 8  # 2 batches x 2 drafters x 2 corpora
    assert len(seen["images"]) >= 5
    for complete, width, src in seen["images"]:
        assert complete and width > 0 and src.startswith("data:image/png;base64")
    assert seen["errors"] == []
    assert seen["remote"] == []
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 50_000


def test_the_browser_check_catches_a_remote_or_broken_image(browser: Any, tmp_path: Path) -> None:
    """The checks above can fail: a page that fetches over the network, or whose image is
    broken, is caught."""
    page_file = tmp_path / "bad.html"
    page_file.write_text(
        '<!DOCTYPE html><title>t</title><img src="http://example.invalid/a.png">'
        '<img src="data:image/png;base64,AAAA">',
        encoding="utf-8",
    )
    seen = open_in(browser, page_file)
    assert seen["remote"] == ["http://example.invalid/a.png"]
    assert [width for _, width, _ in seen["images"]] == [0, 0]


class _Audit(HTMLParser):
    """Every tag and every URL-valued attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k in ("src", "href", "action", "srcset")]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def audit(page: str) -> _Audit:
    parser = _Audit()
    parser.feed(page)
    return parser


def test_the_html_is_one_self_contained_file(html_report: Path) -> None:
    page = html_report.read_text(encoding="utf-8")
    found = audit(page)
    assert "script" not in found.tags and "iframe" not in found.tags
    assert all(u.startswith(("data:", "#")) for u in found.urls), found.urls
    assert "default-src 'none'; img-src data:" in page  # the browser may fetch nothing else
    assert not re.search(r"url\(|@import", page.split("<body>")[0])
    # What was measured: engine, resolved arguments, corpora and data quality are stated.
    text = " ".join(found.text)
    for fact in ("dvfs-twin 0.1.0", "speculative_num_steps=3", "content hash", "Invalid"):
        assert fact in text
    assert "Confidence: 95%, one-sided." in text


def test_markdown_report_links_its_figures(small_sweep: Path, tmp_path: Path) -> None:
    markdown_it = pytest.importorskip("markdown_it")
    out = tmp_path / "team report.md"  # the .md suffix picks the format; a space in the name
    result = run("report", str(small_sweep), "-o", str(out), "--slo", "tpot_p50<=1ms")
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    tokens = markdown_it.MarkdownIt("commonmark").enable("table").parse(text)
    headings = [
        tokens[i + 1].content
        for i, t in enumerate(tokens)
        if t.type == "heading_open" and t.tag == "h2"
    ]
    assert headings == SECTIONS
    assert sum(t.type == "table_open" for t in tokens) >= 5
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) >= 5
    for link in images:
        assert link.startswith("team%20report_figures/")
        assert (tmp_path / link.replace("%20", " ")).read_bytes().startswith(b"\x89PNG")
    # An SLO no setting meets: every group infeasible, no cap recommended, said in words.
    assert "0 of 8" in text and "none feasible" in text
    assert "no cap: none feasible on " in text and "raise the --slo limit" in text
    assert "| cap |" not in text


#: The first bytes of every PNG file.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def unrendered_png(fig: object, out_dir: Path, name: str, fmt: str) -> Path:
    """`unsaved_figure`, a PNG's signature in it when the figure is a PNG: for a test of where
    a report's figures end up, not of their pixels (tests/test_plots.py's, and `html_report`'s,
    are drawn)."""
    path = unsaved_figure(fig, out_dir, name, fmt)
    if fmt == "png":
        path.write_bytes(PNG_SIGNATURE)
    return path


def test_a_markdown_page_that_cannot_be_written_leaves_no_figures(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figures' folder was written before the page: a page whose write failed (here an
    immutable report.md, EPERM even for root; a full disk alike) left report_figures/ full
    beside it. Nothing new is left now, the old page included; written, the page and its
    figures are there as before."""
    import dvfs.plots

    monkeypatch.setattr(dvfs.plots, "save", unrendered_png)
    out = tmp_path / "report.md"
    out.write_text("the old page\n")
    replace = os.replace

    def refused(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst) == str(out):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(dst))
        replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refused)
    result = run("report", str(small_sweep), "-o", str(out))
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: cannot use {out}: operation not permitted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
    assert out.read_text() == "the old page\n"
    monkeypatch.setattr(os, "replace", replace)
    assert run("report", str(small_sweep), "-o", str(out)).exit_code == 0
    figures = sorted((tmp_path / "report_figures").iterdir())
    assert figures and all(f.read_bytes().startswith(b"\x89PNG") for f in figures)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "report_figures"]


def test_a_markdown_figure_that_cannot_be_written_leaves_the_old_page(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figures were staged in a hidden folder beside the page and moved into their own
    only after the page was written: a figures' folder that could not take them (a file where
    it should be; a link to a folder on another disk, where no rename from beside the page
    reaches) failed after the new page had replaced the old one, its figures missing, exit 1.
    The file in the way is named with the old page kept and nothing new; the linked folder
    gets its figures, as before the staging."""
    import dvfs.plots

    monkeypatch.setattr(dvfs.plots, "save", unrendered_png)
    out = tmp_path / "report.md"
    out.write_text("the old page\n")
    (tmp_path / "report_figures").write_text("not a folder\n")
    result = run("report", str(small_sweep), "-o", str(out))
    assert result.exit_code == 1, result.output
    assert out.read_text() == "the old page\n"
    assert result.stderr.startswith(f"Error: cannot create {tmp_path / 'report_figures'}:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "report_figures"]

    other_disk = tmp_path / "other-disk"
    other_disk.mkdir()
    page = tmp_path / "linked" / "report.md"
    page.parent.mkdir()
    (page.parent / "report_figures").symlink_to(other_disk)
    replace = os.replace

    def across_disks(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        folders = (Path(os.path.realpath(p)).parent for p in (src, dst))
        if len({other_disk in (f, *f.parents) for f in folders}) == 2:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fspath(src), os.fspath(dst))
        replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", across_disks)
    result = run("report", str(small_sweep), "-o", str(page))
    assert result.exit_code == 0, result.output
    figures = sorted(other_disk.iterdir())
    assert figures and all(f.read_bytes().startswith(b"\x89PNG") for f in figures)
    assert sorted(p.name for p in page.parent.iterdir()) == ["report.md", "report_figures"]


@pytest.mark.parametrize(
    "args", [("--knob", "power_limit", "--slack", "5%", "--confidence", "0.9"), ()]
)
@pytest.mark.parametrize("command", ["report", "plot", "ds.dvfs.plot"])
def test_the_figures_mark_the_settings_the_reports_table_chose(
    small_sweep: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    args: tuple[str, ...],
) -> None:
    """`--knob power_limit` keeps the clock at stock: the report's table chooses 1980 MHz and
    saves nothing on this cube, and its headroom map says the same of every cell, and in its
    title which knob moved (it was drawn for both knobs, naming 1500 MHz and 16-19% savings
    the table had ruled out). The confidence is the report's too. `dvfs plot` takes the same
    --knob and --confidence (it had neither) and marks what `dvfs headroom` chose for them.
    With no option given, the same: `dvfs plot` defaulted --slack to 5% where `dvfs headroom`
    and `dvfs report` default to 0%, so a plain `dvfs plot` marked savings a plain table ruled
    out."""
    import json

    import dvfs.plots

    drawn: dict[str, Any] = {}

    def keep(fig: Any, out_dir: Path, name: str, fmt: str) -> Path:
        if name == "headroom":  # each cell's text at (batch, drafter) in its corpus's panel
            drawn["title"] = fig.get_suptitle()
            drawn["cells"] = [
                (ax.get_title(), *(round(v) for v in t.get_position()), t.get_text())
                for ax in fig.axes
                for t in ax.texts
            ]
        return unsaved_figure(fig, out_dir, name, fmt)  # what it drew, not its pixels

    monkeypatch.setattr(dvfs.plots, "save", keep)
    figures_drawn_only(monkeypatch, "draw_headroom")  # the map alone is read
    if command == "ds.dvfs.plot":  # the Python API takes the options as keywords
        import dvfs.accessor  # noqa: F401  (registers ds.dvfs)
        from dvfs.cube import open_analysable

        options = dict(zip(args[::2], args[1::2], strict=True))
        open_analysable(small_sweep).dvfs.plot(
            tmp_path,
            knob=options.get("--knob", "both"),
            slack=options.get("--slack"),
            confidence=float(options.get("--confidence", 0.95)),
        )
    else:
        out = (
            ["-o", str(tmp_path / "report.md")] if command == "report" else ["--out", str(tmp_path)]
        )
        result = run(command, str(small_sweep), *out, *args)
        assert result.exit_code == 0, result.output
    room = run("headroom", str(small_sweep), *args, "--json")
    assert room.exit_code == 0, room.output
    rows = {(r["corpus"], r["drafter"], r["batch"]): r for r in json.loads(room.stdout)["rows"]}
    drafters = list(dict.fromkeys(k[1] for k in rows))  # the cube's order, as the map's rows
    batches = sorted({k[2] for k in rows})
    assert ("; power limit only" in drawn["title"]) == ("power_limit" in args)
    assert len(drawn["cells"]) == len(rows) == 8
    for title, j, i, text in drawn["cells"]:
        row = rows[(title.removeprefix("corpus "), drafters[i], batches[j])]
        assert row["feasible"], row
        clock = row["chosen"]["sm_clock_mhz"]
        assert text.split("\n")[:2] == [f"{row['saving'] * 100:.0f}%", f"{clock} MHz"]


def _legend_colours(fig: Any) -> dict[str, str]:
    """Each legend label's colour (the drafters' entries)."""
    from matplotlib.colors import to_hex

    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    return {
        h.get_label(): to_hex(h.get_color())
        for legend in legends
        for h in legend.legend_handles
        if hasattr(h, "get_color")
    }


def test_a_report_on_one_drafter_colours_it_as_dvfs_plot_does(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--drafter eagle3` cut the cube to eagle3 and the baseline, in that order, and colours
    went by place: eagle3 took none's blue and none eagle3's orange in every figure of the
    report, against `dvfs plot`'s. Each drafter keeps its colour."""
    import dvfs.plots
    from dvfs.cube import open_analysable
    from dvfs.plots import draw_energy_vs_batch

    drawn: dict[str, dict[str, str]] = {}
    save = dvfs.plots.save

    compared = ("energy_vs_batch", "energy_vs_clock_code", "pareto_code")

    def keep(fig: Any, out_dir: Path, name: str, fmt: str) -> Path:
        if name in compared:
            drawn[name] = _legend_colours(fig)
        return (save if name in compared else unsaved_figure)(fig, out_dir, name, fmt)

    monkeypatch.setattr(dvfs.plots, "save", keep)
    # the figures compared alone are drawn
    figures_drawn_only(monkeypatch, "draw_energy_vs_batch", "draw_energy_vs_clock", "draw_pareto")
    out = tmp_path / "report.md"
    result = run("report", str(small_sweep), "-o", str(out), "--drafter", "eagle3")
    assert result.exit_code == 0, result.output
    fig = draw_energy_vs_batch(open_analysable(small_sweep))
    assert fig is not None
    plot = _legend_colours(fig)
    assert plot["none"] != plot["eagle3"]
    for name in compared:
        mine = {d: drawn[name][d] for d in ("none", "eagle3")}
        assert mine == {d: plot[d] for d in ("none", "eagle3")}, name


@pytest.mark.parametrize("target", [[], ["--vs-baseline"]])
def test_a_report_on_one_drafter_maps_the_headroom_of_that_drafter_only(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: list[str]
) -> None:
    """`--drafter eagle3` keeps the baseline in the cube the figures are drawn from (the
    target of --vs-baseline is its latency, and the curves draw eagle3 against it), and the
    headroom map drew the baseline's row too, which the report's table leaves out. The map's
    rows are the table's: eagle3's alone, a cell per corpus and batch."""
    import dvfs.plots
    from dvfs.cube import open_analysable

    rows: dict[str, list[str]] = {}

    def keep(fig: Any, out_dir: Path, name: str, fmt: str) -> Path:
        if name == "headroom":  # each corpus's panel's rows (labelled on a grid row's first)
            panels = [ax for ax in fig.axes if ax.get_title().startswith("corpus ")]
            rows["drafters"] = [t.get_text() for ax in panels for t in ax.get_yticklabels()]
            rows["cells"] = [t.get_text() for ax in panels for t in ax.texts]
        return unsaved_figure(fig, out_dir, name, fmt)  # what it drew, not its pixels

    monkeypatch.setattr(dvfs.plots, "save", keep)
    figures_drawn_only(monkeypatch, "draw_headroom")  # the map alone is read
    args = ("--drafter", "eagle3", *target)
    result = run("report", str(small_sweep), "-o", str(tmp_path / "one.md"), *args)
    assert result.exit_code == 0, result.output
    assert [d for d in rows["drafters"] if d] == ["eagle3"]
    cube = open_analysable(small_sweep)
    assert len(rows["cells"]) == cube.sizes["corpus"] * cube.sizes["batch"]
    result = run("report", str(small_sweep), "-o", str(tmp_path / "all.md"), *target)
    assert result.exit_code == 0, result.output
    assert sorted(d for d in rows["drafters"] if d) == ["eagle3", "none"]  # all: both rows


def hostile_document() -> Document:
    bad = "<script>alert(1)</script> *x* _y_ a|b [l](http://e.x) &lt; `c` # h"
    return Document(
        title=bad,
        subtitle=bad,
        sections=(
            Section(
                bad,
                "s",
                (
                    Paragraph(bad, tone="warning"),
                    Facts(((bad, bad),)),
                    Table(bad, (bad, "n"), ((bad, "1.5"),)),
                    Code(bad, bad + "\n```\nmore"),
                    Finding(bad, (bad,), (Figure("x/" + bad + ".png", bad, PIXEL, "image/png"),)),
                ),
            ),
        ),
    )


def test_html_escapes_every_text() -> None:
    page = render_html(hostile_document())
    found = audit(page)
    assert "script" not in found.tags
    assert all(u.startswith(("data:", "#")) for u in found.urls)
    assert page.count("&lt;script&gt;") >= 9
    assert "<script>" not in page


def test_markdown_escapes_every_text() -> None:
    markdown_it = pytest.importorskip("markdown_it")
    text, files = render_markdown(hostile_document(), "figs")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    assert "<script>" not in html and 'href="http' not in html
    assert "<em>x</em>" not in html and "<em>y</em>" not in html
    assert html.count("<code>") == 1  # the fenced block, not the backticks in the text
    assert html.count("<em>") == 1  # the figure's caption, set in italics on purpose
    assert html.count("<td>") == 2  # the | inside the cell did not split it
    assert "```\nmore" in text and "````" in text  # the fence outlasts the backticks inside
    assert len(files) == 1
    assert all(re.fullmatch(r"figs/01_[A-Za-z0-9_.-]+\.png", name) for name in files), files


# Cs (surrogates) left out: every character is then valid UTF-8.
@given(st.text(alphabet=st.characters(exclude_categories=("Cs", "Cc"))))
def test_md_escape_round_trips_through_a_markdown_parser(text: str) -> None:
    """Whatever the text, a CommonMark parser reads it back as one paragraph of exactly that
    text (spaces folded), even at the start of a line: no heading, list, rule, code or link."""
    markdown_it = pytest.importorskip("markdown_it")
    folded = " ".join(text.split())
    tokens = markdown_it.MarkdownIt("commonmark").parse(md_escape(text))
    if not folded:
        assert tokens == []
        return
    assert [t.type for t in tokens] == ["paragraph_open", "inline", "paragraph_close"]
    children = tokens[1].children or []
    assert all(t.type == "text" for t in children), children
    assert "".join(t.content for t in children) == folded


def test_figure_captions_come_from_file_names() -> None:
    assert figure_caption("pareto_code.png").endswith(", corpus code")
    # a UUID already says GPU; an index or a model's name does not
    assert figure_caption("GPU-abc/headroom.png").startswith("GPU-abc: Energy saved")
    assert figure_caption("h100-sxm/headroom.png").startswith("GPU h100-sxm: Energy saved")
    assert figure_caption("new_kind.svg") == "new kind"


def test_document_from_a_hand_built_cube_says_what_it_cannot_know() -> None:
    """One repeat: no confidence claimed; no provenance: "not recorded"; stock chosen: no cap."""
    cube = make_cube(
        clocks=[1000, 2000],
        drafters=["none"],
        latency=lambda c, *a: 10.0 * 2000 / c,
        energy=lambda c, *a: c / 1000,
    )
    doc = build_document(cube, ReportOptions(Target("preserve")), [], generated="now")
    measured, headroom, speculation, findings, caps = doc.sections
    facts = dict(measured.blocks[0].pairs)  # type: ignore[union-attr]
    assert facts["Driver"] == "not recorded" and facts["Engine"] == "not recorded"
    confidence = headroom.blocks[1]
    assert isinstance(confidence, Paragraph) and confidence.text.startswith("Confidence: none")
    assert "nothing to compare" in speculation.blocks[0].text  # type: ignore[union-attr]
    assert "No figures" in findings.blocks[-1].text  # type: ignore[union-attr]
    table = caps.blocks[1]
    assert isinstance(table, Table) and table.rows[0][-1] == "stock: nothing to cap"


def test_a_target_no_setting_meets_keeps_the_confidence_of_a_cube_with_repeats() -> None:
    """With repeats, an SLO that no setting meets leaves every row without an answer (and so
    without repeats of its own): the report still states the confidence of the bound that
    judged them, not "none" with advice to measure the repeats the cube has."""
    from dvfs.analysis.targets import parse_slo

    cube = make_cube(clocks=[1000, 2000], repeats=3, latency=lambda c, *a: 10.0 * 2000 / c)
    options = ReportOptions(parse_slo("tpot_p50<=1ms"))
    confidence = build_document(cube, options, [], generated="now").sections[1].blocks[1]
    assert isinstance(confidence, Paragraph)
    assert confidence.text.startswith("Confidence: 95%, one-sided."), confidence.text
    one = make_cube(clocks=[1000, 2000], latency=lambda c, *a: 10.0 * 2000 / c)
    said = build_document(one, options, [], generated="now").sections[1].blocks[1]
    assert isinstance(said, Paragraph) and said.text.startswith("Confidence: none. One repeat")
    # a level is said with its digits: 99.9%, not rounded to a certain-looking 100%
    sure = ReportOptions(parse_slo("tpot_p50<=1ms"), confidence=0.999)
    level = build_document(cube, sure, [], generated="now").sections[1].blocks[1]
    assert isinstance(level, Paragraph)
    assert level.text.startswith("Confidence: 99.9%, one-sided."), level.text
    assert "one-sided 99.9% Student-t" in level.text, level.text


def _a_within_target_from_1000_b_from_1500(
    clock: int, limit: float, batch: int, drafter: str, corpus: str, r: int
) -> float:
    """TPOT of a cube whose corpus a keeps its latency down to 1000 MHz, corpus b to 1500."""
    floor = 1000 if corpus == "a" else 1500
    return 10.0 if clock >= floor else 20.0


def test_the_caps_table_recommends_no_cap_whose_saving_is_unknown() -> None:
    """With --slo, stock measured in three repeats of which one is usable has no energy (it
    needs two), yet 1500 MHz meets the limit: the headroom table and the findings say its
    saving is unknown, and the caps table below them recommended "cap" at 1500 MHz, a cap
    that may spend more than stock. It says no cap, why and what to do, as `dvfs cap plan`."""
    from dvfs.analysis.targets import parse_slo

    cube = one_usable_stock_repeat_cube()
    cube.attrs["gpu_uuids"] = "GPU-1234"
    options = ReportOptions(parse_slo("tpot_p50<=16ms"))
    caps = build_document(cube, options, [], generated="now").sections[-1].blocks[1]
    assert isinstance(caps, Table)
    ((*lead, decision),) = caps.rows
    assert lead == ["1", "none", "GPU-1234", "stock", "stock"], caps.rows
    assert decision.startswith("no cap: saving unknown for corpus code: stock has too few"), (
        decision
    )
    # every stock repeat usable: the saving is known, and the cap recommended
    cube["valid"][...] = 1.0
    caps = build_document(cube, options, [], generated="now").sections[-1].blocks[1]
    assert isinstance(caps, Table)
    assert caps.rows == (("1", "none", "GPU-1234", "1500 MHz", "stock", "cap"),)


def test_document_recommends_the_worst_case_cap_over_corpora() -> None:
    """Corpus a tolerates 1000 MHz, corpus b only 1500: the cap is 1500 MHz."""

    cube = make_cube(
        clocks=[1000, 1500, 2000],
        corpora=["a", "b"],
        repeats=2,
        latency=_a_within_target_from_1000_b_from_1500,
        energy=lambda c, *a: c / 1000 + 0.01 * a[-1],
    )
    cube.attrs["gpu_uuids"] = "GPU-1234"
    doc = build_document(cube, ReportOptions(Target("preserve")), [], generated="now")
    caps = doc.sections[-1].blocks[1]
    assert isinstance(caps, Table)
    assert caps.rows == (("1", "none", "GPU-1234", "1500 MHz", "stock", "cap"),)
    confidence = doc.sections[1].blocks[1]
    assert "Confidence: 95%, one-sided" in confidence.text  # type: ignore[union-attr]
    assert not math.isnan(float(doc.sections[1].blocks[2].rows[0][5]))  # type: ignore[union-attr]


def test_findings_read_a_latency_of_seconds_as_plain_milliseconds() -> None:
    """A TTFT target past a second: the findings' sentence reads 1333 ms against a 1400 ms
    target, as the tables do, not 1.33e+03 (make_cube's TTFT is ten times its TPOT)."""
    cube = make_cube(
        clocks=[1500, 2000],
        latency=lambda c, *a: 100.0 * 2000 / c,
        energy=lambda c, *a: c / 1000,
    )
    doc = build_document(
        cube, ReportOptions(Target("preserve", metric="ttft", slack=0.4)), [], generated="now"
    )
    finding = doc.sections[3].blocks[0]
    assert isinstance(finding, Finding)
    largest = next(d for d in finding.details if d.startswith("Largest saving"))
    assert "latency 1333 ms against a 1400 ms target" in largest, largest


def test_the_largest_saving_finding_shows_energies_that_give_its_saving() -> None:
    """Adaptive repeats: stock took five, 1500 MHz three; repeats 3 and 4's prompts cost 1.3x.
    The finding read "20.0% ... (1.12 -> 0.8 J per token": stock over all five beside a
    saving over the three measured at both. Its stock energy is over those three now, and
    it says so, with stock's energy over all of them."""
    cost = [1.0, 1.0, 1.0, 1.3, 1.3]
    cube = make_cube(
        clocks=[1500, 2000],
        repeats=5,
        latency=lambda c, *_: 10.0,
        energy=lambda c, p, b, d, k, r: (
            math.nan if c == 1500 and r >= 3 else (0.8 if c == 1500 else 1.0) * cost[r]
        ),
    )
    doc = build_document(cube, ReportOptions(Target("preserve", slack=0.01)), [], generated="now")
    finding = doc.sections[3].blocks[0]
    assert isinstance(finding, Finding)
    largest = next(d for d in finding.details if d.startswith("Largest saving"))
    assert largest.startswith("Largest saving: 20.0%"), largest
    assert "(1 -> 0.8 J per token, over the 3 repeat(s) measured at both; 1.12 J" in largest


def test_the_speculation_finding_says_too_slow_only_where_no_setting_was_fast_enough() -> None:
    """EAGLE-3 at 0.4x none's latency, but none's stock cell invalid at batch 1 (nothing to
    compare there): the finding never says no drafter meets none's latency where the rows
    have no data, and says it where EAGLE-3 is slower than none at every setting."""

    def finding(eagle_ms: float, none_stock_invalid_at: tuple[int, ...]) -> str:
        cube = make_cube(
            clocks=[1000, 2000],
            batches=[1, 8],
            drafters=["none", "eagle3"],
            latency=lambda c, p, b, d, *a: (eagle_ms if d == "eagle3" else 10.0) * 2000 / c,
            energy=lambda c, *a: c / 1000,
            valid=lambda c, p, b, d, *a: (
                not (d == "none" and c == 2000 and b in none_stock_invalid_at)
            ),
        )
        doc = build_document(cube, ReportOptions(Target("preserve")), [], generated="now")
        speculation = doc.sections[3].blocks[2]
        assert isinstance(speculation, Finding)
        return speculation.headline

    assert "No drafter" not in finding(4.0, ())  # a ratio where both are valid
    no_data = finding(4.0, (1, 8))
    assert "meets" not in no_data and "could be compared" in no_data, no_data
    assert (
        finding(12.0, ()) == "No drafter meets 'none''s latency at stock at any measured setting."
    )
    mixed = finding(12.0, (1,))
    assert "in 1 of 2 rows" in mixed and "the other 1 have no valid cells" in mixed, mixed


def test_the_caps_command_of_a_report_on_some_corpora_plans_its_caps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report on corpus a alone caps at 1000 MHz (corpus b needs 1500): the commands it
    prints write that cap, not one over every corpus in the cube."""
    from dvfs.caps.files import load_caps
    from dvfs.cube import write_cube

    cube = make_cube(
        clocks=[1000, 1500, 2000],
        corpora=["a", "b"],
        latency=_a_within_target_from_1000_b_from_1500,
        energy=lambda c, *a: c / 1000,
    )
    cube.attrs["gpu_uuids"] = "GPU-1234"
    options = ReportOptions(Target("preserve"), corpus=("a",))
    doc = build_document(cube, options, [], generated="now")
    caps, command = doc.sections[-1].blocks[1:3]
    assert isinstance(caps, Table) and isinstance(command, Code)
    assert caps.rows[0][:5] == ("1", "none", "GPU-1234", "1000 MHz", "stock")
    write_cube(cube, tmp_path / "cube.nc")
    monkeypatch.chdir(tmp_path)
    for line in command.text.splitlines():
        args = shlex.split(line.replace("CUBE", "cube.nc").replace(" B ", " 1 "))
        result = run(*[a.replace("D", "none") if a == "D" else a for a in args[1:]])
        assert result.exit_code == 0, result.output
    assert [c.sm_clock_max_mhz for c in load_caps(tmp_path / "caps.toml").caps] == [1000]


def test_a_merged_cube_gets_caps_per_gpu_against_each_gpus_own_stock() -> None:
    """Latency holds down to 1500 MHz on both GPUs; the H100's stock is 2000 MHz (cap it at
    1500), the H200's is 1500 MHz (nothing to cap). Twin GPUs are capped by model name."""
    from dvfs.cube import merge_cubes

    cubes = []
    for i, (name, stock) in enumerate([("NVIDIA H100 (twin)", 2000), ("NVIDIA H200 (twin)", 1500)]):
        cube = make_cube(
            clocks=[1000, 1500, 2000],
            repeats=2,
            latency=lambda c, *a: 10.0 if c >= 1500 else 20.0,
            energy=lambda c, *a: c / 1000 + 0.01 * a[-1],
            stock_clock=stock,
        )
        cube.attrs.update(
            gpu_name=name,
            gpu_uuids=f"GPU-{i}",
            gpu_backend="twin",
            campaign='{"name": "x"}',
            campaign_hash="0123abcd",
        )
        cubes.append(cube)
    doc = build_document(merge_cubes(cubes), ReportOptions(Target("preserve")), [], generated="")
    assert doc.title.endswith("on NVIDIA H100 (twin), NVIDIA H200 (twin)")
    caps = doc.sections[-1].blocks[1]
    assert isinstance(caps, Table)
    assert caps.rows == (
        ("1", "none", "every NVIDIA H100 (twin)", "1500 MHz", "stock", "cap"),
        ("1", "none", "every NVIDIA H200 (twin)", "stock", "stock", "stock: nothing to cap"),
    )
    merged_from = doc.sections[0].blocks[1]
    assert isinstance(merged_from, Table) and merged_from.title == "Merged from"
    assert [r[:2] for r in merged_from.rows] == [
        ("GPU-0", "NVIDIA H100 (twin)"),
        ("GPU-1", "NVIDIA H200 (twin)"),
    ]
    # the campaign line gives the hash the table shows, not "not recorded"
    assert all(r[3] == "0123abcd" for r in merged_from.rows)
    facts = doc.sections[0].blocks[0]
    assert isinstance(facts, Facts)
    assert dict(facts.pairs)["Campaign"].endswith("(hash 0123abcd)"), facts.pairs


def _real_cube(name: str, uuids: list[str]) -> Any:
    """A real (not twin) cube measured on `uuids` at once: batch 1 holds its latency down to
    1500 MHz (cap it), batch 8 only at stock, 2000 MHz (nothing to cap)."""
    cube = make_cube(
        clocks=[1000, 1500, 2000],
        batches=[1, 8],
        repeats=2,
        latency=lambda c, p, b, *a: 10.0 if c >= (1500 if b == 1 else 2000) else 20.0,
        energy=lambda c, *a: c / 1000 + 0.01 * a[-1],
        stock_clock=2000,
    )
    cube.attrs.update(
        gpu_name=name,
        gpu_uuids=",".join(uuids),
        gpu_backend="nvml",
        campaign='{"name": "x"}',
        campaign_hash="0123abcd",
    )
    return cube


def test_every_caps_row_of_a_real_multi_gpu_cube_names_its_gpus_as_cap_plan_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stock row of a cube measured on two GPUs said `-`, and of merged shards each on
    two GPUs (a label of two UUIDs) only the first GPU, where the capped rows list every GPU:
    each row now names each GPU, and the capped ones are the GPUs `dvfs cap plan` caps."""
    from dvfs.caps.files import load_caps
    from dvfs.cube import merge_cubes, write_cube

    uuids = [f"GPU-{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]
    one = _real_cube("NVIDIA H100 80GB HBM3", uuids[:2])
    merged = merge_cubes([one, _real_cube("NVIDIA H200", uuids[2:])])
    monkeypatch.chdir(tmp_path)
    for cube, gpus in ((one, uuids[:2]), (merged, uuids)):
        doc = build_document(cube, ReportOptions(Target("preserve")), [], generated="")
        caps = doc.sections[-1].blocks[1]
        assert isinstance(caps, Table)
        for batch, decision in (("1", "cap"), ("8", "stock: nothing to cap")):
            rows = [r for r in caps.rows if r[0] == batch]
            assert sorted(r[2] for r in rows) == [u[:16] for u in gpus], caps.rows
            assert {r[5] for r in rows} == {decision}, caps.rows
        write_cube(cube, tmp_path / "cube.nc")
        for args in (
            ["headroom", "cube.nc", "--preserve", "--json", "-o", "room.json"],
            ["cap", "plan", "room.json", "--batch", "1", "--drafter", "none", "-o", "caps.toml"],
        ):
            result = run(*args)
            assert result.exit_code == 0, result.output
        planned = {(c.uuid or "")[:16]: c for c in load_caps(tmp_path / "caps.toml").caps}
        shown = {r[2]: r for r in caps.rows if r[0] == "1"}
        assert sorted(planned) == sorted(shown)
        assert all(shown[u][3] == f"{c.sm_clock_max_mhz} MHz" for u, c in planned.items())
        assert all(c.power_limit_w is None and shown[u][4] == "stock" for u, c in planned.items())


def test_a_merged_cube_of_shards_on_several_gpus_names_every_gpu_of_a_row(tmp_path: Path) -> None:
    """Merged shards of one model on two GPUs have a label of both UUIDs: the report's tables
    and its reference named only the first GPU ("GPU-aaaaaaaa"); they name both, as `dvfs
    cube info` does."""
    from dvfs.cube import merge_cubes, write_cube

    uuids = [f"GPU-{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]
    cubes = [_real_cube(n, uuids[i : i + 2]) for n, i in (("NVIDIA H100", 0), ("NVIDIA H200", 2))]
    for cube in cubes:
        cube.attrs["stock_sm_clock_mhz"] = 2000 if cube.attrs["gpu_name"] == "NVIDIA H100" else 1500
    merged = merge_cubes(cubes)
    pairs = ["GPU-aaaaaaaa,GPU-bbbbbbbb", "GPU-cccccccc,GPU-dddddddd"]
    doc = build_document(merged, ReportOptions(Target("preserve")), [], generated="")
    tables = [b for s in doc.sections for b in s.blocks if isinstance(b, Table)]
    by_gpu = [t for t in tables if t.header[0] == "gpu"]
    assert by_gpu, [t.header for t in tables]
    assert all({r[0] for r in t.rows} == set(pairs) for t in by_gpu), [t.rows for t in by_gpu]
    reference = dict(doc.sections[0].blocks[0].pairs)["Reference"]  # type: ignore[union-attr]
    assert all(p in reference for p in pairs), reference
    write_cube(merged, tmp_path / "cube.nc")
    info = run("cube", "info", str(tmp_path / "cube.nc"))
    assert info.exit_code == 0, info.output
    assert " ".join(reference.split()) in " ".join(info.output.split()), info.output
    # 4 GPUs, as the GPU UUIDs and sessions say, not the 2 labels
    gpu = dict(doc.sections[0].blocks[0].pairs)["GPU"]  # type: ignore[union-attr]
    assert gpu == "merged cube of 4 GPUs: NVIDIA H100, NVIDIA H200", gpu
    assert gpu in " ".join(info.output.split()), info.output


def test_the_report_on_a_cube_merged_across_gpus_counts_its_sessions_as_cube_info() -> None:
    """A merged cube keeps each source's sessions in `merged_from`: `cube info` said 5 runs of
    the sweep, the report's facts said no session count at all."""
    from dvfs.cube import merge_cubes
    from dvfs.cube.info import info_text

    uuids = [f"GPU-{c * 8}-1111-2222-3333-444444444444" for c in "abcd"]
    cubes = [_real_cube(n, uuids[i : i + 2]) for n, i in (("NVIDIA H100", 0), ("NVIDIA H200", 2))]
    for cube, sessions in zip(cubes, (2, 3), strict=True):
        cube.attrs["sessions"] = sessions
    merged = merge_cubes(cubes)
    assert info_text(merged)["sessions"] == 5
    doc = build_document(merged, ReportOptions(Target("preserve")), [], generated="")
    built = dict(doc.sections[0].blocks[0].pairs)["Cube built"]  # type: ignore[union-attr]
    assert built.endswith(" from 5 measurement session(s)"), built


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["NOCUBE", "-o", "{tmp}/r.html"], 1, "no cube at"),
        (["{tmp}/bad.nc", "-o", "{tmp}/r.html"], 1, "is not a readable netCDF cube"),
        (["{cube}", "-o", "{tmp}/bad.nc/r.html"], 1, "a part of the path is a file"),
        (["{cube}", "-o", "{tmp}"], 2, "is a directory"),
        (["{cube}", "-o", "{tmp}/r.html", "--drafter", "nope"], 2, "'--drafter'"),
        (["{cube}", "-o", "{tmp}/r.html", "--vs-baseline", "--baseline", "x"], 2, "'--baseline'"),
        (["{cube}", "-o", "{tmp}/r.html", "--slo", "tpot<=5"], 2, "cannot read SLO"),
        (["{cube}", "-o", "{tmp}/r.html", "--slo", "tpot_p50<=5ms", "--preserve"], 2, "one of"),
        (["{cube}", "-o", "{tmp}/r.html", "--slack", "nan"], 2, "finite"),
        (["{cube}", "-o", "{tmp}/r.html", "--confidence", "1"], 2, "not a confidence"),
    ],
)
def test_user_errors_are_one_line(
    small_sweep: Path, tmp_path: Path, args: list[str], code: int, expected: str
) -> None:
    (tmp_path / "bad.nc").write_bytes(b"not netcdf")
    argv = [a.format(tmp=tmp_path, cube=small_sweep) for a in args]
    result = run("report", *argv)
    assert result.exit_code == code, result.output
    assert expected in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "r.html").exists()


def test_the_output_folder_is_made_as_plot_makes_its_own(html_report: Path) -> None:
    """The shared report was written into two folders that did not exist (`html_report`)."""
    assert html_report.parent.name == "deeper" and html_report.parent.parent.name == "new"
    assert html_report.read_bytes().startswith(b"<!DOCTYPE html>")


def test_an_unwritable_output_is_refused_before_any_work(small_sweep: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    with failing_writes(folder, errno.EROFS):
        result = run("report", str(small_sweep), "-o", str(folder / "r.html"))
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"Error: cannot write {folder / 'r.html'}: read-only file system; choose another --output"
    )
    assert list(folder.iterdir()) == []


@pytest.mark.slow
@pytest.mark.usefixtures("unsaved_figures")  # the stream's content, not the figures' pixels
def test_a_report_to_stdout_is_the_page_alone(small_sweep: Path) -> None:
    """`dvfs report CUBE -o /dev/stdout | gzip`: the stream holds the page and nothing else;
    the "wrote" line went to stdout after it (text after </html>, shown on the page). In this
    process, `-o` a pipe's /dev/fd path as /dev/stdout piped on is: the page alone in the pipe,
    the line on stderr (tests/test_cube_files.py runs `-o /dev/stdout` in a process of its
    own)."""
    with pipe_output() as (stream, got):
        done = run("report", str(small_sweep), "-o", stream)
    assert done.exit_code == 0, done.output
    page = b"".join(got)
    assert page.startswith(b"<!DOCTYPE html>")
    assert page.endswith(b"</html>\n"), page[-80:]
    assert done.stdout == "", done.stdout
    assert done.stderr.strip() == f"wrote {stream}"


def test_a_markdown_report_to_a_stream_is_refused_before_any_work(
    small_sweep: Path, tmp_path: Path
) -> None:
    """Markdown links its figures from a folder beside the page: beside a pipe or a device
    (`-o /dev/stdout`) that folder was made there (/dev/stdout_figures, as root)."""
    import contextlib
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader: a write would not block
    try:
        result = run("report", str(small_sweep), "-o", str(fifo), "--format", "md")
        got = b""
        with contextlib.suppress(BlockingIOError):  # no writer ever opened it
            got = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "is not a file" in lines[0] and "--format html" in lines[0], lines[0]
    assert got == b""
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_a_markdown_report_to_stdout_redirected_to_a_file_is_refused(
    small_sweep: Path, tmp_path: Path
) -> None:
    """`dvfs report CUBE --format md -o /dev/stdout > report.md`: /dev/stdout leads to a
    regular file there, which was taken for a file of /dev: the figures' folder was made as
    /dev/stdout_figures (as root; after all the work, refused elsewhere) and report.md linked
    to stdout_figures/, beside it, where no figure is."""
    import shutil
    import subprocess

    from conftest import PYTHON, subprocess_env

    stray = Path("/dev/stdout_figures")
    was_there = stray.exists()
    page = tmp_path / "report.md"
    try:
        with page.open("wb") as out:
            done = subprocess.run(
                [PYTHON, "-m", "dvfs", "report", str(small_sweep), "--format", "md"]
                + ["-o", "/dev/stdout"],
                stdout=out,
                stderr=subprocess.PIPE,
                env=subprocess_env(MPLCONFIGDIR=str(tmp_path)),
                cwd=tmp_path,
                timeout=300,
                check=False,
            )
        made = stray.exists() and not was_there
    finally:
        if stray.exists() and not was_there:
            shutil.rmtree(stray, ignore_errors=True)
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "/dev/stdout is not a file" in lines[0] and "--format html" in lines[0], lines[0]
    assert not made
    assert page.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


@given(st.floats(0.001, 999_999.0))
def test_milliseconds_read_as_plain_numbers_within_half_a_percent(ms: float) -> None:
    """A latency or target in a table is a plain number (1000, not 1e+03), close to the
    value: three significant digits below 100 ms, whole milliseconds above."""
    from dvfs.report.common import fmt_ms

    text = fmt_ms(ms)
    assert "e" not in text and abs(float(text) - ms) <= max(0.005 * ms, 0.5)
    assert fmt_ms(None) == "-"


def test_the_quality_flags_say_which_invalidate_and_what_a_warning_means(
    tmp_path: Path,
) -> None:
    """A cube with an invalidating flag (foreign_process) and a warning (idle_baseline_foreign):
    the report's table and `dvfs cube info` say which makes its cells invalid, and both explain
    the warning, whose cells the analyses still use."""
    from dvfs.cube import write_cube
    from dvfs.cube.quality import FLAG_NOTES
    from dvfs.measure.meter import Q_FOREIGN_PROCESS, Q_IDLE_BASELINE_FOREIGN
    from dvfs.report.facts import measured_section

    cube = make_cube(
        clocks=[1000, 2000],
        batches=[1, 4],
        quality=lambda c, p, b, *a: (
            Q_IDLE_BASELINE_FOREIGN | (Q_FOREIGN_PROCESS if (c, b) == (1000, 4) else 0)
        ),
        valid=lambda c, p, b, *a: (c, b) != (1000, 4),
    )
    blocks = measured_section(cube).blocks
    [table] = [b for b in blocks if isinstance(b, Table) and b.title.startswith("Quality flags")]
    assert table.header == ("flag", "cells", "effect")
    effect = {flag: (int(count), what) for flag, count, what in table.rows}
    assert effect["foreign_process"] == (1, "invalid: never chosen by an analysis")
    assert effect["idle_baseline_foreign"] == (4, "warning: the cell stays valid")
    notes = [b.text for b in blocks if isinstance(b, Paragraph)]
    assert f"idle_baseline_foreign: {FLAG_NOTES['idle_baseline_foreign']}." in notes
    # the invalid cell is said, and nothing says the opposite beside it
    assert not [n for n in notes if "every cell was measured and valid" in n], notes
    assert any(n.startswith("Data quality: 1 of 4 cells are failed") for n in notes), notes
    path = write_cube(cube, tmp_path / "cube.nc")
    said = " ".join(run("cube", "info", str(path)).stdout.split())
    assert "foreign_process x1 (invalid), idle_baseline_foreign x4;" in said, said


def test_cube_info_names_a_failed_cell_as_the_sweep_did(tmp_path: Path) -> None:
    """A failed cell in `dvfs cube info` and the report reads as the sweep's line named it,
    not as a Python dict with `None` for the stock limit."""
    import json

    from dvfs.cube import write_cube

    cube = make_cube(clocks=[1000, 2000], energy=lambda c, *a: math.nan if c == 1000 else 1.0)
    cube["cell_status"].loc[{"sm_clock": 1000}] = 2
    cell = {"drafter": "none", "repeat": 0, "sm_clock_mhz": 1000, "power_limit_w": None}
    cell |= {"batch": 1, "corpus": "code"}
    cube.attrs["failed_cells"] = json.dumps([{"cell": cell, "error": "HTTP 500"}])
    path = write_cube(cube, tmp_path / "cube.nc")
    said = " ".join(run("cube", "info", str(path)).stdout.split())
    assert "failed none/code/b1/r0 @ 1000 MHz, stock limit: HTTP 500" in said, said
    from dvfs.report.facts import measured_section

    blocks = measured_section(cube).blocks
    said = [b.text for b in blocks if isinstance(b, Paragraph)]
    assert not [s for s in said if "every cell was measured and valid" in s], said
    [table] = [b for b in blocks if isinstance(b, Table)]
    assert table.header == ("cell", "error")
    assert table.rows == (("none/code/b1/r0 @ 1000 MHz, stock limit", "HTTP 500"),)


def test_a_report_on_part_of_the_cube_says_which_part() -> None:
    """--batch, --drafter and --corpus narrow every table, finding and figure: the heading
    says so, or "0 of 1 groups" would read as the whole campaign's."""
    cube = make_cube(clocks=[1000, 2000], batches=[1, 4], drafters=["none", "eagle3"])
    options = ReportOptions(Target("preserve"), batch=(4,), drafter=("eagle3",))
    doc = build_document(cube, options, [], generated="now")
    assert "; only batch 4; drafter eagle3; generated now" in doc.subtitle, doc.subtitle
    energy = doc.sections[3].blocks[1]
    assert isinstance(energy, Finding)  # one group: its energy, not a range from it to itself
    assert (
        energy.headline
        == "At stock, energy per token is 1 J (batch 4, drafter eagle3, corpus code)."
    )
    whole = build_document(cube, ReportOptions(Target("preserve")), [], generated="now")
    assert "only" not in whole.subtitle
    # --drafter none leaves the baseline alone: eagle3 was measured, the filter left it out
    options = ReportOptions(Target("preserve"), drafter=("none",))
    alone = build_document(cube, options, [], generated="now")
    said = alone.sections[2].blocks[0].text  # type: ignore[union-attr]
    assert said.startswith("--drafter keeps only the baseline 'none'"), said
    assert "was measured" not in said, said


@pytest.mark.parametrize(
    ("measurement", "said"),
    [
        ({"mode": "in-flight"}, "in-flight, abba: each knob level a segment of one"),
        ({"mode": "in-flight", "inflight_order": "serpentine"}, "in-flight, serpentine: "),
        ({"mode": "per-level"}, "per-level"),
        ({}, "per-level"),  # a campaign from before the mode existed
    ],
)
def test_the_report_and_cube_info_say_how_the_knobs_were_stepped(
    measurement: dict[str, str], said: str, tmp_path: Path
) -> None:
    """An in-flight cube's windows are segments of one decode, not per-level rounds, which
    the measurement method's text describes: the report and `cube info` name the mode."""
    import json

    from dvfs.cube import write_cube
    from dvfs.report.facts import measured_section

    cube = make_cube(clocks=[1000, 2000])
    cube.attrs["campaign"] = json.dumps({"measurement": measurement})
    facts = dict(measured_section(cube).blocks[0].pairs)  # type: ignore[union-attr]
    assert facts["Measurement mode"].startswith(said), facts["Measurement mode"]
    info = run("cube", "info", str(write_cube(cube, tmp_path / "cube.nc")))
    shown = " ".join(info.stdout.split())
    assert (f"mode {said}" in shown) is (measurement.get("mode") == "in-flight"), shown


@pytest.mark.usefixtures("unsaved_figures")
def test_the_report_names_no_clock_the_campaign_did_not_set(shared_run, tmp_path: Path) -> None:
    """A power-limit-only campaign never locks the SM clock: the report's facts said "SM
    clocks: 1980 MHz", a clock knob never swept (the cube files the unlocked cells under the
    stock clock). They say it was not set; a clock sweep's power limit left at stock likewise;
    knobs swept are listed as before."""
    from dvfs.cube import open_cube
    from dvfs.report.facts import measured_section

    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    out = tmp_path / "report.md"
    result = run("report", str(shared_run(text, "limits") / "cube.nc"), "-o", str(out))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    said = "SM clocks:** not set: left unlocked; the cube files its cells under 1980 MHz"
    assert said in page and "SM clocks:** 1980 MHz" not in page
    assert "- **Power limits:** 300, 700 W" in page
    clock_only = replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", "")
    cube = open_cube(shared_run(clock_only, "clocks") / "cube.nc")
    facts = dict(measured_section(cube).blocks[0].pairs)  # type: ignore[union-attr]
    assert facts["SM clocks"] == "1005, 1500, 1980 MHz"
    assert facts["Power limits"] == "not set: as found at start (700 W)"


def test_an_observe_only_fleet_mixing_models_is_not_said_to_have_left_clocks_unlocked(
    shared_run, tmp_path: Path
) -> None:
    """A fleet mixing GPU models swept observe-only has one cube per model merged along
    `gpu`, which keeps each source's `actuation` in `merged_from`, not its own: the report's
    facts said "SM clocks: not set: left unlocked", and `cube info` "SM clock left unlocked",
    of GPUs dvfs never touched (a clock lock set outside dvfs stays). Both say observe-only,
    as of one model's cube."""
    from dvfs.cube import open_cube
    from dvfs.report.facts import measured_section

    out = shared_run(TINY_EXACT, "mixed-observed", *MIXED_FLEET, "--observe-only")
    cube = open_cube(out / "cube.nc")
    assert "gpu" in cube.dims and "actuation" not in cube.attrs
    facts = dict(measured_section(cube).blocks[0].pairs)  # type: ignore[union-attr]
    assert facts["SM clocks"].startswith("not set: as found (observe-only);"), facts
    info = run("cube", "info", str(out))
    assert info.exit_code == 0, info.output
    shown = " ".join(info.output.split())
    assert "observe-only: dvfs changed no knob" in shown and "left unlocked" not in shown


def test_cube_info_names_no_clock_the_campaign_did_not_set(shared_run) -> None:
    """`dvfs cube info` on a power-limit-only cube listed 'sm_clock 1: 1980' as if swept,
    where the report says the clock was not set; its axis row says so now, as the report's
    facts do (a clock-only cube's power limit likewise), and --json gives it in
    knobs_not_set, its coordinates unchanged."""
    limits = shared_run(replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", ""), "limits")
    shown = run("cube", "info", str(limits))
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in shown.output.splitlines()}
    unset = "not set: left unlocked; the cube files its cells under 1980 MHz, which is no lock"
    assert rows["sm_clock"] == f"1: {unset}", rows
    assert rows["power_limit"] == "2: 300.0, 700.0", rows
    summary = json.loads(run("cube", "info", str(limits), "--json").output)
    assert summary["knobs_not_set"] == {"sm_clock": unset}
    assert summary["coords"]["sm_clock"] == [1980]
    clocks = shared_run(replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", ""), "clocks")
    shown = run("cube", "info", str(clocks))
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in shown.output.splitlines()}
    assert rows["power_limit"] == "1: not set: as found at start (700 W)", rows
    assert rows["sm_clock"] == "3: 1005, 1500, 1980", rows


@pytest.mark.parametrize(
    ("target", "confidence"),
    [
        (Target("preserve", slack=0.123456789), 0.9999995),
        (Target("vs-baseline", baseline="eagle3", slack=0.07), 0.975),
        ("tpot_p99<1234.5678ms", 0.95),
        ("ttft_p50<=2.0000001s", 0.51234567),
    ],
)
def test_the_reports_headroom_command_asks_the_reports_own_question(
    target: Target | str, confidence: float
) -> None:
    """The report prints the `dvfs headroom` flags that ask its question; read back, they are
    its target and confidence, not ones rounded to six digits (a confidence of 0.9999995 read
    1, which headroom refuses; an SLO of 1234.5678 ms read 1234.57)."""
    from dvfs.analysis.targets import parse_slack, parse_slo
    from dvfs.report.document import target_flags

    asked = parse_slo(target) if isinstance(target, str) else target
    flags = shlex.split(target_flags(ReportOptions(asked, confidence=confidence)))
    value = dict(zip(flags, [*flags[1:], ""], strict=True))
    if asked.mode == "slo":
        again = parse_slo(value["--slo"])
        assert again.limit_ms == pytest.approx(asked.limit_ms, rel=1e-12)
        assert (again.metric, again.quantile, again.strict) == (
            asked.metric,
            asked.quantile,
            asked.strict,
        )
    else:
        assert parse_slack(value["--slack"]) == pytest.approx(asked.slack, rel=1e-12)
    read = float(value.get("--confidence", "0.95"))
    assert read == pytest.approx(confidence, rel=1e-12) and 0.5 <= read < 1


def test_the_reports_comparison_is_dvfs_compare_at_its_confidence(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs report --confidence` set the headroom's bound only: its speculation section
    stayed at 95% (intervals, verdicts, the equal-latency settings), so it disagreed with the
    `dvfs compare --confidence` it stands for. Its tables are that command's now."""
    import dvfs.plots

    monkeypatch.setattr(dvfs.plots, "save", unsaved_figure)  # the tables, not the figures
    figures_drawn_only(monkeypatch)

    def tables(text: str) -> list[str]:
        return [line.replace("\\", "") for line in text.splitlines() if line.startswith("| ")]

    out = tmp_path / "report.md"
    result = run("report", str(small_sweep), "-o", str(out), "--confidence", "0.6")
    assert result.exit_code == 0, result.output
    section = out.read_text().split("## Speculation vs no speculation")[1].split("\n## ")[0]
    assert "60% interval" in section and "95%" not in section, section
    compared = run("compare", str(small_sweep), "--confidence", "0.6", "--markdown")
    assert compared.exit_code == 0, compared.output
    assert tables(section) == tables(compared.stdout)
    at_95 = run("compare", str(small_sweep), "--markdown")
    assert tables(at_95.stdout) != tables(compared.stdout)  # the level changes the intervals


@pytest.mark.usefixtures("unsaved_figures")
def test_two_markdown_pages_of_one_stem_keep_their_figures_apart(
    small_sweep: Path, tmp_path: Path
) -> None:
    """`-o r.md` and `-o r.html --format md` in one folder: both pages put their figures in
    r_figures/, so the later overwrote the figures the earlier still linked to. r.md's stay in
    r_figures/ (as documented), the other's go in r.html_figures/."""
    runner = CliRunner()
    for name, extra in (("r.md", ()), ("r.html", ("--format", "md"))):
        args = ["report", str(small_sweep), "-o", str(tmp_path / name), *extra]
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    md, other = ((tmp_path / n).read_text(encoding="utf-8") for n in ("r.md", "r.html"))
    assert "](r_figures/" in md and "r.html_figures/" not in md
    assert "](r.html_figures/" in other and "](r_figures/" not in other
    mine = {p.name for p in (tmp_path / "r_figures").iterdir()}
    theirs = {p.name for p in (tmp_path / "r.html_figures").iterdir()}
    assert mine and mine == theirs


def test_a_named_pipe_beside_a_markdown_page_is_not_waited_on(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A named pipe `r` beside `-o r.md`: the check for a page sharing r_figures/ opened it to
    read it, and the report waited for a writer for ever, saying nothing. It is no page: the
    report is written, the pipe never opened for reading. (The test opens the pipe's writing
    end as soon as a reader waits on it, so that the old behaviour ends, and fails.)"""
    import subprocess
    import sys
    import time

    from conftest import subprocess_env

    fifo = tmp_path / "r"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "dvfs", "report", str(small_sweep), "-o", str(tmp_path / "r.md")]
    env = subprocess_env(MPLCONFIGDIR=str(tmp_path / "mpl"))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    waited_on = False
    while proc.poll() is None and not waited_on:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader is waiting
            waited_on = True
        except OSError:  # ENXIO: no reader
            time.sleep(0.05)
    _, err = proc.communicate()
    assert not waited_on, "the report opened the named pipe to read it"
    assert proc.returncode == 0, err
    assert (tmp_path / "r.md").is_file() and fifo.is_fifo()


@pytest.mark.usefixtures("unsaved_figures")
@pytest.mark.parametrize(("first", "second"), [("r.md", "r"), ("r", "r.md")])
def test_a_page_and_its_name_with_md_refuse_to_share_a_figures_folder(
    small_sweep: Path, tmp_path: Path, first: str, second: str
) -> None:
    """`-o r.md` and `-o r --format md` in one folder: both pages' figures went in
    r_figures/, the later page's replacing those the earlier still linked to. The later is
    refused in one line (exit 2) that names the folder and the other page, before any work,
    and the earlier page's figures are left as they were; an HTML page of that name, which
    links no figures folder, shares nothing."""
    from conftest import folder_files

    runner = CliRunner()

    def report(name: str, *extra: str) -> Any:
        return runner.invoke(cli, ["report", str(small_sweep), "-o", str(tmp_path / name), *extra])

    md = ("--format", "md")
    done = report(first, *md)
    assert done.exit_code == 0, done.output
    before = folder_files(tmp_path)
    refused = report(second, *md)
    assert refused.exit_code == 2, refused.output
    [line] = refused.stderr.splitlines()
    assert f"{tmp_path / 'r_figures'}, where the Markdown page {tmp_path / first}" in line, line
    assert "give this page another name" in line, line
    assert folder_files(tmp_path) == before
    html = tmp_path / "html"
    html.mkdir()
    for name, fmt in ((first, "html"), (second, "md")):
        args = ["report", str(small_sweep), "-o", str(html / name), "--format", fmt]
        done = runner.invoke(cli, args)
        assert done.exit_code == 0, done.output


def test_a_markdown_page_whose_figures_folder_name_is_too_long_is_refused_before_the_work(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o NAME.md` with NAME of 248 bytes or more (on a file system of 255-byte names): the
    page's name fits, NAME_figures does not, and "the name is too long" was said only after
    the cube was read and every figure drawn. It is said before any work, in one line, and
    nothing is written."""
    import dvfs.cube

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cube was opened before the figures folder's name was checked")

    monkeypatch.setattr(dvfs.cube, "open_analysable", no_work)
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    stem = "r" * (limit - len("_figures") + 1)  # NAME.md fits, NAME_figures does not
    page = tmp_path / f"{stem}.md"
    result = CliRunner().invoke(cli, ["report", str(small_sweep), "-o", str(page)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot use {tmp_path / (stem + '_figures')}: the name is too long; use a "
        "shorter path"
    ], result.stderr
    assert list(tmp_path.iterdir()) == []
