"""Request limits (docs/reliability.md): each is refused before the work it bounds, with a 4xx in OpenAI's
shape whose `code` (and `param`, where a field is to blame) names the limit, and the keep-alive connection
that carried the refused request goes on serving."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from corral.grammars.contract import validate_output
from corral.grammars.limits import InputLimits, LimitExceeded, check_schema_limits
from corral.grammars.request import parse_constraint
from corral.grammars.spec import GrammarSpec
from corral.server.middleware import json_depth
from corral.server.openai.tools import parse_tools
from corral.server.settings import Settings

MODEL = "corral-tiny"
MESSAGES = [{"role": "user", "content": "hello"}]
CHOICE_OK = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}}


def nested_items(depth: int) -> str:
    """A JSON Schema `depth` JSON levels deep (`items` inside `items`), as text (json.dumps would recurse)."""
    return '{"type":"array","items":' * (depth - 1) + '{"type":"string"}' + "}" * (depth - 1)


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **fields}


# -- constraint limits, below the server -------------------------------------------------------------------

SMALL = InputLimits(
    max_schema_depth=4, max_schema_nodes=20, max_schema_refs=2, max_regex_length=8, max_grammar_length=16,
    max_choices=3, max_tools=2,
)


@pytest.mark.parametrize(("schema", "code"), [
    (json.loads(nested_items(5)), "schema_too_deep"),
    ({"enum": list(range(30))}, "schema_too_large"),
    ({"$defs": {"a": {}}, "anyOf": [{"$ref": "#/$defs/a"}] * 3}, "too_many_schema_refs"),
])
def test_schema_limits_name_the_limit(schema: Any, code: str) -> None:
    with pytest.raises(LimitExceeded) as info:
        parse_constraint(None, {"json": schema}, limits=SMALL)
    assert info.value.code == code
    assert info.value.param == "structured_outputs.json"
    flag = {"schema_too_deep": "--max-schema-depth", "schema_too_large": "--max-schema-nodes",
            "too_many_schema_refs": "--max-schema-refs"}[code]
    assert flag in str(info.value)


def test_schema_at_the_limits_is_accepted() -> None:
    at_depth = json.loads(nested_items(4))
    spec = parse_constraint(None, {"json": at_depth}, limits=SMALL).spec
    assert spec == GrammarSpec.json_schema(at_depth)


@pytest.mark.parametrize("depth", [400, 10_000])
def test_deep_schema_as_a_json_string_is_refused_not_a_recursion_error(depth: int) -> None:
    with pytest.raises(LimitExceeded) as info:
        parse_constraint(None, {"json": nested_items(depth)})
    assert info.value.code == "schema_too_deep"


def _chain(links: int) -> str:
    """Terminals each naming the next twice: Lark writes A0 out as 2^links copies of `"x"`."""
    return "start: A0\n" + "".join(f"A{i}: A{i + 1} A{i + 1}\n" for i in range(links)) + f'A{links}: "x"\n'


def test_a_lark_terminal_that_writes_out_past_the_grammar_limit_is_refused() -> None:
    with pytest.raises(LimitExceeded) as info:
        parse_constraint(None, {"grammar": _chain(30), "grammar_syntax": "lark"})
    assert info.value.code == "grammar_terminal_too_large" and "--max-grammar-length" in str(info.value)
    assert "A0" in str(info.value) and info.value.param == "structured_outputs.grammar"
    parse_constraint(None, {"grammar": _chain(10), "grammar_syntax": "lark"})  # 1,024 copies: within 100,000
    with pytest.raises(LimitExceeded) as info:
        parse_constraint(None, {"grammar": _chain(10), "grammar_syntax": "lark"},
                         limits=InputLimits(max_grammar_length=1000))
    with pytest.raises(LimitExceeded, match="names itself") as info:
        parse_constraint(None, {"grammar": 'start: A\nA: "x" B\nB: "y" A\n', "grammar_syntax": "lark"})
    assert info.value.code == "grammar_terminal_recursive"
    # Rules may name each other freely (Lark does not write them out), strings and patterns may hold capitals.
    parse_constraint(None, {"grammar": 'start: a\na: b b\nb: "X" | /[A-Z]+/ | WORD\n%import common.WORD\n',
                            "grammar_syntax": "lark"})


def test_walk_stops_at_the_limit_on_a_huge_schema() -> None:
    # 200,000 values: refused once the first thousand are seen.
    schema = {"enum": list(range(200_000))}
    with pytest.raises(LimitExceeded, match="more than 1000 JSON values"):
        check_schema_limits(schema, InputLimits(max_schema_nodes=1000), param="p")


def test_node_limit_is_exact() -> None:
    """Refused exactly when the document has more values than the limit (the walk counts what it pushed)."""
    rng = random.Random(5)
    for _ in range(300):
        value = _random_json(rng)
        size = _count(value)
        for limit in (max(1, size - 1), size, size + 1):
            refused = False
            try:
                check_schema_limits(value, InputLimits(max_schema_nodes=limit), param="p")
            except LimitExceeded:
                refused = True
            assert refused == (size > limit), (value, size, limit)


def _count(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(_count(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_count(v) for v in value)
    return 1


@pytest.mark.parametrize(("block", "code", "param"), [
    ({"regex": "a" * 9}, "regex_too_long", "structured_outputs.regex"),
    ({"grammar": 'start: "' + "a" * 20 + '"'}, "grammar_too_long", "structured_outputs.grammar"),
    ({"choice": ["a", "b", "c", "d"]}, "too_many_choices", "structured_outputs.choice"),
])
def test_source_and_choice_limits(block: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(LimitExceeded) as info:
        parse_constraint(None, block, limits=SMALL)
    assert (info.value.code, info.value.param) == (code, param)


def test_tool_limits() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(LimitExceeded) as info:
        parse_tools([tool] * 3, None, True, limits=SMALL)
    assert (info.value.code, info.value.param) == ("too_many_tools", "tools")
    deep = {"type": "function", "function": {"name": "g", "parameters": json.loads(nested_items(5))}}
    with pytest.raises(LimitExceeded) as info:
        parse_tools([tool, deep], None, True, limits=SMALL)
    assert (info.value.code, info.value.param) == ("schema_too_deep", "tools[1].function.parameters")


def test_defaults_accept_every_committed_benchmark_schema() -> None:
    from conftest import SAMPLE_BENCH, SHARED_BENCH

    root = SHARED_BENCH if SHARED_BENCH.is_dir() else SAMPLE_BENCH
    files = sorted(root.glob("*/*.json"))
    assert files
    for path in files[:: max(1, len(files) // 400)]:  # a spread of at most ~400 schemas keeps this quick
        check_schema_limits(json.loads(path.read_text())["schema"], InputLimits(), param=str(path))


def test_settings_defaults_match_the_library_defaults() -> None:
    assert Settings().input_limits() == InputLimits()
    assert Settings(max_tools=3, max_choices=7).input_limits() == InputLimits(max_tools=3, max_choices=7)


def test_an_answer_too_deep_to_check_fails_closed() -> None:
    spec = GrammarSpec.json_schema({"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                                    "$ref": "#/$defs/t"})
    check = validate_output(spec, "[" * 5000 + "]" * 5000)
    assert not check.valid
    assert "too deeply" in (check.error or "")


# -- the raw-body depth scan -----------------------------------------------------------------------------

def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _random_json(rng: random.Random, level: int = 0) -> Any:
    alphabet = ["a", "[", "]", "{", "}", "\\", '"', "\\\\", "\n", "é"]
    pick = rng.random()
    if level > 6 or pick < 0.3:
        return "".join(rng.choices(alphabet, k=rng.randint(0, 8)))
    if pick < 0.65:
        return [_random_json(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {"".join(rng.choices(alphabet, k=rng.randint(0, 5))): _random_json(rng, level + 1)
            for _ in range(rng.randint(0, 3))}


def test_json_depth_ignores_brackets_and_escapes_inside_strings() -> None:
    rng = random.Random(13)
    for _ in range(500):
        value = _random_json(rng)
        for ascii_only in (True, False):
            body = json.dumps(value, ensure_ascii=ascii_only).encode()
            assert json_depth(body) == _depth(value), body
    assert json_depth(b'{"a": "\\\\", "b": [[1]]}') == 3
    assert json_depth(b"") == 0


# -- over HTTP ---------------------------------------------------------------------------------------------

@pytest.fixture()
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def local_port(response: httpx.Response) -> int:
    """The client side of the connection that carried `response` (same port: same keep-alive connection)."""
    return int(response.extensions["network_stream"].get_extra_info("socket").getsockname()[1])


def assert_openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["param"] == param, body
    return str(body["error"]["message"])


def assert_serves_on(http: httpx.Client, port: int) -> None:
    response = http.post("/v1/chat/completions", json=CHOICE_OK)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert local_port(response) == port, "the refused request's connection was dropped"


@pytest.mark.parametrize("depth", [400, 10_000])
def test_deeply_nested_schema_is_a_400_and_the_connection_serves_on(http: httpx.Client, depth: int) -> None:
    """The issue's repro: a JSON Schema nested 400 levels deep answered 500 RecursionError and broke the
    keep-alive connection."""
    body = json.dumps(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": 0}}))
    body = body.replace('"schema": 0', '"schema": ' + nested_items(depth))
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    message = assert_openai_error(response, 400, "json_too_deep")
    assert "--max-json-depth" in message
    assert_serves_on(http, local_port(response))


@pytest.mark.parametrize("depth", [400, 10_000])
def test_deep_schema_inside_a_json_string_names_the_field(http: httpx.Client, depth: int) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(structured_outputs={"json": nested_items(depth)}))
    message = assert_openai_error(response, 400, "schema_too_deep", "structured_outputs.json")
    assert "--max-schema-depth" in message
    assert_serves_on(http, local_port(response))


def test_schema_past_the_depth_limit_names_the_field(http: httpx.Client) -> None:
    schema = json.loads(nested_items(140))  # within --max-json-depth (160), past --max-schema-depth (128)
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}
    response = http.post("/v1/chat/completions", json=chat_body(response_format=fmt))
    assert_openai_error(response, 400, "schema_too_deep", "response_format.json_schema.schema")
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    response = http.post("/v1/chat/completions", json=chat_body(tools=tools))
    assert_openai_error(response, 400, "schema_too_deep", "tools[0].function.parameters")


@pytest.mark.parametrize(("structured", "code"), [
    ({"json": {"enum": list(range(100_001))}}, "schema_too_large"),
    ({"json": {"$defs": {"a": {}}, "anyOf": [{"$ref": "#/$defs/a"}] * 5_001}}, "too_many_schema_refs"),
    ({"regex": "a" * 10_001}, "regex_too_long"),
    ({"grammar": 'start: "' + "a" * 100_000 + '"'}, "grammar_too_long"),
    ({"choice": [str(i) for i in range(10_001)]}, "too_many_choices"),
])
def test_constraint_limits_over_http(http: httpx.Client, structured: dict[str, Any], code: str) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(structured_outputs=structured))
    (key,) = structured
    assert_openai_error(response, 400, code, f"structured_outputs.{key}")


def test_too_many_tools(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    response = http.post("/v1/chat/completions", json=chat_body(tools=tools))
    assert_openai_error(response, 400, "too_many_tools", "tools")


def test_prompt_plus_max_tokens_past_the_context(http: httpx.Client, server: Any) -> None:
    context = server.service.engine.max_len
    response = http.post("/v1/chat/completions", json=chat_body(max_tokens=context - 5))
    message = assert_openai_error(response, 400, "context_length_exceeded", "max_tokens")
    assert "room for" in message


def test_body_over_the_declared_size_is_a_413_before_it_is_read(http: httpx.Client) -> None:
    limit = Settings().max_body_bytes
    response = http.post(
        "/v1/chat/completions", content=b" " * (limit + 1), headers={"content-type": "application/json"}
    )
    message = assert_openai_error(response, 413, "request_too_large")
    assert "--max-body-bytes" in message
    assert response.headers["connection"] == "close"


def test_chunked_body_is_cut_off_at_the_limit(http: httpx.Client) -> None:
    """No Content-Length: the body is counted while it arrives and refused at the limit, not after it."""
    limit = Settings().max_body_bytes
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        for _ in range(64):  # up to 4x the limit, if the server kept reading
            sent += limit // 16
            yield b" " * (limit // 16)

    try:
        response = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    except httpx.HTTPError:
        pass  # the server answered and closed while the client still wrote: also a refusal before reading it all
    else:
        assert_openai_error(response, 413, "request_too_large")
    assert sent < 4 * limit


def _refusals(http: httpx.Client, limit: str) -> float:
    match = re.search(rf'^corral_limit_refusals_total\{{limit="{limit}"\}} (\S+)$', http.get("/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def test_refusals_are_counted_by_limit(http: httpx.Client, server: Any) -> None:
    cases = [
        ("json_too_deep", {"content": nested_items(200).encode(), "headers": {"content-type": "application/json"}}),
        ("too_many_choices", {"json": chat_body(structured_outputs={"choice": [str(i) for i in range(10_001)]})}),
        ("context_length_exceeded", {"json": chat_body(max_tokens=server.service.engine.max_len)}),
    ]
    for limit, request in cases:
        before = _refusals(http, limit)
        assert http.post("/v1/chat/completions", **request).status_code == 400
        assert _refusals(http, limit) == before + 1, limit
