"""xgrammar as a SamplerBackend: JSON Schema, regex, EBNF and Lark through one GrammarCompiler, and its sandbox
codec (XGrammarCodec). Its traits and keyword table are declared in corral/grammar_engines/backends/xgrammar.py."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar

from corral.grammar_engines.backends.xgrammar import IGNORED_KEYWORDS, NAME
from corral.grammar_engines.forced_runs import forced_run_bound
from corral.grammar_engines.protocol import CompiledGrammar, CompileError, Matcher, SamplerBackend, TokenizerSpec
from corral.grammars.combinator_siblings import distribute_siblings
from corral.grammars.features import schema_features
from corral.grammars.lowering import choice_to_ebnf
from corral.grammars.spec import FREE_GAP_INDENT, FREE_GAP_NEWLINES, GrammarKind, GrammarSpec
from corral.grammars.tools import ToolGrammar, not_starting_with, tool_schemas

log = logging.getLogger(__name__)

BATCH_THRESHOLD = 64  # rows per step before xgrammar's own thread pool is worth its hand-off
# xgrammar's find_jump_forward_string builds the whole forced string in one uninterruptible call on the engine
# thread (`((x{1000}){1000}){1000}` and 30 rules each naming the next twice compile at once, then that call
# ran until the hung-step watchdog killed the server). Jump-forward is only a shortcut, so it is off for a
# grammar whose forced runs corral/grammar_engines/forced_runs.py cannot bound by this many bytes per parser frame (the
# JSONSchemaBench schemas stay under 150). A run may span frames, and recursion stacks them as deep as the
# text written so far, so the bound is kept small: at 1,000 bytes a frame, even 8,000 frames force ~1.6 s.
MAX_FORCED_RUN = 1_000
FREE_GAP_MAX = FREE_GAP_NEWLINES + FREE_GAP_INDENT  # whitespace characters in one gap (GrammarSpec.whitespace free)


@dataclass(frozen=True)
class XGrammarCompiled:
    spec: GrammarSpec
    grammar: Any  # xgrammar.CompiledGrammar
    backend_name: str = NAME
    jump_forward: bool = True  # its forced runs are bounded (MAX_FORCED_RUN)


class XGrammarMatcher:
    def __init__(self, compiled: XGrammarCompiled, tokenizer: Any) -> None:
        self._m = xgrammar.GrammarMatcher(compiled.grammar)
        self._tokenizer = tokenizer
        self._error: str | None = None
        self._jump_forward = compiled.jump_forward

    @property
    def handle(self) -> Any:
        return self._m

    @property
    def error(self) -> str | None:
        return self._error

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self._m.accept_token(token_id))
        if not ok:
            self._error = f"token {token_id} rejected by the grammar"
        return ok

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        probe = self._m.fork()
        for count, token in enumerate(token_ids):
            if not probe.accept_token(token):
                return count
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        # xgrammar gives the forced *string*; tokenising it alone could split differently from how
        # the model would, so the last token (which could merge with what follows) is held back and
        # the rest is kept only as far as the grammar accepts it token by token.
        if not self._jump_forward:
            return []
        forced = self._m.find_jump_forward_string()
        if not forced:
            return []
        tokens: list[int] = list(self._tokenizer.encode(forced, add_special_tokens=False))[:-1]
        return tokens[: self.validate_tokens(tokens)]

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        return bool(self._m.is_completed())


# GrammarSpec.leading_whitespace: at most one space or newline before the value.
_LEADING_WHITESPACE = xgrammar.Grammar.from_ebnf("root ::= [ \\n]?")


class XGrammarBackend:
    name = NAME

    def __init__(self, tokenizer: TokenizerSpec) -> None:
        self._tokenizer = tokenizer.hf_tokenizer
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer.hf_tokenizer,
            vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.stop_token_ids),
        )
        self.tokenizer_info = info  # the codec deserialises shipped grammars with it
        threads = max(1, min(8, os.cpu_count() or 1))
        # corral keeps its own cache keyed by canonical spec, so xgrammar's is off (no double memory).
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile_only(self) -> None:
        """Drop what only matchers use (the tokenizer, for jump-forward's text): a compile worker never makes
        one, and the tokenizer is its largest object (~0.3 GB for Gemma 3's vocabulary)."""
        self._tokenizer = None

    def supports(self, spec: GrammarSpec) -> str | None:
        if spec.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS) or spec.decode_safe:
            return None  # decode-safe: the contract guard enforces what xgrammar ignores
        schemas = tool_schemas(spec) if spec.kind is GrammarKind.TOOL_CALLS else [spec.schema()]
        ignored = sorted(set().union(*(schema_features(schema) for schema in schemas)) & IGNORED_KEYWORDS)
        if ignored:
            return f"xgrammar 0.2.8 does not enforce {', '.join(ignored)}"
        return None

    def compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        try:
            grammar = self._grammar(spec)
            # The bound is read from the grammar as written: the compiled one also carries per-rule automata,
            # 100x the text to serialise and parse (0.5 s for a small schema).
            bounded = forced_run_bound(grammar.serialize_json(), MAX_FORCED_RUN) <= MAX_FORCED_RUN
            return XGrammarCompiled(spec, self._compiler.compile_grammar(grammar), jump_forward=bounded)
        except RuntimeError as exc:
            raise CompileError(_clean(str(exc)), backend=NAME, unsupported=spec.embeds_schema) from exc

    def _grammar(self, spec: GrammarSpec) -> Any:
        if spec.is_json:
            # `fixed`: no free whitespace (bounded output, no whitespace loops). xgrammar 0.2.8's generic
            # object/array rules always use ", " whatever `separators` says, so keep its defaults
            # (", " and ": ") to stay self-consistent.
            source = '{"type":"object"}'
            if spec.kind is GrammarKind.JSON_SCHEMA:
                source = _xgrammar_schema(spec.schema(), spec.source)
            if spec.whitespace == "free":
                # `free`: xgrammar bounds a gap by its length only, `[ \n\r\t]{0,N}` between any two tokens. N is
                # the longest gap llama.cpp's rule allows (FREE_GAP_*), so every gap that rule allows is allowed
                # here, and some it refuses too (several spaces, spaces before a newline, `\r`, three newlines),
                # bounded all the same. Separators are then `,` and `:`, with a gap on either side.
                value = xgrammar.Grammar.from_json_schema(
                    source, any_whitespace=True, max_whitespace_cnt=FREE_GAP_MAX, strict_mode=False
                )
            else:
                value = xgrammar.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=False)
            return xgrammar.Grammar.concat(_LEADING_WHITESPACE, value) if spec.leading_whitespace else value
        if spec.kind is GrammarKind.REGEX:
            return xgrammar.Grammar.from_regex(spec.source)
        if spec.kind is GrammarKind.LARK:
            return xgrammar.Grammar.from_lark(spec.source)
        if spec.kind is GrammarKind.EBNF:
            return xgrammar.Grammar.from_ebnf(spec.source)
        if spec.kind is GrammarKind.CHOICE:
            return xgrammar.Grammar.from_ebnf(choice_to_ebnf(spec.choices()))
        if spec.kind is GrammarKind.TOOL_CALLS:
            return xgrammar.Grammar.from_structural_tag(json.dumps(tool_calls_structural_tag(ToolGrammar.of(spec))))
        raise CompileError(f"xgrammar cannot compile a {spec.kind} constraint", backend=NAME, unsupported=True)

    def new_matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self._tokenizer)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        # One fill takes microseconds, while BatchGrammarMatcher's thread hand-off costs milliseconds per call
        # below ~16 rows (measured: docs/measured-choices.md#xgrammar-backend). Its threads only pay off for large
        # batches on many cores.
        if len(matchers) >= BATCH_THRESHOLD:
            handles = [m.handle for m in matchers if isinstance(m, XGrammarMatcher)]
            self._batch.batch_fill_next_token_bitmask(handles, bitmask, list(rows))
            return
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)


