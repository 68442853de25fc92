"""Errors that never crash (issue 9): bad inputs of every kind, driven through the CLI.

Every case must exit non-zero (with the documented code where there is one) and print ONE line
on stderr that names what is wrong (a path, key or value) -- never a traceback, never exit 0.
Click's own usage errors print "Usage: ... / Try ... / Error: ..."; their final Error line
must be one line too.

Damaged files are generated in tmp_path at test time (see tests/bad_inputs.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from bad_inputs import (
    DELETE,
    TINY,
    binary_bytes,
    campaign,
    failing_writes,
    jsonl,
    latin1,
    prompts,
    sparse_file,
    torn_middle_line,
    truncated,
    user_corpus_campaign,
)
from click.testing import CliRunner
from conftest import made_once, pipe_output

from dvfs.cli import cli

#: Marker for `Case.files`: make a directory at this path.
DIR = object()


class Writer:
    """A file `Case.files` value that writes the file itself: fn(path, env).

    `same`: the file is the same in every test that uses this Writer (made from the shared
    sweep's files alone: a damaged cube, roofline or profile), so it is made once per process
    and its bytes written into each later test's folder: a cube write costs ~70 ms.
    """

    def __init__(self, fn: Callable[[Path, dict[str, Path]], None], *, same: bool = False) -> None:
        self.fn = fn
        self.same = same
        self._made: bytes | None = None

    def write(self, path: Path, env: dict[str, Path]) -> None:
        if not self.same:
            self.fn(path, env)
        elif self._made is None:
            self.fn(path, env)
            self._made = path.read_bytes()
        else:
            path.write_bytes(self._made)


Files = dict[str, Any]


@dataclass
class Case:
    """One bad input: the argv (placeholders below), the files to create, what must be said.

    Placeholders in argv, files and `says`: {tmp} (this test's folder), {sweep} (a finished tiny
    sweep folder, shared, read-only), {cube}, {journal}, {headroom} (its headroom JSON), and
    with `nvml` {uuid0} (the fake GPU 0's UUID; also in file names).
    A file's value is text, bytes, DIR, a Writer, or a function of those paths (a dict with the
    same keys) returning text or bytes.
    """

    id: str
    argv: list[str]
    files: Files = field(default_factory=dict)
    code: int | tuple[int, ...] | None = None  # the exit code, or the codes allowed
    says: tuple[str, ...] = ()
    fault: tuple[str, int] | None = None  # (folder under {tmp}, errno): writes there fail
    chatty: bool = False  # progress or warnings may come first; the error is the last line
    nvml: bool = False  # run against the fake NVML (as root)
    env: dict[str, str] = field(default_factory=dict)  # environment variables set (placeholders)
    xfail: str | None = None


def C(id: str, argv: list[str], files_extra: Files | None = None, **kw: Any) -> Case:  # noqa: N802
    """A case (reads like a table row); `files_extra` adds files to a helper's own."""
    if files_extra:
        kw["files"] = {**kw.get("files", {}), **files_extra}
    return Case(id, argv, **kw)


# -- campaigns -------------------------------------------------------------------------------

DRY = ["--dry-run", "--out", "{tmp}/out"]


def camp_case(
    id: str, text: str | bytes | object, *says: str, code: int | None = 2, **kw: Any
) -> Case:
    return C(
        f"campaign-{id}",
        ["sweep", "{tmp}/c.toml", *DRY],
        files={"c.toml": text},
        code=code,
        says=says,
        **kw,
    )


def key_case(id: str, path: str, value: Any, *says: str, **kw: Any) -> Case:
    """TINY with one key set to a bad value (DELETE removes it)."""
    return camp_case(id, campaign((path, value)), *says, **kw)


GOOD_TEXT = campaign()

#: A TOML file and a JSON document nested 100k deep: deeper than their parsers recurse.
DEEP_TOML = "a = " + "[" * 100_000 + "]" * 100_000 + "\n"
DEEP_JSON = "[" * 100_000 + "]" * 100_000

CAMPAIGN_FILE_CASES = [
    C(
        "campaign-missing-file",
        ["sweep", "{tmp}/nope.toml", *DRY],
        code=2,
        says=("{tmp}/nope.toml",),
    ),
    C(
        "campaign-is-a-directory",
        ["sweep", "{tmp}/d.toml", *DRY],
        files={"d.toml": DIR},
        code=2,
        says=("d.toml",),
    ),
    camp_case("binary-bytes", binary_bytes(), "c.toml"),
    camp_case("non-utf8", latin1("# caf\u00e9\n") + GOOD_TEXT.encode(), "c.toml", "utf-8"),
    camp_case("nul-byte", GOOD_TEXT.replace('"tiny"', '"ti\x00ny"'), "c.toml"),
    camp_case("truncated-toml", truncated(GOOD_TEXT, 0.4) + b"[work", "c.toml"),
    camp_case("truncated-mid-string", GOOD_TEXT[: GOOD_TEXT.index("llama") + 3], "c.toml"),
    camp_case("empty-file", "", "c.toml"),
    camp_case("only-whitespace", "\n\n   \n", "c.toml"),
    camp_case("huge-comment-5mb", "#" * (5 << 20) + "\n", "c.toml"),
    camp_case("json-not-toml", json.dumps(TINY), "c.toml", "toml"),
    camp_case("utf16", GOOD_TEXT.encode("utf-16"), "c.toml"),
    camp_case("duplicate-table", GOOD_TEXT + '\n[gpu]\nbackend = "twin"\n', "c.toml"),
    camp_case("workload-not-a-table", campaign(("workload", 3)), "workload"),
]

CAMPAIGN_KEY_CASES = [
    # [campaign]
    key_case("name-not-string", "campaign.name", 5, "campaign.name"),
    key_case("unknown-key-in-campaign", "campaign.nmae", "x", "nmae", "name"),
    # [gpu]
    key_case("gpu-backend-unknown", "gpu.backend", "cuda", "gpu.backend", "cuda"),
    key_case("gpu-backend-int", "gpu.backend", 5, "gpu.backend"),
    key_case("gpu-profile-unknown", "gpu.profile", "a100", "gpu.profile", "a100"),
    key_case("gpu-profile-missing", "gpu.profile", DELETE, "gpu.profile"),
    key_case("gpu-devices-string", "gpu.devices", "0", "gpu.devices"),
    key_case("gpu-devices-empty", "gpu.devices", [], "gpu.devices"),
    key_case("gpu-devices-negative", "gpu.devices", [-1], "gpu.devices", "-1"),
    key_case("gpu-devices-twice", "gpu.devices", [0, 0], "gpu.devices", "twice"),
    key_case("gpu-devices-bool", "gpu.devices", [True], "gpu.devices"),
    key_case("gpu-actuation-bool", "gpu.actuation", True, "gpu.actuation"),
    key_case("gpu-actuation-off-with-knobs", "gpu.actuation", "off", "stock"),
    # [knobs]
    key_case("sm-clock-word", "knobs.sm_clock", "max", "knobs.sm_clock", "max"),
    key_case("sm-clock-empty-list", "knobs.sm_clock", [], "knobs.sm_clock"),
    key_case("sm-clock-unsupported", "knobs.sm_clock", [1981], "knobs.sm_clock", "1981"),
    key_case("sm-clock-zero", "knobs.sm_clock", [0], "knobs.sm_clock"),
    key_case("sm-clock-float", "knobs.sm_clock", [1980.5], "knobs.sm_clock"),
    key_case("sm-clock-absurd", "knobs.sm_clock", [99999], "knobs.sm_clock", "99999"),
    key_case("sm-clock-twice", "knobs.sm_clock", [1980, 1980], "knobs.sm_clock", "twice"),
    key_case(
        "sm-clock-range-reversed",
        "knobs.sm_clock",
        {"start": 1980, "stop": 705, "step": 75},
        "knobs.sm_clock",
        "start",
    ),
    key_case(
        "sm-clock-range-not-reached",
        "knobs.sm_clock",
        {"start": 705, "stop": 1000, "step": 100},
        "knobs.sm_clock",
        "1000",
    ),
    key_case(
        "sm-clock-range-no-step",
        "knobs.sm_clock",
        {"start": 705, "stop": 1980},
        "knobs.sm_clock",
        "step",
    ),
    key_case(
        "sm-clock-range-unknown-key",
        "knobs.sm_clock",
        {"start": 705, "stop": 1980, "stepp": 75},
        "stepp",
    ),
    key_case(
        "sm-clock-range-zero-step",
        "knobs.sm_clock",
        {"start": 705, "stop": 1980, "step": 0},
        "step",
    ),
    key_case("power-limit-negative", "knobs.power_limit", [-5], "knobs.power_limit"),
    key_case("power-limit-zero", "knobs.power_limit", [0], "knobs.power_limit"),
    key_case("power-limit-absurd", "knobs.power_limit", [5000], "knobs.power_limit", "5000"),
    key_case("power-limit-word", "knobs.power_limit", "max", "knobs.power_limit"),
    key_case("power-limit-twice", "knobs.power_limit", [700, 700], "knobs.power_limit", "twice"),
    key_case("power-limit-nan", "knobs.power_limit", [float("nan")], "knobs.power_limit"),
    key_case("power-limit-inf", "knobs.power_limit", [float("inf")], "knobs.power_limit"),
    key_case("settle-negative", "knobs.settle_s", -1, "knobs.settle_s"),
    key_case("settle-string", "knobs.settle_s", "2s", "knobs.settle_s", "2s"),
    key_case("settle-nan", "knobs.settle_s", float("nan"), "knobs.settle_s"),
    key_case("settle-inf", "knobs.settle_s", float("inf"), "knobs.settle_s"),
    key_case("knobs-misspelt-key", "knobs.sm_clocks", [1980], "sm_clocks", "sm_clock"),
    # [engine]
    key_case("engine-backend-unknown", "engine.backend", "vllm", "engine.backend", "vllm"),
    key_case("engine-model-int", "engine.model", 7, "engine.model"),
    key_case("engine-model-missing", "engine.model", DELETE, "engine.model"),
    key_case("engine-model-unknown-to-twin", "engine.model", "gpt-5", "gpt-5"),
    key_case("engine-tp-mismatch", "engine.tp_size", 2, "tp_size", "2"),
    key_case("engine-tp-zero", "engine.tp_size", 0, "tp_size"),
    key_case("engine-tp-string", "engine.tp_size", "1", "tp_size"),
    key_case("engine-twin-model-unknown", "engine.twin_model", "llama-9", "twin_model"),
    key_case("engine-sglang-url-ftp", "engine.sglang.url", "ftp://x", "engine.sglang.url"),
    key_case(
        "engine-sglang-timeout-zero", "engine.sglang.startup_timeout_s", 0, "startup_timeout_s"
    ),
    key_case("engine-sglang-env-int", "engine.sglang.env", {"A": 1}, "env"),
    key_case("engine-sglang-unknown-key", "engine.sglang.urll", "http://x", "urll"),
    key_case("engine-sglang-args-not-list", "engine.sglang.extra_args", "--x", "extra_args"),
    key_case(
        "engine-sglang-args-config-file",
        "engine.sglang.extra_args",
        ["--config", "sglang.yaml"],
        "engine.sglang.extra_args",
        "--config",
    ),
    key_case(
        "engine-sglang-command-with-flags",
        "engine.sglang.server_command",
        ["python", "-m", "sglang.launch_server", "--enable-torch-compile"],
        "engine.sglang.server_command",
        "--enable-torch-compile",
        "extra_args",
    ),
    # [drafters]
    key_case(
        "drafter-unknown-algorithm", "drafters.eagle3.algorithm", "MEDUSA", "algorithm", "MEDUSA"
    ),
    key_case("drafter-algorithm-int", "drafters.eagle3.algorithm", 5, "algorithm"),
    key_case("drafter-partial-triple", "drafters.eagle3.eagle_topk", DELETE, "eagle_topk"),
    key_case("drafter-steps-zero", "drafters.eagle3.num_steps", 0, "num_steps"),
    key_case("drafter-topk1-mismatch", "drafters.eagle3.num_draft_tokens", 7, "num_draft_tokens"),
    key_case("drafter-no-draft-model", "drafters.eagle3.draft_model", DELETE, "draft_model"),
    key_case("drafter-none-with-steps", "drafters.none.num_steps", 3, "num_steps"),
    key_case("drafter-block-size-on-eagle", "drafters.eagle3.block_size", 16, "block_size"),
    key_case("drafter-dspark-on-twin", "drafters.eagle3.algorithm", "DSPARK", "DSPARK"),
    key_case("drafter-bad-name", "drafters.bad name!", {"algorithm": "none"}, "bad name!"),
    key_case("drafter-not-a-table", "drafters.x", 5, "drafters.x"),
    key_case("drafter-misspelt-key", "drafters.eagle3.num_step", 3, "num_step", "num_steps"),
    # [workload]
    key_case("batch-empty", "workload.batch", [], "workload.batch"),
    key_case("batch-zero", "workload.batch", [0], "workload.batch"),
    key_case("batch-string", "workload.batch", "1", "workload.batch"),
    key_case("batch-float", "workload.batch", [1.5], "workload.batch"),
    key_case("batch-twice", "workload.batch", [1, 1], "workload.batch", "twice"),
    key_case("batch-missing", "workload.batch", DELETE, "workload.batch"),
    key_case("corpora-empty", "workload.corpora", [], "workload.corpora"),
    key_case("corpora-unknown", "workload.corpora", ["klingon"], "klingon"),
    key_case("corpora-misspelt", "workload.corpora", ["cod"], "cod", "code"),
    key_case("corpora-string", "workload.corpora", "code", "workload.corpora"),
    key_case("corpora-twice", "workload.corpora", ["code", "code"], "twice"),
    key_case("input-tokens-zero", "workload.input_tokens", [0, 10], "input_tokens"),
    key_case("input-tokens-reversed", "workload.input_tokens", [100, 5], "input_tokens"),
    key_case("input-tokens-three", "workload.input_tokens", [1, 2, 3], "input_tokens"),
    key_case("output-tokens-one", "workload.output_tokens", 1, "output_tokens"),
    key_case("output-tokens-negative", "workload.output_tokens", -5, "output_tokens"),
    key_case("output-tokens-float", "workload.output_tokens", 1.5, "output_tokens"),
    key_case("mode-unknown", "workload.mode", "open", "workload.mode", "open"),
    key_case("temperature-negative", "workload.temperature", -1, "temperature"),
    key_case("temperature-string", "workload.temperature", "hot", "temperature"),
    key_case("temperature-nan", "workload.temperature", float("nan"), "temperature"),
    key_case("ignore-eos-false-fixed", "workload.ignore_eos", False, "ignore_eos"),
    key_case("ignore-eos-string", "workload.ignore_eos", "yes", "ignore_eos"),
    key_case("pool-size-zero", "workload.pool_size", 0, "pool_size"),
    # a pool the size of the batch drains below it at once: refused at load, not mid-sweep
    key_case("pool-size-equal-batch", "workload.pool_size", 1, "pool_size", "larger than"),
    key_case("workload-misspelt-key", "workload.batches", [1], "batches", "batch"),
    # [measurement]
    key_case("warmup-negative", "measurement.warmup_tokens", -1, "warmup_tokens"),
    key_case("min-window-zero", "measurement.min_window_s", 0, "min_window_s"),
    key_case("min-window-nan", "measurement.min_window_s", float("nan"), "min_window_s"),
    key_case("min-window-inf", "measurement.min_window_s", float("inf"), "min_window_s"),
    key_case("max-rounds-zero", "measurement.max_rounds", 0, "max_rounds"),
    key_case("repeats-zero", "measurement.repeats", 0, "repeats"),
    key_case("seed-negative", "measurement.seed", -1, "seed"),
    key_case("sample-period-too-coarse", "measurement.sample_period_s", 1.0, "sample_period_s"),
    key_case("idle-negative", "measurement.idle_s", -1, "idle_s"),
    # A duration past any clock's reach: the twin's idle baseline of 2**70 s (or 1e12 s) ended
    # in an internal error ("Python int too large to convert to C long") after the sweep began.
    key_case("idle-huge", "measurement.idle_s", 2**62, "measurement.idle_s", "a week"),
    key_case("idle-1e12-s", "measurement.idle_s", 1e12, "measurement.idle_s", "a week"),
    key_case("settle-beyond-a-week", "knobs.settle_s", 2**62, "knobs.settle_s", "a week"),
    key_case("window-beyond-a-week", "measurement.min_window_s", 1e12, "min_window_s", "a week"),
    # An integer no float holds (TOML's are any size to Python): "internal error:
    # OverflowError: int too large to convert to float", before the week's bound was reached.
    key_case("idle-beyond-a-float", "measurement.idle_s", 10**400, "measurement.idle_s", "64 bits"),
    key_case(
        "settle-beyond-a-float", "measurement.settle", -(10**400), "measurement.settle", "64 bits"
    ),
    key_case("slope-beyond-a-float", "measurement.thermal_slope_c_per_min", 10**400, "64 bits"),
    # Beyond TOML's 64 bits (tomllib reads any integer): "internal error: OverflowError" where
    # an integer key's value met a float (a batch's, the warm-up's tokens).
    key_case("batch-beyond-64-bits", "workload.batch", [1, 2**64], "workload.batch[1]", "64 bits"),
    key_case(
        "warmup-beyond-64-bits", "measurement.warmup_tokens", 10**400, "warmup_tokens", "64 bits"
    ),
    key_case("retries-negative", "measurement.retries", -1, "retries"),
    key_case("measurement-misspelt-key", "measurement.repeat", 2, "repeat"),
    # sections
    key_case("misspelt-section", "workloads", {"batch": [1]}, "workloads"),
    key_case("unknown-top-level-key", "gpus", {"backend": "twin"}, "gpus", "gpu"),
    key_case("engine-missing", "engine", DELETE, "engine"),
    key_case("corpus-section-not-table", "corpus", 5, "corpus"),
]

# -- user corpora ----------------------------------------------------------------------------


def corpus_case(
    id: str,
    filename: str,
    content: Any,
    *says: str,
    spec: dict[str, Any] | None = None,
    via: str = "show",
    **kw: Any,
) -> Case:
    """A campaign naming user corpus `mine` read from `filename`, shown through the CLI: a
    file missing or damaged makes the campaign invalid (exit 2, unless `code` says)."""
    spec = spec or {"path": filename, "field": "text"}
    files = {"c.toml": user_corpus_campaign(spec)}
    if content is not None:
        files[filename] = content
    argv = {
        "show": ["corpus", "show", "mine", "--campaign", "{tmp}/c.toml"],
        "list": ["corpus", "list", "--campaign", "{tmp}/c.toml"],
        "sweep": ["sweep", "{tmp}/c.toml", "--out", "{tmp}/out", "--no-progress"],
    }[via]
    return C(f"corpus-{id}", argv, files=files, code=kw.pop("code", 2), says=says, **kw)


GOOD_JSONL = jsonl(prompts(4))
GOOD_CSV = "id,text\n" + "".join(f"p{i},Prompt number {i} about the sky.\n" for i in range(4))


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _parquet_not_utf8() -> bytes:
    """A Parquet file whose text column holds Latin-1 bytes (Parquet's writers check no text:
    a converted export, a hand-made file). Written uncompressed, so that one letter of the
    text is changed in place."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(prompts(4)), buf, compression="none")
    data = buf.getvalue()
    assert b"Prompt" in data
    return data.replace(b"Prompt", b"Pr\xe9mpt")  # same length: the file stays whole


def _huge_corpus(path: Path, env: dict[str, Path]) -> None:
    from dvfs.corpora.loaders import MAX_CORPUS_BYTES

    sparse_file(path, MAX_CORPUS_BYTES + 1)


CORPUS_CASES = [
    corpus_case("jsonl-binary", "mine.jsonl", binary_bytes(), "mine.jsonl", "binary"),
    corpus_case(
        "jsonl-non-utf8",
        "mine.jsonl",
        GOOD_JSONL.encode() + latin1('{"text": "caf\u00e9"}\n'),
        "mine.jsonl",
        "line 5",
    ),
    corpus_case(
        "jsonl-truncated", "mine.jsonl", truncated(GOOD_JSONL, 0.9), "mine.jsonl", "line 4"
    ),
    corpus_case(
        "jsonl-torn-middle",
        "mine.jsonl",
        torn_middle_line(GOOD_JSONL.encode()),
        "mine.jsonl",
        "line 3",
    ),
    corpus_case("jsonl-empty", "mine.jsonl", "", "mine.jsonl", "empty"),
    corpus_case("jsonl-blank-lines", "mine.jsonl", "\n\n\n", "mine.jsonl"),
    corpus_case(
        "jsonl-json-array", "mine.jsonl", json.dumps(prompts(2), indent=1), "mine.jsonl", "line 1"
    ),
    corpus_case("jsonl-line-is-list", "mine.jsonl", "[1, 2]\n", "mine.jsonl", "line 1"),
    corpus_case(
        "jsonl-missing-field", "mine.jsonl", jsonl(prompts(2, field="prompt")), "mine.jsonl", "text"
    ),
    corpus_case("jsonl-field-number", "mine.jsonl", jsonl([{"text": 5}]), "mine.jsonl", "text"),
    corpus_case("jsonl-field-null", "mine.jsonl", jsonl([{"text": None}]), "mine.jsonl", "text"),
    corpus_case("jsonl-deep-nesting", "mine.jsonl", "[" * 100_000 + "\n", "mine.jsonl", "line 1"),
    corpus_case("jsonl-huge", "mine.jsonl", Writer(_huge_corpus), "mine.jsonl"),
    corpus_case("jsonl-missing-file", "mine.jsonl", None, "mine.jsonl"),
    corpus_case("jsonl-is-directory", "mine.jsonl", DIR, "mine.jsonl"),
    corpus_case(
        "jsonl-unknown-role",
        "mine.jsonl",
        jsonl([{"chat": [{"role": "wizard", "content": "hi"}]}]),
        "wizard",
        spec={"path": "mine.jsonl", "messages": "chat"},
    ),
    corpus_case(
        "jsonl-no-user-turn",
        "mine.jsonl",
        jsonl([{"chat": [{"role": "assistant", "content": "hi"}]}]),
        "user",
        spec={"path": "mine.jsonl", "messages": "chat"},
    ),
    corpus_case(
        "jsonl-messages-not-list",
        "mine.jsonl",
        jsonl([{"chat": 3}]),
        "chat",
        spec={"path": "mine.jsonl", "messages": "chat"},
    ),
    corpus_case("csv-wrong-columns", "mine.csv", "id,prompt\n1,hello\n", "mine.csv", "text"),
    corpus_case(
        "csv-non-utf8", "mine.csv", latin1("id,text\n1,caf\u00e9 au lait\n"), "mine.csv", "line 2"
    ),
    corpus_case("csv-binary", "mine.csv", binary_bytes(), "mine.csv"),
    corpus_case("csv-nul-byte", "mine.csv", "id,text\n1,he\x00llo\n", "mine.csv"),
    corpus_case("csv-empty", "mine.csv", "", "mine.csv", "empty"),
    corpus_case("csv-header-only", "mine.csv", "id,text\n", "mine.csv"),
    corpus_case("csv-truncated-quote", "mine.csv", 'id,text\n1,"an unfinished quote\n', "mine.csv"),
    corpus_case("csv-short-row", "mine.csv", "id,text\n1\n", "mine.csv", "line 2"),
    corpus_case("csv-long-row", "mine.csv", "id,text\n1,a,b,c\n", "mine.csv", "line 2"),
    corpus_case("csv-quote-in-field", "mine.csv", 'id,text\n1,"a"b\n', "mine.csv", "line 2"),
    corpus_case(
        "jsonl-huge-integer", "mine.jsonl", '{"text": ' + "1" * 5000 + "}\n", "mine.jsonl", "line 1"
    ),
    corpus_case("jsonl-utf16", "mine.jsonl", GOOD_JSONL.encode("utf-16"), "mine.jsonl", "utf-16"),
    corpus_case(
        "path-is-a-device",
        "mine.jsonl",
        None,
        "/dev/zero",
        spec={"path": "/dev/zero", "field": "text", "format": "jsonl"},
    ),
    *(
        corpus_case(
            f"path-nul-byte-{via}",
            "x",
            None,
            "NUL",
            "da\\x00ta.jsonl",
            spec={"path": "da\0ta.jsonl", "field": "text", "format": "jsonl"},
            via=via,
            chatty=via == "sweep",
        )
        for via in ("show", "list", "sweep")
    ),
    corpus_case(
        "package-resource-nul-byte",
        "x",
        None,
        "NUL",
        spec={"package": "dvfs.corpora", "resource": "data/a\0.jsonl", "field": "text"},
    ),
    corpus_case("parquet-not-parquet", "mine.parquet", "id,text\n1,hello\n", "mine.parquet"),
    corpus_case(
        "parquet-truncated",
        "mine.parquet",
        lambda tmp: truncated(_parquet(prompts(4)), 0.5),
        "mine.parquet",
    ),
    corpus_case(
        "parquet-wrong-column",
        "mine.parquet",
        lambda tmp: _parquet(prompts(2, field="q")),
        "mine.parquet",
        "text",
    ),
    corpus_case("parquet-empty", "mine.parquet", "", "mine.parquet", "empty"),
    # its rows were made Python text outside the reader's checks: the campaign file was named
    # "not UTF-8 text" (exit 1), not the Parquet file
    *(
        corpus_case(
            f"parquet-text-not-utf8-via-{via}",
            "mine.parquet",
            lambda tmp: _parquet_not_utf8(),
            "mine.parquet",
            "row 1",
            "utf-8",
            via=via,
            chatty=via == "sweep",
        )
        for via in ("show", "list", "sweep")
    ),
    corpus_case("unknown-extension", "mine.txt", "hello\n", "mine.txt", "format"),
    corpus_case("via-list-binary", "mine.jsonl", binary_bytes(), "mine.jsonl", via="list"),
    corpus_case("via-list-missing", "mine.jsonl", None, "mine.jsonl", via="list"),
    corpus_case(
        "via-sweep-non-utf8",
        "mine.jsonl",
        latin1('{"text": "caf\u00e9"}\n'),
        "mine.jsonl",
        via="sweep",
        chatty=True,
    ),
    corpus_case(
        "via-sweep-truncated",
        "mine.jsonl",
        truncated(GOOD_JSONL, 0.9),
        "mine.jsonl",
        via="sweep",
        chatty=True,
    ),
    corpus_case(
        "package-not-installed",
        "x",
        None,
        "no_such_pkg",
        spec={"package": "no_such_pkg", "resource": "p.jsonl", "field": "text"},
        code=1,  # this environment lacks it, the campaign is not at fault
    ),
    corpus_case(
        "package-resource-missing",
        "x",
        None,
        "nope.jsonl",
        spec={"package": "dvfs.corpora", "resource": "data/nope.jsonl", "field": "text"},
    ),
    corpus_case(
        "package-resource-is-a-folder",
        "x",
        None,
        "data",
        spec={"package": "dvfs.corpora", "resource": "data", "field": "text", "format": "jsonl"},
    ),
    # [corpus.NAME] tables that are wrong before any file is read: campaign errors (exit 2)
    corpus_case(
        "spec-no-source", "mine.jsonl", GOOD_JSONL, "corpus.mine", spec={"field": "text"}, code=2
    ),
    corpus_case(
        "spec-unknown-key",
        "mine.jsonl",
        GOOD_JSONL,
        "pth",
        spec={"pth": "mine.jsonl", "field": "text"},
        code=2,
    ),
    corpus_case(
        "spec-bad-format",
        "mine.jsonl",
        GOOD_JSONL,
        "xml",
        spec={"path": "mine.jsonl", "field": "text", "format": "xml"},
        code=2,
    ),
    corpus_case(
        "spec-limit-zero",
        "mine.jsonl",
        GOOD_JSONL,
        "limit",
        spec={"path": "mine.jsonl", "field": "text", "limit": 0},
        code=2,
    ),
    corpus_case(
        "spec-field-and-messages",
        "mine.jsonl",
        GOOD_JSONL,
        "field",
        spec={"path": "mine.jsonl", "field": "text", "messages": "m"},
        code=2,
    ),
    corpus_case(
        "spec-acceptance-like-unknown",
        "mine.jsonl",
        GOOD_JSONL,
        "klingon",
        spec={"path": "mine.jsonl", "field": "text", "acceptance_like": "klingon"},
        code=2,
    ),
    # `dvfs corpus show` itself
    C("corpus-show-unknown-builtin", ["corpus", "show", "klingon"], code=2, says=("klingon",)),
    C("corpus-show-negative-n", ["corpus", "show", "code", "-n", "-1"], code=2, says=("-1",)),
    C("corpus-show-n-not-int", ["corpus", "show", "code", "-n", "many"], code=2, says=("many",)),
    C(
        "corpus-show-missing-campaign",
        ["corpus", "show", "code", "--campaign", "{tmp}/no.toml"],
        code=2,
        says=("no.toml",),
    ),
]

# -- caps files ------------------------------------------------------------------------------

GOOD_CAPS = (
    '[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1305\npower_limit_w = 450\n'
)


def caps_case(id: str, content: Any, *says: str, code: int | None = 2, **kw: Any) -> Case:
    argv = ["cap", "apply", "{tmp}/caps.toml", "--dry-run", "--state-dir", "{tmp}/state"]
    files = {} if content is None else {"caps.toml": content}
    return C(f"caps-{id}", argv, files=files, code=code, says=says, **kw)


CAPS_CASES = [
    caps_case("missing-file", None, "caps.toml"),
    caps_case("is-a-directory", DIR, "caps.toml"),
    caps_case("binary", binary_bytes(), "caps.toml"),
    caps_case("non-utf8", latin1("# r\u00e9seau\n") + GOOD_CAPS.encode(), "caps.toml"),
    caps_case("truncated", truncated(GOOD_CAPS, 0.6), "caps.toml"),
    caps_case("empty", "", "caps.toml"),
    caps_case("json-not-toml", json.dumps({"gpu": [{"uuid": "GPU-1"}]}), "caps.toml"),
    caps_case("wrong-schema", "dvfs_caps = 99\n" + GOOD_CAPS, "caps.toml", "99"),
    caps_case("unknown-top-key", "gpus = 1\n" + GOOD_CAPS, "gpus"),
    caps_case("unknown-entry-key", GOOD_CAPS + "power_limit = 5\n", "power_limit"),
    caps_case("gpu-not-array", 'gpu = "GPU-1"\n', "gpu"),
    caps_case("gpu-entry-not-table", "gpu = [1, 2]\n", "gpu"),
    caps_case("uuid-not-uuid", '[[gpu]]\nuuid = "0"\npower_limit_w = 400\n', "uuid", "'0'"),
    caps_case("no-knob", '[[model]]\nname = "NVIDIA H100 80GB HBM3"\n', "neither"),
    caps_case("negative-watts", GOOD_CAPS.replace("450", "-450"), "power_limit_w", "-450"),
    caps_case("zero-mhz", GOOD_CAPS.replace("1305", "0"), "sm_clock_max_mhz"),
    caps_case("watts-string", GOOD_CAPS.replace("450", '"450W"'), "power_limit_w", "450W"),
    caps_case("watts-nan", GOOD_CAPS.replace("450", "nan"), "power_limit_w", "nan"),
    caps_case("watts-inf", GOOD_CAPS.replace("450", "inf"), "power_limit_w", "inf"),
    caps_case("min-above-max", GOOD_CAPS + "sm_clock_min_mhz = 1900\n", "sm_clock_min_mhz"),
    caps_case("absurd-watts", GOOD_CAPS.replace("450", "1000000"), "power limit", nvml=True),
    caps_case("absurd-mhz", GOOD_CAPS.replace("1305", "99999"), "99999", nvml=True),
    caps_case("tiny-watts", GOOD_CAPS.replace("450", "1"), "power limit", nvml=True),
    # An integer beyond TOML's 64 bits (tomllib reads any): "internal error: OverflowError"
    caps_case(
        "watts-beyond-64-bits",
        GOOD_CAPS.replace("450", str(10**400)),
        "model[0].power_limit_w",
        "64 bits",
    ),
    C(
        "caps-show-garbled-record",
        ["cap", "show", "--state-dir", "{tmp}/state"],
        files={"state/caps-applied.json": binary_bytes()},
        code=1,
        says=("{tmp}/state",),
        nvml=True,
    ),
    C(
        "caps-show-record-is-a-list",
        ["cap", "show", "--state-dir", "{tmp}/state"],
        files={"state/caps-applied.json": "[1, 2]"},
        code=1,
        says=("{tmp}/state",),
        nvml=True,
    ),
    C(
        "caps-state-dir-is-a-file",
        ["cap", "reset", "--state-dir", "{tmp}/file.txt"],
        files={"file.txt": "x"},
        code=2,
        says=("file.txt",),
    ),
    C(
        "caps-show-takes-no-file",
        ["cap", "show", "{tmp}/caps.toml"],
        files={"caps.toml": GOOD_CAPS},
        code=2,
        says=("caps.toml",),
    ),
]

# -- headroom JSON for `cap plan` ------------------------------------------------------------


def plan_case(
    id: str, content: Any, *says: str, args: tuple[str, ...] = (), code: int | None = 2, **kw: Any
) -> Case:
    argv = ["cap", "plan", "{tmp}/h.json", "--batch", "1", "--drafter", "eagle3", *args]
    files = {} if content is None else {"h.json": content}
    return C(f"plan-{id}", argv, files=files, code=code, says=says, **kw)


def _headroom_with(**changes: Any) -> Callable[[dict[str, Path]], str]:
    def make(shared: dict[str, Path]) -> str:
        doc = json.loads(shared["headroom"].read_text())
        doc.update(changes)
        return json.dumps(doc)

    return make


def _headroom_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Path]], str]:
    """The shared headroom document with `edit` applied to it (nested values)."""

    def make(shared: dict[str, Path]) -> str:
        doc = json.loads(shared["headroom"].read_text())
        edit(doc)
        return json.dumps(doc)

    return make


def _every_row(key: str, value: Any, under: str | None = None) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for row in doc["rows"]:
            (row[under] if under else row)[key] = value

    return edit


PLAN_CASES = [
    plan_case("missing-file", None, "h.json"),
    plan_case("is-a-directory", DIR, "h.json"),
    plan_case("binary", binary_bytes(), "h.json"),
    plan_case("non-utf8", latin1('{"schema": "caf\u00e9"}'), "h.json"),
    plan_case("truncated-json", lambda s: truncated(s["headroom"].read_bytes(), 0.5), "h.json"),
    plan_case("empty", "", "h.json"),
    plan_case("json-list", "[1, 2]", "headroom"),
    plan_case("wrong-schema", _headroom_with(schema="dvfs.compare/1"), "headroom"),
    plan_case("rows-not-list", _headroom_with(rows=5), "rows"),
    plan_case("a-cube-instead", lambda s: s["cube"].read_bytes(), "h.json"),
    # the right keys, wrong types inside (a hand-edited or damaged document)
    plan_case("target-not-a-table", _headroom_with(target="tpot"), "target", "tpot"),
    plan_case("gpu-not-a-table", _headroom_with(gpu=5), "gpu"),
    plan_case("reference-null", _headroom_with(reference=None), "reference"),
    plan_case(
        "stock-clock-string",
        _headroom_edit(lambda d: d["reference"].update(stock_sm_clock_mhz="x")),
        "reference.stock_sm_clock_mhz",
    ),
    plan_case("row-not-a-table", _headroom_edit(lambda d: d["rows"].append(5)), "rows[2]"),
    plan_case("row-empty-table", _headroom_edit(lambda d: d["rows"].append({})), "rows[2]"),
    plan_case("row-batch-list", _headroom_edit(_every_row("batch", [])), "rows[0].batch"),
    plan_case(
        "chosen-null-when-feasible", _headroom_edit(_every_row("chosen", None)), "rows[0].chosen"
    ),
    plan_case(
        "chosen-clock-string",
        _headroom_edit(_every_row("sm_clock_mhz", "1500", under="chosen")),
        "rows[0].chosen.sm_clock_mhz",
        "1500",
    ),
    C(
        "plan-per-batch-energy-string",
        ["cap", "plan", "{tmp}/h.json", "--per-batch", "--drafter", "eagle3"],
        files={"h.json": _headroom_edit(_every_row("energy_per_token_j", "x"))},
        code=2,
        says=("energy_per_token_j", '"x"'),
    ),
    plan_case("unknown-batch", lambda s: s["headroom"].read_text(), "999", args=("--batch", "999")),
    plan_case(
        "unknown-drafter",
        lambda s: s["headroom"].read_text(),
        "medusa",
        args=("--drafter", "medusa"),
    ),
    plan_case(
        "unknown-corpus",
        lambda s: s["headroom"].read_text(),
        "klingon",
        args=("--corpus", "klingon"),
    ),
    # (an output in a missing folder is written, the folder made, as `dvfs report -o` makes
    # it: `test_an_output_files_missing_folders_are_made`)
    # (`cap plan` first warns that twin caps are simulated: chatty)
    plan_case(
        "out-under-a-file",
        lambda s: s["headroom"].read_text(),
        "{tmp}/file.txt",
        args=("-o", "{tmp}/file.txt/caps.toml"),
        code=1,
        files_extra={"file.txt": "x"},
        chatty=True,
    ),
    plan_case(
        "out-full-disk",
        lambda s: s["headroom"].read_text(),
        "/dev/full",
        args=("-o", "/dev/full"),
        code=1,
        chatty=True,
    ),
]

# -- journals (`dvfs cube build DIR`) ---------------------------------------------------------


def journal_case(id: str, content: Any, *says: str, code: int | None = 1, **kw: Any) -> Case:
    files = {} if content is None else {"run/journal.jsonl": content}
    return C(
        f"journal-{id}", ["cube", "build", "{tmp}/run"], files=files, code=code, says=says, **kw
    )


def _journal_lines(shared: dict[str, Path]) -> list[dict[str, Any]]:
    return [json.loads(x) for x in shared["journal"].read_text().splitlines() if x.strip()]


def _journal_edit(edit: Callable[[list[dict[str, Any]]], list[Any]]) -> Callable[..., str]:
    def make(shared: dict[str, Path]) -> str:
        return jsonl(edit(_journal_lines(shared)))

    return make


def _first_cell(records: list[dict[str, Any]]) -> int:
    return next(i for i, r in enumerate(records) if r.get("type") == "cell")


def _cell_field(key: str, value: Any) -> Callable[[list[dict[str, Any]]], list[Any]]:
    def edit(records: list[dict[str, Any]]) -> list[Any]:
        i = _first_cell(records)
        records[i] = {**records[i], key: value}
        return records

    return edit


def _session_gpu(key: str, value: Any) -> Callable[[list[dict[str, Any]]], list[Any]]:
    """The first session's GPUs' `key` hand-edited to `value`."""

    def edit(records: list[dict[str, Any]]) -> list[Any]:
        i = next(i for i, r in enumerate(records) if r.get("type") == "session")
        gpus = [{**g, key: value} for g in records[i]["gpus"]]
        records[i] = {**records[i], "gpus": gpus}
        return records

    return edit


JOURNAL_CASES = [
    # A GPU's ECC mode or VBIOS hand-edited to what is no name: before, a list or number went
    # into the cube as its repr, a newline into `cube info`'s lines, and a name longer than a
    # cube attribute may hold made a cube `cube info` called damaged, "rebuild it from its
    # journal" (this one): the journal's line is named instead.
    *(
        journal_case(
            f"session-gpu-{key}-{what}",
            _journal_edit(_session_gpu(key, value)),
            "journal.jsonl, line 2",
            f"GPU 0's {key} is",
        )
        for key in ("ecc_mode", "vbios_version")
        for what, value in (
            ("list", ["on"]),
            ("number", 1),
            ("bool", True),
            ("long", "E" * 5000),
            ("newline", "on\nx"),
        )
    ),
    C(
        "journal-session-gpu-ecc-mode-garbled-on-resume",
        ["sweep", "{tmp}/c.toml", "--out", "{tmp}/run", "--no-progress"],
        files={
            "c.toml": GOOD_TEXT,
            "run/journal.jsonl": _journal_edit(_session_gpu("ecc_mode", {"on": 1})),
        },
        code=1,
        says=("journal.jsonl, line 2", "GPU 0's ecc_mode is"),
        chatty=True,
    ),
    journal_case("missing-dir", None, "{tmp}/run"),
    journal_case("no-journal", None, "journal.jsonl", files_extra={"run/notes.txt": "x"}),
    journal_case("garbage-bytes", binary_bytes(), "journal.jsonl"),
    journal_case(
        "non-utf8",
        lambda s: s["journal"].read_bytes().replace(b'"code"', b'"c\xe9de"'),
        "journal.jsonl",
    ),
    journal_case(
        "torn-middle-line",
        lambda s: torn_middle_line(s["journal"].read_bytes()),
        "journal.jsonl",
        "line",
    ),
    # Empty: a sweep starts it afresh, so the build says to run the sweep (issue nu35).
    journal_case("empty", "", "journal.jsonl", "is empty", "dvfs sweep"),
    # A device: refused unread (read line by line, it would take all the memory).
    journal_case(
        "link-to-dev-zero",
        Writer(lambda path, env: path.symlink_to("/dev/zero")),
        "journal.jsonl",
        "no regular file",
    ),
    journal_case(
        "header-only", lambda s: s["journal"].read_text().splitlines()[0] + "\n", "session"
    ),
    journal_case("no-header", _journal_edit(lambda r: r[1:]), "journal.jsonl", "header", "--fresh"),
    journal_case("lines-are-lists", "[1, 2]\n[3]\n", "journal.jsonl"),
    journal_case(
        "future-schema", _journal_edit(lambda r: [{**r[0], "journal_schema": 99}, *r[1:]]), "99"
    ),
    journal_case(
        "header-campaign-garbled",
        _journal_edit(lambda r: [{**r[0], "campaign": "x"}, *r[1:]]),
        "journal.jsonl",
    ),
    journal_case("cell-not-a-table", _journal_edit(_cell_field("cell", "x")), "journal.jsonl"),
    journal_case(
        "cell-without-key",
        _journal_edit(lambda r: [x for x in r if x.get("type") != "cell"] + [{"type": "cell"}]),
        "journal.jsonl",
    ),
    journal_case(
        "cell-measurement-garbled", _journal_edit(_cell_field("measurement", [1])), "journal.jsonl"
    ),
    journal_case("journal-is-directory", DIR, "journal.jsonl"),
    journal_case("run-dir-is-a-file", None, "run", files_extra={"run": "x"}, code=2),
    C(
        "journal-other-campaigns-header",
        ["sweep", "{tmp}/c.toml", "--out", "{tmp}/run", "--no-progress"],
        files={
            "c.toml": campaign(("workload.output_tokens", 8)),
            "run/journal.jsonl": lambda s: s["journal"].read_text(),
        },
        code=1,
        says=("journal.jsonl", "--fresh"),
        chatty=True,
    ),
    C(
        "journal-shard-record-garbled-dry-run",
        ["sweep", "{tmp}/c.toml", "--shard", "0/1", "--out", "{tmp}/run", "--dry-run"],
        files={
            "c.toml": GOOD_TEXT,
            "run/journal.jsonl": _journal_edit(
                lambda r: [r[0], {"type": "shard", "index": "x", "count": 2}, *r[1:]]
            ),
        },
        code=1,
        # with the folder it is in: a shard's sweep without --out goes to its default folder
        says=("journal.jsonl", "damaged shard record", "--shard 0/1 --out {tmp}/run --fresh`"),
    ),
    C(
        "journal-garbage-on-resume",
        ["sweep", "{tmp}/c.toml", "--out", "{tmp}/run", "--no-progress"],
        files={"c.toml": GOOD_TEXT, "run/journal.jsonl": binary_bytes() + b"\n" + binary_bytes()},
        code=1,
        says=("journal.jsonl",),
        chatty=True,
    ),
]

# -- cubes -----------------------------------------------------------------------------------


def _not_dvfs_cube(path: Path, env: dict[str, Path]) -> None:
    import numpy as np
    import xarray as xr

    xr.Dataset({"t": ("x", np.arange(3.0))}).to_netcdf(path, engine="netcdf4")


def _cube_with(change: Callable[[Any], Any]) -> Writer:
    def make(path: Path, env: dict[str, Path]) -> None:
        from dvfs.cube import open_cube, write_cube

        write_cube(change(open_cube(env["cube"])), path)

    return Writer(make, same=True)


def _future_schema(ds: Any) -> Any:
    ds = ds.copy()
    ds.attrs["dvfs_schema"] = 99
    return ds


def _on_another_gpu(ds: Any) -> Any:
    ds = ds.copy()
    ds.attrs["gpu_uuids"] = "GPU-00000000-another-gpu"
    return ds


CUBE_FILES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "missing": (None, ("cube.nc",)),
    "text-file": ("this is not netCDF\n", ("cube.nc",)),
    "empty": ("", ("cube.nc",)),
    "truncated": (lambda s: truncated(s["cube"].read_bytes(), 0.5), ("cube.nc",)),
    "binary": (binary_bytes(), ("cube.nc",)),
    "not-a-dvfs-cube": (Writer(_not_dvfs_cube, same=True), ("cube.nc", "dvfs")),
    "future-schema": (_cube_with(_future_schema), ("cube.nc", "99")),
    "missing-dimension": (_cube_with(lambda ds: ds.isel(repeat=0, drop=True)), ("cube.nc",)),
    # "no cube at cube.nc: run `dvfs sweep` or `dvfs cube build` first", whose cube then
    # failed to be written through the link
    "link-in-a-loop": (Writer(lambda p, e: p.symlink_to(p.name)), ("cube.nc", "a loop")),
}


def _raw_cube_with(change: Callable[[Any], Any]) -> Writer:
    """The shared cube changed and saved by xarray as it is (dvfs's writer would refuse to
    encode text where its integer flags go)."""

    def make(path: Path, env: dict[str, Path]) -> None:
        from dvfs.cube import open_cube

        ds = change(open_cube(env["cube"]))
        for var in ds.variables.values():
            var.encoding = {}
        ds.to_netcdf(path)

    return Writer(make, same=True)


def _valid_cells_energy(value: float) -> Callable[[Any], Any]:
    """Every valid cell's energy per token set to `value` (NaN, or a negative number)."""

    def change(ds: Any) -> Any:
        ds = ds.copy(deep=True)
        ds["energy_per_token_j"] = ds["energy_per_token_j"].where(ds["valid"] != 1, value)
        return ds

    return change


#: Valid netCDF files shaped like a cube with values no analysis can use: (content, says,
#: whether `dvfs cube info` refuses it too: it reads no energies).
DAMAGED_VALUES: dict[str, tuple[Any, tuple[str, ...], bool]] = {
    "valid-as-text": (
        _raw_cube_with(lambda ds: ds.assign(valid=ds["valid"].astype(str))),
        ("cube.nc", "valid"),
        True,
    ),
    "timeline-as-text": (
        _raw_cube_with(lambda ds: ds.assign(timeline_power_w=ds["timeline_power_w"].astype(str))),
        ("cube.nc", "timeline_power_w"),
        True,
    ),
    "split-as-text": (
        _raw_cube_with(lambda ds: ds.assign(energy_draft_j=ds["energy_draft_j"].astype(str))),
        ("cube.nc", "energy_draft_j"),
        True,
    ),
    "clock-nan": (
        _cube_with(lambda ds: ds.assign_coords(sm_clock=ds["sm_clock"] * float("nan"))),
        ("cube.nc", "sm_clock"),
        True,
    ),
    "latency-no-quantile-axis": (
        _cube_with(lambda ds: ds.drop_vars("quantile")),
        ("cube.nc", "quantile"),
        True,
    ),
    # Latency quantiles cut or edited (the analyses select each by value, the median first):
    # `headroom` and `compare` ended in an internal error (KeyError: 0.9).
    "latency-median-only": (
        _cube_with(lambda ds: ds.isel(quantile=[0])),
        ("cube.nc", "quantile", "0.99"),
        True,
    ),
    "latency-other-quantiles": (
        _cube_with(lambda ds: ds.assign_coords(quantile=[0.5, 0.9, 0.95])),
        ("cube.nc", "quantile", "0.95"),
        True,
    ),
    # An axis naming an entry twice (a hand-edited label): two rows where one is meant;
    # `compare` was an internal error, `headroom` two rows of one drafter.
    "drafter-named-twice": (
        _cube_with(
            lambda ds: ds.assign_coords(
                drafter=[str(ds["drafter"][0].item())] * ds.sizes["drafter"]
            )
        ),
        ("cube.nc", "drafter", "more than once"),
        True,
    ),
    "energy-nan-in-valid-cells": (
        _cube_with(_valid_cells_energy(float("nan"))),
        ("cube.nc", "energy_per_token_j"),
        False,
    ),
    "energy-negative": (
        _cube_with(_valid_cells_energy(-1.0)),
        ("cube.nc", "energy_per_token_j"),
        False,
    ),
}

CUBE_COMMANDS = {
    "info": ["cube", "info", "{tmp}/cube.nc"],
    "headroom": ["headroom", "{tmp}/cube.nc"],
    "compare": ["compare", "{tmp}/cube.nc"],
    "plot": ["plot", "{tmp}/cube.nc", "--out", "{tmp}/plots"],
    "merge": ["cube", "merge", "{tmp}/cube.nc", "{cube}", "-o", "{tmp}/m.nc"],
}

CUBE_CASES = (
    [
        C(
            f"cube-{cmd}-{kind}",
            argv,
            files={} if content is None else {"cube.nc": content},
            code=1,
            says=says,
        )
        for kind, (content, says) in CUBE_FILES.items()
        for cmd, argv in CUBE_COMMANDS.items()
        if cmd == "info"
        or kind in ("missing", "text-file", "truncated", "not-a-dvfs-cube", "link-in-a-loop")
    ]
    + [
        C(f"cube-{cmd}-{kind}", argv, files={"cube.nc": content}, code=1, says=says)
        for kind, (content, says, info_too) in DAMAGED_VALUES.items()
        for cmd, argv in CUBE_COMMANDS.items()
        if cmd in ("headroom", "compare", "plot") or (cmd == "info" and info_too)
    ]
    + [
        C(
            "cube-info-empty-dir",
            ["cube", "info", "{tmp}/run"],
            files={"run/x.txt": "x"},
            code=1,
            says=("cube.nc",),
        ),
        C(
            "cube-merge-one-cube",
            ["cube", "merge", "{cube}", "-o", "{tmp}/m.nc"],
            code=2,
            says=("at least two cubes",),
        ),
        C(
            "cube-merge-itself",
            ["cube", "merge", "{cube}", "{cube}", "-o", "{tmp}/m.nc"],
            code=2,
            says=("same GPU",),
        ),
    ]
)

#: Provenance attributes holding what the commands cannot read them as (a hand-edited or
#: damaged cube): a list or a number where text goes, text where a number goes, a name
#: megabytes long. (attribute, value), each through the commands that read it.
BAD_ATTRIBUTES: dict[str, tuple[str, Any]] = {
    "gpu-name-list": ("gpu_name", [1, 2]),
    "gpu-name-number": ("gpu_name", 5),
    "gpu-name-huge": ("gpu_name", "N" * 5000),
    "twin-profile-list": ("twin_profile", [1, 2]),
    "token-count-method-list": ("token_count_method", [1, 2]),
    "campaign-source-number": ("campaign_source", 5),
    "corpora-number": ("corpora", 5),
    "tp-size-text": ("tp_size", "two"),
    # the stock clock, the reference's coordinate: "internal error" where it was made an integer
    "stock-clock-nan": ("stock_sm_clock_mhz", float("nan")),
    "stock-clock-inf": ("stock_sm_clock_mhz", float("inf")),
    # A GPU's ECC mode or VBIOS hand-edited: a newline or a terminal's escape broke the lines
    # `cube info`, the report and `compare` print it in.
    "ecc-mode-list": ("ecc_mode", [1, 2]),
    "ecc-mode-newline": ("ecc_mode", "on\nx"),
    "vbios-version-escape": ("vbios_version", "96.00.99\x1b[31m"),
}


def _merged_with_gpu_names(text: str) -> Writer:
    """The shared cube merged with itself on another GPU, its `gpu_names` set to `text`."""

    def make(path: Path, env: dict[str, Path]) -> None:
        from dvfs.cube import open_cube, write_cube
        from dvfs.cube.merge import merge_cubes

        cube = open_cube(env["cube"])
        merged = merge_cubes([cube, _on_another_gpu(cube)])
        write_cube(merged.assign_attrs(gpu_names=text), path)

    return Writer(make, same=True)


#: A merged cube's GPU models (`gpu_names`) that are not a JSON list of one name per GPU.
BAD_GPU_NAMES = {
    "number": "5",
    "null": "null",
    "not-json": "{x",
    "one-string": '"NVIDIA H100 80GB HBM3"',
    "one-name-for-two": '["NVIDIA H200"]',
}

#: One Writer per damaged cube, shared by the commands each is given to (made once).
_GPU_NAMES_CUBES = {kind: _merged_with_gpu_names(text) for kind, text in BAD_GPU_NAMES.items()}
_ATTRIBUTE_CUBES = {
    kind: _cube_with(lambda ds, a=attr, v=value: ds.assign_attrs({a: v}))
    for kind, (attr, value) in BAD_ATTRIBUTES.items()
}

ATTRIBUTE_CASES = [
    C(
        f"cube-gpu-names-{kind}-{cmd}",
        argv,
        files={"cube.nc": _GPU_NAMES_CUBES[kind]},
        code=1,
        says=("cube.nc", "gpu_names", "dvfs cube merge"),
    )
    for kind in BAD_GPU_NAMES
    for cmd, argv in (
        ("info", ["cube", "info", "{tmp}/cube.nc"]),
        ("compare", ["compare", "{tmp}/cube.nc"]),
        ("headroom", ["headroom", "{tmp}/cube.nc"]),
    )
] + [
    C(
        f"cube-attribute-{kind}-{cmd}",
        argv,
        files={"cube.nc": _ATTRIBUTE_CUBES[kind]},
        code=1,
        says=("cube.nc", attr, "dvfs cube build"),
    )
    for kind, (attr, _) in BAD_ATTRIBUTES.items()
    for cmd, argv in (
        ("twin-fit", ["twin", "fit", "{tmp}/cube.nc", "-o", "{tmp}/p.toml"]),
        ("compare", ["compare", "{tmp}/cube.nc"]),
        ("report", ["report", "{tmp}/cube.nc", "-o", "{tmp}/r.html"]),
    )
    if cmd != "report" or kind.startswith(("gpu-name", "ecc-mode", "vbios"))
]
ATTRIBUTE_CASES += [
    C(
        f"cube-attribute-{kind}-info",
        ["cube", "info", "{tmp}/cube.nc"],
        files={"cube.nc": _ATTRIBUTE_CUBES[kind]},
        code=1,
        says=("cube.nc", attr, "dvfs cube build"),
    )
    for kind, (attr, _) in BAD_ATTRIBUTES.items()
    if kind.startswith(("ecc-mode", "vbios", "stock-clock"))
]

#: JSON attributes the commands index into, of another shape: (attribute, text, the command).
BAD_JSON_ATTRIBUTES = {
    "server-args-number": ("server_args", "5", ["compare", "{tmp}/cube.nc"]),
    "server-args-not-json": ("server_args", "{x", ["compare", "{tmp}/cube.nc"]),
    "server-args-numbers": ("server_args", '{"none": 5}', ["compare", "{tmp}/cube.nc"]),
    "failed-cells-number": ("failed_cells", "5", ["cube", "info", "{tmp}/cube.nc"]),
    "failed-cells-numbers": ("failed_cells", "[1]", ["cube", "info", "{tmp}/cube.nc"]),
    "failed-cells-object": ("failed_cells", '{"a": 1}', ["cube", "info", "{tmp}/cube.nc"]),
    # read as an older cube's (no hashes recorded): twin fit checked no corpus against it
    "corpora-not-json": (
        "corpora",
        '{"code": {"content_hash": "b7',
        ["twin", "fit", "{tmp}/cube.nc", "-o", "{tmp}/p.toml"],
    ),
    "corpora-a-list": ("corpora", "[1]", ["cube", "info", "{tmp}/cube.nc"]),
}

ATTRIBUTE_CASES += [
    C(
        f"cube-attribute-{kind}",
        argv,
        files={"cube.nc": _cube_with(lambda ds, a=attr, v=text: ds.assign_attrs({a: v}))},
        code=1,
        says=("cube.nc", attr, "dvfs cube build"),
    )
    for kind, (attr, text, argv) in BAD_JSON_ATTRIBUTES.items()
]


def _merged_with(change: Callable[[dict[str, Any]], Any]) -> Writer:
    """The shared cube merged with itself on another GPU, its `merged_from` (each source's
    provenance, by its GPU's label) replaced by `change(sources)`: text as it is, else JSON."""

    def make(path: Path, env: dict[str, Path]) -> None:
        from dvfs.cube import open_cube, write_cube
        from dvfs.cube.merge import merge_cubes

        cube = open_cube(env["cube"])
        merged = merge_cubes([cube, _on_another_gpu(cube)])
        value = change(json.loads(merged.attrs["merged_from"]))
        text = value if isinstance(value, str) else json.dumps(value)
        write_cube(merged.assign_attrs(merged_from=text), path)

    return Writer(make, same=True)


#: A merged cube's sources (`merged_from`) that are not a JSON object of one object per GPU:
#: its analyses, summary and report stopped on an "internal error ... please report it".
BAD_MERGED_FROM = {
    "not-json": lambda s: "{x",
    "number": lambda s: "5",
    "a-list": lambda s: "[1]",
    "null": lambda s: "null",
    "one-string": lambda s: '"GPU-a"',
    "sources-numbers": lambda s: dict.fromkeys(s, 5),
    "sources-lists": lambda s: dict.fromkeys(s, [1]),
}
_MERGED_FROM_CUBES = {kind: _merged_with(change) for kind, change in BAD_MERGED_FROM.items()}

ATTRIBUTE_CASES += [
    C(
        f"cube-merged-from-{kind}-{cmd}",
        argv,
        files={"cube.nc": _MERGED_FROM_CUBES[kind]},
        code=1,
        says=("cube.nc", "merged_from", "dvfs cube merge"),
    )
    for kind in BAD_MERGED_FROM
    for cmd, argv in (
        ("info", ["cube", "info", "{tmp}/cube.nc"]),
        ("headroom", ["headroom", "{tmp}/cube.nc"]),
        ("compare", ["compare", "{tmp}/cube.nc"]),
        ("report", ["report", "{tmp}/cube.nc", "-o", "{tmp}/r.md"]),
        ("plot", ["plot", "{tmp}/cube.nc", "-o", "{tmp}/plots"]),
    )
]

#: A merged cube's sources readable as such, one value of a GPU's own not: read as not
#: recorded (an older merge's "None"), as the cube's other readers of it do, not an
#: "internal error ... please report it".
UNRECORDED_MERGED_FROM = {
    "empty": lambda s: "",
    "stock-limit-text": lambda s: {k: {**v, "stock_power_limit_w": "abc"} for k, v in s.items()},
    "stock-limit-list": lambda s: {k: {**v, "stock_power_limit_w": [1]} for k, v in s.items()},
    "stock-clock-text": lambda s: {k: {**v, "stock_sm_clock_mhz": "abc"} for k, v in s.items()},
    "stock-clock-object": lambda s: {k: {**v, "stock_sm_clock_mhz": {}} for k, v in s.items()},
    "stock-clock-inf": lambda s: {k: {**v, "stock_sm_clock_mhz": "inf"} for k, v in s.items()},
    "stock-limit-nan": lambda s: {k: {**v, "stock_power_limit_w": "nan"} for k, v in s.items()},
}
_UNRECORDED_CUBES = {kind: _merged_with(c) for kind, c in UNRECORDED_MERGED_FROM.items()}


@pytest.mark.parametrize(
    "argv",
    [
        ["cube", "info", "{cube}"],
        ["headroom", "{cube}", "--slack", "50%"],
        ["compare", "{cube}"],
        ["report", "{cube}", "-o", "{tmp}/r.md", "--slack", "50%"],
    ],
    ids=["info", "headroom", "compare", "report"],
)
@pytest.mark.parametrize("kind", list(UNRECORDED_MERGED_FROM))
def test_a_merged_cube_with_a_sources_value_unreadable_reads_it_as_not_recorded(
    kind: str, argv: list[str], shared: dict[str, Path], tmp_path: Path
) -> None:
    cube = tmp_path / "cube.nc"
    _UNRECORDED_CUBES[kind].write(cube, shared)
    args = [a.replace("{cube}", str(cube)).replace("{tmp}", str(tmp_path)) for a in argv]
    result = CliRunner().invoke(cli, args)
    assert "internal error" not in result.output, result.output
    assert result.exit_code == 0, result.output


def test_a_cube_with_no_corpora_attribute_is_an_older_one(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """A cube from before dvfs recorded its corpora (no `corpora` attribute, or an empty one)
    is read as it was: only one that holds something other than a JSON object is refused."""
    from dvfs.cube import open_cube, write_cube

    for kind, change in (
        ("absent", lambda ds: _without_attr(ds, "corpora")),
        ("empty", lambda ds: ds.assign_attrs(corpora="")),
    ):
        path = tmp_path / f"{kind}.nc"
        write_cube(change(open_cube(shared["cube"])), path)
        result = CliRunner().invoke(cli, ["cube", "info", str(path)])
        assert result.exit_code == 0, (kind, result.output)


def _bytes_read() -> int:
    """The bytes this process has read so far (the kernel's count, cache hits included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
@pytest.mark.parametrize(
    "argv",
    [
        ["cube", "build", "{run}", "-o", "{tmp}/b.nc"],
        ["cube", "merge", "{journal}", "-o", "{tmp}/m.nc"],
    ],
    ids=["cube-build", "cube-merge"],
)
def test_a_journal_whose_records_end_in_a_run_of_zeros_is_not_read_to_its_end(
    argv: list[str], shared: dict[str, Path], tmp_path: Path
) -> None:
    """A journal whose records are followed by a gigabyte of zero bytes and no newline (a file
    extended but never written: a crash on some file systems, a sparse copy): the record too
    long is refused in one line, once the first 64 MiB of it are read. Saying which lines to
    delete read the rest of that line to its end, chunk by chunk: a 20 GiB tail took minutes,
    and a SIGTERM waited for it."""
    run = tmp_path / "run"
    run.mkdir()
    journal = run / "journal.jsonl"
    journal.write_bytes(shared["journal"].read_bytes())
    tail = 1 << 30
    with open(journal, "r+b") as f:
        f.truncate(journal.stat().st_size + tail)  # sparse: costs no disk
    args = [a.format(run=run, journal=journal, tmp=tmp_path) for a in argv]
    before = _bytes_read()
    result = CliRunner().invoke(cli, args)
    read = _bytes_read() - before
    assert result.exit_code == 1, result.output
    assert "longer than 64 MiB" in result.stderr, result.output
    assert "Traceback" not in result.output, result.output
    assert read < tail // 2, f"read {read >> 20} MiB of a journal's {tail >> 20} MiB of zeros"


def _without_attr(ds: Any, name: str) -> Any:
    ds = ds.copy()
    ds.attrs.pop(name, None)
    return ds


# -- GPU state files and devices (`dvfs gpu`, `dvfs cap` on the fake NVML) -------------------

_STATE = "state/{uuid0}.json"  # the fake NVML's GPU 0
GPU_CASES = [
    C(
        f"gpu-state-file-{kind}",
        ["gpu", "reset", "--state-dir", "{tmp}/state"],
        files={_STATE: content},
        nvml=True,
        says=("{tmp}/state",),
    )
    for kind, content in (
        ("binary", binary_bytes()),
        ("non-utf8", latin1('{"original": "caf\u00e9"}')),
        ("truncated", '{"original": {"sm_clock'),
        ("a-list", "[1, 2]"),
        ("original-not-a-table", '{"original": 5}'),
        ("original-wrong-fields", '{"original": {"uuid": 5}}'),
        ("empty", ""),
    )
] + [
    *(
        C(
            f"state-dir-env-{where}-{'-'.join(argv[:2])}",
            argv,
            files={"caps.toml": GOOD_CAPS, "file.txt": "x"},
            nvml=True,
            env={"DVFS_STATE_DIR": value},
            code=1,
            says=(f"DVFS_STATE_DIR={value!r}", "set DVFS_STATE_DIR to a folder"),
        )
        for where, value in (("dev-null", "/dev/null"), ("under-a-file", "{tmp}/file.txt/s"))
        for argv in (["gpu", "reset"], ["cap", "apply", "{tmp}/caps.toml"], ["cap", "show"])
    ),
    # A relative $DVFS_STATE_DIR named another folder from each folder a command ran in: a
    # sweep's state files were left where `dvfs gpu reset` (and the units) never looked.
    *(
        C(
            f"state-dir-env-relative-{where}-{'-'.join(argv[:2])}",
            argv,
            files={"caps.toml": GOOD_CAPS},
            nvml=True,
            env={"DVFS_STATE_DIR": value},
            code=1,
            says=(f"DVFS_STATE_DIR={value!r} is a relative path", "to an absolute folder"),
        )
        for where, value in (("plain", "state"), ("tilde", "~/state"))
        for argv in (["gpu", "reset"], ["cap", "apply", "{tmp}/caps.toml"], ["cap", "show"])
    ),
    # The same folders given with --state-dir (and a FIFO): its caps record was said to be
    # "unreadable (Not a directory); remove it and re-apply", a file that is not there to
    # remove; `gpu reset` said so of each GPU's state file; `cap reset` and `gpu settle` said to
    # "remove" /dev/null.
    *(
        C(
            f"state-dir-option-{where}-{'-'.join(argv[:2])}{'-dry-run' if dry else ''}",
            [*argv, *(["--dry-run"] if dry else []), "--state-dir", value],
            files={
                "caps.toml": GOOD_CAPS,
                "file.txt": "x",
                "fifo": Writer(lambda path, env: _fifo(path, env)),
            },
            nvml=True,
            # `gpu reset` too (it exited 3, as if a GPU held changes or another dvfs used it)
            code=1,
            says=(f"state folder {value}", "a file where a folder should be", "--state-dir"),
        )
        for where, value in (
            ("under-a-file", "{tmp}/file.txt/s"),
            ("dev-null", "/dev/null"),
            ("fifo", "{tmp}/fifo"),
        )
        for argv, dry in (
            (["cap", "apply", "{tmp}/caps.toml"], False),
            (["cap", "apply", "{tmp}/caps.toml"], True),
            (["cap", "show"], False),
            (["monitor", "--once", "--gpu", "0"], False),
            *([(["gpu", "reset"], False)] if where != "under-a-file" else []),
        )
    ),
    *(
        C(
            f"state-dir-option-dev-null-{'-'.join(argv[:2])}",
            [*argv, "--state-dir", "/dev/null"],
            nvml=True,
            code=1,
            says=("/dev/null", "a device", "choose another --state-dir"),
        )
        for argv in (["cap", "reset"], ["gpu", "settle", "--gpu", "0", "--clocks", "1980,1500"])
    ),
    # the caps record's lock a link in a loop: a reset and a dry run stopped on an "internal
    # error" (pathlib's RuntimeError) looking for the folder it leads into
    *(
        C(
            f"caps-record-lock-link-loop-{name}",
            [*argv, "--state-dir", "{tmp}/state"],
            files={
                "caps.toml": GOOD_CAPS,
                "state/caps-applied.json.lock": Writer(lambda p, e: p.symlink_to(p.name)),
            },
            nvml=True,
            code=1,
            says=("caps-applied.json.lock", "symbolic links"),
        )
        for name, argv in (
            ("cap-reset", ["cap", "reset"]),
            ("cap-apply-dry-run", ["cap", "apply", "{tmp}/caps.toml", "--dry-run"]),
            ("cap-apply", ["cap", "apply", "{tmp}/caps.toml"]),
        )
    ),
    C("gpu-info-no-such-index", ["gpu", "info", "99"], nvml=True, says=("99",), code=2),
    C(
        "gpu-reset-no-such-uuid",
        ["gpu", "reset", "GPU-nope"],
        nvml=True,
        says=("GPU-nope",),
        code=2,
    ),
    C("cap-reset-no-such-index", ["cap", "reset", "7"], nvml=True, says=("7",), code=2),
    C(
        "cap-apply-gpu-not-here",
        ["cap", "apply", "{tmp}/caps.toml", "--dry-run"],
        files={
            "caps.toml": '[[gpu]]\nuuid = "GPU-00000000-0000-0000-0000-000000000000"\n'
            "power_limit_w = 400\n"
        },
        nvml=True,
        code=2,
        says=("GPU-00000000-0000-0000-0000-000000000000",),
    ),
    C(
        "cap-apply-model-not-here",
        ["cap", "apply", "{tmp}/caps.toml", "--dry-run"],
        files={"caps.toml": '[[model]]\nname = "NVIDIA A100"\npower_limit_w = 400\n'},
        nvml=True,
        code=2,
        says=("A100",),
    ),
    C(
        "cap-plan-gpu-not-a-uuid",
        ["cap", "plan", "{headroom}", "--batch", "1", "--drafter", "eagle3", "--gpu", "0"],
        says=("'0'",),
    ),
    C(
        "cap-plan-gpu-and-model",
        [
            "cap",
            "plan",
            "{headroom}",
            "--batch",
            "1",
            "--drafter",
            "eagle3",
            "--gpu",
            "GPU-1",
            "--model",
            "NVIDIA H100 80GB HBM3",
        ],
        says=("--model",),
    ),
]

# -- more damaged cubes and journals ---------------------------------------------------------


def _journal_off_grid(records: list[dict[str, Any]]) -> list[Any]:
    i = _first_cell(records)
    cell = dict(records[i]["cell"])
    cell["sm_clock_mhz"] = 1005
    records[i] = {**records[i], "cell": cell}
    return records


#: `dvfs gpu roofline --twin h100-sxm`'s file, the same for every writer below: made once.
_TWIN_ROOFLINE = Writer(
    lambda path, env: _assert_ok(
        CliRunner().invoke(cli, ["gpu", "roofline", "--twin", "h100-sxm", "-o", str(path)])
    ),
    same=True,
)


def _assert_ok(result: Any) -> None:
    assert result.exit_code == 0, result.output


def _roofline_with(change: Callable[[Any], Any]) -> Writer:
    """A twin roofline file (`dvfs gpu roofline --twin`), changed before it is saved."""

    def make(path: Path, env: dict[str, Path]) -> None:
        import xarray as xr

        made = path.with_name("made.nc")
        _TWIN_ROOFLINE.write(made, env)
        with xr.open_dataset(made) as ds:
            change(ds.load()).to_netcdf(path)

    return Writer(make, same=True)


def _no_setting(ds: Any) -> Any:
    empty = ds.isel(setting=[])
    for var in empty.variables.values():
        var.encoding = {}  # the chunk sizes of the measured settings do not fit none
    return empty


ROOFLINE_FILES = {
    "binary": (binary_bytes(), ("r.nc", "`dvfs gpu roofline -o FILE`")),
    "a-cube": (
        lambda s: s["cube"].read_bytes(),
        ("r.nc", "dvfs.roofline/1", "`dvfs gpu roofline -o FILE`"),
    ),
    "no-flops": (_roofline_with(lambda ds: ds.drop_vars("flops")), ("r.nc", "flops")),
    "seconds-text": (
        _roofline_with(lambda ds: ds.assign(seconds=ds["seconds"].astype("S8"))),
        ("r.nc", "damaged"),
    ),
    # netCDF, a roofline's variables, what compare and twin fit cannot read in them
    "gpu-name-list": (
        _roofline_with(lambda ds: ds.assign_attrs(gpu_name=[1, 2])),
        ("r.nc", "gpu_name", "`dvfs gpu roofline -o FILE`"),
    ),
    "no-setting": (
        _roofline_with(_no_setting),
        ("r.nc", "no setting", "`dvfs gpu roofline -o FILE`"),
    ),
    "clock-infinite": (
        _roofline_with(lambda ds: ds.assign(sm_clock_mhz=ds["sm_clock_mhz"] * float("inf"))),
        ("r.nc", "sm_clock_mhz", "`dvfs gpu roofline -o FILE`"),
    ),
}


def _profile_with(key: str, value: str) -> Writer:
    """A `dvfs twin fit` profile (fitted to a twin roofline) with `key = value` in its table."""

    def make(path: Path, env: dict[str, Path]) -> None:
        import re

        roofline = path.with_name("roofline.nc")
        _TWIN_ROOFLINE.write(roofline, env)
        _assert_ok(CliRunner().invoke(cli, ["twin", "fit", str(roofline), "-o", str(path)]))
        text = path.read_text()
        path.write_text(re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text))

    return Writer(make)


def _fitted_profile(path: Path, env: dict[str, Path]) -> None:
    """A `dvfs twin fit` profile, fitted to a twin roofline, as it is written."""
    roofline = path.with_name("roofline.nc")
    _TWIN_ROOFLINE.write(roofline, env)
    _assert_ok(CliRunner().invoke(cli, ["twin", "fit", str(roofline), "-o", str(path)]))


_TWIN_PROFILE = Writer(_fitted_profile, same=True)


def _over_limit(limit_name: str) -> Writer:
    """A file one byte over a read limit of dvfs.inputs (sparse: NULs, no disk)."""

    def make(path: Path, env: dict[str, Path]) -> None:
        import dvfs.inputs

        sparse_file(path, getattr(dvfs.inputs, limit_name) + 1)

    return Writer(make)


def _symlink_loop(path: Path, env: dict[str, Path]) -> None:
    path.symlink_to(path.name)  # a link to itself: ELOOP on open


def _dev_zero(path: Path, env: dict[str, Path]) -> None:
    path.symlink_to("/dev/zero")


#: `dvfs cube build`, a resumed sweep and its dry run, of the folder {tmp}/run: (name, the
#: argv before the folder, after it).
_BUILD = ("cube-build", ["cube", "build"], [])
_RESUME = ("sweep", ["sweep", "{tmp}/c.toml", "--out"], ["--no-progress"])
_DRY_RUN = ("dry-run", ["sweep", "{tmp}/c.toml", "--out"], ["--dry-run"])


def _fifo(path: Path, env: dict[str, Path]) -> None:
    import os

    os.mkfifo(path)  # no writer: a reader that opens it waits for ever


#: The shared cube without variables the analyses read (one Writer each, made once).
_WITHOUT_TPOT_AND_ENERGY = _cube_with(lambda ds: ds.drop_vars(["tpot_ms", "energy_per_token_j"]))
_WITHOUT = {
    var: _cube_with(lambda ds, var=var: ds.drop_vars(var))
    for var in ("timeline_t_s", "energy_j", "window_tokens", "energy_draft_j")
}

MORE_CASES = (
    [
        C(
            f"cube-{cmd}-missing-variable",
            [cmd, "{tmp}/cube.nc", *extra],
            files={"cube.nc": _WITHOUT_TPOT_AND_ENERGY},
            code=1,
            says=("cube.nc",),
        )
        for cmd, extra in (("headroom", []), ("compare", []), ("plot", ["--out", "{tmp}/p"]))
    ]
    + [
        C(
            f"cube-{cmd}-no-{var}",
            [cmd, "{tmp}/cube.nc", *extra],
            files={"cube.nc": _WITHOUT[var]},
            code=1,
            says=("cube", var),
        )
        for var in _WITHOUT
        for cmd, extra in (("plot", ["--out", "{tmp}/p"]), ("report", ["-o", "{tmp}/r.html"]))
    ]
    + [
        # "cannot read campaign file c.toml: Too many levels of symbolic links": now said as
        # the other paths read say it (`link_loop_problem`), by the sweep, doctor and corpus
        camp_case("symlink-loop", Writer(_symlink_loop), "{tmp}/c.toml", "a loop"),
        *(
            C(
                f"campaign-symlink-loop-{id}",
                argv,
                files={"c.toml": Writer(_symlink_loop)},
                code=2,
                says=("{tmp}/c.toml", "a loop"),
            )
            for id, argv in (
                ("doctor", ["doctor", "{tmp}/c.toml"]),
                ("corpus-list", ["corpus", "list", "--campaign", "{tmp}/c.toml"]),
            )
        ),
        # a file far larger than any of its kind (a wrong path): refused unread, not read until
        # memory runs out (/dev/zero is one too)
        camp_case("over-16mib", _over_limit("MAX_SETTINGS_BYTES"), "c.toml", "16 MiB"),
        caps_case("over-16mib", _over_limit("MAX_SETTINGS_BYTES"), "caps.toml", "16 MiB"),
        plan_case("over-64mib", _over_limit("MAX_DOCUMENT_BYTES"), "h.json", "64 MiB"),
        C(
            "twin-profile-over-16mib",
            ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
            files={"c.toml": GOOD_TEXT, "p.toml": _over_limit("MAX_SETTINGS_BYTES")},
            code=2,
            says=("p.toml", "16 MiB"),
        ),
        # nested deeper than the parser recurses: exit 1 "one of c.toml, p.toml is nested too
        # deeply" (the handler of last resort), not invalid input naming the file, exit 2
        camp_case("nested-100k-deep", DEEP_TOML, "{tmp}/c.toml:", "nested too deeply"),
        C(
            "doctor-nested-100k-deep",
            ["doctor", "{tmp}/c.toml"],
            files={"c.toml": DEEP_TOML},
            code=2,
            says=("{tmp}/c.toml:", "nested too deeply"),
        ),
        caps_case("nested-100k-deep", DEEP_TOML, "{tmp}/caps.toml:", "nested too deeply"),
        plan_case("nested-100k-deep", DEEP_JSON, "{tmp}/h.json is not JSON", "nested too deeply"),
        plan_case(
            "rows-nested-100k-deep",
            '{"schema": "dvfs.headroom/1", "rows": ' + DEEP_JSON + "}",
            "{tmp}/h.json is not JSON",
            "nested too deeply",
        ),
        C(
            "twin-predict-campaign-nested-100k-deep",
            ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
            files={"c.toml": DEEP_TOML, "p.toml": GOOD_TEXT},
            code=2,
            says=("{tmp}/c.toml:", "nested too deeply"),
        ),
        C(
            "twin-profile-nested-100k-deep",
            ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
            files={"c.toml": GOOD_TEXT, "p.toml": DEEP_TOML},
            code=2,
            says=("{tmp}/p.toml is not a readable TOML profile", "nested too deeply"),
        ),
        C(
            "govern-plan-beyond-64-bits",
            ["govern", "--plan", "{tmp}/p.toml", "--url", "http://127.0.0.1:9", "--dry-run"],
            files={"p.toml": f"dvfs_batch_plan = {2**64}\n"},
            code=2,
            says=("{tmp}/p.toml:", "dvfs_batch_plan", "64 bits"),
        ),
        C(
            "twin-profile-beyond-64-bits",
            ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
            files={"c.toml": GOOD_TEXT, "p.toml": f"[gpu.x]\nidle_w = {10**400}\n"},
            code=2,
            says=("{tmp}/p.toml:", "gpu.x.idle_w", "64 bits"),
        ),
        C(
            "govern-plan-nested-100k-deep",
            ["govern", "--plan", "{tmp}/p.toml", "--url", "http://127.0.0.1:9", "--dry-run"],
            files={"p.toml": DEEP_TOML},
            code=2,
            says=("{tmp}/p.toml:", "nested too deeply"),
        ),
        # a named pipe no program writes to: was waited on for ever, the command hung
        camp_case("fifo", Writer(_fifo), "c.toml", "pipe"),
        C(
            "doctor-fifo",
            ["doctor", "{tmp}/c.toml"],
            files={"c.toml": Writer(_fifo)},
            code=2,
            says=("c.toml", "pipe"),
        ),
        caps_case("fifo", Writer(_fifo), "caps.toml", "pipe"),
        plan_case("fifo", Writer(_fifo), "h.json", "pipe"),
        C(
            "twin-profile-fifo",
            ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
            files={"c.toml": GOOD_TEXT, "p.toml": Writer(_fifo)},
            code=2,
            says=("p.toml", "pipe"),
        ),
        corpus_case("jsonl-symlink-loop", "mine.jsonl", Writer(_symlink_loop), "mine.jsonl"),
        # "caps file caps.toml does not exist", of a link that is there
        caps_case("symlink-loop", Writer(_symlink_loop), "caps.toml", "a loop"),
        # A symbolic link in a loop (or one on the way to the file) given to a path the command
        # reads: click said "Path 'cube.nc' does not exist", the plan "too many levels of
        # symbolic links"; each now says the link is in a loop, as the cube paths do.
        *(
            C(
                f"{id}-symlink-loop",
                argv,
                files={"c.toml": GOOD_TEXT, "p.toml": _TWIN_PROFILE, name: Writer(_symlink_loop)},
                code=2,
                says=(f"{{tmp}}/{name}", "a loop"),
            )
            for id, name, argv in (
                ("twin-fit", "cube.nc", ["twin", "fit", "{tmp}/cube.nc", "-o", "{tmp}/o.toml"]),
                (
                    "twin-predict-campaign",
                    "l.toml",
                    ["twin", "predict", "{tmp}/l.toml", "--profile", "{tmp}/p.toml", "-o", "o"],
                ),
                (
                    "twin-predict-profile",
                    "l.toml",
                    ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/l.toml", "-o", "o"],
                ),
                ("cap-plan", "h.json", ["cap", "plan", "{tmp}/h.json", "--batch", "1"]),
                (
                    "govern-plan",
                    "l.toml",
                    [
                        "govern",
                        "--plan",
                        "{tmp}/l.toml",
                        "--url",
                        "http://127.0.0.1:9",
                        "--dry-run",
                    ],
                ),
            )
        ),
        # A sweep folder whose cube.nc is no file (a FIFO, a device, a link in a loop, a
        # folder): `twin fit DIR` said "holds a sweep journal but no cube.nc: build the cube",
        # whose build fails on it (or writes into it); it says what `cube info DIR` says.
        *(
            C(
                f"sweep-dir-cube-{kind}-{cmd}",
                [*argv, "{tmp}/run"],
                files={
                    "run/journal.jsonl": lambda e: e["journal"].read_bytes(),
                    "run/cube.nc": content,
                },
                code=1,
                says=("run/cube.nc", said),
            )
            for kind, content, said in (
                ("fifo", Writer(_fifo), "no regular file"),
                ("link-to-dev-zero", Writer(_dev_zero), "no regular file"),
                ("link-in-a-loop", Writer(_symlink_loop), "a loop"),
                ("folder", DIR, "is a folder"),
            )
            for cmd, argv in (
                ("twin-fit", ["twin", "fit", "-o", "{tmp}/p.toml"]),
                ("cube-info", ["cube", "info"]),
            )
        ),
        # The sweep folder's cube.nc a link into a folder that does not exist: twin fit said
        # "build the cube with `dvfs cube build run`", which refuses to write through that link
        C(
            "twin-fit-sweep-dir-cube-link-into-no-folder",
            ["twin", "fit", "{tmp}/run", "-o", "{tmp}/p.toml"],
            files={
                "run/journal.jsonl": lambda e: e["journal"].read_bytes(),
                "run/cube.nc": Writer(
                    lambda p, e: p.symlink_to(p.parent.parent / "nowhere" / "cube.nc")
                ),
            },
            code=2,
            says=("{tmp}/run/cube.nc", "{tmp}/nowhere", "make that folder", "dvfs cube build"),
        ),
        # The sweep folder's journal.jsonl a link in a loop or to no file, and no cube.nc:
        # twin fit said "neither a roofline file nor a cube" of the sweep folder; it says what
        # `cube build DIR` says of that journal.
        *(
            C(
                f"twin-fit-sweep-dir-journal-{kind}",
                ["twin", "fit", "{tmp}/run", "-o", "{tmp}/p.toml"],
                files={"run/journal.jsonl": content},
                code=1,
                says=("run/journal.jsonl", said, "rerun its `dvfs sweep` command"),
            )
            for kind, content, said in (
                ("link-in-a-loop", Writer(_symlink_loop), "a loop"),
                (
                    "link-to-no-file",
                    Writer(lambda p, e: p.symlink_to(p.parent / "gone.jsonl")),
                    "which does not exist",
                ),
            )
        ),
        C(
            "twin-fit-symlink-loop-on-the-way",
            ["twin", "fit", "{tmp}/l/cube.nc", "-o", "{tmp}/o.toml"],
            files={"l": Writer(_symlink_loop)},
            code=2,
            says=("on the way to {tmp}/l/cube.nc", "a loop"),
        ),
        C(
            "cube-info-symlink-loop",
            ["cube", "info", "{tmp}/cube.nc"],
            files={"cube.nc": Writer(_symlink_loop)},
            code=1,
            says=("cube.nc",),
        ),
        *(
            C(
                f"cube-{cmd}-fifo",
                argv,
                files={"cube.nc": Writer(_fifo)},
                code=code,
                says=("cube.nc", "no regular file"),
            )
            for cmd, argv, code in (
                ("info", ["cube", "info", "{tmp}/cube.nc"], 1),
                ("compare", ["compare", "{tmp}/cube.nc"], 1),
                ("merge", ["cube", "merge", "{tmp}/cube.nc", "{cube}", "-o", "{tmp}/m.nc"], 1),
                # twin fit said "neither a roofline file nor a cube (or it is damaged ...)"
                ("twin-fit", ["twin", "fit", "{tmp}/cube.nc", "-o", "{tmp}/p.toml"], 2),
            )
        ),
        C(
            "twin-fit-dev-zero",
            ["twin", "fit", "/dev/zero", "-o", "{tmp}/p.toml"],
            code=2,
            says=("/dev/zero", "no regular file"),
        ),
        journal_case("cell-off-grid", _journal_edit(_journal_off_grid), "journal.jsonl"),
        # A journal that is no regular file: a FIFO was waited on for ever (`cube build`, the
        # sweep, its dry run, the doctor), and the dry run, which skipped any journal that was
        # no regular file, planned a fresh run where the sweep refuses the folder.
        *(
            C(
                f"journal-{kind}-{cmd}",
                [*argv, "{tmp}/run", *extra],
                files={"c.toml": GOOD_TEXT, "run/journal.jsonl": content},
                code=1,
                says=("journal.jsonl", *says),
                chatty=cmd == "sweep",
            )
            for kind, content, says, cmd, argv, extra in (
                ("fifo", Writer(_fifo), ("no regular file",), *_BUILD),
                ("fifo", Writer(_fifo), ("no regular file",), *_RESUME),
                ("fifo", Writer(_fifo), ("no regular file",), *_DRY_RUN),
                ("link-to-dev-zero", Writer(_dev_zero), ("no regular file",), *_DRY_RUN),
                ("directory", DIR, ("is a folder", "move it aside"), *_DRY_RUN),
            )
        ),
        # The sweep folder itself a symbolic link in a loop: `cube build` said "no journal at
        # run/journal.jsonl ... is run the --out folder of a `dvfs sweep`?", of a link that is
        # there; the loop is named, as the other paths read say it (`link_loop_problem`).
        C(
            "cube-build-folder-symlink-loop",
            ["cube", "build", "{tmp}/run"],
            files={"run": Writer(_symlink_loop)},
            code=1,
            says=("{tmp}/run is a symbolic link in a loop", "folder"),
        ),
        # No newline for ever: read line by line it would take all the memory (`MAX_LINE_BYTES`).
        journal_case("sparse-50g", Writer(lambda p, e: sparse_file(p, 50 << 30)), "64 MiB"),
        # A GPU's state file that is no regular file or far too large: a FIFO was waited on for
        # ever, /dev/zero and a 50 GiB file read until memory ran out ("out of memory working
        # on" the caps file), a folder's advice was to "give a file's path for --state-dir".
        *(
            C(
                f"gpu-state-file-{kind}-{'-'.join(argv[:2])}",
                [*argv, "--state-dir", "{tmp}/state"],
                files={_STATE: content, "caps.toml": GOOD_CAPS},
                nvml=True,
                code=3,
                says=("{tmp}/state", "unreadable", why),
            )
            for kind, content, why in (
                ("fifo", Writer(_fifo), "no regular file"),
                ("link-to-dev-zero", Writer(_dev_zero), "no regular file"),
                ("sparse-50g", Writer(lambda p, e: sparse_file(p, 50 << 30)), "1 MiB"),
                ("directory", DIR, "is a directory"),
            )
            for argv in (["gpu", "reset"], ["cap", "apply", "{tmp}/caps.toml"])
        ),
        # A GPU's lock file that is no regular file: a FIFO hung `cap apply --dry-run` for ever;
        # a FIFO or a device failed the apply as "cannot use: invalid argument", no path named;
        # a folder passed the dry run (exit 0) that the apply refused.
        *(
            C(
                f"gpu-lock-file-{kind}-{'-'.join(argv[:2])}{'-dry-run' if dry else ''}",
                [*argv, *(["--dry-run"] if dry else []), "--state-dir", "{tmp}/state"],
                files={"state/{uuid0}.lock": content, "caps.toml": GOOD_CAPS},
                nvml=True,
                code=1,  # no lock of another dvfs's (3): a file to move aside
                says=("{tmp}/state/", ".lock", "no regular file"),
            )
            for kind, content in (
                ("fifo", Writer(_fifo)),
                ("link-to-dev-zero", Writer(_dev_zero)),
                ("directory", DIR),
            )
            for argv, dry in (
                (["cap", "apply", "{tmp}/caps.toml"], True),
                (["cap", "apply", "{tmp}/caps.toml"], False),
                (["gpu", "settle", "--gpu", "0", "--clocks", "1980,1500"], False),
            )
        ),
        # The caps record and a governor's record beside the GPUs' state files, read as those
        # are: a FIFO hung `cap show`, `cap apply` (its dry run too), `cap reset` (the caps
        # unit's stop) and `gpu reset` for ever, /dev/zero was read until memory ran out, and a
        # folder's advice was to "give a file's path for --state-dir". A damaged record is
        # dvfs's own, no bad usage: exit 1, as `monitor` exits on it.
        *(
            C(
                f"{record.split('-')[0]}-record-{kind}-{'-'.join(argv[:2])}",
                [*argv, "--state-dir", "{tmp}/state"],
                files={f"state/{record}": content, "caps.toml": GOOD_CAPS},
                nvml=True,
                code=1,
                says=(f"{{tmp}}/state/{record}", "unreadable", why),
            )
            for kind, content, why in (
                ("fifo", Writer(_fifo), "no regular file"),
                ("link-to-dev-zero", Writer(_dev_zero), "no regular file"),
                ("directory", DIR, "is a directory"),
            )
            for record, argv in (
                ("caps-applied.json", ["cap", "show"]),
                ("caps-applied.json", ["cap", "apply", "{tmp}/caps.toml", "--dry-run"]),
                ("caps-applied.json", ["cap", "reset"]),
                ("governed-{uuid0}.json", ["cap", "show"]),
                ("governed-{uuid0}.json", ["gpu", "reset"]),
            )
        ),
        *(
            C(
                f"twin-profile-{id}",
                ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o", "{tmp}/o"],
                files={"c.toml": GOOD_TEXT, "p.toml": _profile_with(key, value)},
                code=2,
                says=("p.toml", key),
            )
            for id, key, value in (
                ("count-text", "sm_count", '"many"'),
                ("efficiency-text", "verify_attention_efficiency", '"half"'),
                ("bandwidth-zero", "hbm_bandwidth_gb_s", "0"),
                ("clock-step-zero", "sm_clock_step_mhz", "0"),
                ("efficiency-nan", "gemm_efficiency", "nan"),
                ("nvlink-zero", "nvlink_gb_s", "0"),
                ("limit-min-above-default", "power_limit_min_w", "5000.0"),
                ("name-number", "nvml_name", "5"),
            )
        ),
        *(
            C(
                f"roofline-{kind}-{cmd}",
                argv,
                files={"r.nc": content},
                code=(1, 2),
                says=says,
            )
            for kind, (content, says) in ROOFLINE_FILES.items()
            for cmd, argv in (
                ("compare", ["compare", "{cube}", "--roofline", "{tmp}/r.nc"]),
                ("twin-fit", ["twin", "fit", "{tmp}/r.nc", "-o", "{tmp}/p.toml"]),
            )
            if not (kind == "a-cube" and cmd == "twin-fit")  # a cube is what twin fit also takes
        ),
        # `compare --roofline` on a path that is there but no roofline file said there was no
        # file at all (and a FIFO would be waited on for ever); the JSON view of one (`dvfs gpu
        # roofline --json`) is said to be that, not a damaged netCDF file
        *(
            C(
                f"roofline-{kind}-compare",
                ["compare", "{cube}", "--roofline", "{tmp}/r.nc"],
                files={"r.nc": content},
                code=1,
                says=says,
            )
            for kind, content, says in (
                ("fifo", Writer(_fifo), ("r.nc", "no regular file")),
                (
                    "link-to-dev-zero",
                    Writer(lambda path, env: path.symlink_to("/dev/zero")),
                    ("r.nc", "no regular file"),
                ),
                ("json-view", '{"schema": "dvfs.roofline/1"}\n', ("r.nc", "JSON", "-o FILE")),
                # "no roofline file at r.nc (write one with `dvfs gpu roofline`)", which then
                # failed on the link
                (
                    "link-in-a-loop",
                    Writer(lambda path, env: path.symlink_to(path.name)),
                    ("r.nc", "a loop", "-o FILE"),
                ),
            )
        ),
        # A folder where `dvfs cube build DIR` writes DIR/cube.nc by default: "give a file's
        # path for SWEEP_DIR", the folder it reads.
        C(
            "cube-build-default-out-a-folder",
            ["cube", "build", "{tmp}/run"],
            files={"run/journal.jsonl": lambda s: s["journal"].read_bytes(), "run/cube.nc": DIR},
            code=1,
            says=("run/cube.nc", "a folder", "--out"),
        ),
        # A folder where the sweep writes its cube: the sweep measured every cell, then failed
        # "cannot write the cube run/cube.nc: Is a directory" (its dry run said nothing).
        *(
            C(
                f"sweep-cube-a-folder-{id}",
                [*argv, "{tmp}/run", *extra],
                files={"c.toml": GOOD_TEXT, "p.toml": _TWIN_PROFILE, "run/cube.nc": DIR},
                code=2,
                says=("run/cube.nc", "is a folder", "move it aside"),
                chatty=True,
            )
            for id, argv, extra in (
                ("sweep", ["sweep", "{tmp}/c.toml", "--out"], ["--no-progress"]),
                (
                    "twin-predict",
                    ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o"],
                    ["--no-progress"],
                ),
                ("demo", ["demo", "--out"], ["--no-progress"]),
            )
        ),
        # A folder named sweep.lock in the output folder: "cannot use run as the output folder
        # (run/sweep.lock): Is a directory", no way round it named.
        *(
            C(
                f"sweep-lock-a-folder-{id}",
                [*argv, "{tmp}/run", "--no-progress"],
                files={"c.toml": GOOD_TEXT, "p.toml": _TWIN_PROFILE, "run/sweep.lock": DIR},
                code=1,
                says=("run/sweep.lock", "move it aside", "--out"),
                chatty=True,
            )
            for id, argv in (
                ("sweep", ["sweep", "{tmp}/c.toml", "--out"]),
                (
                    "twin-predict",
                    ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o"],
                ),
            )
        ),
        # sweep.lock a link into a folder that is not there: "cannot use run as the output
        # folder (run/sweep.lock): No such file or directory", neither the link nor a way out
        # named.
        *(
            C(
                f"sweep-lock-a-link-into-no-folder-{id}",
                [*argv, "{tmp}/run", "--no-progress"],
                files={
                    "c.toml": GOOD_TEXT,
                    "p.toml": _TWIN_PROFILE,
                    "run/sweep.lock": Writer(lambda p, e: p.symlink_to("missing/sweep.lock")),
                },
                code=1,
                says=("run/sweep.lock", "missing/sweep.lock", "does not exist", "--out"),
            )
            for id, argv in (
                ("sweep", ["sweep", "{tmp}/c.toml", "--out"]),
                (
                    "twin-predict",
                    ["twin", "predict", "{tmp}/c.toml", "--profile", "{tmp}/p.toml", "-o"],
                ),
                ("demo", ["demo", "--out"]),
            )
        ),
        # Something in the way of a file or folder the command makes from its output option (a
        # figure in --out, report.md's figures folder beside it): "give a file's path for
        # path", "remove it or choose another path", "give a file's path for --out" (a folder
        # option) named no way round it.
        *(
            C(
                f"{id}-in-the-way",
                argv,
                files={rel: content},
                code=1,
                says=(rel, advice, option),
            )
            for id, argv, rel, content, advice, option in (
                (
                    "report-md-figure-a-folder",
                    ["report", "{cube}", "-o", "{tmp}/r.md"],
                    "r_figures/01_pareto_code.png",
                    DIR,
                    "move that folder aside",
                    "--output",
                ),
                (
                    "report-md-figures-folder-a-file",
                    ["report", "{cube}", "-o", "{tmp}/r.md"],
                    "r_figures",
                    "x",
                    "remove it",
                    "--output",
                ),
                (
                    "plot-figure-a-folder",
                    ["plot", "{cube}", "--out", "{tmp}/p"],
                    "p/pareto_code.png",
                    DIR,
                    "move that folder aside",
                    "--out",
                ),
            )
        ),
        corpus_case(
            "path-empty-string",
            "x",
            None,
            "folder",
            spec={"path": "", "field": "text", "format": "jsonl"},
        ),
    ]
)

# -- command-line flags ----------------------------------------------------------------------

H = ["headroom", "{cube}"]
#: `dvfs cap plan` on the shared headroom document, for one batch and drafter (add -o).
CAP_PLAN = ["cap", "plan", "{headroom}", "--batch", "1", "--drafter", "eagle3"]

FLAG_CASES = [
    C("slack-nan", [*H, "--slack", "nan"], says=("nan",)),
    C("slack-inf", [*H, "--slack", "inf"], says=("inf",)),
    C("slack-inf-percent", [*H, "--slack", "inf%"], says=("inf",)),
    C("slack-negative", [*H, "--slack", "-5%"], says=("-5%",)),
    C("slack-word", [*H, "--slack", "abc"], says=("abc",)),
    C("slack-empty", [*H, "--slack", ""], says=("slack",)),
    C("slack-double-percent", [*H, "--slack", "5%%"], says=("5%%",)),
    C("slack-ambiguous", [*H, "--slack", "5"], says=("5",)),
    C("slack-with-slo", [*H, "--slack", "5%", "--slo", "tpot_p90<=50ms"], says=("--slack",)),
    C("json-with-markdown", [*H, "--json", "--markdown"], says=("--json", "--markdown")),
    C(
        "preserve-with-vs-baseline",
        [*H, "--preserve", "--vs-baseline"],
        code=2,
        says=("--preserve",),
    ),
    C("slo-no-quantile", [*H, "--slo", "tpot<=50ms"], says=("tpot<=50ms",)),
    C("slo-garbage", [*H, "--slo", "fast please"], says=("fast please",)),
    C("slo-zero", [*H, "--slo", "tpot_p90<=0ms"], says=("slo",)),
    C("slo-unknown-metric", [*H, "--slo", "e2e_p90<=50ms"], says=("e2e_p90",)),
    C("slo-unknown-unit", [*H, "--slo", "tpot_p90<=50us"], says=("50us",)),
    C("confidence-above-one", [*H, "--confidence", "1.5"], says=("confidence",)),
    C("confidence-zero", [*H, "--confidence", "0"], says=("confidence",)),
    C("confidence-nan", [*H, "--confidence", "nan"], says=("confidence",)),
    C("confidence-word", [*H, "--confidence", "high"], code=2, says=("high",)),
    C("baseline-unknown", [*H, "--baseline", "medusa"], says=("medusa",)),
    C("metric-unknown", [*H, "--metric", "e2e"], code=2, says=("e2e",)),
    C("quantile-unknown", [*H, "--quantile", "p95"], code=2, says=("p95",)),
    C("knob-unknown", [*H, "--knob", "voltage"], code=2, says=("voltage",)),
    C("drafter-filter-unknown", [*H, "--drafter", "medusa"], says=("medusa",)),
    C("corpus-filter-unknown", [*H, "--corpus", "klingon"], says=("klingon",)),
    C("batch-filter-unknown", [*H, "--batch", "999"], says=("999",)),
    C("batch-filter-not-int", [*H, "--batch", "big"], code=2, says=("big",)),
    C(
        "headroom-out-under-a-file",
        [*H, "-o", "{tmp}/file.txt/h.json"],
        code=1,
        says=("{tmp}/file.txt",),
        files={"file.txt": "x"},
    ),
    C("headroom-out-is-a-dir", [*H, "-o", "{tmp}"], code=2, says=("{tmp}",)),
    C("headroom-out-full-disk", [*H, "-o", "/dev/full"], code=1, says=("/dev/full", "space")),
    # An output on the kernel's file systems: "no such file or folder; check the path (does
    # its folder exist?)" of /proc, "permission denied; check permissions" of /sys (to root).
    C(
        "headroom-out-under-proc",
        [*H, "-o", "/proc/dvfs-test-h.json"],
        code=1,
        says=("/proc/dvfs-test-h.json: /proc is the kernel's proc file system", "for --output"),
    ),
    C(
        "plot-out-under-sys",
        ["plot", "{cube}", "--out", "/sys/dvfs-test-plots"],
        code=1,
        says=("/sys is the kernel's sysfs file system", "choose a folder on a disk for --out"),
    ),
    C(
        "report-out-under-sys",
        ["report", "{cube}", "-o", "/sys/kernel/dvfs-test.html"],
        code=1,
        says=("/sys is the kernel's sysfs file system", "choose a folder on a disk for --output"),
    ),
    C("headroom-unknown-option", [*H, "--slak", "5%"], code=2, says=("--slak",)),
    C("compare-baseline-unknown", ["compare", "{cube}", "--baseline", "medusa"], says=("medusa",)),
    C("compare-drafter-unknown", ["compare", "{cube}", "--drafter", "medusa"], says=("medusa",)),
    C(
        "compare-json-with-markdown",
        ["compare", "{cube}", "--json", "--markdown"],
        says=("--json", "--markdown"),
    ),
    C(
        "plot-format-unknown",
        ["plot", "{cube}", "--out", "{tmp}/p", "--format", "gif"],
        code=2,
        says=("gif",),
    ),
    C("plot-slack-word", ["plot", "{cube}", "--out", "{tmp}/p", "--slack", "abc"], says=("abc",)),
    C(
        "plot-out-under-a-file",
        ["plot", "{cube}", "--out", "{tmp}/file.txt/p"],
        code=1,
        says=("{tmp}/file.txt",),
        files={"file.txt": "x"},
    ),
    C(
        "report-out-under-a-file",
        ["report", "{cube}", "-o", "{tmp}/file.txt/new/r.html"],
        code=1,
        says=("{tmp}/file.txt", "a part of the path is a file"),
        files={"file.txt": "x"},
    ),
    C("cube-info-json-and-extra-arg", ["cube", "info", "{cube}", "extra"], code=2, says=("extra",)),
    C("no-such-command", ["sweeep"], code=2, says=("sweeep",)),
    C("doctor-missing-campaign", ["doctor", "{tmp}/nope.toml"], code=2, says=("nope.toml",)),
    C(
        "doctor-binary-campaign",
        ["doctor", "{tmp}/c.toml"],
        files={"c.toml": binary_bytes()},
        code=2,
        says=("c.toml",),
    ),
    C(
        "doctor-bad-key",
        ["doctor", "{tmp}/c.toml"],
        files={"c.toml": campaign(("workload.batch", [0]))},
        code=2,
        says=("workload.batch",),
    ),
    C(
        "cube-merge-out-under-a-file",
        ["cube", "merge", "{cube}", "{tmp}/other.nc", "-o", "{tmp}/file.txt/m.nc"],
        files={"file.txt": "x", "other.nc": _cube_with(_on_another_gpu)},
        code=1,
        says=("choose a path inside a folder for --out",),
    ),
    C("gpu-info-twin-uuid", ["gpu", "info", "--twin", "h100-sxm", "GPU-xyz"], says=("GPU-xyz",)),
    C("verbose-unknown-option", ["-vv", "--bogus"], code=2, says=("--bogus",)),
    C("sweep-no-campaign", ["sweep"], code=2, says=("CAMPAIGN_FILE",)),
    C(
        "sweep-out-under-a-file",
        ["sweep", "{tmp}/c.toml", "--out", "{tmp}/file.txt/out", "--no-progress"],
        files={"c.toml": GOOD_TEXT, "file.txt": "x"},
        code=1,
        says=("{tmp}/file.txt",),
        chatty=True,
    ),
    C(
        "sweep-out-is-a-file",
        ["sweep", "{tmp}/c.toml", "--out", "{tmp}/file.txt"],
        files={"c.toml": GOOD_TEXT, "file.txt": "x"},
        code=2,
        says=("file.txt",),
    ),
    C(
        "sweep-out-dev-full",
        ["sweep", "{tmp}/c.toml", "--out", "/dev/full"],
        files={"c.toml": GOOD_TEXT},
        code=(1, 2),
        says=("/dev/full",),
        chatty=True,
    ),
    C(
        "cube-build-out-under-a-file",
        ["cube", "build", "{sweep}", "-o", "{tmp}/file.txt/c.nc"],
        files={"file.txt": "x"},
        code=1,
        says=("{tmp}/file.txt",),
    ),
    C("gpu-list-unknown-twin", ["gpu", "list", "--twin", "a100"], says=("a100",)),
]

# -- filesystem faults on outputs ------------------------------------------------------------

FAULTS = {
    "read-only": (errno.EROFS, 1, "read-only"),
    "full-disk": (errno.ENOSPC, 1, "space"),
    "no-permission": (errno.EACCES, 1, "permission"),
}

FAULT_CASES = [
    C(
        f"fault-{cmd}-{kind}",
        argv,
        files=files,
        code=code,
        says=("{tmp}/ro", words),
        fault=("ro", err),
        chatty=cmd in ("sweep", "cap-plan-o"),
    )
    for kind, (err, code, words) in FAULTS.items()
    for cmd, argv, files in (
        (
            "sweep",
            ["sweep", "{tmp}/c.toml", "--out", "{tmp}/ro/out", "--no-progress"],
            {"c.toml": GOOD_TEXT},
        ),
        ("cube-build", ["cube", "build", "{sweep}", "-o", "{tmp}/ro/cube.nc"], {}),
        ("headroom-o", [*H, "-o", "{tmp}/ro/h.json"], {}),
        ("plot", ["plot", "{cube}", "--out", "{tmp}/ro/plots"], {}),
        ("report-new-folder", ["report", "{cube}", "-o", "{tmp}/ro/new/r.html"], {}),
        ("cap-plan-o", [*CAP_PLAN, "-o", "{tmp}/ro/caps.toml"], {}),
    )
]

# A read-only or full disk, or a folder this user may not write, under the input's own folder:
# the advice names the output option (the way round it), never the input (`dvfs cube build
# DIR` said "check permissions or choose another SWEEP_DIR").
FAULT_CASES += [
    C(
        f"fault-{cmd}-beside-its-input-{kind}",
        argv,
        files=files,
        code=1,
        says=("{tmp}/ro", words, option),
        fault=("ro", err),
    )
    for kind, (err, _, words) in FAULTS.items()
    for cmd, argv, files, option in (
        (
            "headroom-o",
            ["headroom", "{tmp}/ro", "-o", "{tmp}/ro/h.json"],
            {"ro/cube.nc": lambda s: s["cube"].read_bytes()},
            "another --output",
        ),
        (
            "cube-build-default-out",
            ["cube", "build", "{tmp}/ro"],
            {"ro/journal.jsonl": lambda s: s["journal"].read_bytes()},
            "another --out",
        ),
        (
            "twin-fit-o",
            ["twin", "fit", "{tmp}/ro", "-o", "{tmp}/ro/p.toml"],
            {"ro/cube.nc": lambda s: s["cube"].read_bytes()},
            "another --out",
        ),
    )
]

ALL_CASES = [
    *CAMPAIGN_FILE_CASES,
    *CAMPAIGN_KEY_CASES,
    *CORPUS_CASES,
    *CAPS_CASES,
    *PLAN_CASES,
    *JOURNAL_CASES,
    *CUBE_CASES,
    *ATTRIBUTE_CASES,
    *FLAG_CASES,
    *FAULT_CASES,
    *GPU_CASES,
    *MORE_CASES,
]

# Cases still failing in code other engineers own: listed for the integrator (see the report).
XFAIL: dict[str, str] = {}


def _params() -> list[Any]:
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    out = []
    for c in ALL_CASES:
        reason = c.xfail or XFAIL.get(c.id)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


# -- fixtures and the check ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One finished tiny sweep (4 cells, well under a second) and its headroom JSON, made once
    per session (`made_once`: the xdist workers share it), read-only."""
    base = made_once(tmp_path_factory, "bad_inputs-shared", _make_shared)
    sweep_dir, headroom = base / "sweep", base / "headroom.json"
    return {
        "sweep": sweep_dir,
        "cube": sweep_dir / "cube.nc",
        "journal": sweep_dir / "journal.jsonl",
        "headroom": headroom,
    }


def _make_shared(base: Path) -> None:
    """`shared`'s files in `base`: the sweep, and its headroom JSON."""
    (base / "tiny.toml").write_text(campaign(), encoding="utf-8")
    sweep_dir = base / "sweep"
    runner = CliRunner()
    result = runner.invoke(
        cli, ["sweep", str(base / "tiny.toml"), "--out", str(sweep_dir), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    headroom = base / "headroom.json"
    # A loose target, so that the chosen settings are below stock and `cap plan` has caps to write.
    result = runner.invoke(
        cli, ["headroom", str(sweep_dir), "--slack", "50%", "--json", "-o", str(headroom)]
    )
    assert result.exit_code == 0, result.output


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nvml_support import load_fake, root_fake_env

    root_fake_env(tmp_path, monkeypatch)
    module = load_fake()
    module.fake_reset_state()
    monkeypatch.setitem(sys.modules, "pynvml", module)


def _fill(text: str, places: dict[str, str]) -> str:
    for key, value in places.items():
        text = text.replace("{" + key + "}", value)
    return text


def _materialise(files: Files, tmp: Path, shared: dict[str, Path]) -> None:
    env = {"tmp": tmp, **shared}
    for rel, content in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is DIR:
            path.mkdir(exist_ok=True)
            continue
        if isinstance(content, Writer):
            content.write(path, env)
            continue
        if callable(content):
            content = content(env)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)


def check_one_clean_error(result: Any, case: Case, places: dict[str, str]) -> None:
    """Non-zero exit, one error line on stderr naming the problem, no traceback."""
    shown = f"exit {result.exit_code}\n--- stdout:\n{result.stdout}\n--- stderr:\n{result.stderr}"
    assert "Traceback" not in result.output, shown
    assert isinstance(result.exception, SystemExit), f"{result.exception!r}\n{shown}"
    assert result.exit_code != 0, f"silently accepted\n{shown}"
    if case.code is not None:
        codes = case.code if isinstance(case.code, tuple) else (case.code,)
        assert result.exit_code in codes, shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, f"nothing on stderr\n{shown}"
    if lines[0].startswith("Usage:"):  # click's usage error: Usage / Try / Error
        assert lines[-1].startswith("Error:"), shown
        assert all(x.startswith(("Usage:", "Try ")) for x in lines[:-1]), shown
    elif not case.chatty:
        assert len(lines) == 1, f"more than one line on stderr\n{shown}"
    error = lines[-1]
    assert len(error) > 15, shown
    for needle in case.says:
        assert _fill(needle, places).lower() in error.lower(), f"{needle!r} not named\n{shown}"


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_clean_error(
    case: Case,
    shared: dict[str, Path],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # in the case's own folder: a relative path a command wrongly takes lands there, not in
    # the repository
    monkeypatch.chdir(tmp_path)
    places = {"tmp": str(tmp_path), **{k: str(v) for k, v in shared.items()}}
    if case.nvml:
        request.getfixturevalue("fake_nvml")
        listed = CliRunner().invoke(cli, ["gpu", "list", "--json"])
        places["uuid0"] = json.loads(listed.stdout)[0]["uuid"]
    _materialise({_fill(k, places): v for k, v in case.files.items()}, tmp_path, shared)
    argv = [_fill(a, places) for a in case.argv]
    runner = CliRunner(env={k: _fill(v, places) for k, v in case.env.items()})
    if case.fault:
        folder, code = case.fault
        with failing_writes(tmp_path / folder, code):
            result = runner.invoke(cli, argv)
    else:
        result = runner.invoke(cli, argv)
    check_one_clean_error(result, case, places)


def test_the_matrix_is_big_enough() -> None:
    assert len(ALL_CASES) >= 130


# -- the generic error layer itself ----------------------------------------------------------


def test_an_unexpected_exception_is_one_line_and_vv_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dvfs.corpora.sampling

    def boom(corpus: Any) -> Any:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(dvfs.corpora.sampling, "corpus_stats", boom)
    quiet = CliRunner().invoke(cli, ["corpus", "list"])
    assert isinstance(quiet.exception, SystemExit) and quiet.exit_code == 1
    assert "Traceback" not in quiet.output
    [line] = quiet.stderr.splitlines()
    assert line.startswith("Error: internal error: RuntimeError: boom;") and "-vv" in line
    # followed as said: -vv is dvfs's own option, before the command ("rerun with -vv" read
    # as `dvfs corpus list -vv` was refused: "No such option: -v")
    if "rerun as `" in line:
        said = line.split("rerun as `", 1)[1].split("`", 1)[0]
        again = said.replace("COMMAND ...", "corpus list").split()[1:]
    else:
        again = ["corpus", "list", "-vv"]
    loud = CliRunner().invoke(cli, again)
    assert loud.exit_code == 1 and "Traceback" in loud.stderr and "second line" in loud.stderr
    assert loud.stderr.splitlines()[-1].startswith("Error: internal error: RuntimeError: boom;")


def test_a_command_that_cannot_import_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.lazy_commands, "corpus", ("dvfs.cli.no_such_module", "corpus", "x"))
    result = CliRunner().invoke(cli, ["corpus", "list"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert "cannot import dvfs.cli.no_such_module" in line


def test_messages_are_one_printable_bounded_line() -> None:
    from dvfs.cli.common import MAX_MESSAGE_CHARS, one_line

    text = one_line("a\nb\r\nc\u2028d\x00e\x1bf\x85g " + "x" * 5000)
    assert len(text.splitlines()) == 1 and len(text) == MAX_MESSAGE_CHARS
    assert text.startswith("a b c\\u2028d\\x00e\\x1bf\\x85g x") and text.endswith("...")


def test_a_closed_pipe_stops_quietly() -> None:
    """`dvfs ... | head`: the reader goes away; no traceback, no error line, exit 1."""
    import subprocess

    from conftest import PYTHON, subprocess_env

    proc = subprocess.Popen(
        [PYTHON, "-m", "dvfs", "corpus", "show", "code", "--json", "-n", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before dvfs has imported anything, let alone written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == "", err


def test_an_argument_of_bytes_not_utf8_is_said_to_be_that_not_an_output_encoding(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs twin fit CUBE --name $'my\\xffgpu'`: Python carries the byte as a surrogate,
    which no encoding writes, and the error said "set PYTHONIOENCODING=utf-8 (or a UTF-8
    locale) and rerun", which changes nothing under a UTF-8 locale. It names the byte and says
    to give the argument in UTF-8."""
    from conftest import PYTHON, subprocess_env

    proc = subprocess.run(
        [PYTHON, "-m", "dvfs", "twin", "fit", str(shared["cube"]), "-o", str(tmp_path / "p.toml")]
        + ["--name", b"my\xffgpu"],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONIOENCODING="utf-8", LC_ALL="C.UTF-8"),
        timeout=300,
    )
    assert proc.returncode in (1, 2), proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert "PYTHONIOENCODING" not in line, line
    assert "bytes that are not UTF-8 (0xff)" in line and "give it in UTF-8" in line, line


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (MemoryError(), "out of memory working on {campaign}"),
        (RecursionError("maximum recursion depth exceeded"), "{campaign} is nested too deeply"),
        (UnicodeDecodeError("utf-8", b"ab\ncd\xff", 5, 6, "invalid start byte"), "line 2"),
        (OSError(errno.EIO, "Input/output error", "/x/y"), "cannot use /x/y: input/output error"),
        (OSError(errno.EMFILE, "Too many open files"), "ulimit -n"),
        (ImportError("no module named pyarrow", name="pyarrow"), "cannot import pyarrow"),
        (UnicodeEncodeError("ascii", "caf\u00e9", 3, 4, "no"), "PYTHONIOENCODING=utf-8"),
    ],
    ids=["memory", "recursion", "unicode-decode", "eio", "emfile", "import", "unicode-encode"],
)
def test_generic_failures_are_one_line(
    exc: BaseException, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dvfs.cli.corpus

    def raise_it(campaign_file: Any) -> Any:
        raise exc

    monkeypatch.setattr(dvfs.cli.corpus, "_corpora", raise_it)
    campaign_file = tmp_path / "c.toml"
    campaign_file.write_text(campaign(), encoding="utf-8")
    result = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign_file)])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1
    assert "Traceback" not in result.output
    [line] = result.stderr.splitlines()
    assert says.format(campaign=campaign_file) in line, line


# -- outputs: a failed write keeps the file that was there; a FIFO or device is not replaced --

#: Commands that write one file over an existing one: (argv, the option naming the file).
OVERWRITES = {
    "headroom-o": ["headroom", "{sweep}", "--json", "-o", "{out}"],
    "cap-plan-o": [*CAP_PLAN, "-o", "{out}"],
    "cap-plan-per-batch-o": [
        "cap",
        "plan",
        "{headroom}",
        "--per-batch",
        "--drafter",
        "eagle3",
        "-o",
        "{out}",
    ],
    # a cube the fit settles on in ~100 solver steps (`shared`'s 4 cells take ~1500: seconds)
    "twin-fit-o": ["twin", "fit", "{fit_cube}", "-o", "{out}"],
    "report-o": ["report", "{cube}", "-o", "{out}"],
    "cube-build-o": ["cube", "build", "{sweep}", "-o", "{out}"],
    "roofline-o": ["gpu", "roofline", "--twin", "h100-sxm", "-o", "{out}"],
}


def _argv(name: str, shared: dict[str, Path], out: Path) -> list[str]:
    places = {"out": str(out), **{k: str(v) for k, v in shared.items()}}
    return [_fill(a, places) for a in OVERWRITES[name]]


def _capped_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a dvfs run under a file-size limit: no bytecode written (Python
    ignores a short write of a .pyc and would leave it cut short for later runs) and
    matplotlib's caches in `tmp_path` (not the user's)."""
    from conftest import subprocess_env

    return subprocess_env(PYTHONDONTWRITEBYTECODE="1", MPLCONFIGDIR=str(tmp_path / "mpl"))


def _small_files(limit: int) -> None:
    """Files of this process may not grow past `limit` bytes from now on: a write past it
    fails part-way through (EFBIG, SIGXFSZ ignored), as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _run_capped(argv: list[str], limit: int, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`dvfs ARGV` in a child whose files may not grow past `limit` bytes (`_small_files`)."""
    from conftest import PYTHON

    return subprocess.run(
        [PYTHON, "-m", "dvfs", *argv],
        preexec_fn=lambda: _small_files(limit),
        capture_output=True,
        text=True,
        env=_capped_env(tmp_path),
        timeout=300,
    )


def _invoke_capped(argv: list[str], limit: int) -> Any:
    """`dvfs ARGV` in this process (CliRunner) under `_small_files(limit)`, set back after it:
    the same limit without a child's ~1 s of imports. No bytecode is written meanwhile (as
    `_capped_env`), matplotlib's font cache is loaded (or made and saved) before (the limit
    would cut it short in the user's cache folder, where `_capped_env` keeps a child's apart),
    and the output goes to CliRunner's memory, not a file."""
    import resource
    import signal

    import matplotlib.font_manager  # noqa: F401  (its import loads the cache, made once)

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.getsignal(signal.SIGXFSZ)
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        _small_files(limit)
        return CliRunner().invoke(cli, argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
        sys.dont_write_bytecode = bytecode


def test_a_command_under_the_limit_in_process_leaves_matplotlibs_cache_whole(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """`_invoke_capped` lowers the file-size limit of the whole test process: matplotlib, first
    loaded in it under the limit (a worker whose first figure is `dvfs plot`'s here), wrote its
    font cache cut short at the limit into the user's cache folder, which every later process
    found damaged and built again (the child of `_run_capped` has its own, `_capped_env`).
    Here a fresh process with a cache folder of its own does what such a worker did."""
    from conftest import PYTHON, subprocess_env

    mpl = tmp_path / "mpl"
    script = (
        "import sys; from test_bad_inputs import _invoke_capped; "
        "result = _invoke_capped(sys.argv[1:], 512); "
        "sys.exit(0 if result.exit_code == 1 else f'exit {result.exit_code}: {result.output}')"
    )
    argv = ["plot", str(shared["cube"]), "--out", str(tmp_path / "plots"), "--format", "svg"]
    proc = subprocess.run(
        [PYTHON, "-c", script, *argv],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONDONTWRITEBYTECODE="1", MPLCONFIGDIR=str(mpl)),
        cwd=Path(__file__).parent,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    [cache] = mpl.glob("fontlist-*.json")
    assert json.loads(cache.read_text(encoding="utf-8"))["_version"], cache


@pytest.mark.parametrize("name", list(OVERWRITES))
def test_a_write_cut_short_keeps_the_old_file(
    name: str, shared: dict[str, Path], tiny_exact_run, tmp_path: Path
) -> None:
    """A full disk part-way through the new content (here: the file-size limit, which fails
    the write after the file was opened, as a full disk does) leaves the user's old file whole
    and no temp file: the new content goes to a temp file renamed over the old one."""

    out = tmp_path / "out" / "old.file"
    out.parent.mkdir()
    out.write_bytes(b"OLD\n")
    # bytes: each command's output is larger (the report's figures, drawn to a temp folder
    # first, are smaller than the report)
    limit = 200_000 if name == "report-o" else 512

    if name == "twin-fit-o":
        shared = {**shared, "fit_cube": tiny_exact_run("one") / "cube.nc"}
    result = _invoke_capped(_argv(name, shared, out), limit)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert str(out) in result.stderr.splitlines()[-1], result.stderr
    assert out.read_bytes() == b"OLD\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["old.file"]


@pytest.mark.parametrize("name", list(OVERWRITES))
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_an_output_files_missing_folders_are_made(
    name: str, shared: dict[str, Path], tiny_exact_run, tmp_path: Path
) -> None:
    """`-o new/deeper/FILE` where `new` does not exist: `dvfs report` and `dvfs cube build`
    made the folders, while `dvfs headroom`, `dvfs cap plan`, `dvfs twin fit` and `dvfs gpu
    roofline` failed "no such file or folder" after their work. Each makes them."""
    out = tmp_path / "new" / "deeper" / "out.file"
    if name == "twin-fit-o":
        shared = {**shared, "fit_cube": tiny_exact_run("one") / "cube.nc"}
    result = CliRunner().invoke(cli, _argv(name, shared, out))
    assert result.exit_code == 0, result.output
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.parametrize("name", list(OVERWRITES))
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_an_output_file_of_a_name_near_the_limit_is_written(
    name: str, shared: dict[str, Path], tiny_exact_run, tmp_path: Path
) -> None:
    """An output name of 250 bytes, which the file system takes (255 at most): its temp file
    beside it (`.NAME.XXXXXXXX.tmp`) went past the limit, and the command said "the name is
    too long; use a shorter path" of a name that is not. The temp file's name is cut to fit;
    the output has the name given, and no temp file is left."""
    out = tmp_path / ("x" * 246 + ".out")
    if name == "twin-fit-o":
        shared = {**shared, "fit_cube": tiny_exact_run("one") / "cube.nc"}
    result = CliRunner().invoke(cli, _argv(name, shared, out))
    assert result.exit_code == 0, result.output
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    assert out.stat().st_size > 0


@pytest.mark.parametrize("link", ["to-nothing", "loop"])
@pytest.mark.usefixtures("unsaved_figures")
def test_a_plot_folder_that_is_a_link_to_nothing_is_said_as_that(
    shared: dict[str, Path], tmp_path: Path, link: str
) -> None:
    """`dvfs plot CUBE --out L`, L a symbolic link to nothing (or in a loop): "cannot create L:
    something is in the way; remove it", of no thing. It says what L is; the `mkdir -p` said
    for a link to nothing, run as said, lets the figures be written through it."""
    out = tmp_path / "plots"
    target = tmp_path / "gone" / "{x}"  # braces: the advice is formatted with its option
    out.symlink_to(target if link == "to-nothing" else out)
    argv = ["plot", str(shared["cube"]), "--out", str(out)]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    words = "leads back to itself (a loop)"
    if link == "to-nothing":
        words = f"link to {target}, which does not exist"
    assert line.startswith(f"Error: cannot create {out}: it is a symbolic "), line
    assert words in line and "in the way" not in line and "choose another --out" in line, line
    if link == "to-nothing":
        said = line.split("(mkdir -p ", 1)[1].split("), or remove", 1)[0]
        subprocess.run(["mkdir", "-p", *shlex.split(said)], check=True)
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, result.output
        assert any(target.iterdir()) and out.is_symlink()


@pytest.mark.parametrize("name", ["headroom-o", "report-o"])
@pytest.mark.usefixtures("unsaved_figures")
def test_an_output_file_in_a_folder_linked_to_nothing_is_said_as_that(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o L/FILE`, L a symbolic link to nothing: "a part of the path is a file, not a
    folder", of no file (the folder, made where missing, could not be made there). It says
    what L is; the `mkdir -p` said, run as said, lets the file be written through it."""
    link, target = tmp_path / "L", tmp_path / "gone" / "there"
    link.symlink_to(target)
    argv = _argv(name, shared, link / "out.file")
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    said = f"Error: cannot create {link}: it is a symbolic link to {target}, which does not exist"
    assert line.startswith(said) and "a part of the path is a file" not in line, line
    made = line.split("(mkdir -p ", 1)[1].split("), or remove", 1)[0]
    subprocess.run(["mkdir", "-p", *shlex.split(made)], check=True)
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    assert (target / "out.file").is_file()


@pytest.mark.parametrize("name", ["twin-fit-o", "report-o"])
def test_an_output_folder_made_for_a_command_that_fails_is_removed_again(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o new/deeper/FILE` of a command that then fails (an unknown `--base`, a damaged cube):
    the folders made for the output were left behind, empty. They are removed again; a folder
    that was there is kept."""
    (tmp_path / "bad.nc").write_text("not a cube")
    shared = {**shared, "fit_cube": shared["cube"], "cube": tmp_path / "bad.nc"}
    (tmp_path / "was").mkdir()
    out = tmp_path / "was" / "new" / "deeper" / "out.file"
    argv = [*_argv(name, shared, out), *(["--base", "nosuch"] if name == "twin-fit-o" else [])]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert list((tmp_path / "was").iterdir()) == [], result.output


def test_a_write_cut_short_in_a_process_of_its_own_is_one_line(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """`test_a_write_cut_short_keeps_the_old_file` as a script sees it: `python -m dvfs` in a
    process of its own (the limit set as it starts) exits 1 with one line naming the file on
    stderr, no traceback, and the old file whole."""
    out = tmp_path / "out" / "old.file"
    out.parent.mkdir()
    out.write_bytes(b"OLD\n")
    proc = _run_capped(_argv("cap-plan-o", shared, out), 512, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert str(out) in proc.stderr.splitlines()[-1], proc.stderr
    assert out.read_bytes() == b"OLD\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["old.file"]


#: Every option naming the one file a command writes: OVERWRITES' and the merged cube's.
OUTPUT_FILES = {**OVERWRITES, "cube-merge-o": ["cube", "merge", "{cube}", "{cube}", "-o", "{out}"]}


@pytest.mark.parametrize("name", list(OUTPUT_FILES))
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_an_output_file_linked_into_a_missing_folder_is_said_to_be_that_link(
    name: str, shared: dict[str, Path], tiny_exact_run, tmp_path: Path
) -> None:
    """`-o FILE` where FILE is a symbolic link to a file in a folder that does not exist: "cannot
    open FILE: no such file or folder; check the path (does its folder exist?)", of a path
    whose folder is there (`dvfs headroom`, `cap plan`, `twin fit` and `gpu roofline` after
    their work). Refused in one line naming the link and where it points, as `dvfs sweep`
    refuses a cube.nc linked so, and that folder not made through it."""
    out = tmp_path / "out.file"
    target = tmp_path / "gone" / "out.file"
    out.symlink_to(target)
    if name == "twin-fit-o":
        shared = {**shared, "fit_cube": tiny_exact_run("one") / "cube.nc"}
    places = {**{k: str(v) for k, v in shared.items()}, "out": str(out)}
    result = CliRunner().invoke(cli, [_fill(a, places) for a in OUTPUT_FILES[name]])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    # (`cap plan` first warns that twin caps are simulated)
    [line] = [x for x in result.stderr.splitlines() if x.startswith("Error")]
    assert line == result.stderr.splitlines()[-1], result.stderr
    assert line == (
        f"Error: {out} is a link to {target}, in a folder that does not exist: make that "
        "folder, or remove the link, and run again"
    ), line
    assert not target.parent.exists()


@pytest.mark.parametrize("end", ["/", "/.", "/./", "/.."])
@pytest.mark.parametrize("name", list(OUTPUT_FILES))
def test_an_output_file_ending_in_a_slash_is_refused(
    name: str, end: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o new/folder/` (or `new/folder/.`, as `"$DIR/."` in a script gives it) means a folder,
    yet pathlib drops the slash (and the '.'): the command wrote a file named `new/folder`. It
    is click's usage error (exit 2) naming the option, before any work, and it shows a file
    path to give instead. `new/folder/..` is a folder too (`new`): the command did its work,
    made `new/folder`, then failed to write a file over `new` (exit 1, the work lost)."""
    out = tmp_path / "new" / "folder"
    places = {**{k: str(v) for k, v in shared.items()}, "out": f"{out}{end}"}
    result = CliRunner().invoke(cli, [_fill(a, places) for a in OUTPUT_FILES[name]])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = " ".join(result.stderr.split())
    assert "Error: Invalid value for '-o' / '--out" in error, error
    assert f"give a file's path, e.g. '{out}/" in error, error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", list(OUTPUT_FILES))
def test_an_output_file_named_dash_is_refused_not_written_as_a_file_named_dash(
    name: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o -`, standard output to many tools: each command wrote a file named '-' in the
    current folder. It is click's usage error (exit 2) naming the option, before any work,
    saying to give /dev/stdout (or ./- for a file of that name)."""
    monkeypatch.chdir(tmp_path)
    places = {**{k: str(v) for k, v in shared.items()}, "out": "-"}
    result = CliRunner().invoke(cli, [_fill(a, places) for a in OUTPUT_FILES[name]])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = " ".join(result.stderr.split())
    assert "Error: Invalid value for '-o' / '--out" in error, error
    assert "give /dev/stdout for standard output, or ./- for a file of that name" in error, error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["file", "on-the-way"])
@pytest.mark.parametrize("name", list(OUTPUT_FILES))
def test_an_output_file_through_a_link_in_a_loop_is_refused_before_the_work(
    name: str, where: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o LOOP`, a symbolic link in a loop (`ln -s loop loop`), or a path through one: the
    command did its work (`twin fit`: a minute's fit), then failed to write, "too many levels
    of symbolic links; check the links in the path". It is click's usage error (exit 2)
    naming the option and the loop, before any work (`link_loop_problem`)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop.name)
    out = loop if where == "file" else loop / "out.toml"
    places = {**{k: str(v) for k, v in shared.items()}, "out": str(out)}
    result = CliRunner().invoke(cli, [_fill(a, places) for a in OUTPUT_FILES[name]])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = " ".join(result.stderr.split())
    assert "Error: Invalid value for '-o' / '--out" in error, error
    assert "in a loop" in error and str(out) in error, error
    assert [p.name for p in tmp_path.iterdir()] == ["loop"]


#: Options naming a folder a command writes into (or keeps its state in), "{out}" their value.
OUTPUT_FOLDERS = {
    "sweep-o": ["sweep", "{campaign}", "-o", "{out}", "--no-progress"],
    "doctor-o": ["doctor", "{campaign}", "-o", "{out}"],
    "demo-o": ["demo", "-o", "{out}"],
    "plot-o": ["plot", "{cube}", "-o", "{out}"],
    "twin-predict-o": ["twin", "predict", "{campaign}", "-o", "{out}", "--profile", "{campaign}"],
    "gpu-reset-state-dir": ["gpu", "reset", "--state-dir", "{out}"],
    "cap-show-state-dir": ["cap", "show", "--state-dir", "{out}"],
    "monitor-state-dir": ["monitor", "--once", "--state-dir", "{out}"],
}


@pytest.mark.parametrize("name", list(OUTPUT_FOLDERS))
def test_an_output_folder_named_dash_is_refused_not_made_as_a_folder_named_dash(
    name: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--out -` for a folder option (sweep, plot, demo, ...): it made a folder named '-' in
    the current folder, while the file options refuse `-o -`. It is click's usage error
    (exit 2) naming the option, before any work, saying to give ./- for a folder of that
    name."""
    (tmp_path / "tiny.toml").write_text(campaign(), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    places = {**{k: str(v) for k, v in shared.items()}, "campaign": str(tmp_path / "tiny.toml")}
    argv = OUTPUT_FOLDERS[name]
    result = CliRunner().invoke(cli, [_fill(a, {**places, "out": "-"}) for a in argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = " ".join(result.stderr.split())
    option = argv[argv.index("{out}") - 1]
    assert f"Error: Invalid value for '{option}'" in error, error
    assert "give ./- for a folder of that name" in error, error
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("home", ["~", "~root"])
@pytest.mark.parametrize("name", [*OUTPUT_FILES, *OUTPUT_FOLDERS])
def test_an_output_under_a_tilde_no_shell_expanded_is_refused_before_the_work(
    name: str, home: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o '~/r/h.json'` (quoted, or `--output=~/r/h.json`: no shell expands it) made a folder
    named '~' in the current folder and wrote there (`cube build -o`, `plot --out`, `sweep
    --out`), or was refused only once the work was done (headroom, cap plan). It is click's
    usage error for every output option, exit 2, before any work, saying the path in full;
    nothing is made. A folder here really named '~' is the user's to write into."""
    (tmp_path / "tiny.toml").write_text(campaign(), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    places = {**{k: str(v) for k, v in shared.items()}, "campaign": str(tmp_path / "tiny.toml")}
    argv = {**OUTPUT_FILES, **OUTPUT_FOLDERS}[name]
    given = f"{home}/r/out.file"
    result = CliRunner().invoke(cli, [_fill(a, {**places, "out": given}) for a in argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = " ".join(result.stderr.split())
    assert f"{given}: no shell expanded its {home!r}" in error, error
    assert f"write the path in full (e.g. {Path(home).expanduser()}/r/out.file)" in error, error
    assert list(work.iterdir()) == []


def test_a_folder_really_named_tilde_is_written_into(
    shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal above is of a '~' no folder here is named: one the user made is used (the
    README said only that such a path is refused, and `./~/x` written into a folder '~')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~").mkdir()
    result = CliRunner().invoke(cli, _argv("headroom-o", shared, Path("~/h.json")))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "~" / "h.json").is_file()
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "and so is `~/x` once a folder here is named `~`" in readme


@pytest.mark.parametrize("name", ["headroom-o", "plot-o"])  # a file option, a folder one
def test_an_output_under_dot_slash_tilde_is_a_folder_named_tilde_here(
    name: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o ./~/r/out.file`: no shell expands a '~' after './', and the './' says the folder is
    here; pathlib drops the './', so it was refused as the '~' above, which only the path in
    full could get past. It is written into a folder named '~' here."""
    monkeypatch.chdir(tmp_path)
    places = {**{k: str(v) for k, v in shared.items()}, "out": "./~/r/out.file"}
    argv = {**OUTPUT_FILES, **OUTPUT_FOLDERS}[name]
    result = CliRunner().invoke(cli, [_fill(a, places) for a in argv])
    assert "no shell expanded" not in result.output, result.output
    assert result.exit_code == 0, result.output
    assert (tmp_path / "~" / "r" / "out.file").exists()


@pytest.mark.parametrize("name", [*OUTPUT_FILES, *OUTPUT_FOLDERS])
def test_an_empty_output_path_is_refused(
    name: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o ''` (a script's `-o "$OUT"` with OUT unset): pathlib reads '' as '.', so a folder
    option wrote into the current folder, and a file option did the work, then failed with
    "cannot use .: it is a folder", naming another option. It is click's usage error (exit 2)
    naming the option, before any work, and nothing is written."""
    (tmp_path / "tiny.toml").write_text(campaign(), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    places = {**{k: str(v) for k, v in shared.items()}, "campaign": str(tmp_path / "tiny.toml")}
    argv = {**OUTPUT_FILES, **OUTPUT_FOLDERS}[name]
    result = CliRunner().invoke(cli, [_fill(a, {**places, "out": ""}) for a in argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = result.stderr.strip().splitlines()[-1]
    option = argv[argv.index("{out}") - 1]
    assert error.startswith(f"Error: Invalid value for '{option}'"), error
    assert "the path is empty: give a f" in error, error
    assert list(work.iterdir()) == []


def _netcdf_output_refused(
    name: str, out: str, shared: dict[str, Path], tmp_path: Path
) -> tuple[str, Path]:
    """Command `name` (OUTPUT_FILES, OUTPUT_FOLDERS) writing its netCDF output to `out` in an
    empty folder: refused as click's usage error of -o/--out (exit 2); its message on one line,
    and the folder."""
    (tmp_path / "tiny.toml").write_text(campaign(), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    places = {
        **{k: str(v) for k, v in shared.items()},
        "campaign": str(tmp_path / "tiny.toml"),
        "out": str(work / out),
    }
    argv = {**OUTPUT_FILES, **OUTPUT_FOLDERS}[name]
    result = CliRunner().invoke(cli, [_fill(a, places) for a in argv])
    assert result.exit_code == 2, result.output
    error = " ".join(result.stderr.split())
    assert "Error: Invalid value for '-o' / '--out': cannot write " in error, error
    return error, work


@pytest.mark.parametrize(
    ("name", "out"),
    [
        ("cube-build-o", "a\\b.nc"),
        ("roofline-o", "a\\b.nc"),
        ("cube-merge-o", "a\\b.nc"),
        ("sweep-o", "a\\b"),
        ("twin-predict-o", "a\\b"),
        ("cube-build-o", "a\\b/cube.nc"),  # in a folder whose name holds one
    ],
)
def test_a_netcdf_output_with_a_backslash_is_refused(
    name: str, out: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """netCDF-C reads a backslash in a path as '/', even on Linux: `-o 'a\\b.nc'` failed as
    "cannot use a\\b.nc: permission denied" (a roofline after measuring, a sweep after its
    whole campaign), and where a folder `a` was, netCDF wrote `a/b.nc` instead. It is click's
    usage error naming the option and the reason, before any work; nothing is written."""
    error, work = _netcdf_output_refused(name, out, shared, tmp_path)
    assert "netCDF reads a backslash in a path as '/'" in error, error
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "out"),
    [
        ("cube-build-o", "a\udcffb.nc"),
        ("sweep-o", "a\udcffb"),
        ("cube-build-o", "a\udcffb/cube.nc"),  # in a folder whose name holds one
    ],
)
def test_a_netcdf_output_whose_path_is_not_utf8_is_refused(
    name: str, out: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """A path holding bytes that are not UTF-8 (`--out $'run\xff'`, a Latin-1 folder name):
    netCDF-C cannot take it, so a sweep measured its whole campaign and then failed writing
    its cube ("an argument or a file name holds bytes that are not UTF-8"), its cells in a
    journal of no cube. It is click's usage error naming the option and the reason, before
    any work; nothing is written. A cube at such a path, given to read, is named so too."""
    import shutil

    error, work = _netcdf_output_refused(name, out, shared, tmp_path)
    assert "netCDF takes paths in UTF-8 alone" in error and "choose a path in UTF-8" in error
    assert list(work.iterdir()) == []
    folder = tmp_path / "r\udcffn"
    folder.mkdir()
    shutil.copyfile(shared["cube"], folder / "cube.nc")
    read = CliRunner().invoke(cli, ["cube", "info", str(folder)])
    assert read.exit_code == 1, read.output
    shown = str(folder / "cube.nc").replace("\udcff", "\\udcff")  # as the line shows it
    assert read.stderr.strip().splitlines()[-1] == (
        f"Error: cannot open {shown}: netCDF takes paths in UTF-8 alone, and this one holds "
        "bytes that are not; rename it (or its folder) in UTF-8"
    ), read.output


def test_a_cube_built_into_a_folder_with_a_backslash_is_refused_before_writing(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs cube build 'my\\sweep'` (no -o: the cube goes beside the journal) reached
    netCDF, which failed as "permission denied"; the write is refused in one line saying why,
    and no file is left."""
    import shutil

    sweep = tmp_path / "my\\sweep"
    shutil.copytree(shared["sweep"], sweep)
    (sweep / "cube.nc").unlink()
    before = sorted(p.name for p in sweep.iterdir())
    result = CliRunner().invoke(cli, ["cube", "build", str(sweep)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: cannot write {sweep / 'cube.nc'}: netCDF reads a backslash in a path as '/', "
        "a Windows folder separator; choose a path without one"
    ), result.output
    assert sorted(p.name for p in sweep.iterdir()) == before


@pytest.mark.parametrize(
    "command",
    [
        ["headroom"],
        ["cube", "info"],
        ["compare"],
        ["twin", "fit", "-o", "{tmp}/p.toml"],
        ["compare", "{cube}", "--roofline"],
    ],
)
def test_a_netcdf_input_whose_path_holds_a_backslash_is_named_not_called_damaged(
    command: list[str], shared: dict[str, Path], tmp_path: Path
) -> None:
    """netCDF-C cannot open a file whose path holds a backslash (it reads '/'): a cube was
    called "not a readable netCDF cube (NetCDF: HDF error)" and its journal was to be built
    again, which then failed to write. One line says what netCDF does and to rename it; as
    for a roofline file, which `twin fit` and `compare --roofline` read (the cube stands in
    for one: the check comes first). Exit 1 from every command, as a file it cannot read
    (`twin fit` exited 2 for the file, 1 for its folder)."""
    import shutil

    folder = tmp_path / "my\\files"
    folder.mkdir()
    given = folder / "cube.nc"
    shutil.copyfile(shared["cube"], given)
    argv = [_fill(a, {"tmp": str(tmp_path), "cube": str(shared["cube"])}) for a in command]
    for source in (given, folder):  # a cube file, or a sweep folder holding it
        if source == folder and "--roofline" in command:
            continue  # `compare --roofline FILE`: a file, not a folder
        result = CliRunner().invoke(cli, [*argv, str(source)])
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines()[-1] == (
            f"Error: cannot open {given}: netCDF reads a backslash in a path as '/', a Windows "
            "folder separator; rename it (or its folder) without one"
        ), result.output


# twin fit (seconds of fitting) is left out: `test_a_write_cut_short_keeps_the_old_file` shows
# it writes through `dvfs.outputs` as the others do, whose handling of a pipe is tested here.
@pytest.mark.parametrize("name", [n for n in OVERWRITES if n != "twin-fit-o"])
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_a_fifo_output_is_written_not_replaced(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o /dev/stdout`, `-o /dev/null` or a named pipe: the content goes into it. Renaming a
    temp file over it would replace the device (root may) or the pipe with a regular file."""
    import contextlib
    import os
    import select
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open succeeds
    done = threading.Event()
    got: list[bytes] = []

    def drain() -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.05)
            try:
                chunk = os.read(fd, 1 << 16) if ready else b""
            except BlockingIOError:  # the writer opened after select said "no writer": EOF
                continue
            got.append(chunk)
            if not chunk and done.is_set():
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = CliRunner().invoke(cli, _argv(name, shared, fifo))
    finally:
        done.set()
        reader.join()
        # what the thread left in the pipe (a CI run on a loaded machine saw it read nothing
        # where the command had written and exited 0): the pipe holds it until this end closes
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(fd, 1 << 16):
                got.append(chunk)
        os.close(fd)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(fifo.lstat().st_mode), "the pipe was replaced by a regular file"
    assert len(b"".join(got)) > 100
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]


@pytest.mark.parametrize("name", ["report-o", "headroom-o"])
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_an_anonymous_pipe_output_is_written(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`-o /dev/stdout` piped on (`dvfs report CUBE -o /dev/stdout | gzip`) or `-o >(...)`:
    the path is a link to an anonymous pipe, whose target (`pipe:[N]`) names no file. The
    content goes into the pipe; resolving the link first said "no such file or folder"."""
    with pipe_output() as (stream, got):
        result = CliRunner().invoke(cli, _argv(name, shared, Path(stream)))
    assert result.exit_code == 0, result.output
    assert len(b"".join(got)) > 100


@pytest.mark.parametrize("name", ["report-o", "headroom-o"])
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_a_socket_output_is_written(name: str, shared: dict[str, Path]) -> None:
    """`-o /dev/stdout` where standard output is a socket (a systemd unit's, the journal's):
    a socket cannot be opened again through its `/proc/self/fd` link, and the command failed
    'cannot open /dev/stdout: no such device; check the path'. The content goes into it."""
    import socket
    import threading

    ours, theirs = socket.socketpair()
    got: list[bytes] = []

    def drain() -> None:
        while chunk := theirs.recv(1 << 16):
            got.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = CliRunner().invoke(cli, _argv(name, shared, Path(f"/dev/fd/{ours.fileno()}")))
    finally:
        ours.close()
        reader.join(timeout=60)
        theirs.close()
    assert result.exit_code == 0, result.output
    assert len(b"".join(got)) > 100


@pytest.mark.parametrize("name", ["headroom-o", "cube-build-o"])
def test_a_fifo_output_no_program_reads_is_refused_not_waited_on(
    name: str,
    shared: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A named pipe no program reads from where the output goes (a FIFO left in a sweep folder
    as its cube.nc): opening it for writing waited for a reader for ever. It is waited on for
    its reader a while (`PIPE_READER_WAIT_S`, shortened here), saying so, then refused in one
    line, the pipe left in place."""
    import os
    import stat

    import dvfs.outputs

    monkeypatch.setattr(dvfs.outputs, "PIPE_READER_WAIT_S", 0.2)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    ran = CliRunner().invoke(cli, _argv(name, shared, fifo))
    assert ran.exit_code == 2, ran.output
    # (the warning goes to the log, which pytest's handler takes: to stderr in the CLI)
    [refused] = ran.stderr.splitlines()
    waited = f"waiting up to 0.2 s for a program to read the named pipe {fifo}"
    assert waited in caplog.text, caplog.text
    assert refused.startswith(f"Error: {fifo} is a named pipe no program read from in 0.2 s"), (
        refused
    )
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_ctrl_c_while_a_sweeps_cube_waits_for_its_pipe_stops(
    shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep whose cube.nc became a named pipe after its start (the start refuses one there)
    waits for its reader, saying "Ctrl-C stops"; Ctrl-C there wrote the interrupted sweep's
    partial cube into the same pipe, and waited for its reader again as long (30 s more) before
    it stopped. The partial cube's pipe is refused at once."""
    import os

    import dvfs.out_folder
    import dvfs.outputs

    # the pipe is made after the start's check, as one made while the sweep measures would be
    monkeypatch.setattr(dvfs.out_folder, "check_cube_files", lambda out_dir, **_: None)

    monkeypatch.setattr(dvfs.outputs, "PIPE_READER_WAIT_S", 3.0)
    sleeps: list[float] = []

    def interrupted(seconds: float) -> None:  # Ctrl-C at the first wait for the reader
        sleeps.append(seconds)
        if len(sleeps) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(dvfs.outputs.time, "sleep", interrupted)
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(shared["sweep"], sweep_dir)
    (sweep_dir / "cube.nc").unlink()
    os.mkfifo(sweep_dir / "cube.nc")  # no reader
    (tmp_path / "tiny.toml").write_text(campaign(), encoding="utf-8")
    ran = CliRunner().invoke(
        cli, ["sweep", str(tmp_path / "tiny.toml"), "--out", str(sweep_dir), "--no-progress"]
    )
    assert ran.exit_code == 130, ran.output
    assert len(sleeps) == 1, f"waited again after Ctrl-C ({len(sleeps) - 1} more tries)"
    # one line each, however long (not cut where the console's width ends)
    [no_cube] = [line for line in ran.output.splitlines() if line.startswith("(no cube: ")]
    assert no_cube.startswith(
        f"(no cube: {sweep_dir / 'cube.nc'} is a named pipe no program reads from"
    ), ran.output
    assert no_cube.endswith("or remove the pipe)"), ran.output


@pytest.mark.parametrize("name", ["headroom-o", "cube-build-o"])
def test_a_fifo_output_whose_reader_starts_later_is_written(
    name: str, shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mkfifo p; dvfs headroom CUBE --json -o p`, its reader (`gzip < p`) started once dvfs is
    at the pipe: refused at once ("no program reads from"), as no writer into a pipe is, where
    `echo > p` waits. The reader started then (here: once dvfs says it waits) gets the output."""
    import os
    import threading

    import dvfs.outputs

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    readers: list[threading.Thread] = []

    def read() -> None:
        with open(fifo, "rb") as pipe:
            got.append(pipe.read())

    class Log:
        def warning(self, *args: Any) -> None:  # dvfs is at the pipe, and found no reader
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            readers.append(reader)

    monkeypatch.setattr(dvfs.outputs, "log", Log(), raising=False)
    ran = CliRunner().invoke(cli, _argv(name, shared, fifo))
    assert ran.exit_code == 0, ran.output
    assert len(readers) == 1
    readers[0].join(timeout=60)
    assert len(got) == 1 and len(got[0]) > 100


def test_sigterm_stops_a_cube_blocked_on_a_pipe_no_one_reads(
    shared: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs cube build DIR -o FIFO` whose reader opened the pipe and stopped reading: the copy
    into it blocked with SIGTERM held (held for the netCDF write, which a signal's exception
    leaves holding a lock of xarray's), so `kill` did nothing and only SIGKILL ended it. The
    hold covers the write to the temp file alone: SIGTERM (its default disposition, set
    here) ends the process at once."""
    import fcntl
    import os
    import select
    import signal
    import stat

    from conftest import PYTHON, subprocess_env

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    temp = tmp_path / "temp"  # the child's temp folder: the cube's copy is left in none
    temp.mkdir()
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, and never read
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)  # full long before the cube is copied
        child = subprocess.Popen(
            [PYTHON, "-m", "dvfs", *_argv("cube-build-o", shared, fifo)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=subprocess_env(TMPDIR=str(temp)),
            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        )
        try:
            # the first bytes in the pipe: the copy is under way, and blocks once it is full
            assert select.select([reader], [], [], 60)[0], "no byte of the cube came"
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("SIGTERM did not stop a cube write blocked on a full pipe")
        finally:
            child.kill()
            child.wait()
            assert child.stderr is not None
            child.stderr.close()
    finally:
        os.close(reader)
    assert child.returncode == -signal.SIGTERM
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # the pipe left in place
    assert not list(temp.iterdir()), "the cube's temp copy was left behind"


def test_sigterm_held_for_a_netcdf_write_into_a_pipe_leaves_no_temp_file(tmp_path: Path) -> None:
    """A SIGTERM that came while a cube went to its temp file, bound for a pipe: held for that
    write, then acted (its default disposition) before the temp folder was removed, which kept
    the whole cube. It is removed; the process still ends by the signal."""
    import os
    import signal

    from conftest import PYTHON, subprocess_env

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    temp = tmp_path / "temp"
    temp.mkdir()
    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from dvfs.outputs import write_netcdf\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        f"reader = os.open({str(fifo)!r}, os.O_RDONLY | os.O_NONBLOCK)\n"
        "def write(tmp):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # held for the write\n"
        "    tmp.write_bytes(b'x' * 1000)\n"
        f"write_netcdf(Path({str(fifo)!r}), write, 1000)\n"
    )
    ran = subprocess.run(
        [PYTHON, "-c", code],
        capture_output=True,
        env=subprocess_env(TMPDIR=str(temp)),
        timeout=120,
    )
    assert ran.returncode == -signal.SIGTERM, ran.stderr
    assert not list(temp.iterdir()), "the cube's temp copy was left behind"


@pytest.mark.parametrize("name", ["headroom-o", "cube-build-o"])
def test_sigterm_while_a_fifo_output_waits_for_its_reader_leaves_no_temp_file(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs cube build DIR -o FIFO` (or headroom) waiting for the pipe's reader, stopped by
    SIGTERM (its default disposition, `systemctl stop`): the output, written whole to a temp
    file first, was left in a dvfs-out-* folder of the temp folder (a cube's size each time).
    It is removed, and the process still ends by the signal."""
    import os
    import select
    import signal
    import stat

    from conftest import PYTHON, subprocess_env

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no reader: dvfs waits for one
    temp = tmp_path / "temp"
    temp.mkdir()
    child = subprocess.Popen(
        [PYTHON, "-m", "dvfs", *_argv(name, shared, fifo)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=subprocess_env(TMPDIR=str(temp)),
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )
    try:
        assert child.stderr is not None
        said = b""
        while b"waiting up to" not in said:
            assert select.select([child.stderr], [], [], 120)[0], said
            line = child.stderr.readline()
            assert line, said  # ended before it waited
            said += line
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.wait()
        assert child.stderr is not None
        child.stderr.close()
    assert child.returncode == -signal.SIGTERM
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert not list(temp.iterdir()), "the output's temp copy was left behind"


@pytest.mark.parametrize("name", ["report-o", "cube-build-o", "headroom-o"])
@pytest.mark.usefixtures("unsaved_figures")  # where the page goes, not its figures
def test_a_symlinked_output_keeps_its_link(
    name: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """An output that is a symlink (a file kept elsewhere): the file it points to gets the new
    content, and the link stays a link."""
    target = tmp_path / "kept" / "real.file"
    target.parent.mkdir()
    target.write_bytes(b"OLD\n")
    link = tmp_path / "link.file"
    link.symlink_to(target)
    result = CliRunner().invoke(cli, _argv(name, shared, link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert target.read_bytes() != b"OLD\n" and target.stat().st_size > 100
    assert sorted(p.name for p in target.parent.iterdir()) == ["real.file"]


@pytest.mark.parametrize(
    ("name", "netcdf_says"),
    [
        ("cube-build-o", PermissionError(errno.EACCES, "Permission denied")),
        ("cube-build-o", RuntimeError("NetCDF: HDF error")),
        ("roofline-o", PermissionError(errno.EACCES, "Permission denied")),
        ("roofline-o", RuntimeError("NetCDF: HDF error")),
    ],
    ids=["cube-create", "cube-write", "roofline-create", "roofline-write"],
)
def test_a_full_disk_under_netcdf_is_said_to_be_full(
    name: str,
    netcdf_says: Exception,
    shared: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """netCDF-C reports a full disk as "Permission denied" when it creates the file (as a 64 KiB
    tmpfs shows) and as "NetCDF: HDF error" when it writes: with no room left in the folder,
    dvfs says the disk is full, names the user's path (not its temp file), and keeps no temp
    file."""
    import shutil
    from collections import namedtuple

    import xarray as xr

    import dvfs.cube.files

    def full_disk_netcdf(self: Any, path: Any = None, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"")  # created, then the disk is full
        raise netcdf_says

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    monkeypatch.setattr(xr.Dataset, "to_netcdf", full_disk_netcdf)  # the roofline's
    monkeypatch.setattr(dvfs.cube.files, "_write_netcdf4", full_disk_netcdf)  # a cube's
    out = tmp_path / "out" / "file.nc"
    out.parent.mkdir()
    result = CliRunner().invoke(cli, _argv(name, shared, out))
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert f"cannot write {out}: no space left on the device" in line, line
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("name", ["cube-build-o", "roofline-o"])
@pytest.mark.parametrize("out", ["/proc/dvfs-no-such-file.nc", "/sys/dvfs-no-such-file.nc"])
def test_a_netcdf_output_where_no_file_can_be_made_is_not_called_a_full_disk(
    name: str, out: str, shared: dict[str, Path]
) -> None:
    """/proc and /sys show no free space (they hold no files): a netCDF output there, which
    cannot be created, was said to be on a full disk ("no space left on the device; free
    space"), as a real full disk is."""
    if not Path(out).parent.is_dir() or shutil.disk_usage(Path(out).parent).total:
        pytest.skip(f"no file system of no size at {Path(out).parent}")
    result = CliRunner().invoke(cli, _argv(name, shared, Path(out)))
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert out in line and "space" not in line, line
    assert not Path(out).exists()


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_a_figure_cut_short_keeps_the_old_one(
    fmt: str, shared: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs plot` into a folder of earlier figures on a disk that fills part-way through (the
    file-size limit, as in `test_a_write_cut_short_keeps_the_old_file`): the figure being
    written when it fails keeps its earlier content."""

    out = tmp_path / "plots"
    out.mkdir()
    first = out / f"energy_vs_clock_code.{fmt}"  # the first figure `dvfs plot` writes
    first.write_bytes(b"OLD\n")

    argv = ["plot", str(shared["cube"]), "--out", str(out), "--format", fmt]
    result = _invoke_capped(argv, 512)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert first.read_bytes() == b"OLD\n"
    assert [p.name for p in out.iterdir()] == [first.name]


@pytest.mark.parametrize("via", ["show", "sweep"])
def test_a_corpus_package_resource_that_is_a_named_pipe_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    """A user corpus's `package`/`resource` naming a FIFO in the package's folder: it was opened
    and waited on for ever while no program wrote to it (a `path` naming one is refused). A
    writer stands by here, so that a command that opens it reads a corpus and ends."""
    import os
    import threading

    package = tmp_path / "dvfs_bad_inputs_fifo_pkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    fifo = package / "data" / "prompts.jsonl"
    os.mkfifo(fifo)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package.name, raising=False)
    spec = {"package": package.name, "resource": "data/prompts.jsonl", "field": "text"}
    (tmp_path / "c.toml").write_text(user_corpus_campaign(spec), encoding="utf-8")

    def feed() -> None:
        with contextlib.suppress(OSError), open(fifo, "wb") as f:
            f.write(jsonl(prompts(4)).encode())

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    argv = {
        "show": ["corpus", "show", "mine", "--campaign", str(tmp_path / "c.toml")],
        "sweep": ["sweep", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--no-progress"],
    }[via]
    try:
        result = CliRunner().invoke(cli, argv)
    finally:  # the writer, if the command never opened the pipe, let go
        # (again until it has: a reader opened and closed before the writer's open() began
        # left that open waiting for ever, and the join with it, in a loaded full-file run)
        while feeder.is_alive():
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
            feeder.join(0.05)
    check_one_clean_error(
        result,
        Case("corpus-package-resource-fifo", argv, code=2, says=("prompts.jsonl", "regular file")),
        {},
    )


@pytest.mark.parametrize(
    ("resource", "content"),
    [("p.jsonl", ""), ("p.jsonl", "\n  \n"), ("p.csv", "\n"), ("p.txt", "")],
    ids=["empty", "whitespace", "csv-whitespace", "no-format"],
)
def test_an_empty_corpus_package_resource_names_the_package_not_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resource: str, content: str
) -> None:
    """A user corpus's `package`/`resource` naming an empty data file (or one of only
    whitespace): it said to "point the campaign's path for this corpus at the file that holds
    them", of a corpus that has no path but a package and resource. It names those."""
    package = tmp_path / "dvfs_bad_inputs_empty_pkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / resource).write_text(content)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, package.name, raising=False)
    spec = {"package": package.name, "resource": f"data/{resource}", "field": "text"}
    (tmp_path / "c.toml").write_text(user_corpus_campaign(spec), encoding="utf-8")
    argv = ["corpus", "show", "mine", "--campaign", str(tmp_path / "c.toml")]
    result = CliRunner().invoke(cli, argv)
    says = (f"{package.name}:data/{resource} is empty", "package and resource")
    check_one_clean_error(result, Case("corpus-package-empty", argv, code=2, says=says), {})
    assert "campaign's path" not in result.stderr, result.stderr


@pytest.mark.parametrize("writer_done", [True, False], ids=["written", "writing"])
def test_a_campaign_from_a_pipe_is_read(tmp_path: Path, writer_done: bool) -> None:
    """`dvfs sweep <(generate) --dry-run`: the campaign comes through a pipe whose writer has
    written it all and closed it, or has written half and writes the rest later. A named pipe
    no program writes to is refused rather than waited on (`campaign-fifo`); these are read."""
    import os
    import threading
    import time

    read_end, write_end = os.pipe()
    text = GOOD_TEXT.encode()
    half = len(text) // 2 if not writer_done else len(text)
    os.write(write_end, text[:half])

    def rest() -> None:
        time.sleep(0.2)  # (the reader waits for it: no bound on how long)
        os.write(write_end, text[half:])
        os.close(write_end)

    feeder = threading.Thread(target=rest, daemon=True)
    feeder.start()
    try:
        argv = ["sweep", f"/proc/self/fd/{read_end}", *(a.format(tmp=tmp_path) for a in DRY)]
        result = CliRunner().invoke(cli, argv)
    finally:
        feeder.join()
        os.close(read_end)
    assert result.exit_code == 0, result.output
    assert "tiny" in result.output


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("gpus", 0, "memory_clock_mhz"), None),
        (("gpus", 0, "memory_clock_mhz"), True),
        (("gpus", 0, "driver_version"), {}),
        (("gpus", 0, "name"), True),
        (("stock", "sm_clock_mhz"), 1e308),
        (("measurement_method",), None),
        (("gpu_backend",), None),
        (("engine_backend",), None),
        (("clock",), None),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else repr(v),
)
def test_a_session_record_edited_to_what_a_cube_cannot_keep_is_named(
    shared: dict[str, Path], tmp_path: Path, path: tuple[Any, ...], value: Any
) -> None:
    """A journal's session line edited (or damaged) so that a value the cube keeps as an
    attribute is null, true, an object or past 64 bits: `cube build` failed writing the cube,
    "internal error: ... please report it". The record is refused as any damaged one is."""
    lines = (shared["sweep"] / "journal.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if json.loads(line)["type"] == "session")
    record = json.loads(lines[at])
    node = record
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    lines[at] = json.dumps(record)
    run = tmp_path / "run"
    run.mkdir()
    (run / "journal.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["cube", "build", str(run), "-o", str(tmp_path / "c.nc")])
    assert result.exit_code not in (0, 70), result.output
    assert "internal error" not in result.output, result.output
    assert "a record lacks what a cube needs" in result.output, result.output


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("campaign_name",), {}),
        (("campaign_hash",), {}),
        (("dvfs_version",), True),
        (("campaign", "engine", "model"), None),
        (("campaign", "engine", "twin_model"), True),
        (("campaign", "engine", "tp_size"), 1e308),
        (("campaign", "measurement", "repeats"), 1e308),
        (("campaign", "measurement", "max_repeats"), 1e308),
        (("campaign", "measurement", "repeats"), float("inf")),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else repr(v),
)
def test_a_header_edited_to_what_a_cube_cannot_keep_is_no_internal_error(
    shared: dict[str, Path], tmp_path: Path, path: tuple[Any, ...], value: Any
) -> None:
    """A journal's header line edited so that a value the cube keeps as an attribute, or sizes
    its arrays by, is an object, null, true or past any count: `cube build` ended in "internal
    error: ... please report it" (netCDF refusing the attribute; an OverflowError). The
    header is read as a damaged record, or its field as missing."""
    lines = (shared["sweep"] / "journal.jsonl").read_text().splitlines()
    record = json.loads(lines[0])
    assert record["type"] == "header"
    node = record
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    lines[0] = json.dumps(record)
    run = tmp_path / "run"
    run.mkdir()
    (run / "journal.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["cube", "build", str(run), "-o", str(tmp_path / "c.nc")])
    assert "internal error" not in result.output, result.output
    assert result.exit_code != 70, result.output
    if result.exit_code:
        assert "a record lacks what a cube needs" in result.output, result.output


def test_a_report_figure_on_a_full_disk_names_the_reports_option(
    shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs report CUBE -o report.md` on a disk that fills as a figure is written (beside
    report.md, in report_figures/): the figure is named by no option, and the refusal said
    "choose another path"; the report's option is --output, which it now names."""
    import errno
    import os

    from click.testing import CliRunner

    import dvfs.cli.report

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dvfs.cli.report.os, "fsync", full)
    out = tmp_path / "out" / "report.md"
    out.parent.mkdir()
    result = CliRunner().invoke(cli, ["report", str(shared["sweep"]), "-o", str(out)])
    monkeypatch.undo()
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"Error: cannot write {out.parent / 'report_figures'}"), last
    assert last.endswith("choose another --output"), last


@pytest.mark.parametrize("suffix", [".md", ".html"])
def test_report_figures_on_a_full_temporary_folder_say_so(
    shared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    """`dvfs report` with the temporary folder full (where its figures are drawn first): it
    said "cannot write /tmp/dvfs-report-.../energy_vs_clock_code.png: no space left on the
    device; free space or choose another path", a path the user never gave; it now says the
    temporary folder is full and to free space there or set TMPDIR."""
    import errno
    import os

    from click.testing import CliRunner

    import dvfs.plots

    def full(cube: object, folder: str, **kw: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(folder, "a.png"))

    monkeypatch.setattr(dvfs.plots, "plot_all", full)
    out = tmp_path / "out" / f"report{suffix}"
    result = CliRunner().invoke(cli, ["report", str(shared["sweep"]), "-o", str(out)])
    monkeypatch.undo()
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: cannot draw the report's figures in the temporary folder "), line
    assert "set TMPDIR" in line and "choose another" not in line, line
    assert not out.exists()


# -- a fleet mixing GPU models, one model's journal no regular file --------------------------


@pytest.fixture(scope="module")
def mixed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny sweep on a fleet of two twin GPU models (a journal in each of its
    `gpu-<model>/` folders, and the merged cube), made once per session, read-only."""

    def make(base: Path) -> None:
        (base / "tiny.toml").write_text(campaign(), encoding="utf-8")
        out = base / "fleet"
        argv = ["sweep", str(base / "tiny.toml"), "--gpus", "0,h200-sxm:0", "--out", str(out)]
        result = CliRunner().invoke(cli, [*argv, "--no-progress"])
        assert result.exit_code == 0, result.output

    return made_once(tmp_path_factory, "bad_inputs-mixed-fleet", make) / "fleet"


def damaged_model_journal(out: Path, kind: str) -> Path:
    """The H200's journal of the fleet folder `out` replaced by a FIFO, a folder, a link in a
    loop or binary garbage; its path."""
    import os

    [h200] = [p for p in out.glob("gpu-*h200*/journal.jsonl")]
    h200.unlink()
    if kind == "fifo":
        os.mkfifo(h200)
    elif kind == "directory":
        h200.mkdir()
    elif kind == "garbage":
        h200.write_bytes(binary_bytes())
    else:
        h200.symlink_to(h200.name)
    return h200


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("fifo", "no regular file"),
        ("directory", "is a folder"),
        ("symlink-loop", "(a loop)"),
        ("garbage", "is not a dvfs journal"),
    ],
)
def test_a_rerun_of_a_fleet_refuses_a_models_journal_that_is_no_file(
    mixed_fleet: Path, tmp_path: Path, kind: str, says: str
) -> None:
    """A fleet folder mixing two GPU models, one model's journal replaced by a FIFO, a folder
    or a link in a loop, swept again on the other model's GPU alone (a plain `dvfs sweep
    CAMPAIGN --out DIR`: the GPUs left after a node loss): the sweep skipped that journal,
    exit 0, and rewrote the merged cube with the other model alone; `dvfs cube build`, the dry
    run and the doctor refuse it. It is refused, before any GPU is used, the cube kept (and
    so is binary garbage there)."""
    out = tmp_path / "fleet"
    shutil.copytree(mixed_fleet, out)
    h200 = damaged_model_journal(out, kind)
    before = (out / "cube.nc").read_bytes()
    result = CliRunner().invoke(
        cli, ["sweep", str(mixed_fleet.parent / "tiny.toml"), "--out", str(out), "--no-progress"]
    )
    case = Case(f"fleet-model-journal-{kind}", [], code=1, says=(str(h200), says), chatty=True)
    check_one_clean_error(result, case, {})
    assert (out / "cube.nc").read_bytes() == before  # the merged cube of both models kept


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-loop", "garbage"])
@pytest.mark.parametrize(
    "command",
    [
        ["cube", "info", "{out}"],
        ["headroom", "{out}"],
        ["report", "{out}", "-o", "{tmp}/r.md"],
        ["plot", "{out}", "--out", "{tmp}/p"],
    ],
)
def test_the_analyses_of_a_fleet_cube_pass_over_a_models_damaged_journal(
    mixed_fleet: Path, tmp_path: Path, kind: str, command: list[str]
) -> None:
    """`dvfs cube info|headroom|report|plot FLEET`, the merged cube intact but one model's
    journal binary garbage: refused with the journal's line (exit 1), though the same folder,
    that journal a FIFO or a folder, was analysed (the journals are read there only to name a
    model that measured nothing). The cube is analysed either way, and `dvfs cube build`
    still refuses the journal."""
    out = tmp_path / "fleet"
    shutil.copytree(mixed_fleet, out)
    h200 = damaged_model_journal(out, kind)
    argv = [a.replace("{out}", str(out)).replace("{tmp}", str(tmp_path)) for a in command]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert str(h200) not in result.stderr  # no model said left out: the cube holds both
    build = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert build.exit_code == 1, build.output
    assert str(h200) in build.stderr


@pytest.mark.parametrize("kind", ["read-only", "full-disk"])
@pytest.mark.parametrize("out", [False, True])
def test_a_fleet_folder_its_model_cubes_cannot_be_written_in_is_not_told_another_out(
    mixed_fleet: Path, tmp_path: Path, kind: str, out: bool
) -> None:
    """`dvfs cube build FLEET` of a fleet mixing GPU models, on a read-only or full disk (a
    sweep folder archived read-only): each model's cube goes beside its journal, which failed
    "cannot write FLEET/gpu-<model>/cube.nc: read-only file system; choose another --out",
    though --out (given or not) names only the merged cube's path. It says where the model
    cubes go and what gets round it."""
    err, words = FAULTS[kind][0], FAULTS[kind][2]
    folder = tmp_path / "fleet"
    shutil.copytree(mixed_fleet, folder)
    argv = ["cube", "build", str(folder), *(["-o", str(tmp_path / "m.nc")] if out else [])]
    with failing_writes(folder, err):
        result = CliRunner().invoke(cli, argv)
    case = Case(
        f"fleet-cube-build-{kind}",
        argv,
        code=1,
        says=(str(folder / "gpu-"), words, "beside its journal", f"copy {folder}"),
    )
    check_one_clean_error(result, case, {})
    assert "another --out" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["folder", "link-to-nowhere"])
@pytest.mark.parametrize("out", [False, True])
def test_a_fleet_model_cube_with_something_in_its_way_is_not_told_to_copy_the_folder(
    mixed_fleet: Path, tmp_path: Path, kind: str, out: bool
) -> None:
    """`dvfs cube build FLEET` where a GPU model's cube.nc is a folder, or a link into a folder
    that does not exist: it said "make room or write access in FLEET/gpu-<model>, or copy
    FLEET to a folder that can be written and build the cube there", where there is room and
    write access, and whose copy holds the same folder or link. It says to move it aside (or
    remove the link) and run again, which builds the cube."""
    folder = tmp_path / "fleet"
    shutil.copytree(mixed_fleet, folder)
    [cube] = folder.glob("gpu-*h200*/cube.nc")
    cube.unlink()
    if kind == "folder":
        cube.mkdir()
        says: tuple[str, ...] = ("it is a folder", "move that folder aside and run again")
    else:
        cube.symlink_to(tmp_path / "missing" / "cube.nc")
        says = ("symbolic link to", "remove the link and run again")
    argv = ["cube", "build", str(folder), *(["-o", str(tmp_path / "m.nc")] if out else [])]
    result = CliRunner().invoke(cli, argv)
    case = Case(f"fleet-cube-{kind}", argv, code=1, says=(str(cube), *says))
    check_one_clean_error(result, case, {})
    assert "copy" not in result.stderr and "another --out" not in result.stderr, result.stderr
    (shutil.rmtree if kind == "folder" else Path.unlink)(cube)  # as the line says
    assert CliRunner().invoke(cli, argv).exit_code == 0


def _dead_runs_state_file(state: Path) -> tuple[dict[str, Any], Path]:
    """The first fake GPU, and the state file a sweep that died left for it in `state`."""
    import socket
    from datetime import UTC, datetime

    [gpu, *_] = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout)
    state.mkdir()
    record = state / f"{gpu['uuid']}.json"
    record.write_text(
        json.dumps(
            {
                "original": {
                    "uuid": gpu["uuid"],
                    "sm_clock_lock_mhz": None,
                    "power_limit_mw": 700_000,
                },
                "pid": 999_999_999,  # no such process: a run that died
                "host": socket.gethostname(),
                "since": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command": "sweep",
            }
        )
    )
    return gpu, record


@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("defaults", [False, True])
def test_gpu_reset_in_a_state_folder_it_cannot_write_is_not_told_another_state_dir(
    fake_nvml: None, tmp_path: Path, kind: str, defaults: bool
) -> None:
    """`dvfs gpu reset --state-dir DIR` with a GPU's state file in DIR, on a read-only or full
    disk or a folder it may not write (the GPU's lock cannot be taken): it said "cannot write
    DIR/GPU-....lock: read-only file system; choose another --state-dir", whose reset finds
    none of the state files DIR keeps ("nothing to restore"). It says to mend DIR and run the
    same reset again, the GPU unchanged and its state file kept."""
    err, _, words = FAULTS[kind]
    state = tmp_path / "state"
    _, record = _dead_runs_state_file(state)
    argv = ["gpu", "reset", *(["--defaults"] if defaults else []), "--state-dir", str(state)]
    with failing_writes(state, err):
        result = CliRunner().invoke(cli, argv)
    again = "dvfs gpu reset" + (" --defaults" if defaults else "") + f" --state-dir {state}"
    says = (str(state), words, again, "no GPU was restored")
    check_one_clean_error(result, Case(f"gpu-reset-{kind}", argv, code=1, says=says), {})
    assert "another --state-dir" not in result.stderr, result.stderr
    assert record.exists()


@pytest.mark.parametrize("by", ["index", "uuid"])
@pytest.mark.parametrize("defaults", [False, True])
def test_gpu_reset_of_named_gpus_in_a_state_folder_it_cannot_write_says_them_again(
    fake_nvml: None, tmp_path: Path, by: str, defaults: bool
) -> None:
    """`dvfs gpu reset DEVICES --state-dir DIR`, DIR read-only: the reset to run again once DIR
    is mended was said without DEVICES, which run as said restores every GPU's state file and,
    with --defaults, resets every other GPU to driver defaults too (caps applied to GPUs the
    user left out of DEVICES gone). It is said with the DEVICES as given."""
    state = tmp_path / "state"
    gpu, record = _dead_runs_state_file(state)
    device = str(gpu["index"]) if by == "index" else gpu["uuid"]
    flags = ["--defaults"] if defaults else []
    argv = ["gpu", "reset", device, *flags, "--state-dir", str(state)]
    with failing_writes(state, errno.EROFS):
        result = CliRunner().invoke(cli, argv)
    again = " ".join(["dvfs gpu reset", device, *flags, f"--state-dir {state}"])
    says = (str(state), f"run `{again}` again", "no GPU was restored")
    check_one_clean_error(result, Case(f"gpu-reset-named-{by}", argv, code=1, says=says), {})
    assert record.exists()


@pytest.mark.parametrize("where", ["dev-null", "under-a-file", "link-loop"])
def test_a_state_folder_that_cannot_be_reached_is_refused_in_one_wording(
    fake_nvml: None, tmp_path: Path, where: str
) -> None:
    """--state-dir naming /dev/null, a path under a file or a link in a loop: `gpu reset` and
    `cap show`, `cap apply` and `monitor` refused it in two near-identical lines (one said "its
    state files", "name the folder itself", the other "dvfs's records in it", "name a
    folder"), two texts to keep in step. Every command says the one line, exit 1 each (`gpu
    reset` exited 3, which says a GPU holds changes or another dvfs uses it)."""
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "caps.toml").write_text(GOOD_CAPS)
    (tmp_path / "loop").symlink_to("loop")
    value = {
        "dev-null": "/dev/null",
        "under-a-file": str(tmp_path / "file.txt" / "s"),
        "link-loop": str(tmp_path / "loop"),
    }[where]
    lines = set()
    for argv in (
        ["gpu", "reset"],
        ["gpu", "reset", "0", "--defaults"],
        ["cap", "show"],
        ["cap", "apply", str(tmp_path / "caps.toml"), "--dry-run"],
        ["monitor", "--once", "--gpu", "0"],
    ):
        result = CliRunner().invoke(cli, [*argv, "--state-dir", value])
        assert result.exit_code == 1, (argv, result.output)
        [line] = result.stderr.splitlines()
        assert line.startswith(f"Error: state folder {value} is unreadable ("), (argv, line)
        lines.add(line)
    assert len(lines) == 1, lines


@pytest.mark.parametrize("blocked", ["gpu-lock", "caps-record"])
def test_cap_reset_of_a_named_gpu_that_cannot_write_its_state_says_it_again(
    fake_nvml: None, tmp_path: Path, blocked: str
) -> None:
    """`dvfs cap reset 0 --state-dir DIR`, both GPUs capped, where GPU 0's lock cannot be
    taken, or the caps record cannot be rewritten once GPU 0 is reset (a read-only disk): the
    reset to run again was said as `dvfs cap reset --state-dir DIR`, which run as said resets
    GPU 1's caps too. It is said with the DEVICES as given, and run so, leaves GPU 1 capped."""
    (tmp_path / "caps.toml").write_text(GOOD_CAPS)
    state = tmp_path / "state"
    applied = ["cap", "apply", str(tmp_path / "caps.toml"), "--state-dir", str(state)]
    _assert_ok(CliRunner().invoke(cli, applied))
    argv = ["cap", "reset", "0", "--state-dir", str(state)]
    where = state if blocked == "gpu-lock" else state / "caps-applied.json"
    with failing_writes(where, errno.EROFS):
        result = CliRunner().invoke(cli, argv)
    again = f"run `dvfs cap reset 0 --state-dir {state}` again"
    check_one_clean_error(result, Case(f"cap-reset-0-{blocked}", argv, code=1, says=(again,)), {})
    _assert_ok(CliRunner().invoke(cli, argv))  # as the line says, the disk writable again
    shown = CliRunner().invoke(cli, ["cap", "show", "--state-dir", str(state)]).stdout
    [gpu1] = [line for line in shown.splitlines() if line.startswith("GPU 1 ")]
    assert "power limit 450 W" in gpu1, shown


def test_gpu_reset_defaults_of_a_named_gpu_that_cannot_rewrite_the_caps_record_says_it_again(
    fake_nvml: None, tmp_path: Path
) -> None:
    """`dvfs gpu reset 0 --defaults --state-dir DIR`, both GPUs capped, the caps record
    unwritable once GPU 0 is reset (a read-only disk): the caps reset to run again was said as
    `dvfs cap reset --state-dir DIR`, which run as said resets GPU 1's caps too. It is said
    with the DEVICES as given, and run so, leaves GPU 1 capped."""
    (tmp_path / "caps.toml").write_text(GOOD_CAPS)
    state = tmp_path / "state"
    applied = ["cap", "apply", str(tmp_path / "caps.toml"), "--state-dir", str(state)]
    _assert_ok(CliRunner().invoke(cli, applied))
    argv = ["gpu", "reset", "0", "--defaults", "--state-dir", str(state)]
    with failing_writes(state / "caps-applied.json", errno.EROFS):
        result = CliRunner().invoke(cli, argv)
    again = f"run `dvfs cap reset 0 --state-dir {state}` again"
    check_one_clean_error(result, Case("gpu-reset-0-defaults", argv, code=1, says=(again,)), {})
    _assert_ok(CliRunner().invoke(cli, ["cap", "reset", "0", "--state-dir", str(state)]))
    shown = CliRunner().invoke(cli, ["cap", "show", "--state-dir", str(state)]).stdout
    [gpu1] = [line for line in shown.splitlines() if line.startswith("GPU 1 ")]
    assert "power limit 450 W" in gpu1, shown


@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("given", [False, True])
def test_govern_in_a_state_folder_it_cannot_write_is_not_told_another_state_dir(
    fake_nvml: None, tmp_path: Path, kind: str, given: bool
) -> None:
    """`dvfs govern` with its state folder (--state-dir DIR, or the default) on a read-only or
    full disk or a folder it may not write (a GPU's lock cannot be taken): it said "cannot
    write DIR/GPU-....lock: read-only file system; choose another --state-dir", a folder where
    `cap show`, sweeps and `gpu reset` would not look, as `cap apply` and `gpu reset` no
    longer say. It says what mends the folder and to start the governor again, in one line,
    no GPU changed."""
    import os

    err, _, words = FAULTS[kind]
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    state = tmp_path / "state" if given else Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    before = CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout
    argv = ["govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--gpu", "0"]
    argv += ["--max-intervals", "1", "--interval", "0.1", "--listen", "off"]
    argv += ["--state-dir", str(state)] if given else []
    with failing_writes(state, err):
        result = CliRunner().invoke(cli, argv)
    says = (str(state), words, "start the governor again", "no GPU was changed")
    case = Case(f"govern-state-{kind}", argv, code=1, says=says, chatty=True)
    check_one_clean_error(result, case, {})
    assert "choose another" not in result.stderr, result.stderr
    assert CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout == before


@pytest.mark.parametrize("kind", list(FAULTS))
def test_govern_whose_state_records_cannot_be_written_is_not_told_another_state_dir(
    fake_nvml: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """`dvfs govern --state-dir DIR`, its GPU locks taken but its records there not written (a
    disk filled or remounted read-only since): it said "cannot write DIR/governed-GPU-...json:
    no space left on the device; free space or choose another --state-dir", a folder where
    `gpu reset` and `cap show` would not look. It says what mends DIR and to start the
    governor again, in one line, the GPU as it was."""
    import os

    import dvfs.govern.metrics
    import dvfs.gpu.safety
    from dvfs.govern.metrics import ServerSample

    class Server:  # a server running batch 1, which the plan's step sets a clock for
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

        def __call__(self) -> ServerSample:
            return ServerSample(1, None, None)

    err, _, words = FAULTS[kind]
    state = tmp_path / "state"

    def unwritable(path: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(dvfs.govern.metrics, "ServerReader", Server)
    monkeypatch.setattr(dvfs.gpu.safety, "write_json_atomic", unwritable)
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    before = CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout
    argv = ["govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--gpu", "0"]
    argv += ["--max-intervals", "2", "--interval", "0.1", "--listen", "off"]
    result = CliRunner().invoke(cli, [*argv, "--state-dir", str(state)])
    says = (str(state), words, "start the governor again")
    case = Case(f"govern-records-{kind}", argv, code=1, says=says, chatty=True)
    check_one_clean_error(result, case, {})
    assert "choose another" not in result.stderr, result.stderr
    assert CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout == before


def test_govern_whose_state_folder_turns_read_only_mid_run_names_the_reset_a_restart_needs(
    fake_nvml: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs govern` on two GPUs, its state folder turned read-only after the first step (an
    ext4 error remounting it): GPU 0's state file could not be removed on the way out, which
    stopped the restore there, GPU 1 left capped, and the line said only "make it writable,
    then start the governor again", though a restart is refused (exit 3) until `dvfs gpu
    reset` runs. Both GPUs are put back, and the line names that reset, with the folder."""
    import os

    import dvfs.govern.loop
    import dvfs.govern.metrics
    import dvfs.gpu.safety
    from dvfs.govern.metrics import ServerSample

    class Server:  # batch 1, then 4: the second step's record cannot be written
        batches = iter([1, 4])

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> Server:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

        def __call__(self) -> ServerSample:
            return ServerSample(next(self.batches, 4), None, None)

    state = tmp_path / "state"
    read_only, remounts = [False], [True]
    write, unlink, apply = (
        dvfs.gpu.safety.write_json_atomic,
        Path.unlink,
        dvfs.govern.loop.CappedKnobs.apply,
    )

    def refused(path: Path) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def writes(path: Path, *args: Any, **kwargs: Any) -> None:
        if read_only[0]:
            raise refused(path)
        write(path, *args, **kwargs)

    def unlinks(path: Path, *args: Any, **kwargs: Any) -> None:
        if read_only[0] and path.absolute().is_relative_to(state.absolute()):
            raise refused(path)
        unlink(path, *args, **kwargs)

    def applies(knobs: Any, setting: Any) -> bool:
        wrote = apply(knobs, setting)
        read_only[0] = remounts[0]  # remounted once the first step's records are written
        return wrote

    monkeypatch.setattr(dvfs.govern.metrics, "ServerReader", Server)
    monkeypatch.setattr(dvfs.gpu.safety, "write_json_atomic", writes)
    monkeypatch.setattr(Path, "unlink", unlinks)
    monkeypatch.setattr(dvfs.govern.loop.CappedKnobs, "apply", applies)
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n[[batch]]\nbatch = 4\nsm_clock_mhz = 1500\n"
    )
    before = CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout
    argv = ["govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--gpu", "0"]
    argv += ["--gpu", "1", "--max-intervals", "5", "--interval", "0.01", "--dwell", "0"]
    argv += ["--listen", "off", "--state-dir", str(state)]
    result = CliRunner().invoke(cli, argv)
    reset = f"`dvfs gpu reset --state-dir {state}`"
    says = (str(state), "read-only", "make it writable", reset, "start the governor again")
    case = Case("govern-records-read-only-mid-run", argv, code=1, says=says, chatty=True)
    check_one_clean_error(result, case, {})
    fake = sys.modules["pynvml"]
    assert [fake.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [None, None]
    read_only[0] = remounts[0] = False  # made writable
    assert CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout == before
    assert CliRunner().invoke(cli, argv).exit_code == 3  # the restart the line warns of
    assert CliRunner().invoke(cli, ["gpu", "reset", "--state-dir", str(state)]).exit_code == 0
    assert CliRunner().invoke(cli, argv).exit_code == 0


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("read-only", ("{state}:", "read-only file system", "make it writable")),
        ("full-disk", ("{state}:", "no space left", "free space there")),
        ("immutable-folder", ("{state}:", "operation not permitted", "chattr -i")),
        ("immutable-lock", ("{state}/{uuid}.lock:", "operation not permitted", "chattr -i")),
    ],
)
def test_a_cap_apply_dry_run_says_the_apply_would_fail_on_a_state_folder_it_cannot_write(
    fake_nvml: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    says: tuple[str, ...],
) -> None:
    """`dvfs cap apply --dry-run` with its state folder on a read-only or full file system, or
    the folder or a GPU's lock in it immutable (`chattr +i`, which refuses root too): it said
    "would apply to GPU 0", exit 0, where the apply fails "cannot write ...", exit 1, though a
    dry run exits as the apply would (README). It says the apply would be refused and what
    mends the folder, exit 1, in one line, writing nothing there. The faults are seen as
    the dry run sees them (the file system's flags and counts, the inode's flags), made up
    here: no mount or `chattr` needed."""
    import os

    import dvfs.gpu.safety as safety
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    [gpu, *_] = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout)
    uuid = gpu["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=1500),))))
    state = tmp_path / "state"
    state.mkdir()
    (state / f"{uuid}.lock").write_text("")
    real_statvfs = os.statvfs
    real_flags = getattr(safety, "_inode_flags", lambda path: 0)

    def statvfs(path: Any) -> os.statvfs_result:
        got = real_statvfs(path)
        if os.path.abspath(path) != str(state):
            return got
        fields = list(got)[:10]  # bsize frsize blocks bfree bavail files ffree favail flag max
        if kind == "read-only":
            fields[8] |= os.ST_RDONLY
        elif kind == "full-disk":
            fields[2], fields[3], fields[4] = max(fields[2], 1), 0, 0
        return os.statvfs_result(fields)

    def flags(path: Path) -> int:
        immutable = {"immutable-folder": state, "immutable-lock": state / f"{uuid}.lock"}
        return 0x10 if Path(path) == immutable.get(kind) else real_flags(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(safety, "_inode_flags", flags, raising=False)  # (the dry run's reader)
    listing = sorted(p.name for p in state.iterdir())
    argv = ["cap", "apply", str(caps), "--state-dir", str(state), "--dry-run"]
    result = CliRunner().invoke(cli, argv)
    places = {"state": str(state), "uuid": uuid}
    words = ("dry run, nothing changed: the apply would be refused", *says, "apply the caps again")
    check_one_clean_error(result, Case(f"cap-dry-run-{kind}", argv, code=1, says=words), places)
    assert sorted(p.name for p in state.iterdir()) == listing  # nothing written there
    assert "would apply to" not in result.stdout, result.stdout


def test_doctor_says_the_sweeps_refusal_of_a_lock_linked_into_no_folder(tmp_path: Path) -> None:
    """An --out folder whose sweep.lock is a symbolic link into a folder that is not there:
    the sweep refuses it (7c763a3a), but `dvfs doctor` said "ok output folder: OUT: usable",
    and the dry run planned it without a note, for `path.exists()` denies such a link is
    there. Both now say the sweep's line."""
    (tmp_path / "c.toml").write_text(campaign(), encoding="utf-8")
    out = tmp_path / "run"
    out.mkdir()
    (out / "sweep.lock").symlink_to("missing/sweep.lock")
    argv = ["sweep", str(tmp_path / "c.toml"), "--out", str(out)]
    swept = CliRunner().invoke(cli, [*argv, "--no-progress"])
    assert swept.exit_code == 1, swept.output
    refusal = swept.stderr.strip().splitlines()[-1].removeprefix("Error: ")
    assert "missing/sweep.lock, in a folder that does not exist" in refusal, refusal
    doctor = CliRunner().invoke(cli, ["doctor", str(tmp_path / "c.toml"), "--out", str(out)])
    assert doctor.exit_code == 1, doctor.output
    # doctor wraps to the console's width, a long path mid-word too: compared without spaces
    said = "".join(doctor.output.split())
    assert "".join(f"FAIL output folder: {refusal}".split()) in said, doctor.output
    dry = CliRunner().invoke(cli, [*argv, "--dry-run", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    assert f"the sweep would stop: {refusal}" in " ".join(dry.stderr.split()), dry.output
    assert not (out / "missing").exists()


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["sweep", "{f}"], "campaign file"),
        (["cap", "apply", "{f}"], "caps file"),
        (["cap", "plan", "{f}", "--batch", "1", "--drafter", "none"], "headroom document"),
        (["govern", "--plan", "{f}", "--dry-run"], "per-batch plan"),
        (["twin", "predict", "{demo}", "--profile", "{f}", "-o", "{o}"], "twin profile"),
    ],
)
def test_a_text_file_that_is_not_utf8_is_said_so_in_one_wording(
    tmp_path: Path, args: list[str], what: str
) -> None:
    """A caps file, plan, headroom document or twin profile not UTF-8 (a binary file given by
    mistake) said Python's codec message ("'utf-8' codec can't decode byte 0xff in position
    2"), or its reason alone ("not UTF-8 text: invalid start byte"), where the campaign file's
    reader names the byte, its line and what to do: each says it as the campaign's does."""
    binary = tmp_path / "binary.dat"
    binary.write_bytes(b"a\n\xff\n")
    demo = Path(__file__).resolve().parent.parent / "sweeps" / "demo.toml"
    words = [a.format(f=binary, o=tmp_path / "out", demo=demo) for a in args]
    result = CliRunner().invoke(cli, words)
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line == (
        f"Error: {binary} is not UTF-8 text (byte 0xff on line 2): is it the {what}? Save it "
        "as UTF-8"
    ), line


@pytest.mark.parametrize(
    "args",
    [
        ["twin", "fit", "{p}", "-o", "{o}"],
        ["cap", "plan", "{p}", "--batch", "1", "--drafter", "none"],
    ],
)
def test_an_input_path_through_a_file_names_the_file(tmp_path: Path, args: list[str]) -> None:
    """`twin fit afile/x` (and every input checked so, `cap plan afile/x`) said click's "Path
    'afile/x' does not exist.", where a campaign file's read says which part is a file: said
    as it says it."""
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    words = [a.format(p=afile / "x", o=tmp_path / "p.toml") for a in args]
    result = CliRunner().invoke(cli, words)
    assert result.exit_code == 2, result.output
    said = f"{afile / 'x'} does not exist: {afile} is a file, not a folder; check the path"
    assert said in result.output and "Traceback" not in result.output, result.output


def test_twin_fit_of_a_folder_whose_cube_is_a_link_to_nothing_names_the_link(
    tmp_path: Path,
) -> None:
    """`twin fit DIR` whose cube.nc is a link to no file, and no journal beside it, said "DIR
    is neither a roofline file nor a cube": the link is named, with what to do."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "cube.nc").symlink_to(tmp_path / "gone" / "cube.nc")
    result = CliRunner().invoke(cli, ["twin", "fit", str(folder), "-o", str(tmp_path / "p.toml")])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line == (
        f"Error: {folder}'s cube.nc ({folder / 'cube.nc'}) is a symbolic link to "
        f"{tmp_path / 'gone' / 'cube.nc'}, which does not exist: point it at the cube, or give "
        "the cube's own path"
    ), line
    assert not (tmp_path / "p.toml").exists()
