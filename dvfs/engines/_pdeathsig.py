"""Exec a command that dies with its parent: `python _pdeathsig.py PARENT_PID ARGV...`.

The SGLang server must not outlive a SIGKILLed dvfs. Linux delivers a chosen signal to a process
when its parent dies (prctl PR_SET_PDEATHSIG), and the setting survives exec. Setting it from
`Popen(preexec_fn=...)` is unsafe in a threaded parent (the child may deadlock before exec), so
dvfs launches the server through this tiny program instead: it sets the signal, checks the parent
has not died already, and execs the server in its own place (same pid, same process group).
Elsewhere it just execs. Run by path, it imports nothing from dvfs.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `signum` when the parent dies; False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: _pdeathsig.py PARENT_PID COMMAND [ARG...]\n")
        return 2
    parent, command = int(argv[0]), argv[1:]
    if set_parent_death_signal() and os.getppid() != parent:
        return 1  # the parent died before the signal was armed: do not start an orphan
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"cannot start {command[0]}: {exc.strerror}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
