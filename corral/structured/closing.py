"""Closing an answer early: a short token sequence that takes a matcher from where it stands to a state
where the answer may end, found by searching the grammar itself.

Used when the token budget runs low (or the model runs away) so that a cut answer is still an answer in
shape rather than half a value. Neither engine exposes "the shortest completion", so this is a bounded
depth-first search over the matcher (accept, look at the mask, roll back). Where the grammar allows many
tokens it tries a small set of closing texts (`"`, `}`, `]` and their combinations, the smallest values
`1`, `""`, `[]`, `{}`, `null`, separators); where it leaves only a few (an enum, a property name, a `,` the
schema requires) it tries those; what the grammar dictates it takes as one move. Moves are ranked by how near
the JSON syntax says they bring the answer to a complete value. Everything it appends was accepted by the
matcher, so the result is in the grammar (and, under `auto`'s contract guard, in the full schema) by
construction.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from corral.grammar_engines.bitmask import allowed_counts, allowed_ids
from corral.grammar_engines.protocol import Matcher, TokenizerSpec, allocate_bitmask
from corral.grammars.json_walk import objects_in
from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.structured.json_syntax import JsonScan

# Texts worth trying while the grammar allows many tokens: closers first, then minimal values and separators.
CLOSING_TEXTS = (
    '"', "}", "]", '"}', '"]', "}}", "]}", "}]", "]]", '"}}', '"]}', '"}]', "}}}", "]}}", "}]}", '"}]}',
    "1", "0", "2", "3", "4", "5", "6", "7", "8", "9", '""', "[]", "{}", "null", "true", "false",
    ":", ",", '":', '",', "{", "[", "-", ".", "e", "a", "@", "T", "Z", "/", "_",
)
CLOSERS = '"}])'
# A state that allows at most this many tokens has all of them tried (they are what the grammar insists on).
FEW = 64
BRANCH = 6  # moves tried from one state at most
DEFAULT_NODES = 256  # mask fills per search at most
# A search holds up the engine step of every row in the batch: past this it gives up (the slowest measured, under
# load, took 0.8 s without this bound: docs/measured-choices.md#closing-answers).
DEFAULT_DEADLINE_S = 0.05


def _rank(text: str) -> tuple[int, int]:
    """Tie-break: more closing characters first, then longer (more progress per token, e.g. a whole property
    name rather than its first letter)."""
    return (-sum(text.count(c) for c in CLOSERS), -len(text))


class Piece(NamedTuple):
    """A token's text and what the ranking reads of it, worked out once per tokenizer."""

    text: str
    bare: str  # without surrounding whitespace
    spaces: int  # leading whitespace characters
    rank: tuple[int, int]  # `_rank`

    @classmethod
    def of(cls, text: str) -> Piece:
        return cls(text, text.strip(), len(text) - len(text.lstrip()), _rank(text))


@dataclass
class ClosingVocabulary:
    """What the search needs of a tokenizer: the ids of single-token closing texts, and each token's text."""

    tokenizer: TokenizerSpec
    closing_ids: list[int]  # ranked best first
    # Decoded on first use and kept for the tokenizer's life: searches near every answer's end revisit the same
    # few hundred tokens, each a decode through the tokenizer otherwise (docs/measured-choices.md#closing-answers).
    pieces: dict[int, Piece] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tokenizer: TokenizerSpec) -> ClosingVocabulary:
        hf = tokenizer.hf_tokenizer
        found: dict[int, str] = {}
        # Each also after a space: grammars with free whitespace may want one (and a tokenizer may only have
        # the spaced piece, as Llama 3's ` "`).
        for text in (*CLOSING_TEXTS, *(" " + t for t in CLOSING_TEXTS), " ", "\n"):
            ids = hf.encode(text, add_special_tokens=False)
            if len(ids) == 1 and ids[0] < tokenizer.vocab_size and ids[0] not in tokenizer.stop_token_ids:
                found.setdefault(int(ids[0]), text)
        ranked = sorted(found, key=lambda i: _rank(found[i]))
        return cls(tokenizer, ranked)

    def text(self, token: int) -> str:
        return self.piece(token).text

    def piece(self, token: int) -> Piece:
        piece = self.pieces.get(token)
        if piece is None:
            piece = self.pieces[token] = Piece.of(str(self.tokenizer.hf_tokenizer.decode([token])))
        return piece


