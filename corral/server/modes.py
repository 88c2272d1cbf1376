"""The mediation modes (docs/mediation.md) as the server sees them, read off a request's own constraint.

A mediating client picks a mode per call; corral never learns the client's choice, but the constraint it was
sent says which mode that was: a schema, grammar, choice, regex or tool call is `schema_constrained`, a bare
JSON object is `json_mode`, no constraint is `contract_only` (instructions and the client's own check)."""

from __future__ import annotations

from corral.grammars.spec import GrammarKind, GrammarSpec

MODES = ("schema_constrained", "json_mode", "contract_only")


def request_mode(spec: GrammarSpec | None) -> str:
    if spec is None:
        return "contract_only"
    return "json_mode" if spec.kind is GrammarKind.JSON_OBJECT else "schema_constrained"
