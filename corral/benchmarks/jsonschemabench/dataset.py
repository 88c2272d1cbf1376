"""The MaskBench files on disk: `<data>/<Subset>/*.json`, each `{description, meta, schema, tests}`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUBSETS = (
    "Github_trivial", "Github_easy", "Github_medium", "Github_hard",
    "Glaiveai2K", "Kubernetes", "WashingtonPost",
)


@dataclass(frozen=True)
class TestInstance:
    data: Any
    valid: bool
    description: str = ""


@dataclass(frozen=True)
class SchemaCase:
    subset: str
    name: str  # file name, unique within its subset
    schema: Any
    tests: tuple[TestInstance, ...]

    @property
    def case_id(self) -> str:
        return f"{self.subset}/{self.name}"


def list_subsets(data_dir: Path, wanted: list[str] | None) -> list[str]:
    """The subset folders to run, in the paper's order first; unknown names are an error."""
    present = sorted(p.name for p in data_dir.iterdir() if p.is_dir() and any(p.glob("*.json")))
    if wanted:
        missing = [s for s in wanted if s not in present]
        if missing:
            raise ValueError(
                f"subset(s) not found under {data_dir}: {', '.join(missing)}; present: {', '.join(present)}"
            )
        return list(wanted)
    known = [s for s in SUBSETS if s in present]
    return known + [s for s in present if s not in known]


def sample_names(names: list[str], limit: int | None) -> list[str]:
    """Deterministic sample: `limit` names evenly spaced over the sorted list (all when limit is None).
    Evenly spaced rather than the first N so a small sample still spans the whole subset."""
    ordered = sorted(names)
    if limit is None or limit >= len(ordered):
        return ordered
    if limit <= 0:
        return []
    return [ordered[i * len(ordered) // limit] for i in range(limit)]


def load_case(path: Path, subset: str) -> SchemaCase:
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or "schema" not in raw:
        raise ValueError(f"{path} is not a MaskBench file (no 'schema')")
    tests = tuple(
        TestInstance(t["data"], bool(t["valid"]), str(t.get("description", "")))
        for t in raw.get("tests", [])
        if isinstance(t, dict) and "data" in t and "valid" in t
    )
    return SchemaCase(subset, path.name, raw["schema"], tests)


def load_cases(data_dir: Path, subsets: list[str] | None, limit: int | None) -> list[SchemaCase]:
    cases: list[SchemaCase] = []
    for subset in list_subsets(data_dir, subsets):
        folder = data_dir / subset
        for name in sample_names([p.name for p in folder.glob("*.json")], limit):
            try:
                cases.append(load_case(folder / name, subset))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping %s/%s: %s", subset, name, exc)
    return cases