def _lengthens(before: JsonScan, after: JsonScan) -> bool:
    """The move only added to the number, literal or string being written."""
    return (before.in_string and after.in_string) or (bool(before.word) and bool(after.word))


class _Search:
    def __init__(
        self,
        matcher: Matcher,
        vocab: ClosingVocabulary,
        nodes: int,
        prefix: str,
        keys: frozenset[str],
        deadline_s: float = DEFAULT_DEADLINE_S,
        examples: tuple[str, ...] = (),
    ) -> None:
        self.matcher = matcher
        self.deadline = time.perf_counter() + deadline_s
        self.keys = keys  # property names some schema requires: the names worth writing when one must be
        # Texts the schema's patterns match (corral/structured/pattern_texts.py), tokenized: tried inside a string
        # that
        # may not end yet, where the mask says nothing of what is missing. At most one per string.
        hf = vocab.tokenizer.hf_tokenizer
        self.examples = [list(hf.encode(text, add_special_tokens=False)) for text in examples]
        self.example_at: list[int] = []  # len(self.scans) right after each example taken on this path
        self.vocab = vocab
        self.nodes = nodes
        self.stops = frozenset(vocab.tokenizer.stop_token_ids)
        self.bitmask = allocate_bitmask(1, vocab.tokenizer.vocab_size)
        self.scans = [JsonScan().feed(prefix)]  # the syntax's view after the prefix and each move taken
        self.streaks = [0]  # moves in a row that only lengthened a number, literal or string

    def _text(self, token: int) -> str:
        return self.vocab.text(token)

    def _push(self, tokens: Sequence[int]) -> None:
        before = self.scans[-1]
        after = before.copy().feed("".join(self._text(t) for t in tokens))
        self.scans.append(after)
        self.streaks.append(self.streaks[-1] + 1 if _lengthens(before, after) else 0)

    def _pop(self) -> None:
        self.scans.pop()
        self.streaks.pop()

    def candidates(self) -> list[int]:
        """The moves from the matcher's current state, best first: nearest to a complete value by the JSON
        syntax (corral/structured/json_syntax.py), then by `_rank`; at most BRANCH of them."""
        self.nodes = self.nodes - 1 if time.perf_counter() < self.deadline else 0
        self.bitmask.fill_(0)
        self.matcher.fill_bitmask(self.bitmask, 0)
        words = self.bitmask.numpy()[0]
        if allowed_counts(self.bitmask, [0])[0] <= FEW:
            ids = [int(t) for t in allowed_ids(words, self.vocab.tokenizer.vocab_size) if int(t) not in self.stops]
            ids = [t for t in ids if "\ufffd" not in self._text(t)]
        else:
            ids = [t for t in self.vocab.closing_ids if (int(words[t >> 5]) >> (t & 31)) & 1]
        scan, streak = self.scans[-1], self.streaks[-1]

        piece_of = self.vocab.piece

        def key(token: int) -> tuple[int, ...]:
            text, bare, spaces, rank = piece_of(token)
            after = scan.copy().feed(text)
            # Writing a property name: one a schema requires first (an optional one only lengthens the answer).
            naming = after.is_key and (after.in_string or after.expect == "colon") and after.key != scan.key
            unwanted = naming and not any(k.startswith(after.key) for k in self.keys)
            # Lengthening a value never brings the end nearer by the syntax's count, so each such move in a
            # row costs one more: a `,` the schema requires wins over a number growing digit by digit.
            cost = after.distance() + (streak + 1 if _lengthens(scan, after) else 0)
            if scan.in_string:
                # A string that may not end yet (a format, a pattern: `"` was not allowed here) alternates
                # letters or digits with punctuation, shortest first: `a:`, `a@a.a`, rather than `aaaa...`.
                alternate = bare.isalnum() != scan.last.isalnum()
                # `"` before ` "`: inside a string a space is text the model did not write.
                return (cost, int(unwanted), 0 if alternate else 1, len(bare), spaces)
            # Spaces only where the grammar requires one; a minus sign last (`: 1` reads better than `: -1`).
            style = 2 if "-" in bare else 1 if not bare else 0
            if after.in_string and not bare.endswith('"') and len(bare) > 1:
                style = 3  # `"}` opens a string with `}` in it: `"` alone, then what the string needs
            elif scan.started and text[len(text.rstrip()) :] not in ("", " "):
                style = max(style, 1)  # `[]\n` after `[]`: a gap only free whitespace allows, and none was written
            # Where a space is optional (GrammarSpec.leading_whitespace), `{` before ` {`: `{"` then follows as
            # one token, where ` {` would need `"` on its own, one token more.
            # Before an object starts, its longest opening first (`{"` before `{`): the syntax counts `{` nearer
            # its end, but a schema's required keys follow it anyway, and `"` then costs a token of its own.
            opening = -len(bare) if not scan.started and bare.startswith("{") else 0
            # Whitespace alone last, whatever the syntax's count: where the grammar allows free whitespace
            # (GrammarSpec.whitespace `free`) it clears a number being written, which the count reads as nearer
            # the end, and the search spent the room on a gap's worth of spaces before each `,`.
            idle = not bare
            return (opening, int(idle), cost, int(unwanted), style, spaces, *rank)

        return sorted(ids, key=key)[:BRANCH]

    def _string_held(self, moves: list[list[int]]) -> bool:
        """Inside a string whose end the grammar withholds (no move starts with `"`): a pattern not yet met."""
        return self.scans[-1].in_string and not any(self._text(m[0]).lstrip().startswith('"') for m in moves)

    def _example_wanted(self, moves: list[list[int]]) -> bool:
        """A held string (`_string_held`) with no example taken in it yet."""
        if not self.examples or not self._string_held(moves):
            return False
        return not self.example_at or any(not scan.in_string for scan in self.scans[self.example_at[-1] - 1 :])

    def run(self, limit: int) -> list[int] | None:
        """A completion of at most `limit` tokens, or None; the matcher is left as it was."""
        if self.matcher.can_terminate():
            return []
        if limit <= 0 or self.nodes <= 0:
            return None
        forced = [t for t in self.matcher.forced_tokens() if t not in self.stops][:limit]
        moves = [forced] if forced else [[t] for t in self.candidates()]
        if self.example_at and self.example_at[-1] == len(self.scans) and self._string_held(moves):
            return None  # the example just written did not let the string end: not this pattern
        examples = self.examples if not forced and self._example_wanted(moves) else []
        for index, move in enumerate([*examples, *moves]):
            if self.nodes <= 0:
                return None
            taken = 0
            for token in move:
                if not self.matcher.accept_token(token):
                    break
                taken += 1
            if not taken:
                continue
            example = index < len(examples)  # by position: a one-token example may equal a candidate move
            self._push(move[:taken])
            if example:
                self.example_at.append(len(self.scans))
            rest = self.run(limit - taken)
            self.matcher.rollback(taken)
            self._pop()
            if example:
                self.example_at.pop()
            if rest is not None:
                return [*move[:taken], *rest]
        return None


