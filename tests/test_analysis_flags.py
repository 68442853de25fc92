"""`dvfs headroom`, `compare` and `plot`: bad flags, contradicting flags and cubes that cannot
answer are refused in one line (never a traceback, never silently ignored), and tables keep
every column when the output is not a terminal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dvfs.cli import cli


def invoke(*args: str, **env: str) -> Any:
    return CliRunner().invoke(cli, list(args), env=env or None)


def ok(*args: str, **env: str) -> str:
    result = invoke(*args, **env)
    assert result.exit_code == 0, result.output
    return result.output


def refused(result: Any, code: int, *says: str) -> str:
    """The command failed with `code`, no traceback, and its last line names the problem."""
    shown = f"exit {result.exit_code}\n{result.output}"
    assert result.exit_code == code, shown
    assert "Traceback" not in result.output, shown
    assert isinstance(result.exception, SystemExit), shown
    error = [line for line in result.output.splitlines() if line.strip()][-1]
    assert error.startswith("Error:"), shown
    for needle in says:
        assert needle in error, f"{needle!r} not in {error!r}"
    return error


# --- flag values --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["headroom", "plot"])
@pytest.mark.parametrize(
    ("slack", "says"),
    [
        ("nan", "finite"),
        ("inf", "finite"),
        ("-inf", "finite"),
        ("1e309%", "finite"),
        ("-5%", "negative"),
        ("-0.05", "negative"),
        ("abc", "cannot read slack 'abc'"),
        ("5", "ambiguous"),
    ],
)
def test_bad_slack_is_a_usage_error(small_sweep: Path, tmp_path, command, slack, says) -> None:
    extra = ["--out", str(tmp_path / "p")] if command == "plot" else []
    result = invoke(command, str(small_sweep), *extra, f"--slack={slack}")
    refused(result, 2, "Invalid value for '--slack'", says)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("slo", "says"),
    [
        ("tpot_p90<=", "no limit"),
        ("foo<=5ms", "unknown latency 'foo'"),
        ("tpot_p90<=-3ms", "positive, finite"),
        ("tpot_p90<=nanms", "positive, finite"),
        ("tpot_p90<=5us", "unknown unit 'us'"),
        ("tpot_p90<=5", "no unit"),
        ("tpot_p90=>5ms", "<= or <"),
    ],
)
def test_malformed_slo_is_a_usage_error(small_sweep: Path, slo, says) -> None:
    result = invoke("headroom", str(small_sweep), f"--slo={slo}")
    refused(result, 2, "Invalid value for '--slo'", says, "metrics tpot, itl, ttft")


@pytest.mark.parametrize("command", ["headroom", "plot"])
@pytest.mark.parametrize("confidence", ["nan", "1", "1.5", "0.4", "-inf"])
def test_confidence_must_be_a_level(small_sweep: Path, tmp_path, command, confidence) -> None:
    extra = ["--out", str(tmp_path / "p")] if command == "plot" else []
    result = invoke(command, str(small_sweep), *extra, "--confidence", confidence)
    refused(result, 2, "Invalid value for '--confidence'")
    assert not (tmp_path / "p").exists()


def _option_help(command: str, option: str) -> str:
    """The --help entry of `option` of `command`, as one line (up to the next option)."""
    text = ok(command, "--help", COLUMNS="200")
    entry = text.split("Options:", 1)[1].split(f"  {option} ", 1)[1].split("\n  -", 1)[0]
    return " ".join(entry.split())


@pytest.mark.parametrize("option", ["--knob", "--confidence"])
def test_plot_has_the_search_options_of_headroom_and_report(option: str) -> None:
    """`dvfs plot` marks headroom settings as `dvfs report` does, but had no --knob or
    --confidence: it has both, said and defaulted as `dvfs headroom` and `dvfs report` say
    them (one definition)."""
    said = {command: _option_help(command, option) for command in ("headroom", "report", "plot")}
    assert len(set(said.values())) == 1, said
    assert "[default: " in said["plot"]


@pytest.mark.parametrize(
    ("command", "extra", "says"),
    [
        ("headroom", [], "one-sided 99.9% Student-t upper bound"),
        ("headroom", ["--vs-baseline"], "conservative 99.9% upper bound"),
        ("headroom", ["--vs-baseline"], "bounds of each mean at 99.95%"),
        ("compare", [], "two-sided 99.9% Student-t interval"),
        ("compare", [], "[99.9% interval]"),
    ],
)
def test_a_confidence_level_is_said_with_its_digits(
    small_sweep: Path, command: str, extra: list[str], says: str
) -> None:
    """--confidence 0.999 is a 99.9% bound, not one rounded to "100%" (which no finite
    bound has, and which reads as certainty)."""
    said = " ".join(ok(command, str(small_sweep), "--confidence", "0.999", *extra).split())
    assert says in said, said
    assert "100%" not in said and "100.0%" not in said, said


@pytest.mark.parametrize(
    ("confidence", "said"),
    [
        (0.5, "50%"),
        (0.95, "95%"),
        (0.975, "97.5%"),
        (0.9999, "99.99%"),
        ((1 + 0.9999) / 2, "99.995%"),
        (0.999999999999, "99.9999999999%"),
        (1 - 1e-15, "99.9999999999999%"),
    ],
)
def test_a_level_below_one_is_never_said_as_100_percent(confidence: float, said: str) -> None:
    """`level_text` gives the level's digits, as few as say it; a level a hair below 1 (which
    --confidence accepts) is not rounded up to the certainty of "100%" (it was, from 12 nines
    on)."""
    from dvfs.analysis.bounds import level_text

    assert level_text(confidence) == said


# --- contradictions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--slack", "5%", "--slo", "tpot_p90<=8ms"], "--slack"),
        (["--slack", "0%", "--slo", "tpot_p90<=8ms"], "--slack"),  # even the default value
        (["--metric", "itl", "--slo", "tpot_p90<=8ms"], "--metric itl contradicts"),
        (["--quantile", "p99", "--slo", "tpot_p90<=8ms"], "--quantile p99 contradicts"),
        (["--json", "--markdown"], "--json and --markdown"),
        (["--preserve", "--slo", "tpot_p90<=8ms"], "choose one of"),
    ],
)
def test_contradicting_headroom_flags_are_refused(small_sweep: Path, args, says) -> None:
    refused(invoke("headroom", str(small_sweep), *args), 2, says)


def test_compare_refuses_json_with_markdown(small_sweep: Path) -> None:
    refused(invoke("compare", str(small_sweep), "--json", "--markdown"), 2, "--json and --markdown")


def test_flags_that_agree_with_the_slo_are_fine(small_sweep: Path) -> None:
    doc = json.loads(
        ok(
            "headroom",
            str(small_sweep),
            "--slo",
            "tpot_p90<=8ms",
            "--metric",
            "tpot",
            "--quantile",
            "p90",
            "--json",
        )
    )
    assert doc["target"]["metric"] == "tpot" and doc["target"]["quantile"] == 0.9


def test_an_slo_keeps_the_baseline_it_was_given(small_sweep: Path) -> None:
    doc = json.loads(
        ok(
            "headroom",
            str(small_sweep),
            "--slo",
            "tpot_p50<=50ms",
            "--baseline",
            "eagle3",
            "--json",
        )
    )
    assert doc["target"]["baseline"] == "eagle3"
    stock = {
        (r["batch"], r["drafter"], r["corpus"]): r["stock_energy_per_token_j"] for r in doc["rows"]
    }
    for r in doc["rows"]:
        assert r["baseline_energy_per_token_j"] == stock[(r["batch"], "eagle3", r["corpus"])]


def test_a_strict_slo_is_honoured_and_shown(small_sweep: Path) -> None:
    doc = json.loads(ok("headroom", str(small_sweep), "--slo", "tpot_p50<50ms", "--json"))
    assert doc["target"]["strict"] is True
    assert doc["target"]["description"] == "TPOT p50 < 50 ms"
    assert "TPOT p50 < 50 ms" in ok("headroom", str(small_sweep), "--slo", "tpot_p50<50ms")
    inclusive = json.loads(ok("headroom", str(small_sweep), "--slo", "tpot_p50<=50ms", "--json"))
    assert inclusive["target"]["strict"] is False


def test_a_strict_slo_excludes_the_setting_on_the_limit(small_sweep: Path) -> None:
    # With one repeat the point value is compared: take one setting's latency as the limit.
    from dvfs.cube import open_cube

    cube = variant(small_sweep, "one-repeat", lambda ds: ds.sel(repeat=[0]))
    tpot = open_cube(cube)["tpot_ms"].sel(quantile=0.5, batch=1, drafter="none", corpus="code")
    limit = float(tpot.sel(sm_clock=1500, power_limit=700.0, repeat=0))
    only = ["--json", "--batch", "1", "--drafter", "none", "--corpus", "code"]

    def settings(op: str) -> int:
        doc = json.loads(ok("headroom", str(cube), "--slo", f"tpot_p50{op}{limit!r}ms", *only))
        [row] = doc["rows"]
        return row["feasible_settings"]

    on_or_below, below = int((tpot <= limit).sum()), int((tpot < limit).sum())
    assert on_or_below > below  # 1500 MHz (and any setting with the same latency) is on it
    assert settings("<=") == on_or_below
    assert settings("<") == below


def test_baseline_must_be_in_the_cube_even_when_only_used_for_savings(small_sweep: Path) -> None:
    refused(
        invoke("headroom", str(small_sweep), "--baseline", "medusa"),
        2,
        "'--baseline'",
        "medusa",
        "none, eagle3",
    )


# --- filters and selections ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["headroom", "compare"])
@pytest.mark.parametrize(
    ("flag", "value", "has"),
    [
        ("--drafter", "medusa", "none, eagle3"),
        ("--corpus", "klingon", "code, conversation"),
        ("--batch", "999", "1, 8"),
    ],
)
def test_unknown_filter_values_name_what_the_cube_has(small_sweep: Path, command, flag, value, has):
    refused(invoke(command, str(small_sweep), flag, value), 2, f"'{flag}'", value, has)


def test_compare_needs_a_drafter_besides_the_baseline(small_sweep: Path) -> None:
    refused(invoke("compare", str(small_sweep), "--drafter", "none"), 2, "only the baseline")


def test_a_repeated_filter_value_is_one_row(small_sweep: Path) -> None:
    doc = json.loads(ok("headroom", str(small_sweep), "--json", "--batch", "1", "--batch", "1"))
    assert len(doc["rows"]) == 4  # 1 batch x 2 drafters x 2 corpora, not twice over


# --- cubes that cannot answer -------------------------------------------------------------


def variant(small_sweep: Path, name: str, change: Callable[[Any], Any]) -> Path:
    from dvfs.cube import open_cube, write_cube

    path = small_sweep.parent / f"{name}.nc"
    if not path.exists():
        write_cube(change(open_cube(small_sweep / "cube.nc").copy(deep=True)), path)
    return path


def no_valid_cell(ds: Any) -> Any:
    ds["valid"][:] = 0
    return ds


@pytest.mark.parametrize("command", ["headroom", "compare", "plot"])
def test_a_cube_without_a_valid_cell_is_one_line(small_sweep: Path, tmp_path, command) -> None:
    cube = variant(small_sweep, "no-valid-cell", no_valid_cell)
    extra = ["--out", str(tmp_path / "p")] if command == "plot" else []
    refused(invoke(command, str(cube), *extra), 1, "no valid measured cell", "dvfs sweep")


def test_compare_on_a_cube_with_only_the_baseline(small_sweep: Path) -> None:
    cube = variant(small_sweep, "only-none", lambda ds: ds.sel(drafter=["none"]))
    refused(invoke("compare", str(cube)), 1, "no drafter besides the baseline 'none'")
    ok("headroom", str(cube))  # the headroom of no speculation is still a fine question


def test_the_baseline_missing_from_the_cube(small_sweep: Path) -> None:
    cube = variant(small_sweep, "no-none", lambda ds: ds.sel(drafter=["eagle3"]))
    refused(invoke("compare", str(cube)), 2, "'--baseline'", "'none'", "eagle3")
    refused(invoke("headroom", str(cube), "--vs-baseline"), 2, "'--baseline'", "'none'")
    ok("headroom", str(cube))  # preserve mode does not need the (default) baseline


def test_one_repeat_says_no_interval_was_possible(small_sweep: Path) -> None:
    cube = variant(small_sweep, "one-repeat", lambda ds: ds.sel(repeat=[0]))
    assert "no interval was possible" in ok("headroom", str(cube), "--slack", "5%")
    ok("compare", str(cube))


def test_writing_the_json_where_it_cannot_go_is_one_line(small_sweep: Path, tmp_path) -> None:
    """A path under a regular file (a missing folder is made: `make_parent`)."""
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "such" / "h.json"
    refused(invoke("headroom", str(small_sweep), "-o", str(target)), 1, str(target))


# --- tables through a pipe ----------------------------------------------------------------


def headers(doc: dict[str, Any], kind: str) -> list[str]:
    from dvfs.report import compare_tables, headroom_table_rows

    if kind == "headroom":
        return headroom_table_rows(doc)[0]
    return [name for _, header, _ in compare_tables(doc) for name in header]


@pytest.mark.parametrize("command", ["headroom", "compare"])
def test_piped_tables_keep_every_column(small_sweep: Path, command) -> None:
    """Into a pipe (CliRunner is one) and with COLUMNS=40, no column is folded or dropped."""
    doc = json.loads(ok(command, str(small_sweep), "--json"))
    table = ok(command, str(small_sweep), COLUMNS="40")
    names = headers(doc, command)
    assert len(names) >= 5
    for name in names:
        assert name in table, f"{name!r} missing or folded:\n{table}"
    assert "conversation" in table  # cells are not folded either
    if command == "headroom":
        assert "headroom MHz/W" in table and "J/tok chosen" in table
        for row in doc["rows"]:
            line = f"│ {row['batch']} "
            assert line in table
    else:
        assert f"at equal latency ({doc['latency']})" in table


# --- merged cubes -------------------------------------------------------------------------


def merged_cube(small_sweep: Path) -> Path:
    """Two GPUs whose stock power limits differ (700 W and 300 W)."""
    from dvfs.cube import merge_cubes, open_cube, write_cube

    path = small_sweep.parent / "merged.nc"
    if not path.exists():
        a = open_cube(small_sweep / "cube.nc")
        b = a.copy(deep=True)
        b.attrs.update(gpu_uuids="GPU-second", stock_power_limit_w=300.0)
        write_cube(merge_cubes([a, b]), path)
    return path


def test_merged_cubes_with_different_stock_settings_are_analysed(small_sweep: Path) -> None:
    cube = merged_cube(small_sweep)
    doc = json.loads(ok("headroom", str(cube), "--json"))
    ref = doc["reference"]
    assert ref["power_limit_w"] is None  # no single stock power limit
    assert sorted(r["power_limit_w"] for r in ref["per_gpu"].values()) == [300.0, 700.0]
    assert {r["gpu"] for r in doc["rows"]} == set(ref["per_gpu"])
    table = ok("headroom", str(cube), "--batch", "1")
    assert "each GPU's own" in table and "GPU-second" in table
    assert "each GPU's own" in ok("headroom", str(cube), "--markdown")
    compared = json.loads(ok("compare", str(cube), "--json"))
    assert compared["reference"]["per_gpu"] == ref["per_gpu"]
    assert {e["gpu"] for e in compared["break_even_batch"]} == set(ref["per_gpu"])
    # each row's two arms were measured on one GPU (the relabelled copy keeps its cells'
    # measured_on), and the JSON says which
    for r in compared["rows"]:
        assert r["measured_on"] == r["baseline_measured_on"] != [] and not r["different_gpus"]
    assert "GPU-second" in ok("compare", str(cube))
