"""Process-wide memory settings applied when `corral serve` starts.

glibc gives each thread that contends for the allocator an arena of its own and rarely returns their memory.
corral runs many threads (HTTP, the prepare pool, compile threads, the engine and its mask thread), so its RSS
drifted upward under varied load: +7.9-8.4 % over the 1,000-request `corral bench soak`, against +1.2 % with
arenas capped at 2 (docs/hostile-input-testing.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas unless MALLOC_ARENA_MAX is set (then glibc already applied the user's).
    True when the cap was set here."""
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))
