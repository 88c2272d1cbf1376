"""Build a model directory once into corral's cache, safe against concurrent builders and interrupted builds.

A build writes into a private temporary sibling and is renamed into place only when complete, with a marker
file (written last) listing its files. Builders of the same entry take an exclusive `flock` on a lock file
beside it (`<entry>.lock`), so two processes starting at once build it once: the second waits, then finds it complete. A
directory without a valid marker (a build cut off before the rename could not leave one, but an older
corral or a hand copy could) is removed and built again; stale temporaries are removed under the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from corral.server.settings import cache_dir

logger = logging.getLogger(__name__)

MARKER = "corral-build.json"


def file_key(path: Path) -> str:
    """A short key for `path` as it is now (resolved path, size, modification time): a changed file gets another."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def cache_root() -> Path:
    """Where built models are kept (corral/server/settings.py `cache_dir`)."""
    return cache_dir()


def is_complete(model_dir: Path) -> bool:
    try:
        files = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(files, list) and bool(files) and all((model_dir / str(f)).is_file() for f in files)


def cached_build(target: Path, build: Callable[[Path], None], what: str) -> Path:
    """`target`, built by `build(tmp_dir)` unless a complete copy is already there. `what` names it in logs."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if is_complete(target):  # another process built it while this one waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.warning("removing the incomplete cache entry %s", target)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary readable directory
        start = time.perf_counter()
        logger.info("building %s into %s (once; later starts reuse it)", what, target)
        try:
            build(tmp)
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            (tmp / MARKER).write_text(json.dumps({"files": files, "built_s": round(time.perf_counter() - start, 1)}))
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s in %.1f s", what, time.perf_counter() - start)
    return target
