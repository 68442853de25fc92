"""User text printed through rich (a path, a model's name): brackets in it are text, not rich
markup. `[/]` was an internal error (rich's MarkupError) in place of the line, `[red]` or
`[bold x]` dropped from the path shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import TINY, write
from test_durability import _signal_after_first_cell_written

from dvfs.cli import cli

#: Folder names rich reads as markup: a closing tag with nothing to close (an error), a style
#: (dropped), a style rich does not know (dropped too).
BRACKETED = ["a[/]b", "m[red]x", "c[bold x]d"]


def _said(stderr: str) -> str:
    return " ".join(stderr.split())


@pytest.mark.parametrize("name", BRACKETED)
def test_an_interrupted_sweep_names_its_partial_cube_as_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C after the first cell: "partial cube written to PATH" named another folder (the
    brackets dropped), or, with `[/]` in --out, the line and the advice to resume were lost to
    an internal error, exit 1 for 130."""
    _signal_after_first_cell_written(monkeypatch)  # Ctrl-C there
    out = tmp_path / name
    campaign = write(tmp_path / "tiny.toml", TINY)
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    assert result.exit_code == 130, result.output
    said = _said(result.stderr)
    assert f"partial cube written to {out / 'cube.nc'}" in said, said
    assert "GPU settings restored. Run the same command again to resume." in said, said
    assert (out / "cube.nc").is_file()


def test_an_interrupted_sweep_names_the_state_folder_of_the_gpus_it_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C, and NVML refusing to unlock the GPU's clocks: the line saying the GPU's settings
    are NOT restored, and where their state files are, was an internal error where the state
    folder ($DVFS_STATE_DIR) holds `[/]`."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    state = tmp_path / "st[/]ate"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_STATE_DIR=str(state))
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 999})
    _signal_after_first_cell_written(monkeypatch)  # Ctrl-C there
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert result.returncode == 130, result.stderr
    said = _said(result.stderr)
    assert "GPU settings NOT fully restored" in said, said
    assert f"(state in {state})." in said, said
    assert "internal error" not in said, said


def test_a_fleet_that_left_a_gpu_unrestored_names_its_state_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet worker's GPU fell off the bus, its settings left: the last line, NOT restored
    and where the state files are, was an internal error where $DVFS_STATE_DIR holds `[/]`."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process
    from test_multi_gpu import _fake_gpu1_lost_on_its_second_cell

    env, _ = _fake_gpu1_lost_on_its_second_cell(tmp_path, monkeypatch)
    state = tmp_path / "st[/]ate"
    env["DVFS_STATE_DIR"] = str(state)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--gpus", "0-1", "--out", str(out), env=env)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and f"(state in {state})." in last, result.stderr


@pytest.mark.parametrize("name", BRACKETED)
def test_cap_show_names_the_caps_file_as_given(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap show` says which file the caps in force came from: `dvfs cap apply` of a file in a
    folder with brackets in its name was shown without them, or (`[/]`) `cap show` failed
    with an internal error, showing no GPU."""
    from nvml_support import installed_root_fake

    from dvfs.caps import CapsFile, GpuCap, dump_caps

    installed_root_fake(tmp_path, monkeypatch)
    listed = CliRunner().invoke(cli, ["gpu", "list", "--json"])
    uuid = json.loads(listed.output)[0]["uuid"]
    caps = tmp_path / name / "caps.toml"
    caps.parent.mkdir(parents=True)
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    applied = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert applied.exit_code == 0, applied.output
    shown = CliRunner().invoke(cli, ["cap", "show"])
    assert shown.exit_code == 0, shown.output
    assert f"from {caps.resolve()} at " in _said(shown.output), shown.output


def test_cap_reset_names_the_unreadable_state_file_it_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap reset` drops a GPU's unreadable state file, naming it: with `[/]` in the state
    folder ($DVFS_STATE_DIR) the GPUs were reset and the file dropped, but nothing was said
    of them: an internal error, exit 1."""
    from nvml_support import installed_root_fake

    installed_root_fake(tmp_path, monkeypatch)
    state = tmp_path / "st[/]ate"
    monkeypatch.setenv("DVFS_STATE_DIR", str(state))
    listed = CliRunner().invoke(cli, ["gpu", "list", "--json"])
    uuid = json.loads(listed.output)[0]["uuid"]
    state.mkdir(parents=True)
    (state / f"{uuid}.json").write_text("not a state file\n")
    reset = CliRunner().invoke(cli, ["cap", "reset"])
    assert reset.exit_code == 0, reset.output
    said = _said(reset.stdout)
    assert f"the unreadable state file {state / uuid}.json: dropped" in said, said
    assert not (state / f"{uuid}.json").exists()


@pytest.mark.parametrize("name", BRACKETED)
def test_corpus_list_and_show_name_the_tokenizer_of_a_models_path_as_given(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the tokenizer of engine.model at hand, `corpus list` and `corpus show` say the
    tokens are counted by the tokenizer of that model: a local model's path with brackets was
    shown without them, or (`[/]`) each command ended in an internal error after its table."""
    from sglang_support import stub_campaign

    import dvfs.corpora.tokens

    class Tokenizer:  # one token a word; no chat template
        chat_template = None

        def __call__(self, text: str) -> dict[str, list[str]]:
            return {"input_ids": text.split()}

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: Tokenizer())
    path, marker = stub_campaign(tmp_path)
    model = f"/models/{name}"
    path.write_text(path.read_text().replace(f'model = "{marker}"', f'model = "{model}"'))
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(path)])
    assert listed.exit_code == 0, listed.output
    assert f"token counts: tokenizer of {model}" in _said(listed.output), listed.output
    shown = CliRunner().invoke(cli, ["corpus", "show", "code", "-n", "0", "--campaign", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"(min/median/max, tokenizer of {model});" in _said(shown.output), shown.output
