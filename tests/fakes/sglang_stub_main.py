"""`python sglang_stub_main.py ARGV`: the stub server (`sglang_stub.py`) run from its cached
bytecode, as `python sglang_stub.py ARGV` runs it.

Python compiles a script run by path from source on every start and caches only the modules
it imports: the stub's 2,200 lines cost about 13 ms of CPU each time, and the tests start it
hundreds of times (`--help` for each sweep's probe, a server per drafter and per resume).
Imported from here, it is compiled once into tests/fakes/__pycache__ and then read.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sglang_stub  # noqa: E402

if __name__ == "__main__":
    exit_code = sglang_stub.main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit, as the stub's own __main__: in-flight handler threads must not delay the exit.
    os._exit(exit_code)
