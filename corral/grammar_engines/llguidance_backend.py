"""llguidance as a SamplerBackend: JSON Schema, regex, Lark (and GBNF converted to Lark). Its traits, keyword
table and sandbox codec are declared in corral/grammar_engines/backends/llguidance.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from corral.grammar_engines.backends.llguidance import NAME
from corral.grammar_engines.llguidance_vocabulary import compile_only, ll_tokenizer, special_ids_by_text
from corral.grammar_engines.protocol import CompileError, Matcher, TokenizerSpec
from corral.grammars.lowering import choice_to_lark
from corral.grammars.spec import FREE_GAP_INDENT, FREE_GAP_NEWLINES, GrammarKind, GrammarSpec
from corral.grammars.tools import ToolFormat, ToolGrammar, to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The same separators as the xgrammar backend (", " and ": ") and no free whitespace: llguidance's
# default is flexible whitespace, which lets a model loop on spaces. Not lenient: an unimplemented
# keyword is a compile error, so `auto` can route the schema elsewhere instead of under-enforcing it.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# The decode-safe profile (GrammarSpec.decode_safe, `auto` only, always behind the contract guard):
# unimplemented keywords and unknown formats are skipped and oneOf is compiled as anyOf.
RELAXED_JSON_OPTIONS: JsonCompileOptions = {**JSON_OPTIONS, "lenient": True, "coerce_one_of": True}
# GrammarSpec.whitespace `free`: llama.cpp's `space` rule (corral/grammars/spec.py FREE_GAP_*) as the skip between any
# two JSON tokens, with bare separators. llguidance takes at most one skip per gap (two spaces in a row, or newlines
# after the indent, are refused: tests/samplers/test_json_whitespace.py), so the pattern bounds the whole gap.
FREE_WHITESPACE: JsonCompileOptions = {
    "whitespace_flexible": True,
    "whitespace_pattern": f"(?: |\\n{{1,{FREE_GAP_NEWLINES}}}[ \\t]{{0,{FREE_GAP_INDENT}}})",
    "item_separator": ",",
    "key_separator": ":",
}


@dataclass(frozen=True)
class LLGuidanceCompiled:
    spec: GrammarSpec
    prototype: Any  # an LLMatcher at the start state; matchers are deep copies of it
    backend_name: str = NAME


class LLGuidanceMatcher:
    def __init__(self, compiled: LLGuidanceCompiled) -> None:
        self._m = compiled.prototype.deep_copy()
        self._refused: int | None = None  # the token the last accept_token refused, from the state it left

    @property
    def handle(self) -> Any:
        return self._m

    @property
    def error(self) -> str | None:
        if self._m.is_error():
            return _first_line(str(self._m.get_error()))
        return None if self._refused is None else self._refusal(self._refused)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        width = bitmask.shape[1] * 4
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width, width)

    def accept_token(self, token_id: int) -> bool:
        if self._m.validate_tokens([token_id]) != 1:
            self._refused = token_id  # explained when asked: searches try refused tokens freely
            return False
        self._refused = None
        return bool(self._m.consume_token(token_id))

    def _refusal(self, token_id: int) -> str:
        """Why the grammar refuses `token_id`: llguidance explains it only once a matcher consumed it, so a
        copy does."""
        probe = self._m.deep_copy()
        probe.consume_token(token_id)
        return _first_line(str(probe.get_error())) if probe.is_error() else f"token {token_id} refused"

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return int(self._m.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._refused = None

    def forced_tokens(self) -> list[int]:
        # llguidance tokenises forced text with the model's tokenizer, which splits out added tokens: a forced
        # literal equal to one (`<tool_call>` on Qwen) came back as that special token, which its parser then
        # refuses (a special token matches only a token reference). Only what the grammar accepts is forced.
        forced = list(self._m.compute_ff_tokens())
        return forced[: self._m.validate_tokens(forced)] if forced else forced

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def can_terminate(self) -> bool:
        return bool(self._m.is_accepting())


class LLGuidanceBackend:
    name = NAME

    def __init__(self, tokenizer: TokenizerSpec) -> None:
        self._tokenizer, self._vocabulary = ll_tokenizer(tokenizer)
        self._executor = llguidance.LLExecutor()
        self._markers: dict[str, dict[str, int]] = {}  # per tool-call format: marker text → special token id

    def compile_only(self) -> None:
        """Drop what only the server's matchers use: the vocabulary's slices (~90 MB of Gemma 3's 262,144 tokens)
        and the Rust tokenizer (corral/grammar_engines/llguidance_vocabulary.py)."""
        self._tokenizer = compile_only(self._tokenizer, self._vocabulary)

    def supports(self, spec: GrammarSpec) -> str | None:
        if spec.kind is GrammarKind.TOOL_CALLS:
            grammar = ToolGrammar.of(spec)
            if grammar.text_schema is not None and grammar.format.marker[0] in "{[":
                # A `%json` text branch and a call literal that start with the same character: llguidance
                # 1.9 lexes only one of them (seen: `{"ok": true}` refused after `{"`).
                return f"llguidance cannot tell a {grammar.format.name} call from a JSON text answer"
        return None

    def compile(self, spec: GrammarSpec) -> LLGuidanceCompiled:
        grammar = self._grammar_text(spec)
        # Constructing the matcher does the real work (lexer/parser tables) and drops the GIL.
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise CompileError(_clean(str(matcher.get_error())), backend=NAME, unsupported=spec.embeds_schema)
        return LLGuidanceCompiled(spec, matcher)

    def _grammar_text(self, spec: GrammarSpec) -> str:
        try:
            if spec.is_json:
                schema = spec.schema() if spec.kind is GrammarKind.JSON_SCHEMA else {"type": "object"}
                options = RELAXED_JSON_OPTIONS if spec.decode_safe else JSON_OPTIONS
                if spec.whitespace == "free":
                    options = {**options, **FREE_WHITESPACE}
                if spec.leading_whitespace and isinstance(schema, dict):
                    # The schema embedded in Lark (`%json`, its options as `x-guidance`) after the optional
                    # whitespace, which no JSON value starts with (so the two never overlap in the lexer).
                    with_options = json.dumps({**schema, "x-guidance": options})
                    lark = f"start: LEAD? value\nLEAD: /[ \\n]/\nvalue: %json {with_options}"
                    return str(llguidance.LLMatcher.grammar_from_lark(lark))
                return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options))
            if spec.kind is GrammarKind.REGEX:
                return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
            if spec.kind is GrammarKind.LARK:
                return str(llguidance.LLMatcher.grammar_from_lark(spec.source))
            if spec.kind is GrammarKind.EBNF:
                return str(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source)))
            if spec.kind is GrammarKind.CHOICE:
                return str(llguidance.LLMatcher.grammar_from_lark(choice_to_lark(spec.choices())))
            if spec.kind is GrammarKind.TOOL_CALLS:
                # Each function's schema is embedded with `%json`, compiled with the same options as json_schema.
                embedded: dict[str, Any] = {**(RELAXED_JSON_OPTIONS if spec.decode_safe else JSON_OPTIONS)}
                grammar = ToolGrammar.of(spec)
                lark = to_lark(grammar, embedded, self.marker_tokens(grammar.format))
                return str(llguidance.LLMatcher.grammar_from_lark(lark))
        except Exception as exc:  # gbnf_to_lark raises its own and plain Exceptions on bad EBNF
            raise CompileError(f"llguidance could not read the {spec.kind}: {exc}", backend=NAME) from exc
        raise CompileError(f"llguidance cannot compile a {spec.kind} constraint", backend=NAME, unsupported=True)

    def marker_tokens(self, fmt: ToolFormat) -> dict[str, int]:
        """The format's markers that this vocabulary holds as one special token (by text): llguidance never
        lets literal text match a special token, so the grammar names these by id (corral/grammars/tools.py)."""
        found = self._markers.get(fmt.name)
        if found is None:
            # By text, not by tokenizing the marker: a compile worker has no tokenizer to do it as the server does.
            special = special_ids_by_text(self._tokenizer, self._vocabulary)
            found = self._markers[fmt.name] = {marker: special[marker] for marker in fmt.markers if marker in special}
        return found

    def new_matcher(self, compiled: Any) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        pairs = [(m.handle, row) for m, row in zip(matchers, rows, strict=True) if isinstance(m, LLGuidanceMatcher)]
        width = bitmask.shape[1] * 4
        # Parallel over llguidance's own threads, GIL released; bitmask must be contiguous CPU int32.
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), width, bitmask.shape[0])


def _clean(message: str) -> str:
    return message.strip()


def _first_line(message: str) -> str:
    """llguidance's errors carry its parser state and the whole grammar after the first line."""
    return message.strip().split("\n", 1)[0]
