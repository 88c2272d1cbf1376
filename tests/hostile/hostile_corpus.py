"""The hostile corpus: requests a careless or malicious client sends, as raw HTTP bodies.

Each case is what goes over the wire (bytes, content type, method, path) plus the parsed body the oracle
reads to know which constraint an answer must keep. Deep documents are written as text: Python's own
`json.dumps` would hit its recursion limit before the server gets a chance to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = "application/json"
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Hostile:
    name: str
    body: bytes
    request: Any = None  # the body as the oracle reads it (None: unreadable, nothing to check)
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": JSON})
    # Why this case still fails, while it does (the test marks it xfail with this reason).
    known_failure: str | None = None


def chat(name: str, known_failure: str | None = None, path: str = CHAT, **fields: Any) -> Hostile:
    """A request that is ordinary but for `fields` (max_tokens small so accepted cases finish fast)."""
    body: dict[str, Any] = {"model": "corral-tiny", "max_tokens": 24}
    body.update({"prompt": "hi"} if path == COMPLETIONS else {"messages": MESSAGES})
    body.update(fields)
    text = json.dumps(body, allow_nan=True)
    return Hostile(name, text.encode(), request=body, path=path, known_failure=known_failure)


def raw(name: str, text: str | bytes, request: Any = None, **kw: Any) -> Hostile:
    return Hostile(name, text if isinstance(text, bytes) else text.encode(), request=request, **kw)


def with_fragment(key_path: str, fragment: str) -> str:
    """A chat body whose `key_path` ("structured_outputs.json") is the JSON text `fragment`."""
    inner = fragment
    for key in reversed(key_path.split(".")):
        inner = f'{{"{key}": {inner}}}'
    return f'{{"model": "corral-tiny", "max_tokens": 24, "messages": {json.dumps(MESSAGES)}, {inner[1:-1]}}}'


def nested_object_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def nested_array_schema(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def ref_bomb(levels: int, leaf: Any = None) -> dict[str, Any]:
    """Each definition refers to the one below twice: 2**levels paths through a small document."""
    defs: dict[str, Any] = {"d0": leaf or {"type": "integer"}}
    for i in range(1, levels + 1):
        defs[f"d{i}"] = {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i - 1}"}] * 2, "items": False}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


def schema(value: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": value}}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
BIG_DIGITS = "1" + "0" * 5000  # past Python's 4300-digit int-parsing limit
LONG_TEXT = "lorem ipsum " * 40_000  # ~480 kB of prompt

CORPUS: list[Hostile] = [
    # -- deep schemas ------------------------------------------------------------------------------------------
    raw("schema_depth_400_objects", with_fragment("structured_outputs.json", nested_object_schema(400))),
    raw("schema_depth_400_arrays", with_fragment("structured_outputs.json", nested_array_schema(400))),
    raw("schema_depth_400_response_format",
        with_fragment("response_format", '{"type": "json_schema", "json_schema": {"name": "d", "schema": '
                      + nested_object_schema(400) + "}}")),
    raw("schema_depth_400_as_string",
        with_fragment("structured_outputs.json", json.dumps(nested_object_schema(400)))),
    raw("schema_depth_10000_objects", with_fragment("structured_outputs.json", nested_object_schema(10_000))),
    raw("body_depth_10000_lists", with_fragment("metadata", "[" * 10_000 + "]" * 10_000)),
    raw("tool_parameters_depth_400",
        with_fragment("tools", '[{"type": "function", "function": {"name": "f", "parameters": '
                      + nested_object_schema(400) + "}}]")),
    # -- wide schemas and huge enums ---------------------------------------------------------------------------
    chat("schema_10k_properties", structured_outputs={"json": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}}),
    chat("schema_10k_required_properties", structured_outputs={"json": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
        "required": [f"p{i}" for i in range(10_000)]}}),
    chat("schema_enum_100k", structured_outputs={"json": {"enum": [f"v{i}" for i in range(100_000)]}}),
    chat("choice_100k", structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}),
    chat("choice_10k", structured_outputs={"choice": [f"option number {i}" for i in range(10_000)]}),
    chat("choice_empty_and_duplicates", structured_outputs={"choice": ["", "", "x", "x"]}),
    chat("choice_empty_list", structured_outputs={"choice": []}),
    chat("choice_not_strings", structured_outputs={"choice": [1, None, {"a": 1}]}),
    # -- pathological regexes ----------------------------------------------------------------------------------
    chat("regex_nested_quantifier", structured_outputs={"regex": "(a+)+$"}),
    chat("regex_alternation_blowup", structured_outputs={"regex": "(a|a)*b"}),
    chat("regex_repeat_1000000", structured_outputs={"regex": "a{1000000}"}),
    chat("regex_range_repeat_1000000", structured_outputs={"regex": "[a-z]{1,1000000}"}),
    chat("regex_nested_repeat_product", structured_outputs={"regex": "((x{1000}){1000}){1000}"}),
    chat("regex_counted_chain", structured_outputs={"regex": "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))}),
    chat("regex_unbalanced", structured_outputs={"regex": "(ab"}),
    chat("regex_lookahead", structured_outputs={"regex": "(?=a)a"}),
    chat("regex_backreference", structured_outputs={"regex": "(a)\\1"}),
    chat("regex_empty", structured_outputs={"regex": ""}),
    chat("regex_100k_chars", structured_outputs={"regex": "a" * 100_000}),
    chat("schema_pattern_nested_quantifier", structured_outputs={"json": {"type": "string", "pattern": "^(a+)+$"}}),
    # -- pathological grammars ---------------------------------------------------------------------------------
    chat("ebnf_left_recursion", structured_outputs={"grammar": 'root ::= root "a" | "a"'}),
    chat("lark_left_recursion", structured_outputs={"grammar": 'start: start "a" | "a"', "grammar_syntax": "lark"}),
    # `auto` reads a Lark grammar before routing it (corral/grammars/lark_lexing.py); Lark's own loader copies terminals
    # into terminals and writes optional items out as alternatives, so these took it seconds to minutes.
    chat("lark_terminal_chain_2_pow_30", structured_outputs={"grammar_syntax": "lark", "grammar": "start: A0\n"
         + "".join(f"A{i}: A{i + 1} A{i + 1}\n" for i in range(30)) + 'A30: "x"\n'}),
    chat("lark_40_optional_items", structured_outputs={
        "grammar_syntax": "lark", "grammar": "start: " + " ".join(f'"a{i}"?' for i in range(40))}),
    chat("lark_nested_ranges", structured_outputs={
        "grammar_syntax": "lark", "grammar": 'start: ("a" ~ 0..50) ~ 0..50'}),
    chat("ebnf_20k_alternatives", structured_outputs={
        "grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))}),
    chat("ebnf_5000_nested_groups", structured_outputs={"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000}),
    chat("ebnf_undefined_rule", structured_outputs={"grammar": "root ::= missing"}),
    chat("ebnf_only_itself", structured_outputs={"grammar": "root ::= root"}),
    chat("ebnf_repeat_bomb", structured_outputs={"grammar": 'root ::= "a"{1000000}'}),
    # Rules each naming the next twice compile in milliseconds and dictate 2**30 characters, which xgrammar's
    # jump-forward wrote out in one call the engine cannot interrupt (corral/grammar_engines/forced_runs.py).
    chat("ebnf_rules_doubling_2_pow_30", structured_outputs={"grammar": "root ::= a0\n"
         + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(30)) + 'a30 ::= "x"\n'}),
    chat("lark_rules_doubling_2_pow_30", structured_outputs={"grammar_syntax": "lark", "grammar": "start: a0\n"
         + "".join(f"a{i}: a{i + 1} a{i + 1}\n" for i in range(30)) + 'a30: "x"\n'}),
    chat("grammar_empty", structured_outputs={"grammar": ""}),
    chat("grammar_not_text", structured_outputs={"grammar": {"root": "x"}}),
    # -- $ref trouble ------------------------------------------------------------------------------------------
    chat("ref_to_itself", structured_outputs={"json": {"$ref": "#"}}),
    chat("ref_cycle_in_defs", structured_outputs={"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {
        "$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}),
    chat("ref_bomb_2_pow_30", structured_outputs={"json": ref_bomb(30)}),
    chat("ref_bomb_2_pow_30_to_a_const", structured_outputs={"json": ref_bomb(30, leaf={"const": 1})}),
    chat("ref_remote_url", structured_outputs={"json": {"$ref": "http://127.0.0.1:9/never.json"}}),
    chat("ref_missing", structured_outputs={"json": {"$ref": "#/$defs/nowhere"}}),
    # -- schemas with numbers and values no answer can meet ----------------------------------------------------
    chat("schema_false", structured_outputs={"json": False}),
    chat("response_format_schema_false", response_format=schema(False)),
    chat("schema_min_length_1000000", structured_outputs={"json": {"type": "string", "minLength": 1_000_000}}),
    chat("schema_min_items_1000000", structured_outputs={"json": {"type": "array", "minItems": 1_000_000}}),
    chat("schema_minimum_above_maximum", structured_outputs={"json": {"type": "integer", "minimum": 5, "maximum": 1}}),
    chat("schema_multiple_of_tiny", structured_outputs={"json": {"type": "number", "multipleOf": 1e-300}}),
    chat("schema_format_email", structured_outputs={"json": {"type": "string", "format": "email"}}),
    raw("schema_minimum_1e400", with_fragment("structured_outputs.json", '{"type": "integer", "minimum": 1e400}')),
    raw("schema_maximum_nan", with_fragment("structured_outputs.json", '{"type": "number", "maximum": NaN}')),
    raw("schema_big_int_const", with_fragment("structured_outputs.json", '{"const": ' + BIG_DIGITS + "}")),
    # -- huge numbers, NaN, Infinity in request fields ---------------------------------------------------------
    raw("max_tokens_1e400", with_fragment("max_tokens", "1e400").replace('"max_tokens": 24, ', "")),
    raw("max_tokens_5000_digits", with_fragment("max_tokens", BIG_DIGITS).replace('"max_tokens": 24, ', "")),
    chat("max_tokens_10_pow_9", max_tokens=10**9),
    chat("max_tokens_negative", max_tokens=-1),
    chat("max_tokens_zero", max_tokens=0),
    raw("temperature_nan", with_fragment("temperature", "NaN")),
    raw("top_p_infinity", with_fragment("top_p", "Infinity")),
    raw("temperature_minus_infinity", with_fragment("temperature", "-Infinity")),
    chat("seed_10_pow_30", seed=10**30),
    chat("seed_negative_2_pow_70", seed=-(2**70)),
    raw("seed_5000_digits", with_fragment("seed", BIG_DIGITS)),
    raw("logit_bias_nan", with_fragment("logit_bias", '{"1": NaN}')),
    chat("logit_bias_not_token_ids", logit_bias={"abc": 1, "-5": 2, "99999999999": 3}),
    chat("temperature_1e-300", temperature=1e-300, max_tokens=8),
    chat("repetition_penalty_1e-300", repetition_penalty=1e-300, temperature=1.0, max_tokens=8),
    chat("n_negative", n=-1),
    chat("n_zero", n=0),
    chat("n_million", n=1_000_000),
    chat("top_logprobs_million", logprobs=True, top_logprobs=1_000_000),
    # -- duplicate keys ----------------------------------------------------------------------------------------
    raw("duplicate_messages_key", '{"model": "corral-tiny", "max_tokens": 24, "messages": [{"role": "user", '
        '"content": "hi"}], "messages": "not a list"}'),
    raw("duplicate_constraint_key",
        '{"model": "corral-tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}], '
        '"structured_outputs": {"choice": ["a", "b"], "choice": ["yes", "no"]}}',
        request={"messages": MESSAGES, "structured_outputs": {"choice": ["yes", "no"]}}),
    # -- bodies that are not JSON, not UTF-8, cut short, or not the right shape ---------------------------------
    raw("invalid_utf8_body", b'{"model": "corral-tiny", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'),
    raw("lone_surrogate_escape", '{"model": "corral-tiny", "max_tokens": 8, "messages": [{"role": "user", '
        '"content": "\\ud800\\udfff\\udc00"}]}'),
    chat("nul_characters", messages=[{"role": "user", "content": "a\u0000b\u0000" * 100}], max_tokens=8),
    raw("truncated_body", '{"model": "corral-tiny", "messages": [{"role": "us'),
    raw("truncated_in_schema", '{"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": '
        '{"type": "obj'),
    raw("empty_body", b""),
    raw("body_null", "null"),
    raw("body_array", "[]"),
    raw("body_number", "42"),
    raw("body_string", '"hello"'),
    raw("body_trailing_garbage", '{"messages": [{"role": "user", "content": "x"}]} trailing'),
    raw("body_single_quotes", "{'messages': []}"),
    raw("text_plain_content_type", json.dumps({"messages": MESSAGES, "max_tokens": 8}),
        request={"messages": MESSAGES}, headers={"content-type": "text/plain"}),
    raw("form_content_type", "messages=hi&max_tokens=8", headers={"content-type": "application/x-www-form-urlencoded"}),
    raw("multipart_content_type", b"--b\r\nContent-Disposition: form-data; name=\"messages\"\r\n\r\nhi\r\n--b--\r\n",
        headers={"content-type": "multipart/form-data; boundary=b"}),
    raw("no_content_type", json.dumps({"messages": MESSAGES, "max_tokens": 8}), request={"messages": MESSAGES},
        headers={}),
    raw("latin1_charset", json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}], "max_tokens": 8},
                                     ensure_ascii=False).encode("latin-1"),
        headers={"content-type": "application/json; charset=latin-1"}),
    chat("messages_object", messages={"role": "user", "content": "hi"}),
    chat("messages_nested_list", messages=[[{"role": "user", "content": "hi"}]]),
    chat("messages_empty", messages=[]),
    chat("response_format_list", response_format=[{"type": "json_object"}]),
    chat("structured_outputs_list", structured_outputs=[{"choice": ["a"]}]),
    chat("stream_options_list", stream=True, stream_options=[True]),
    chat("tools_object", tools={"type": "function"}),
    chat("tools_list_of_lists", tools=[[TOOL]]),
    chat("tool_choice_number", tools=[TOOL], tool_choice=7),
    # -- roles and content -------------------------------------------------------------------------------------
    chat("role_number", messages=[{"role": 5, "content": "hi"}]),
    chat("role_null", messages=[{"role": None, "content": "hi"}]),
    chat("role_object", messages=[{"role": {"name": "user"}, "content": "hi"}]),
    chat("role_unknown", messages=[{"role": "wizard", "content": "hi"}]),
    chat("role_missing", messages=[{"content": "hi"}]),
    chat("content_number", messages=[{"role": "user", "content": 5}]),
    chat("content_image_part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]),
    chat("content_10k_parts", messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 10_000}],
         max_tokens=8),
    chat("messages_10k", messages=[{"role": "user", "content": "hi"}] * 10_000, max_tokens=8),
    chat("prompt_480kb", messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=8),
    chat("stop_10k_strings", stop=[f"s{i}" for i in range(10_000)], max_tokens=8),
    chat("stop_100kb_string", stop="x" * 100_000, max_tokens=8),
    chat("tools_500", tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(500)], tool_choice="required"),
    chat("tool_name_empty", tools=[{"type": "function", "function": {"name": "", "parameters": {}}}]),
    chat("tool_choice_unknown_function", tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
    # -- completions endpoint ----------------------------------------------------------------------------------
    chat("completions_10k_prompts", path=COMPLETIONS, prompt=["hi"] * 10_000),
    chat("completions_token_ids", path=COMPLETIONS, prompt=[1, 2, 3]),
    chat("completions_prompt_number", path=COMPLETIONS, prompt=5),
    chat("completions_prompt_empty", path=COMPLETIONS, prompt=""),
    chat("completions_messages_field", path=COMPLETIONS, messages=MESSAGES),
    # -- ordinary constraints under odd but legal settings: answers must keep their constraint -----------------
    chat("choice_streamed", stream=True, structured_outputs={"choice": ["alpha", "beta"]}),
    chat("regex_n_4", n=4, temperature=1.5, structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}),
    chat("schema_high_temperature", temperature=2.0, max_tokens=64, structured_outputs={"json": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 7}}, "required": ["a"],
        "additionalProperties": False}}),
    chat("schema_logit_bias_fights_grammar", max_tokens=64, logit_bias={str(i): 100 for i in range(100, 400)},
         structured_outputs={"json": {"type": "boolean"}}),
    chat("tool_call_required", tools=[TOOL], tool_choice="required", max_tokens=64),
    chat("completions_regex", path=COMPLETIONS, structured_outputs={"regex": "(yes|no)"}),
    chat("streamed_deep_schema", stream=True, structured_outputs={"json": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}, "required": ["a"]}}),
    # -- routes and methods ------------------------------------------------------------------------------------
    raw("unknown_route", "{}", path="/v1/nope"),
    raw("get_on_post_route", b"", method="GET"),
    raw("post_on_models", "{}", path="/v1/models"),
]
