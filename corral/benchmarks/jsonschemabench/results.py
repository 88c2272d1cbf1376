"""Append-only JSONL of per-schema records, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RecordKey = tuple[str, str, str]  # (backend, subset, schema file)


def record_key(record: dict[str, Any]) -> RecordKey:
    return (str(record["backend"]), str(record["subset"]), str(record["schema"]))


class ResultStore:
    """`<out>/<mode>.jsonl`; one line per schema × backend, flushed as soon as it is known."""

    def __init__(self, out_dir: Path, mode: str) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"{mode}.jsonl"
        self.mode = mode
        self._lock = threading.Lock()

    def records(self) -> list[dict[str, Any]]:
        """Every complete record of this mode; a line cut short by a crash is skipped. A schema run twice
        (e.g. after deleting lines) counts once: the last record wins."""
        if not self.path.exists():
            return []
        latest: dict[RecordKey, dict[str, Any]] = {}
        with self.path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("%s:%d is not a complete record; ignoring it", self.path, number)
                    continue
                if isinstance(record, dict) and record.get("mode") == self.mode:
                    latest[record_key(record)] = record
        return list(latest.values())

    def done(self) -> set[RecordKey]:
        return {record_key(r) for r in self.records()}

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
