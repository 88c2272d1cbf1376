"""The figures behind the request-limit defaults (docs/reliability.md): the largest depth, size and `$ref`
count in JSONSchemaBench (every schema must pass the defaults), and what the checks cost.

    python -m corral.benchmarks.request_limits [BENCH_DIR]   (default ../shared/jsonschemabench, else the test sample)
"""

from __future__ import annotations

import json
import sys
import timeit
from pathlib import Path
from typing import Any

from corral.grammars.limits import InputLimits, check_schema_limits
from corral.server.middleware import json_depth

REPO = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO.parent / "shared" / "jsonschemabench"
SAMPLE_DIR = REPO / "tests" / "data" / "jsonschemabench_sample"


def shape(schema: Any) -> tuple[int, int, int]:
    """(JSON nesting depth, JSON values, $ref keywords) of one schema document."""
    depth = nodes = refs = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        nodes += 1
        if isinstance(node, dict):
            depth = max(depth, level)
            refs += isinstance(node.get("$ref"), str)
            stack += [(child, level + 1) for child in node.values()]
        elif isinstance(node, list):
            depth = max(depth, level)
            stack += [(child, level + 1) for child in node]
    return depth, nodes, refs


def _best_ms(work: Any) -> float:
    return 1000 * min(timeit.repeat(work, number=1, repeat=5))


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else SHARED_DIR if SHARED_DIR.is_dir() else SAMPLE_DIR
    limits = InputLimits()
    rows: list[tuple[int, int, int, Path]] = []
    for path in sorted(root.glob("*/*.json")):
        schema = json.loads(path.read_text())["schema"]
        check_schema_limits(schema, limits, param=str(path))  # raises if a real schema is refused
        rows.append((*shape(schema), path))
    if not rows:
        print(f"no schemas under {root}", file=sys.stderr)
        return 2
    print(f"{len(rows)} schemas under {root}, all within the defaults")
    for index, name in enumerate(("depth", "nodes", "$refs")):
        values = sorted(row[index] for row in rows)
        print(f"  {name}: p50 {values[len(values) // 2]}, p99 {values[int(len(values) * 0.99)]}, max {values[-1]}")
    largest = max(rows, key=lambda row: row[1])
    schema = json.loads(largest[3].read_text())["schema"]
    cost = _best_ms(lambda: check_schema_limits(schema, limits, param="schema"))
    print(f"check_schema_limits on the largest schema ({largest[1]} values): {cost:.2f} ms")
    text = "word \\\"quoted\\\" [x] {y} " * 200_000
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()[: 4 * 1024 * 1024]
    print(f"json_depth on a {len(body)}-byte body: {_best_ms(lambda: json_depth(body)):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
