"""A regex as llama.cpp's GBNF, so `corral bench serve --kinds regex --peer-constraint grammar` holds llama-server
to the same regexes corral is held to (llama-server takes no regex field; it takes a GBNF `grammar`).

The regex is parsed by Python's own `re` parser and written back as one GBNF rule: literals, character classes
(ranges, `\\d`, `\\w`, `\\s`, negation), `.`, groups, alternation and every quantifier (`?`, `*`, `+`, `{m}`,
`{m,}`, `{m,n}`). Anchors are dropped (both servers match the whole answer). Anything else (backreferences,
lookarounds) raises ValueError naming it."""

from __future__ import annotations

from re import _constants as sre  # the `re` module's own opcode names
from re import _parser as sre_parse
from typing import Any

_CATEGORIES = {  # as `re` reads them in str patterns, ASCII ranges (the bench's regexes are ASCII)
    sre.CATEGORY_DIGIT: "0-9",
    sre.CATEGORY_WORD: "a-zA-Z0-9_",
    sre.CATEGORY_SPACE: " \\t\\n\\r\\x0C\\x0B",
}
_NEGATED = {sre.CATEGORY_NOT_DIGIT: sre.CATEGORY_DIGIT, sre.CATEGORY_NOT_WORD: sre.CATEGORY_WORD,
            sre.CATEGORY_NOT_SPACE: sre.CATEGORY_SPACE}
# llama.cpp's grammar parser knows \t \r \n \\ \" \[ \] \- and hex escapes (src/llama-grammar.cpp, parse_char).
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\x0C", "\v": "\\x0B"}


def regex_to_gbnf(pattern: str) -> str:
    """`root ::= ...` matching exactly what `re.fullmatch(pattern, text)` matches."""
    return f"root ::= {_sequence(sre_parse.parse(pattern))}\n"


def _sequence(items: Any) -> str:
    parts: list[str] = []
    literal = ""
    for op, value in items:
        if op is sre.LITERAL:
            literal += chr(value)
            continue
        if literal:
            parts.append(_quoted(literal))
            literal = ""
        if op is not sre.AT:  # ^ and $: the whole answer is matched anyway
            parts.append(_item(op, value))
    if literal:
        parts.append(_quoted(literal))
    return " ".join(parts) if parts else '""'


def _item(op: Any, value: Any) -> str:
    if op is sre.IN:
        return _char_class(value)
    if op is sre.NOT_LITERAL:
        return f"[^{_class_char(chr(value))}]"
    if op is sre.ANY:
        return "[^\\n]"
    if op is sre.SUBPATTERN:
        return f"({_sequence(value[-1])})"
    if op is sre.BRANCH:
        return "(" + " | ".join(_sequence(branch) for branch in value[1]) + ")"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
        low, high, body = value
        return _group(body) + _quantifier(low, high)
    raise ValueError(f"the regex uses {op} (only literals, classes, groups, alternation and quantifiers have a "
                     "GBNF form here)")


def _group(body: Any) -> str:
    """One repeatable unit: a single literal, class or group as it is; anything longer in parentheses."""
    if len(body) == 1 and body[0][0] is not sre.LITERAL:
        inner = _item(*body[0])
        return inner if inner.startswith(("[", "(")) else f"({inner})"
    return f"({_sequence(body)})"


def _quantifier(low: int, high: int) -> str:
    unbounded = high is sre.MAXREPEAT or high == sre.MAXREPEAT
    if (low, unbounded) == (0, True):
        return "*"
    if (low, unbounded) == (1, True):
        return "+"
    if unbounded:
        return f"{{{low},}}"
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _char_class(items: Any) -> str:
    if len(items) == 1 and items[0][0] is sre.CATEGORY and items[0][1] in _NEGATED:  # \D, \W, \S
        return f"[^{_CATEGORIES[_NEGATED[items[0][1]]]}]"
    negate = bool(items) and items[0][0] is sre.NEGATE
    body = ""
    for op, value in items[1:] if negate else items:
        if op is sre.LITERAL:
            body += _class_char(chr(value))
        elif op is sre.RANGE:
            body += f"{_class_char(chr(value[0]))}-{_class_char(chr(value[1]))}"
        elif op is sre.CATEGORY and value in _CATEGORIES:
            body += _CATEGORIES[value]
        else:
            raise ValueError(f"the regex's character class uses {op} {value}, which has no GBNF form here")
    return f"[{'^' if negate else ''}{body}]"


def _class_char(char: str) -> str:
    if char == "^":  # no escape for it: its code
        return "\\x5E"
    return _ESCAPES.get(char) or (f"\\{char}" if char in "]\\-[" else char)


def _quoted(text: str) -> str:
    return '"' + "".join(_ESCAPES.get(c) or (f"\\{c}" if c in '"\\' else c) for c in text) + '"'
