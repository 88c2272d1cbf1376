"""Tool-call grammars on both engines (llguidance: Lark + %json; xgrammar: structural tags) and both tokenizer
families, token by token, and the contract guard over them under `auto`."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import TOKENIZER_FAMILIES, family_tokenizer

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.contract_guard import GuardedMatcher
from corral.grammar_engines.protocol import Matcher, TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.tools import FORMATS, tool_calls_spec

BACKENDS = ["xgrammar", "llguidance"]
POINT: dict[str, Any] = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "label": {"type": "string"}},
    "required": ["x"],
    "additionalProperties": False,
}
TOOLS = [("point", POINT), ("ping", {"type": "object", "properties": {}, "additionalProperties": False})]


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def tokenizer(request: pytest.FixtureRequest) -> TokenizerSpec:
    """Both tokenizer families (tests/conftest.py); conftest's `backends` builds on this one."""
    spec = family_tokenizer(str(request.param))
    assert isinstance(spec, TokenizerSpec)
    return spec


def feed(tokenizer: TokenizerSpec, matcher: Matcher, text: str) -> bool:
    """Accept `text` token by token; True when all of it was accepted and the answer may end there."""
    tokens = tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(int(t)) for t in tokens) and matcher.can_terminate()


def matcher(backends: BackendSet, name: str, **spec_args: Any) -> Matcher:
    backend = backends.get(name)
    return backend.new_matcher(backend.compile(tool_calls_spec(TOOLS, **spec_args)))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", BACKENDS)
def test_parallel_calls_in_each_format(backends: BackendSet, tokenizer: TokenizerSpec, name: str, fmt: str) -> None:
    text = FORMATS[fmt].render([("point", '{"x": 1, "label": "a"}'), ("ping", "{}")])
    assert feed(tokenizer, matcher(backends, name, format=fmt), text)
    assert not feed(tokenizer, matcher(backends, name, format=fmt, parallel=False), text)
    one = FORMATS[fmt].render([("point", '{"x": 1}')])
    assert feed(tokenizer, matcher(backends, name, format=fmt, parallel=False), one)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("text", [
    '{"name": "point", "parameters": {"label": "a"}}',  # x is required
    '{"name": "point", "parameters": {"x": 1, "y": 2}}',  # no additional properties
    '{"name": "other", "parameters": {}}',  # unknown function
    '{"name": "point", "parameters": {"x": 1}} ',  # free whitespace
])
def test_calls_outside_the_schemas_are_refused(backends: BackendSet, tokenizer: TokenizerSpec, name: str,
                                               text: str) -> None:
    assert not feed(tokenizer, matcher(backends, name), text)


@pytest.mark.parametrize("name", BACKENDS)
def test_auto_allows_text_or_a_call_but_not_a_broken_call(backends: BackendSet, tokenizer: TokenizerSpec,
                                                          name: str) -> None:
    assert feed(tokenizer, matcher(backends, name, mode="auto"), "Just words.")
    assert feed(tokenizer, matcher(backends, name, mode="auto"), "")
    assert feed(tokenizer, matcher(backends, name, mode="auto"), '{"name": "ping", "parameters": {}}')
    assert not feed(tokenizer, matcher(backends, name, mode="auto"), '{"name": "ping", "parameters": 3}')


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", BACKENDS)
def test_auto_with_a_text_schema_constrains_the_text_branch(backends: BackendSet, tokenizer: TokenizerSpec,
                                                            name: str, fmt: str) -> None:
    text_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = tool_calls_spec(TOOLS, format=fmt, mode="auto", text_schema=text_schema)
    backend = backends.get(name)
    if backend.supports(spec) is not None:
        assert name == "llguidance" and fmt != "hermes"  # its lexer cannot split `{"` two ways; auto uses xgrammar
        return
    compiled = backend.compile(spec)
    assert feed(tokenizer, backend.new_matcher(compiled), '{"ok": true}')
    assert feed(tokenizer, backend.new_matcher(compiled), FORMATS[fmt].render([("ping", "{}")]))
    assert not feed(tokenizer, backend.new_matcher(compiled), "Just words.")


def test_auto_compiles_and_guards_tool_calls(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    """xgrammar relaxes oneOf to anyOf; the guard keeps a call from ending while its arguments break it."""
    one_of = {"type": "object", "properties": {"v": {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}}, "required": ["v"]}
    spec = tool_calls_spec([("pick", one_of)])
    result = GrammarCache(backends).compile(spec, "xgrammar")
    guarded = backends.for_request(result.backend, "auto")
    bad, good = guarded.new_matcher(result.compiled), guarded.new_matcher(result.compiled)
    assert isinstance(bad, GuardedMatcher)
    assert not feed(tokenizer, bad, '{"name": "pick", "parameters": {"v": 1}}')
    assert feed(tokenizer, good, '{"name": "pick", "parameters": {"v": 2}}')


def test_xgrammar_refuses_tools_whose_keywords_it_ignores(backends: BackendSet) -> None:
    spec = tool_calls_spec([("neg", {"type": "object", "not": {"required": ["a"]}})])
    assert backends.get("xgrammar").supports(spec) is not None
    assert backends.get("xgrammar").supports(spec.relaxed()) is None


def test_auto_serves_keywords_no_engine_enforces_through_the_decode_safe_profile(backends: BackendSet,
                                                                                tokenizer: TokenizerSpec) -> None:
    no_a = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "not": {"required": ["a"]}}
    result = GrammarCache(backends).compile(tool_calls_spec([("f", no_a)]), "auto")
    assert (result.backend, result.compiled.spec.decode_safe) == ("llguidance", True)
    guarded = backends.for_request(result.backend, "auto")
    assert not feed(tokenizer, guarded.new_matcher(result.compiled), '{"name": "f", "parameters": {"a": 1}}')
    assert feed(tokenizer, guarded.new_matcher(result.compiled), '{"name": "f", "parameters": {"b": 1}}')
