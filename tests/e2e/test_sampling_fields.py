"""The sampling and response fields users send, through the official openai SDK: n, logprobs / top_logprobs,
penalties, top_k, min_p."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "A person"}]
COLORS = ["red", "green", "blue"]


def chat(client: Any, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="corral-tiny", **{"messages": ASK, **kwargs})


def letters(client: Any, n: int = 24, **kwargs: Any) -> str:
    extra = {"structured_outputs": {"regex": f"[a-z]{{{n}}}"}, **kwargs.pop("extra_body", {})}
    return str(chat(client, extra_body=extra, **kwargs).choices[0].message.content)


def text_of(content: list[Any]) -> str:
    """The answer rebuilt from its logprob entries' exact bytes."""
    return b"".join(bytes(e.bytes) for e in content).decode()


def test_n_gives_independent_valid_choices_that_match_single_requests_with_seed_plus_index(client: Any) -> None:
    resp = chat(client, n=3, temperature=1.0, seed=7, response_format=PERSON_FORMAT)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    answers = [c.message.content for c in resp.choices]
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.model_extra["grammar"]["valid"] is True  # each choice reports its own check
    assert len(set(answers)) > 1  # independent samples, not one answer copied
    singles = [chat(client, temperature=1.0, seed=7 + i, response_format=PERSON_FORMAT) for i in range(3)]
    assert [s.choices[0].message.content for s in singles] == answers
    assert resp.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert resp.usage.prompt_tokens == singles[0].usage.prompt_tokens


def test_choice_logprobs_give_class_probabilities_over_the_allowed_options(client: Any) -> None:
    resp = chat(
        client,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=20,
        extra_body={"structured_outputs": {"choice": COLORS}},
    )
    choice = resp.choices[0]
    assert choice.message.content in COLORS
    content = choice.logprobs.content
    first = content[0]
    # Only tokens that begin an allowed option can come first, and together they hold all the probability.
    assert first.top_logprobs and all(any(c.startswith(t.token) for c in COLORS) for t in first.top_logprobs)
    assert sum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(1.0, abs=1e-3)
    assert first.logprob == pytest.approx(next(t.logprob for t in first.top_logprobs if t.token == first.token))
    assert text_of(content) == choice.message.content
    assert all(e.logprob <= 0.0 for e in content)


def test_top_logprobs_lists_that_many_alternatives_most_likely_first(client: Any) -> None:
    regex = {"structured_outputs": {"regex": "[a-z]{10}"}}
    resp = chat(client, temperature=0.0, logprobs=True, top_logprobs=3, extra_body=regex)
    content = resp.choices[0].logprobs.content
    assert text_of(content) == resp.choices[0].message.content
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy takes the most likely token
    plain = chat(client, logprobs=True, extra_body={"structured_outputs": {"regex": "[a-z]{10}"}})
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert chat(client, max_tokens=3).choices[0].logprobs is None


def test_top_logprobs_without_logprobs_is_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize(("field", "value"), [("n", 17), ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0)])
def test_out_of_range_sampling_fields_are_refused_by_name(client: Any, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={field: value})
    assert caught.value.body["param"] == field


def test_completions_logprobs_have_openais_shape(client: Any) -> None:
    resp = client.completions.create(
        model="corral-tiny",
        prompt="Letters:",
        logprobs=2,
        temperature=1.0,
        seed=11,
        extra_body={"structured_outputs": {"regex": "[a-z ]{16}"}},
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    count = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == count
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(count)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the top 2, plus the sampled token (OpenAI)


def test_streamed_completions_logprobs_line_up_with_the_text(client: Any) -> None:
    stream = client.completions.create(
        model="corral-tiny",
        prompt="Letters:",
        logprobs=1,
        stream=True,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": "[a-z ]{16}"}},
    )
    text, tokens, offsets = "", [], []
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
    assert text and "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]  # offsets count from the answer's start


def test_streaming_n_sends_each_choice_under_its_own_index(client: Any) -> None:
    stream = chat(client, n=2, stream=True, temperature=1.0, seed=5, logprobs=True, response_format=PERSON_FORMAT)
    text: dict[int, str] = {0: "", 1: ""}
    entries: dict[int, list[Any]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in stream:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        text[choice.index] += choice.delta.content or ""
        if choice.logprobs is not None:
            entries[choice.index] += choice.logprobs.content
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for index in (0, 1):
        jsonschema.validate(json.loads(text[index]), PERSON)
        assert text_of(entries[index]) == text[index]  # every token's entry arrives once, with its text


def tokens(client: Any, **extra: Any) -> list[str]:
    regex = {"structured_outputs": {"regex": "[a-z]{40}"}}
    resp = chat(client, temperature=0.3, seed=21, logprobs=True, extra_body={**regex, **extra})
    return [e.token for e in resp.choices[0].logprobs.content]


def test_penalties_are_honoured_under_sampling(client: Any) -> None:
    # Penalties act on logits before temperature, so a low temperature makes their effect plain.
    base = tokens(client)
    assert tokens(client) == base  # seeded: reproducible
    for field, value in [("presence_penalty", 2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 5.0)]:
        discouraged = tokens(client, **{field: value})
        assert discouraged != base and len(set(discouraged)) >= len(set(base)), field
    # Negative values (repetition: below 1) reward tokens already seen: fewer distinct tokens.
    for field, value in [("presence_penalty", -2.0), ("frequency_penalty", -2.0), ("repetition_penalty", 0.2)]:
        assert len(set(tokens(client, **{field: value}))) < len(set(base)), field


def test_top_k_1_and_min_p_1_sample_what_greedy_decodes(client: Any) -> None:
    greedy = letters(client, temperature=0.0)
    assert letters(client, temperature=1.5, seed=1, extra_body={"top_k": 1}) == greedy
    assert letters(client, temperature=1.5, seed=2, extra_body={"min_p": 1.0}) == greedy
    assert letters(client, temperature=1.5, seed=3) != greedy
