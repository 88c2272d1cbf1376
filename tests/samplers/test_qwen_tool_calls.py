"""Hermes tool calls on Qwen2.5-Coder-1.5B-Instruct's real vocabulary (151,936 tokens), on both engines, at the
matcher level (no model). `<tool_call>` and `</tool_call>` are added tokens there (ids 151657/151658), which
llguidance counts as special: literal text in its grammar never matches them. Its mask, where the grammar wrote
`<tool_call>` as text, allowed only that token (its forced text tokenised by the model's own tokenizer, which
splits the marker out), and its parser refused it: every forced Hermes call on this model ended in an engine
error after one step (issue 52). Here a call written as the model writes it — the marker tokens, ordinary tokens
for the JSON — is allowed by each mask, accepted, never forced into a token the matcher refuses, and ends.

Needs the GGUF (the `qwen_tokenizer` fixture in tests/conftest.py: $CORRAL_TEST_QWEN_GGUF or the built-in);
skipped without it. tests/samplers/test_special_token_markers.py guards the same without it."""

from __future__ import annotations

from typing import Any

import pytest
from tool_paths import allowed_ids, read_back, write

from corral.grammar_engines.answer_text import AnswerText
from corral.grammar_engines.protocol import Matcher, TokenizerSpec
from corral.grammar_engines.registry import AUTO, BackendSet
from corral.grammars.spec import GrammarSpec
from corral.grammars.tools import FORMATS, tool_calls_spec

BACKENDS = ["xgrammar", "llguidance"]
TOOL_CALL, END_TOOL_CALL = 151657, 151658
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = [("get_weather", WEATHER), ("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})]
OSLO = ("get_weather", '{"city": "Oslo"}')
HERMES = FORMATS["hermes"]
SPECS = {
    "required": tool_calls_spec(TOOLS, format="hermes", mode="required"),
    "named": tool_calls_spec(TOOLS[:1], format="hermes", mode="required"),
    "auto": tool_calls_spec(TOOLS, format="hermes", mode="auto"),
}


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer: TokenizerSpec) -> TokenizerSpec:
    return qwen_tokenizer


@pytest.fixture(scope="module")
def backends(qwen: TokenizerSpec) -> BackendSet:
    return BackendSet(qwen, BACKENDS)


def matcher(backends: BackendSet, name: str, spec: GrammarSpec, requested: str) -> Matcher:
    """A matcher as a request gets it: under `auto` behind the contract guard (which reads the answer's text)."""
    return backends.for_request(name, requested).new_matcher(backends.get(name).compile(spec))


def test_the_hermes_markers_are_single_tokens_llguidance_counts_as_special(qwen: TokenizerSpec,
                                                                           backends: BackendSet) -> None:
    hf = qwen.hf_tokenizer
    assert hf.encode("<tool_call>", add_special_tokens=False) == [TOOL_CALL]
    assert hf.encode("</tool_call>", add_special_tokens=False) == [END_TOOL_CALL]
    llguidance: Any = backends.get("llguidance")
    assert llguidance.marker_tokens(HERMES) == {"<tool_call>": TOOL_CALL, "</tool_call>": END_TOOL_CALL}
    # Added but not special to transformers: the answer's text has them without help.
    assert not AnswerText(hf).kept
    assert AnswerText(hf).decode([TOOL_CALL, 198, END_TOOL_CALL, qwen.stop_token_ids[0]]) == "<tool_call>\n</tool_call>"


@pytest.mark.parametrize("mode", list(SPECS))
@pytest.mark.parametrize("requested", ["named", AUTO])
@pytest.mark.parametrize("name", BACKENDS)
def test_a_call_as_the_model_writes_it_is_accepted_and_ends(backends: BackendSet, qwen: TokenizerSpec, name: str,
                                                            requested: str, mode: str) -> None:
    spec = SPECS[mode]
    ids = write(matcher(backends, name, spec, requested if requested == AUTO else name), qwen, HERMES.render([OSLO]))
    assert ids[0] == TOOL_CALL and END_TOOL_CALL in ids
    answer = read_back(spec, qwen, ids)
    assert [(c.name, c.value) for c in answer.calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("name", BACKENDS)
def test_parallel_calls_as_the_model_writes_them(backends: BackendSet, qwen: TokenizerSpec, name: str) -> None:
    spec = SPECS["required"]
    ids = write(matcher(backends, name, spec, AUTO), qwen, HERMES.render([OSLO, ("get_time", '{"zone": "CET"}')]))
    assert ids.count(TOOL_CALL) == 2 and ids.count(END_TOOL_CALL) == 2
    assert [c.name for c in read_back(spec, qwen, ids).calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("mode", ["required", "named"])
@pytest.mark.parametrize("name", BACKENDS)
def test_the_first_step_allows_the_marker_and_forces_only_accepted_tokens(backends: BackendSet, qwen: TokenizerSpec,
                                                                          name: str, mode: str) -> None:
    """The step that failed: the first mask offers `<tool_call>`'s token, the matcher takes it, and what the
    grammar then dictates is accepted whole."""
    m = matcher(backends, name, SPECS[mode], name)
    assert TOOL_CALL in set(allowed_ids(m, qwen.vocab_size).tolist())
    forced = m.forced_tokens()
    assert m.validate_tokens(forced) == len(forced)
    assert m.accept_token(TOOL_CALL), m.error
    forced = m.forced_tokens()
    assert forced and m.validate_tokens(forced) == len(forced)
    assert qwen.hf_tokenizer.decode(forced).startswith('\n{"name": "get')  # where the two names part


@pytest.mark.parametrize("name", BACKENDS)
def test_the_marker_spelled_out_stays_allowed(backends: BackendSet, qwen: TokenizerSpec, name: str) -> None:
    encode = qwen.hf_tokenizer.encode
    text = HERMES.render([OSLO])
    pieces = ["<", text[1 : text.index("</tool_call>") + 1], text[text.index("</tool_call>") + 1 :]]
    spelled = [t for piece in pieces for t in encode(piece, add_special_tokens=False)]
    assert TOOL_CALL not in spelled and END_TOOL_CALL not in spelled
    assert matcher(backends, name, SPECS["required"], name).validate_tokens(spelled) == len(spelled)


@pytest.mark.parametrize("name", BACKENDS)
def test_auto_still_answers_in_text(backends: BackendSet, qwen: TokenizerSpec, name: str) -> None:
    ids = write(matcher(backends, name, SPECS["auto"], AUTO), qwen, "It is 12 °C in Oslo.")
    assert read_back(SPECS["auto"], qwen, ids).content == "It is 12 °C in Oslo."
