"""What the benchmark sends: a deterministic spread of JSONSchemaBench schemas and one prompt per schema."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from corral.benchmarks.jsonschemabench.dataset import SchemaCase, load_cases, sample_names
from corral.grammars.spec import GrammarKind, GrammarSpec

PROMPT = "Reply with a JSON value that matches the JSON Schema the server enforces."
CANDIDATE_FACTOR = 3  # spare candidates per subset, to replace schemas the server refuses


def candidate_cases(data: Path, wanted: int) -> list[SchemaCase]:
    """Schemas in the order they should be tried: round-robin over the subsets (paper order), each subset's
    files evenly spaced over its sorted list. The first `wanted` span every subset; the rest are spares."""
    if wanted <= 0:
        raise ValueError(f"--schemas must be positive, got {wanted}")
    by_subset: dict[str, list[SchemaCase]] = {}
    subset_count = sum(1 for p in data.iterdir() if p.is_dir() and any(p.glob("*.json")))
    if subset_count == 0:
        raise ValueError(f"no <Subset>/*.json under {data}")
    per_subset = math.ceil(wanted / subset_count) * CANDIDATE_FACTOR
    for case in load_cases(data, None, per_subset):
        by_subset.setdefault(case.subset, []).append(case)
    # Interleave in spaced order, so the first picks of every subset come before any subset's spares.
    spaced = {s: _spread(cases) for s, cases in by_subset.items()}
    return [c for row in zip_longest(*spaced.values()) for c in row if c is not None]


def _spread(cases: list[SchemaCase]) -> list[SchemaCase]:
    """Reorder so that any prefix is itself evenly spaced over the list (1, 1/2, 1/4 and 3/4, ...)."""
    order: list[int] = []
    for k in range(1, len(cases) + 1):
        for i in sample_names([str(j).zfill(8) for j in range(len(cases))], k):
            if int(i) not in order:
                order.append(int(i))
    return [cases[i] for i in order]


@dataclass(frozen=True)
class SpecCase:
    """A regex, grammar or choice to serve (`corral bench kinds`' cases, for `--kinds`) with its prompt."""

    case_id: str
    spec: GrammarSpec
    prompt: str


BenchCase = SchemaCase | SpecCase
# --kinds names -> the spec kinds they time
KIND_GROUPS: dict[str, tuple[GrammarKind, ...]] = {
    "regex": (GrammarKind.REGEX,), "grammar": (GrammarKind.EBNF, GrammarKind.LARK), "choice": (GrammarKind.CHOICE,),
}


def kind_cases(kinds: tuple[str, ...]) -> list[SpecCase]:
    """The built-in cases of `corral bench kinds` whose kind is in `kinds` (regex, grammar, choice)."""
    from corral.benchmarks.kinds.cases import CASES

    unknown = [k for k in kinds if k not in KIND_GROUPS]
    if unknown or not kinds:
        raise ValueError(f"--kinds takes {', '.join(KIND_GROUPS)} (comma-separated), got {', '.join(kinds) or 'none'}")
    wanted = {kind for k in kinds for kind in KIND_GROUPS[k]}
    return [SpecCase(f"{c.kind}/{c.label}", c.spec, f"Reply with {c.label.split(' (')[0]} and nothing else.")
            for c in CASES if c.spec.kind in wanted]


def case_spec(case: BenchCase) -> GrammarSpec:
    return GrammarSpec.json_schema(case.schema) if isinstance(case, SchemaCase) else case.spec


def messages(case: BenchCase) -> list[dict[str, str]]:
    if isinstance(case, SpecCase):
        return [{"role": "user", "content": case.prompt}]
    # The schema is not in the prompt: the grammar carries it, and big schemas would dominate prefill.
    title = case.schema.get("title", "") if isinstance(case.schema, dict) else ""
    text = f"{PROMPT} Schema title: {title}" if title else PROMPT
    return [{"role": "user", "content": text[:500]}]


CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "response_format", "json_schema", "grammar")


SO_KEYS = {GrammarKind.REGEX: "regex", GrammarKind.EBNF: "grammar", GrammarKind.LARK: "grammar",
           GrammarKind.CHOICE: "choice"}


def constraint_fields(case: BenchCase, field: str, backend: str | None) -> dict[str, Any]:
    """The body fields that ask for `case`'s constraint: corral's and vLLM's `structured_outputs` (with
    `backend` when given; a grammar or choice is sent so only), vLLM's older `guided_json`, OpenAI's
    `response_format` json_schema, llama.cpp llama-server's own top-level `json_schema`, or llama-server's
    `grammar` (GBNF: a regex written as one, corral/benchmarks/serve/regex_gbnf.py)."""
    if field not in CONSTRAINT_FIELDS:
        raise ValueError(f"constraint field must be one of {', '.join(CONSTRAINT_FIELDS)}, got {field!r}")
    if field == "grammar":
        if not isinstance(case, SpecCase) or case.spec.kind is not GrammarKind.REGEX:
            raise ValueError("the grammar field (llama-server's GBNF) carries regexes only")
        from corral.benchmarks.serve.regex_gbnf import regex_to_gbnf

        return {"grammar": regex_to_gbnf(case.spec.source)}
    if isinstance(case, SpecCase):
        if field != "structured_outputs":
            raise ValueError(f"a {case.spec.kind.value} constraint is sent as structured_outputs or, a regex, as "
                             f"grammar, not {field}")
        spec = case.spec
        value: Any = spec.choices() if spec.kind is GrammarKind.CHOICE else spec.source
        return {"structured_outputs": {SO_KEYS[spec.kind]: value, **({"backend": backend} if backend else {})}}
    schema = case.schema
    if field == "structured_outputs":
        return {"structured_outputs": {"json": schema, **({"backend": backend} if backend else {})}}
    if field == "guided_json":
        return {"guided_json": schema}
    if field == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}}
    return {"json_schema": schema}


def request_body(case: BenchCase, *, constrained: bool, max_tokens: int, backend: str | None,
                 constraint: str = "structured_outputs", model: str | None = None, seed: int = 0,
                 temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
    """Same prompt and max_tokens either way; unconstrained ignores EOS so it generates exactly max_tokens
    (the default model ends an unconstrained turn at once). A peer gets the same body with its `model` name
    and its own constraint field."""
    body: dict[str, Any] = {
        "messages": messages(case), "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
    }
    if top_p < 1.0:
        body["top_p"] = top_p
    if model is not None:
        body["model"] = model
    if constrained:
        body.update(constraint_fields(case, constraint, backend))
    else:
        body["ignore_eos"] = True
    return body
