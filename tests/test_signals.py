"""dvfs handles SIGINT/SIGTERM/SIGHUP itself during GPU-changing work, whatever dispositions it
inherited, and a restore holds signals back only until the next one. Every test sets the
dispositions it relies on explicitly, so the suite passes in a background job (SIGINT ignored)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from dvfs.signals import (
    HANDLED,
    Interrupted,
    RestoreAbandoned,
    restoring,
    signals_raise,
)


@pytest.fixture
def dispositions() -> Iterator[None]:
    """Put back whatever handlers the test changed."""
    saved = {s: signal.getsignal(s) for s in HANDLED}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_sigint_raises_even_when_the_process_inherited_it_ignored(dispositions) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell gives a background job
    with pytest.raises(KeyboardInterrupt), signals_raise():
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("SIGINT was ignored")
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back afterwards


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_raise_interrupted(dispositions, signum: int, code: int) -> None:
    signal.signal(signum, signal.SIG_IGN)
    with pytest.raises(Interrupted) as caught, signals_raise():
        os.kill(os.getpid(), signum)
        pytest.fail("the signal was ignored")
    assert caught.value.exit_code == code


def test_a_restore_holds_the_first_signal_and_delivers_it_after(dispositions) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    order: list[str] = []
    notices: list[str] = []
    with pytest.raises(KeyboardInterrupt), signals_raise():
        with restoring(notices.append):
            os.kill(os.getpid(), signal.SIGINT)
            order.append("restored")
        order.append("after")
    assert order == ["restored"]
    assert len(notices) == 1 and "send it again to give up" in notices[0]


def test_a_second_signal_gives_up_on_the_restore(dispositions) -> None:
    notices: list[str] = []
    with pytest.raises(RestoreAbandoned) as caught, signals_raise(), restoring(notices.append):
        os.kill(os.getpid(), signal.SIGTERM)
        assert notices  # the first one only waits
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the restore swallowed the second signal")
    assert caught.value.exit_code == 143
    assert "dvfs gpu reset" in str(caught.value)


def test_a_restore_that_fails_reports_its_error_not_the_held_signal(dispositions) -> None:
    with (
        pytest.raises(RuntimeError, match="restore failed"),
        signals_raise(),
        restoring(lambda _: None),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("restore failed")


@pytest.mark.parametrize("entry", ["console script", "python -m dvfs"])
def test_an_interrupt_while_the_command_line_loads_is_one_line(entry: str) -> None:
    """A Ctrl-C in the tenths of a second Python spends importing dvfs's command line (click
    first) ended in a KeyboardInterrupt traceback: both entries import it inside a guard now,
    and end as an interrupted dvfs does. The interrupt is raised at click's import by a finder
    put ahead of Python's own, not by a timed signal."""
    import subprocess
    import sys

    start = "import dvfs.launch as m; m.main()" if entry == "console script" else "import runpy;"
    if entry != "console script":
        start += " runpy.run_module('dvfs', run_name='__main__')"
    code = (
        "import sys\n"
        "class Interrupting:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'click':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupting())\n"
        "sys.argv = ['dvfs', '--help']\n" + start + "\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stderr == "Interrupted.\n", done.stderr