# xgrammar's JSON serialisation is slow for grammars with a large token-mask cache: a 1 KB schema
# (Github_medium/o83393) took longer to serialise and deserialise than to compile, while a small schema
# round-trips in less than its compile (measured: docs/measured-choices.md#xgrammar-backend). Ship it only
# while small; otherwise the parent compiles again.
SHIP_LIMIT_BYTES = 1 << 20


class XGrammarCodec:
    """The sandbox codec: small grammars cross as `CompiledGrammar.serialize_json()` (and whether jump-forward is
    safe on them), deserialised with the parent's TokenizerInfo (docs/measured-choices.md#xgrammar-backend); big
    ones are compiled again."""

    def export(self, compiled: CompiledGrammar) -> Any:
        if not isinstance(compiled, XGrammarCompiled) or compiled.grammar.memory_size_bytes >= SHIP_LIMIT_BYTES:
            return None
        return {"grammar": compiled.grammar.serialize_json(), "jump_forward": compiled.jump_forward}

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        if payload is None or not isinstance(impl, XGrammarBackend):
            return impl.compile(spec)
        grammar = xgrammar.CompiledGrammar.deserialize_json(payload["grammar"], impl.tokenizer_info)
        return XGrammarCompiled(spec, grammar, jump_forward=bool(payload["jump_forward"]))


def _xgrammar_schema(schema: Any, source: str) -> str:
    """The schema (and its text) as xgrammar is given it: with the keywords beside each anyOf/oneOf inside its
    branches, which xgrammar 0.2.8 would otherwise drop (corral/grammars/combinator_siblings.py); the text unchanged
    when none moves."""
    rewritten = distribute_siblings(schema)
    return source if rewritten is schema else json.dumps(rewritten, ensure_ascii=False)


def _json_grammar(schema: dict[str, Any]) -> dict[str, Any]:
    """One embedded schema as an EBNF grammar compiled exactly like a json_schema request."""
    source = _xgrammar_schema(schema, json.dumps(schema, ensure_ascii=False))
    ebnf = str(xgrammar.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=False))
    return {"type": "grammar", "grammar": ebnf}


def tool_calls_structural_tag(grammar: ToolGrammar) -> dict[str, Any]:
    """The answer as an xgrammar structural tag: one `tag` per function (prefix, arguments, close),
    repeated with the format's separator when parallel calls are on; `or` a text branch under `auto`."""
    fmt = grammar.format
    tags = [
        {"type": "tag", "begin": fmt.prefix(t.name), "content": _json_grammar(t.parameters), "end": fmt.close}
        for t in grammar.tools
    ]
    calls: dict[str, Any] = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": fmt.separator,
        "at_least_one": True,
        "stop_after_first": not grammar.parallel,
    }
    if fmt.begin or fmt.end:
        ends = [{"type": "const_string", "value": text} for text in (fmt.begin, fmt.end)]
        calls = {"type": "sequence", "elements": [ends[0], calls, ends[1]]}
    answer = calls
    if grammar.mode == "auto":
        text = (
            _json_grammar(grammar.text_schema)
            if grammar.text_schema is not None
            else {"type": "regex", "pattern": not_starting_with(fmt.marker)}
        )
        answer = {"type": "or", "elements": [calls, text]}
    return {"type": "structural_tag", "format": answer}


def _clean(message: str) -> str:
    """Drop xgrammar's `[time] /project/cpp/file.cc:123: ` prefix; keep the human part."""
    first, _, rest = message.partition(": ")
    text = rest if first.startswith("[") and rest else message
    return text.strip()
