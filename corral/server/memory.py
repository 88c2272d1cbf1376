"""Process-wide memory settings applied when `corral serve` starts, and whether the model fits at all.

glibc gives each thread that contends for the allocator an arena of its own and rarely returns their memory.
corral runs many threads (HTTP, the prepare pool, compile threads, the engine and its mask thread), so its RSS
drifted upward under varied load: +7.9-8.4 % over the 1,000-request `corral bench soak`, against +1.2 % with
arenas capped at 2 (docs/hostile-input-testing.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
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


def release_freed_memory(collect: bool = True) -> bool:
    """Hand back to the kernel what glibc keeps of freed memory (after a collection, unless `collect` is off:
    a full collection of a serving heap takes longer than the trim). Loading a tokenizer leaves most of its
    parse freed but held: Gemma 3's (262,144 tokens) took 306 MB of RSS, 113 MB after `malloc_trim`.
    True where glibc trimmed something."""
    if collect:
        gc.collect()
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False


# What a serving process holds besides the weights and the KV cache (torch, the tokenizer, both grammar
# engines' vocabulary tables, graph buffers), measured ~0.6 GB for Qwen2.5 1.5B's 151,936-token vocabulary.
RUNTIME_BYTES = 1 << 30


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (free memory plus what the kernel can reclaim); None off Linux."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            lines = info.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def memory_verdict(weights: int, kv_cache: int, available: int | None) -> tuple[str | None, str | None]:
    """(an error, a warning) about serving `weights` bytes with a KV cache (and host block store) that can grow
    to `kv_cache` bytes (it takes memory only as rows fill it) when `available` bytes are: an error when the
    weights and the runtime alone do not fit, a warning when a full cache would not."""
    if available is None:
        return None, None
    gb = 1 << 30
    base = weights + RUNTIME_BYTES
    if base > available:
        return (f"the model needs about {base / gb:.1f} GB ({weights / gb:.1f} GB of weights and ~1 GB of runtime) "
                f"and {available / gb:.1f} GB are available"), None
    if base + kv_cache > available:
        return None, (f"the KV cache can grow to {kv_cache / gb:.1f} GB as rows fill it (with the prefix cache's "
                      f"host store), and with the model's {base / gb:.1f} GB that is more than the "
                      f"{available / gb:.1f} GB available: long contexts on every slot at once would run out of "
                      "memory (lower --max-batch, --max-model-len or --prefix-cache-ram-mb)")
    return None, None

