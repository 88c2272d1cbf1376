"""The repack probe's verdicts (corral/server/models/repack_check.py), kept in corral's cache per file, CPU and
ggml build, so a restart does not probe again.

A verdict depends only on the file's blocks, the kernels ggml picks for this CPU and the probe itself: the key
names the file (path, size, modification time), the CPU (its model and instruction-set flags), ggml's CPU
library (size and modification time: a rebuild with other options is another build) and the probe's version.
Probing costs Qwen2.5-Coder 1.5B 2-6 s at every load (docs/measured-choices.md#gguf-repacking). A verdict that
cannot be read or written is probed again, never assumed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from functools import cache
from pathlib import Path

from corral.server.models.build_cache import cache_root, file_key
from corral.server.models.repack_check import PROBE_TOKENS, TOLERANCE

log = logging.getLogger(__name__)

# Raised when the probe changes what it decides, so older verdicts are not read.
PROBE_VERSION = 1
FOLDER = "repack-verdicts"


@cache
def _cpu_identity() -> str:
    """The CPU's model name and flags (Linux), else what the platform module says."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    first = text.split("\n\n", 1)[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    return "|".join(fields.get(name, "").strip() for name in ("model name", "flags", "Features", "CPU part"))


@cache
def _ggml_identity() -> str | None:
    """ggml's CPU library as loaded here (None without the ggml extra: nothing is repacked then)."""
    try:
        import ggml
    except ImportError:
        return None
    folder = Path(ggml.__file__).parent / "lib"
    libraries = sorted(folder.glob("libggml*")) if folder.is_dir() else []
    return ";".join(f"{lib.name}:{lib.stat().st_size}:{lib.stat().st_mtime_ns}" for lib in libraries) or None


def keyed_path(gguf: Path, what: list[object], folder: str = FOLDER) -> Path | None:
    """Where something decided about `gguf` on this CPU and ggml build is kept, `what` naming the decision and
    its inputs; None where it cannot be keyed."""
    library = _ggml_identity()
    try:
        file = file_key(gguf)
    except OSError:
        return None
    if library is None:
        return None
    identity = [file, _cpu_identity(), library, *what]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    return cache_root() / folder / f"{gguf.stem}-{key}.json"


def read_kept(path: Path | None) -> dict[str, object] | None:
    """A kept decision's JSON object; None if never kept (or unreadable)."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def keep(path: Path | None, data: dict[str, object], what: str) -> None:
    """Write a decision atomically; a cache that cannot be written only costs the next load the work again."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data), encoding="utf-8")
        temporary.replace(path)  # atomic: a concurrent reader sees the whole verdict or none
    except OSError as exc:
        log.debug("could not keep the %s for %s: %s", what, path.name, exc)


def verdict_path(gguf: Path, parts: tuple[str, ...]) -> Path | None:
    """Where the verdict on `gguf` with `parts` repacked is kept; None where it cannot be keyed."""
    return keyed_path(gguf, [list(parts), PROBE_VERSION, PROBE_TOKENS, TOLERANCE])


def read_verdict(gguf: Path, parts: tuple[str, ...]) -> tuple[bool, float] | None:
    """(agree, gap) as probed before on this file, CPU and ggml build; None if never (or unreadable)."""
    data = read_kept(verdict_path(gguf, parts))
    if data is None:
        return None
    try:
        return bool(data["agree"]), float(data["gap"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError):
        return None


def write_verdict(gguf: Path, parts: tuple[str, ...], agree: bool, gap: float) -> None:
    """Keep a probe's verdict; a cache that cannot be written only costs the next load a probe."""
    keep(verdict_path(gguf, parts), {"agree": agree, "gap": gap, "parts": list(parts)}, "repack verdict")
