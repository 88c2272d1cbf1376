"""Jump-forward stays on only where xgrammar's forced runs are bounded (corral/grammar_engines/forced_runs.py).

xgrammar writes the whole forced string in one call the engine cannot interrupt; grammars that force 2^30
characters compile in milliseconds. Each such grammar here would hold the test process for minutes if the
bound missed it, so these tests fail by hanging (pytest-timeout ends them) as well as by assertion."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import xgrammar

from corral.grammar_engines.bitmask import allowed_ids
from corral.grammar_engines.forced_runs import forced_run_bound
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.xgrammar_backend import MAX_FORCED_RUN, XGrammarBackend, XGrammarCodec, XGrammarCompiled
from corral.grammars.spec import GrammarSpec

LINKS = 30


def doubling_ebnf(links: int, *, top_down: bool = True) -> str:
    rules = [f"a{i} ::= a{i + 1} a{i + 1}" for i in range(links)] + [f'a{links} ::= "x"']
    return "\n".join(["root ::= a0", *(rules if top_down else reversed(rules))])


def doubling_lark(links: int) -> str:
    return "\n".join(["start: a0", *(f"a{i}: a{i + 1} a{i + 1}" for i in range(links)), f'a{links}: "x"'])


def doubling_schema(links: int) -> dict[str, Any]:
    """Each definition is an object holding the next one twice, down to a constant: all of it forced."""
    defs: dict[str, Any] = {f"a{links}": {"const": 1}}
    for i in range(links):
        below = {"$ref": f"#/$defs/a{i + 1}"}
        defs[f"a{i}"] = {
            "type": "object",
            "properties": {"x": below, "y": below},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    return {"$defs": defs, "$ref": "#/$defs/a0"}


UNBOUNDED = {
    "ebnf rules doubling": GrammarSpec.ebnf(doubling_ebnf(LINKS)),
    "ebnf rules doubling, written bottom-up": GrammarSpec.ebnf(doubling_ebnf(LINKS, top_down=False)),
    "lark rules doubling": GrammarSpec.lark(doubling_lark(LINKS)),
    "schema $refs doubling to a const": GrammarSpec.json_schema(doubling_schema(LINKS)),
    "nested counted repeats": GrammarSpec.regex("((x{1000}){1000}){1000}"),
    "a pattern forcing 1500 after one letter": GrammarSpec.json_schema({"type": "string", "pattern": "^(a|b{1500})$"}),
}


@pytest.fixture(scope="module")
def backend(tokenizer: TokenizerSpec) -> XGrammarBackend:
    return XGrammarBackend(tokenizer)


@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_grammars_forcing_huge_runs_lose_jump_forward(backend: XGrammarBackend, name: str) -> None:
    compiled = backend.compile(UNBOUNDED[name])
    assert not compiled.jump_forward
    matcher = backend.new_matcher(compiled)
    assert matcher.forced_tokens() == []  # would otherwise build the forced string, for minutes
    codec = XGrammarCodec()
    restored = codec.restore(backend, compiled.spec, codec.export(compiled))
    assert isinstance(restored, XGrammarCompiled) and not restored.jump_forward  # the flag crosses the sandbox


def test_the_same_shapes_kept_small_keep_jump_forward(backend: XGrammarBackend, tokenizer: TokenizerSpec) -> None:
    """Doubling nine times forces 512 characters: bounded, so jump-forward writes them."""
    for spec, forced_text in [
        (GrammarSpec.ebnf(doubling_ebnf(9)), "x" * 512),
        (GrammarSpec.regex("x{200}y{200}"), "x" * 200 + "y" * 200),  # counts multiplying past the limit, not nested
    ]:
        compiled = backend.compile(spec)
        assert compiled.jump_forward
        tokens = backend.new_matcher(compiled).forced_tokens()
        text = tokenizer.hf_tokenizer.decode(tokens)
        assert tokens and forced_text.startswith(text) and len(text) > len(forced_text) // 2


def test_a_schema_keeps_jump_forward_for_its_keys(backend: XGrammarBackend, tokenizer: TokenizerSpec) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    compiled = backend.compile(GrammarSpec.json_schema(schema))
    assert compiled.jump_forward
    assert tokenizer.hf_tokenizer.decode(backend.new_matcher(compiled).forced_tokens()).startswith('{"name')


OBJECT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["id", "tags", "when"],
    "additionalProperties": False,
}
WALKED = {
    "flat": 'root ::= "begin-" ("one" | "two") "-middle-" [0-9] [0-9] "-end"',
    "nested choices": 'root ::= "a" (b | c) "tail"\nb ::= "bb" ("x" | "y") "bbb"\nc ::= "cc" d\nd ::= "ddd" | "e"',
    "optional parts": 'root ::= "ab" ("cd")? "ef" [a-z] ("gh" | "gk")* "ij"',
    "counted": 'root ::= ("ab"){3} ("c" | "d"){2,4} "e"{5}',
    "object": str(xgrammar.Grammar.from_json_schema(json.dumps(OBJECT), any_whitespace=False)),
}


@pytest.mark.parametrize("name", sorted(WALKED))
def test_the_bound_covers_every_forced_run_on_random_walks(tokenizer: TokenizerSpec, name: str) -> None:
    """Along random answers, every forced run xgrammar finds is within the bound times the parser's stack depth
    (a run may finish an inner rule, then go on in the rule around it); without recursion no stack is deeper
    than the grammar has rules."""
    grammar = xgrammar.Grammar.from_ebnf(WALKED[name])
    table = json.loads(grammar.serialize_json())
    bound = forced_run_bound(table, MAX_FORCED_RUN)
    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer.hf_tokenizer, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.stop_token_ids)
    )
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    rng = random.Random(name)
    longest = 0
    for _ in range(6):
        matcher = xgrammar.GrammarMatcher(compiled)
        while not matcher.is_terminated():
            longest = max(longest, len(matcher.find_jump_forward_string().encode()))
            matcher.fill_next_token_bitmask(bitmask)
            allowed = allowed_ids(bitmask.numpy()[0], info.vocab_size).tolist()
            if matcher.is_completed() or not allowed:
                break
            assert matcher.accept_token(rng.choice(allowed))
    assert 0 < longest <= bound * len(table["rules"]) and bound < 100


@pytest.mark.parametrize(
    "source",
    ["root ::= \"(\" root \")\" | \"z\"", "root ::= root \"x\" | \"y\"", "root ::= \"x\" root | \"x\""],
)
def test_recursive_rules_settle_to_a_small_bound(source: str) -> None:
    assert forced_run_bound(xgrammar.Grammar.from_ebnf(source).serialize_json(), MAX_FORCED_RUN) <= 2


def table(*expressions: list[int]) -> dict[str, Any]:
    """A one-rule grammar in xgrammar's serialised form: the rule's body is the last expression."""
    starts = [sum(len(e) for e in expressions[:i]) for i in range(len(expressions))]
    data = [value for expression in expressions for value in expression]
    return {"rules": [["root", len(expressions) - 1]], "grammar_expr_data": data, "grammar_expr_indptr": starts}


def test_what_it_cannot_read_is_not_bounded() -> None:
    def regex(pattern: str) -> list[int]:
        return [12, len(pattern) + 1, 1, *pattern.encode()]

    assert forced_run_bound(table(regex("^(?<name>ab)c$")), MAX_FORCED_RUN) == 3  # JSON Schema's named groups
    assert forced_run_bound(table(regex("^(a)\\1$")), MAX_FORCED_RUN) == MAX_FORCED_RUN + 1  # a back-reference
    assert forced_run_bound(table([9, 1, 42]), MAX_FORCED_RUN) == MAX_FORCED_RUN + 1  # a token set
