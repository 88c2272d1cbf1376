"""Resident memory and open file descriptors of a local process (and its descendants), read from /proc; the
memory of a whole server (its process group's proportional set size) and which process listens on a port."""

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


def group_pss_mb(pid: int) -> float | None:
    """The proportional set size of `pid` and its descendants, summed (MB): each shared page (a memory-mapped
    model file, pages a forked worker shares with its parent) counted once over the processes that map it, so
    two servers on the same file are compared fairly. None if `pid` cannot be read."""
    total = 0.0
    for member in [pid, *_descendants(pid)]:
        try:
            lines = (PROC / str(member) / "smaps_rollup").read_text().splitlines()
        except OSError:
            if member == pid:
                return None
            continue
        total += sum(int(line.split()[1]) for line in lines if line.startswith("Pss:")) / 1024
    return round(total, 1)


_LISTEN = "0A"


def listening_pid(port: int) -> int | None:
    """The local process listening on TCP `port` (IPv4 or IPv6), found through its socket's inode; None if no
    process this user can read listens there."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for process in PROC.iterdir():
        if not process.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (process / "fd").iterdir()]
        except OSError:
            continue
        if inodes.intersection(links):
            return int(process.name)
    return None

