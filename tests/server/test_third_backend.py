"""A third grammar backend, plugged in the two documented ways — `register_backend` and the
`corral.sampler_backends` entry point — and served by a real corral over HTTP.

The backend is small but real: it enforces `choice` constraints with a token trie over each option's
canonical tokenisation. It declares its traits (it compiles choices only, and ranks first for them), so
`auto` routes choices to it and everything else past it, and it declares no codec, so it compiles in the
server's thread rather than in a compile worker."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import RunningServer, serving

from corral.grammar_engines import registry
from corral.grammar_engines.protocol import BackendDescriptor, CompiledGrammar, CompileError, Matcher, TokenizerSpec
from corral.grammars.features import BackendTraits
from corral.grammars.spec import GrammarKind, GrammarSpec

REGISTERED = "choice-trie"  # registered in-process with register_backend
FROM_ENTRY_POINT = "choice-trie-ep"  # found through an installed distribution's entry point
CHOICE_TRAITS = BackendTraits(kinds=frozenset({GrammarKind.CHOICE}), rank={GrammarKind.CHOICE: 0})
COLOURS = ["red", "green", "blue"]


@dataclass(frozen=True)
class TrieCompiled:
    spec: GrammarSpec
    options: tuple[tuple[int, ...], ...]  # each option's canonical token ids
    backend_name: str


class TrieMatcher:
    """Allows the next token of every option the tokens so far are a prefix of, and a stop token once they
    spell a whole option."""

    def __init__(self, compiled: TrieCompiled, stop_ids: Sequence[int]) -> None:
        self._options = compiled.options
        self._stops = frozenset(stop_ids)
        self._tokens: list[int] = []
        self._error: str | None = None

    @property
    def error(self) -> str | None:
        return self._error

    def _next(self, tokens: Sequence[int]) -> set[int]:
        """Non-stop tokens allowed after `tokens`."""
        at = len(tokens)
        return {o[at] for o in self._options if len(o) > at and list(o[:at]) == list(tokens)}

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        allowed = self._next(self._tokens) | (self._stops if self.can_terminate() else set())
        words = [0] * bitmask.shape[1]
        for token in allowed:
            words[token >> 5] |= 1 << (token & 31)
        bitmask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._next(self._tokens):
            self._error = f"token {token_id} continues no option"
            return False
        self._tokens.append(token_id)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        tokens = list(self._tokens)
        for count, token in enumerate(token_ids):
            if token not in self._next(tokens):
                return count
            tokens.append(token)
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        del self._tokens[len(self._tokens) - num_tokens :]

    def forced_tokens(self) -> list[int]:
        live = [o for o in self._options if list(o[: len(self._tokens)]) == self._tokens]
        return list(live[0][len(self._tokens) :]) if len(live) == 1 else []

    def is_terminated(self) -> bool:
        return not self._next(self._tokens)

    def can_terminate(self) -> bool:
        return tuple(self._tokens) in self._options


class TrieChoiceBackend:
    def __init__(self, tokenizer: TokenizerSpec, *, name: str) -> None:
        self.name = name
        self._tokenizer = tokenizer

    def supports(self, spec: GrammarSpec) -> str | None:
        return None if spec.kind is GrammarKind.CHOICE else f"{self.name} compiles choices only"

    def compile(self, spec: GrammarSpec) -> TrieCompiled:
        if spec.kind is not GrammarKind.CHOICE:
            raise CompileError(f"{self.name} compiles choices only", backend=self.name, unsupported=True)
        encode = self._tokenizer.hf_tokenizer.encode
        options = tuple(tuple(encode(option, add_special_tokens=False)) for option in spec.choices())
        return TrieCompiled(spec, tuple(o for o in options if o), self.name)

    def new_matcher(self, compiled: CompiledGrammar) -> TrieMatcher:
        assert isinstance(compiled, TrieCompiled)
        return TrieMatcher(compiled, self._tokenizer.stop_token_ids)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)


# What the entry point names: a descriptor at module level, as a plug-in package would export it.
ENTRY_POINT_DESCRIPTOR = BackendDescriptor(partial(TrieChoiceBackend, name=FROM_ENTRY_POINT), CHOICE_TRAITS)


def install_distribution(site: Path) -> None:
    """A minimal installed distribution in `site` whose entry point names ENTRY_POINT_DESCRIPTOR."""
    info = site / "corral_choice_trie-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: corral-choice-trie\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\n{FROM_ENTRY_POINT} = {__name__}:ENTRY_POINT_DESCRIPTOR\n"
    )


@pytest.fixture(scope="module")
def plugged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server with both plug-ins enabled beside xgrammar; the registry is restored afterwards."""
    site = tmp_path_factory.mktemp("site")
    install_distribution(site)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_registered", dict(registry._registered))
        patch.syspath_prepend(str(site))  # the distribution is installed from now on
        registry.register_backend(REGISTERED, partial(TrieChoiceBackend, name=REGISTERED), traits=CHOICE_TRAITS)
        with serving(backends=f"{REGISTERED},{FROM_ENTRY_POINT},xgrammar") as running:
            yield running


def chat(server: RunningServer, structured_outputs: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": "corral-tiny",
        "messages": [{"role": "user", "content": "Pick a colour."}],
        "max_tokens": 16,
        "structured_outputs": structured_outputs,
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def test_both_plugins_are_found_with_their_traits(plugged: RunningServer) -> None:
    names = registry.backend_names()
    assert REGISTERED in names and FROM_ENTRY_POINT in names
    assert registry.descriptor(FROM_ENTRY_POINT) is ENTRY_POINT_DESCRIPTOR
    assert registry.backend_traits(REGISTERED) == CHOICE_TRAITS


@pytest.mark.parametrize("name", [REGISTERED, FROM_ENTRY_POINT])
def test_a_named_plugin_serves_a_chat_completion(plugged: RunningServer, name: str) -> None:
    answer = chat(plugged, {"choice": COLOURS, "backend": name})
    assert answer["grammar"]["backend"] == name and answer["grammar"]["requested_backend"] == name
    assert answer["choices"][0]["message"]["content"] in COLOURS
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["grammar"]["valid"] is True


def test_auto_routes_by_the_plugins_traits(plugged: RunningServer) -> None:
    # Ranked first for choices (ties keep the enabled order) ...
    answer = chat(plugged, {"choice": ["yes", "no"]})
    assert answer["grammar"]["backend"] == REGISTERED and answer["grammar"]["requested_backend"] == "auto"
    assert answer["choices"][0]["message"]["content"] in ("yes", "no")
    # ... and never handed a kind it does not take.
    answer = chat(plugged, {"regex": "[0-9]{3}"})
    assert answer["grammar"]["backend"] == "xgrammar"
