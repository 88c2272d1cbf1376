"""Output modes, chosen from what a provider can do, degrading deterministically to the next safe one."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx


class Mode(StrEnum):
    SCHEMA_CONSTRAINED = "schema_constrained"  # the provider decodes under the full JSON Schema
    JSON_MODE = "json_mode"  # the provider guarantees a JSON object, not its shape
    CONTRACT_ONLY = "contract_only"  # instructions + post-parse validation only


ORDER = (Mode.SCHEMA_CONSTRAINED, Mode.JSON_MODE, Mode.CONTRACT_ONLY)


@dataclass(frozen=True)
class Capabilities:
    """What a provider's chat endpoint accepts. `lark_json`: a Lark grammar with `%json` embedded schemas
    (corral's `structured_outputs.grammar`), which is how the dispatch markers get into the constraint."""

    json_schema: bool = False  # response_format json_schema
    json_object: bool = False  # response_format json_object
    lark_json: bool = False
    logprobs: bool = False
    grammar_backend: str | None = None  # the backend to name for Lark `%json` grammars (its dialect)

    def supports(self, mode: Mode, *, markers: bool) -> bool:
        if mode is Mode.CONTRACT_ONLY:
            return True
        if markers:  # pure-JSON modes cannot emit markers: only a grammar can put them in the constraint
            return self.lark_json and (mode is Mode.JSON_MODE or self.json_schema)
        return self.json_schema if mode is Mode.SCHEMA_CONSTRAINED else self.json_object

    @classmethod
    def from_corral(cls, document: dict[str, Any]) -> Capabilities:
        """From corral's `GET /v1/capabilities` answer."""
        kinds = set(document.get("constraint_kinds", []))
        backends = [b for b in document.get("backends", []) if isinstance(b, str)]
        lark = "lark" in kinds and "llguidance" in backends
        return cls(
            json_schema="json_schema" in kinds,
            json_object="json_object" in kinds,
            lark_json=lark,
            logprobs=bool(document.get("logprobs", False)),
            grammar_backend="llguidance" if lark else None,
        )


# Known providers. Anything else: ask it (corral) or assume nothing (contract_only).
OPENAI = Capabilities(json_schema=True, json_object=True, logprobs=True)
JSON_OBJECT_ONLY = Capabilities(json_object=True)
PLAIN = Capabilities()
PROVIDERS: dict[str, Capabilities] = {"openai": OPENAI, "json_object_only": JSON_OBJECT_ONLY, "plain": PLAIN}


def fetch_corral_capabilities(base_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> Capabilities:
    """Read corral's `/v1/capabilities` (base_url ends in /v1, as the openai SDK's does)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{str(base_url).rstrip('/')}/capabilities", headers=headers, timeout=timeout)
    response.raise_for_status()
    return Capabilities.from_corral(response.json())


def choose_mode(capabilities: Capabilities, *, markers: bool, preferred: Mode = Mode.SCHEMA_CONSTRAINED) -> Mode:
    """The first mode at or below `preferred` (in ORDER) the provider supports; contract_only always is."""
    return next(m for m in ORDER[ORDER.index(preferred):] if capabilities.supports(m, markers=markers))


def degrade(mode: Mode, capabilities: Capabilities, *, markers: bool) -> Mode | None:
    """The next safe mode below `mode`, or None below contract_only."""
    below = ORDER[ORDER.index(mode) + 1:]
    return next((m for m in below if capabilities.supports(m, markers=markers)), None)
