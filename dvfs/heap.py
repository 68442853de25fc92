"""The C heap under a twin sweep: padded while it measures (`pad_heap`), so that each round's
arrays do not fault their pages in anew, and trimmed before its cube (`release_free_memory`),
so that the cube is not built on top of what the measurement freed. glibc only; elsewhere
both do nothing."""

from __future__ import annotations

#: glibc's mallopt parameter for the C heap's top padding (malloc.h's M_TOP_PAD).
_M_TOP_PAD = -2


#: Bytes the C heap grows by beyond what it needs, and keeps when it shrinks (`pad_heap`).
HEAP_TOP_PAD = 8 << 20


def pad_heap() -> None:
    """Let the C heap grow, and shrink, HEAP_TOP_PAD at a time (glibc's M_TOP_PAD; elsewhere
    nothing). Each round on the twin makes and drops many arrays on the heap (below glibc's
    mmap threshold): at its default padding (128 kB) the heap's top went back to the OS as
    they were freed and was taken again by the next round, every page faulted in anew: 190k
    minor page faults on the demo sweep, 0.6 s of system CPU, against 43k and 0.25 s padded.
    At most HEAP_TOP_PAD more stays resident; `release_free_memory` still hands every free
    page back before the cube."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS)
        return
    mallopt(_M_TOP_PAD, HEAP_TOP_PAD)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere
    nothing). A sweep on the twin makes and drops millions of small arrays, and glibc kept
    the freed pages: tens of MB on a large campaign, which the cube was then built on top of."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return
    trim(0)
