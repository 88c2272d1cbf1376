"""Resident memory and open file descriptors of a local process (and its descendants), read from /proc."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessSample:
    rss_mb: float  # the server process itself
    fds: int
    children: int  # descendants: the compile zygote, the workers it forked, other child processes
    children_rss_mb: float  # their summed RSS (forked workers share pages with the zygote: an upper bound)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample(pid: int) -> ProcessSample | None:
    """None when `pid` is not a readable local process (a remote --server, or not Linux)."""
    try:
        rss = _rss_mb(pid)
        fds = len(os.listdir(PROC / str(pid) / "fd"))
    except OSError:
        return None
    kids = _descendants(pid)
    kids_rss = 0.0
    for kid in kids:
        try:
            kids_rss += _rss_mb(kid)
        except OSError:
            continue  # it ended between the listing and the read
    return ProcessSample(round(rss, 1), fds, len(kids), round(kids_rss, 1))


def _rss_mb(pid: int) -> float:
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no VmRSS for {pid}")


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    stack = _children(pid)
    while stack:
        kid = stack.pop()
        found.append(kid)
        stack += _children(kid)
    return found


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids
