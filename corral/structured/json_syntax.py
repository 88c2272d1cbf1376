"""How far a piece of JSON text is from a complete value, by its syntax alone: an incremental scanner the
closing search (corral/structured/closing.py) uses to rank its moves. A schema may need more (required properties,
minimum lengths): the grammar says what is allowed, this only says which allowed move looks closest."""

from __future__ import annotations

from dataclasses import dataclass, field

_LITERALS = ("true", "false", "null")
_OPENERS = '{["'
_STILL_NEEDED = {"value": 1, "key": 4, "colon": 2}  # characters at least, by what is expected next
NOT_STARTED = 1_000  # distance of text with no JSON in it yet: anything that starts a value is closer


@dataclass
class JsonScan:
    """Where the text fed so far stands. Text before the first `{`, `[` or `"` (a tool-call tag) is skipped."""

    started: bool = False
    stack: list[str] = field(default_factory=list)  # open containers, innermost last
    in_string: bool = False
    escaped: bool = False
    is_key: bool = False  # the open string is a property name
    expect: str = "value"  # value | key | colon | after | open (just after `{` or `[`: a close is fine)
    word: str = ""  # a number or literal being written
    key: str = ""  # the property name being written, or the last one written
    last: str = ""  # the last character fed

    def copy(self) -> JsonScan:
        # Field by field: the closing search copies a scan per candidate token, and dataclasses.replace, which
        # re-runs __init__ through its field machinery, took most of each copy's time (measured:
        # docs/measured-choices.md#closing-answers).
        other = JsonScan.__new__(JsonScan)
        other.__dict__.update(self.__dict__)
        other.stack = list(self.stack)
        return other

    def feed(self, text: str) -> JsonScan:
        for ch in text:
            if not self.started:
                if ch not in _OPENERS:
                    continue
                self.started = True
            self._char(ch)
            self.last = ch
        return self

    def _char(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string, self.expect = False, "colon" if self.is_key else "after"
                return
            if self.is_key:
                self.key += ch
            return
        if self.word and (ch.isalnum() or ch in "+-."):
            self.word += ch
            return
        self.word = ""
        if ch.isspace():
            return
        if ch == '"':
            self.in_string = True
            self.is_key = self.expect in ("key", "open") and self.stack[-1:] == ["{"]
            if self.is_key:
                self.key = ""
        elif ch in "{[":
            self.stack.append(ch)
            self.expect = "open"
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
            self.expect = "after"
        elif ch == ":":
            self.expect = "value"
        elif ch == ",":
            self.expect = "key" if self.stack[-1:] == ["{"] else "value"
        else:  # a number or a literal begins
            self.word, self.expect = ch, "after"

    def closers(self) -> str:
        return "".join("}" if opener == "{" else "]" for opener in reversed(self.stack))

    def closing(self) -> str:
        """What the syntax alone says would end the value: close an open string, finish a number or literal,
        close the open containers. It stops where a schema must decide (a property name's value, a value)."""
        if not self.started:
            return ""
        if self.in_string:
            return '"' if self.is_key else '"' + self.closers()
        if self.word:
            literal = next((w for w in _LITERALS if w.startswith(self.word)), None)
            if literal is not None:
                return literal[len(self.word) :] + self.closers()
            return ("1" if self.word[-1] in "+-.eE" else "") + self.closers()
        return self.closers() if self.expect in ("after", "open") else ""

    def distance(self) -> int:
        """Characters, roughly, to a complete value: the closing plus what the syntax knows must come before it
        (a value after `:`, a name and a value after `,` in an object, the rest of a property)."""
        if not self.started:
            return NOT_STARTED
        if self.in_string:
            return len(self.stack) + (4 if self.is_key else 1)  # a name also needs `:` and a value
        if self.word:
            return len(self.closing())
        return len(self.stack) + _STILL_NEEDED.get(self.expect, 0)


def json_closing(text: str) -> str:
    return JsonScan().feed(text).closing()
