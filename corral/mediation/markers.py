"""The dispatch marker contract: exactly one trailing BEGIN_DISPATCH_RESULT … END_DISPATCH_RESULT block,
nothing but whitespace outside it."""

from __future__ import annotations

import json
from typing import Any

BEGIN = "BEGIN_DISPATCH_RESULT"
END = "END_DISPATCH_RESULT"


class MarkerError(ValueError):
    pass


def extract_block(text: str) -> str:
    """The payload between the markers; MarkerError when the contract does not hold."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        found = f"{text.count(BEGIN)} {BEGIN} and {text.count(END)} {END}"
        raise MarkerError(f"expected exactly one {BEGIN} … {END} block, found {found}")
    before, rest = text.split(BEGIN)
    payload, after = rest.split(END)
    if before.strip() or after.strip():
        raise MarkerError(f"only whitespace may stand outside the {BEGIN} … {END} block")
    return payload.strip()


def lark_grammar(schema: dict[str, Any], json_options: dict[str, Any]) -> str:
    """A Lark grammar (llguidance's `%json` dialect, which corral accepts as `structured_outputs.grammar`)
    whose only sentences are the marker block around JSON under `schema`: the markers are decoded under the
    constraint, so the model cannot drop or misspell them. `json_options` go in as `x-guidance`."""
    embedded = json.dumps({**schema, "x-guidance": json_options}, ensure_ascii=False)
    return f'start: "{BEGIN}\\n" %json {embedded} "\\n{END}"\n'