def shortest_completion(
    matcher: Matcher,
    vocab: ClosingVocabulary,
    limit: int,
    *,
    prefix: str = "",
    keys: frozenset[str] = frozenset(),
    nodes: int = DEFAULT_NODES,
    deadline_s: float = DEFAULT_DEADLINE_S,
    examples: tuple[str, ...] = (),
) -> list[int] | None:
    """Tokens (at most `limit`) after which the answer may end, tried closers-first; None if none was found
    within `nodes` mask fills or `deadline_s` seconds. The matcher ends where it started.

    Depth-first, best move first, so the first path tried is usually the one taken (one mask fill per
    token); at most `BRANCH` moves are tried from any state, so a dead path costs little."""
    with torch.inference_mode():
        return _Search(matcher, vocab, nodes, prefix, keys, deadline_s, examples).run(limit)


@functools.lru_cache(maxsize=512)
def required_keys(spec: GrammarSpec) -> frozenset[str]:
    """Every property name some `required` list in the spec's schemas names (tool-call specs included).
    Cached like compiled grammars: a schema sent again costs nothing."""
    if not spec.embeds_schema or spec.kind is GrammarKind.JSON_OBJECT:
        return frozenset()  # a bare JSON object requires nothing (its spec source is no schema)
    names: set[str] = set()
    for node in objects_in(json.loads(spec.source)):
        required = node.get("required")
        if isinstance(required, list):
            names.update(name for name in required if isinstance(name, str))
    return frozenset(names)
