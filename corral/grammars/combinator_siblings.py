"""Move the keywords beside an `anyOf`/`oneOf` into each of its branches, where an engine that compiles each
branch on its own sees them.

xgrammar 0.2.8 compiles `{"type": "object", "properties": {...}, "oneOf": [{"required": ["a"]}, ...]}` as a
choice between its branches alone: a branch that names no type becomes *any JSON value*, so the answer may be
a string (JSONSchemaBench WashingtonPost/wp_0, where the contract guard then refused every root). The rewrite is
exact: P ∧ anyOf(B1..Bn) = anyOf(P∧B1..P∧Bn), and P ∧ oneOf(B1..Bn) = oneOf(P∧B1..P∧Bn), because P∧Bi holds
exactly when Bi does wherever P holds, and no branch holds where P does not. A node is left as it is when a
branch cannot take P without changing what either means (a keyword both define, a `$ref` whose siblings older
drafts ignore, `additionalProperties` beside another object's `properties`)."""

from __future__ import annotations

import json
from typing import Any

from corral.grammars.features import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_SINGLE

COMBINATORS = ("anyOf", "oneOf")
# Annotations and the definitions that `$ref`s point into stay on the node itself.
STAYS = frozenset(
    {"$schema", "$id", "id", "$defs", "definitions", "$anchor", "$dynamicAnchor", "$comment", "title",
     "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}
)
# Keywords read together with others of the same object: next to a branch's own `properties`, a moved
# `additionalProperties: false` would let through what it refused before (and the reverse). A group's keywords
# may all move, but never split between the siblings and a branch.
_READ_TOGETHER = (
    frozenset({"additionalProperties", "properties", "patternProperties"}),
    frozenset({"additionalItems", "items", "prefixItems"}),
    frozenset({"if", "then", "else"}),
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"maximum", "exclusiveMaximum"}),  # draft 4: a boolean exclusiveMaximum qualifies maximum
    frozenset({"minimum", "exclusiveMinimum"}),
)
_EVALUATION_DEPENDENT = frozenset({"unevaluatedProperties", "unevaluatedItems", "$ref", "$dynamicRef", "$recursiveRef"})
# Past this growth the engines would pay more for the copies than the rewrite is worth: the schema is kept.
MAX_GROWTH = 4


def distribute_siblings(schema: Any) -> Any:
    """The schema with every rewritable `anyOf`/`oneOf` node rewritten (a new object; the input is untouched),
    or the schema itself when nothing changes or the copies would grow it past MAX_GROWTH times."""
    try:
        rewritten = _rewrite(schema)
    except RecursionError:  # request limits cap nesting long before this; a direct caller may not have
        return schema
    if rewritten is schema:
        return schema
    if len(json.dumps(rewritten)) > MAX_GROWTH * len(json.dumps(schema)):
        return schema
    return rewritten


def _rewrite(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = _rewrite_children(node)
    combinators = [key for key in COMBINATORS if isinstance(out.get(key), list)]
    if len(combinators) != 1:
        return out
    key = combinators[0]
    siblings = {k: v for k, v in out.items() if k != key and k not in STAYS}
    if not siblings or siblings.keys() & _EVALUATION_DEPENDENT:
        return out
    branches = [_merged(siblings, branch) for branch in out[key]]
    if any(branch is None for branch in branches):
        return out
    return {**{k: v for k, v in out.items() if k in STAYS}, key: branches}


def _rewrite_children(node: dict[str, Any]) -> dict[str, Any]:
    changed = {key: new for key, value in node.items() if (new := _rewrite_child(key, value)) is not value}
    return {**node, **changed} if changed else node


def _rewrite_child(key: str, value: Any) -> Any:
    """The subschema(s) under `key` rewritten, or `value` itself where nothing under it changed."""
    if key in SCHEMA_MAPS and isinstance(value, dict):
        new_map = {name: _rewrite(schema) for name, schema in value.items()}
        return value if all(new_map[name] is value[name] for name in value) else new_map
    if (key in SCHEMA_LISTS or key in SCHEMA_SINGLE) and isinstance(value, list):
        new_list = [_rewrite(schema) for schema in value]
        return value if all(a is b for a, b in zip(new_list, value, strict=True)) else new_list
    return _rewrite(value) if key in SCHEMA_SINGLE else value


def _merged(siblings: dict[str, Any], branch: Any) -> Any:
    """P ∧ branch as one object, or None when the two cannot share an object without changing meaning."""
    if branch is True or branch == {}:
        return dict(siblings)
    if branch is False:
        return False
    if not isinstance(branch, dict) or branch.keys() & _EVALUATION_DEPENDENT:
        return None
    if any(siblings.keys() & group and branch.keys() & group for group in _READ_TOGETHER):
        return None
    merged = dict(branch)
    for key, value in siblings.items():
        if key not in branch:
            merged[key] = value
        elif key == "required" and isinstance(value, list) and isinstance(branch[key], list):
            merged[key] = list(dict.fromkeys([*value, *branch[key]]))
        elif branch[key] != value:
            return None
    return merged
