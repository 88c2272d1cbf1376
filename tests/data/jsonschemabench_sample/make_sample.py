"""Copy a small, deterministic sample of JSONSchemaBench into this folder (same layout and file format).

Usage: python make_sample.py [SOURCE_DIR]   (default: ../../../../shared/jsonschemabench)

Per subset: the sorted file names, filtered to files of at most MAX_BYTES (keeps the sample small),
then PER_SUBSET of them evenly spaced over that sorted list. Re-running gives the same files.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SUBSETS = (
    "Github_trivial", "Github_easy", "Github_medium", "Github_hard",
    "Glaiveai2K", "Kubernetes", "WashingtonPost",
)
PER_SUBSET = 12
MAX_BYTES = 5_000

HERE = Path(__file__).resolve().parent


def evenly_spaced(items: list[Path], count: int) -> list[Path]:
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def main(source: Path) -> None:
    for subset in SUBSETS:
        files = sorted(p for p in (source / subset).glob("*.json") if p.stat().st_size <= MAX_BYTES)
        target = HERE / subset
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        for path in evenly_spaced(files, PER_SUBSET):
            shutil.copyfile(path, target / path.name)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[3] / "shared" / "jsonschemabench")
