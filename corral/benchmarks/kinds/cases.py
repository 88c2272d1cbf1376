"""The specs `corral bench kinds` measures: regexes, grammars and choices, narrow and wide, each with one
answer it accepts (teacher-forced through every backend, so all backends fill masks along the same path).

Wide means many tokens allowed at most positions (free words, a long list of addresses), where a mask costs
the most; narrow means few (dates, digits). The grammars are the ones the tests and docs use, plus two
classic shapes (arithmetic, CSV) and a JSON-like GBNF."""

from __future__ import annotations

from dataclasses import dataclass

from corral.grammars.spec import GrammarSpec

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "elit", "sed", "do", "tempor", "ut", "labore", "et", "magna",
         "aliqua", "enim", "ad", "minim", "quis", "nos"]  # 2 to 6 letters: the `30 words` regex's words
STATES = [
    "Alabama", "Alaska", "Arizona", "Arkansas", "California", "Colorado", "Connecticut", "Delaware", "Florida",
    "Georgia", "Hawaii", "Idaho", "Illinois", "Indiana", "Iowa", "Kansas", "Kentucky", "Louisiana", "Maine",
    "Maryland", "Massachusetts", "Michigan", "Minnesota", "Mississippi", "Missouri", "Montana", "Nebraska",
    "Nevada", "New Hampshire", "New Jersey", "New Mexico", "New York", "North Carolina", "North Dakota", "Ohio",
    "Oklahoma", "Oregon", "Pennsylvania", "Rhode Island", "South Carolina", "South Dakota", "Tennessee", "Texas",
    "Utah", "Vermont", "Virginia", "Washington", "West Virginia", "Wisconsin", "Wyoming",
]
_STATE = "(" + "|".join(STATES) + ")"
_EMAIL = r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net)"

ARITHMETIC_EBNF = (
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
    'factor ::= number | "(" expr ")"\nnumber ::= [0-9]+\n'
)
JSON_GBNF = (  # llama.cpp's json.gbnf, without free whitespace
    'root ::= object\nvalue ::= object | array | string | number | ("true" | "false" | "null")\n'
    'object ::= "{" (string ": " value (", " string ": " value)*)? "}"\n'
    'array ::= "[" (value (", " value)*)? "]"\n'
    'string ::= "\\"" ([^"\\\\] | "\\\\" ["\\\\/bfnrt])* "\\""\n'
    'number ::= "-"? ([0-9] | [1-9] [0-9]*) ("." [0-9]+)?\n'
)
CSV_LARK = 'start: row ("\\n" row)*\nrow: CELL ("," CELL)*\nCELL: /[a-z0-9 ]{1,12}/\n'
SQL_LARK = (
    'start: "SELECT " cols " FROM " NAME (" WHERE " cond)?\ncols: NAME (", " NAME)*\n'
    'cond: NAME " " OP " " (NAME | NUMBER)\nNAME: /[a-z_][a-z0-9_]{0,15}/\nOP: "=" | "<" | ">"\nNUMBER: /[0-9]{1,6}/\n'
)


@dataclass(frozen=True)
class Case:
    label: str
    spec: GrammarSpec
    text: str  # an answer the spec accepts, fed token by token
    wide: bool  # many tokens allowed at most positions

    @property
    def kind(self) -> str:
        return str(self.spec.kind.value)


CASES: tuple[Case, ...] = (
    # regexes
    Case("date", GrammarSpec.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), "2024-06-30", False),
    Case("iso timestamp", GrammarSpec.regex(
        r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
        r"(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})"), "2024-06-30T12:34:56.789Z", False),
    Case("phone", GrammarSpec.regex(r"\+?[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}"), "+1 (555) 123-4567", False),
    Case("yes/no-digits (e2e)", GrammarSpec.regex(r"(yes|no)-[0-9]{2}"), "yes-42", False),
    Case("short email (e2e)", GrammarSpec.regex(r"[a-z]{1,4}@[a-z]{1,4}\.com"), "abc@defg.com", True),
    Case("email", GrammarSpec.regex(r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"), "jane.doe@example.com", True),
    Case("email list", GrammarSpec.regex(f"{_EMAIL}(, {_EMAIL}){{0,9}}"),
         "jane.doe@example.com, bob_smith@mail.org, x.y.z@corp.net, alice@home.com, q@a.org", True),
    Case("30 words", GrammarSpec.regex(r"([a-z]{2,6} ){30}[a-z]{2,6}"),
         " ".join(WORDS[i % len(WORDS)] for i in range(31)), True),
    Case("sentence", GrammarSpec.regex(r"[A-Z][a-z ,]{10,200}\."),
         "The quick brown fox, as ever, jumps over the lazy dog and runs away.", True),
    Case("50-state list", GrammarSpec.regex(f"{_STATE}(, {_STATE}){{0,4}}"), "Texas, New York, Ohio, Utah", False),
    # grammars
    Case("lark id (e2e)", GrammarSpec.lark('start: "id=" NUM\nNUM: /[0-9]{1,3}/\n'), "id=42", False),
    Case("ebnf yes/no (e2e)", GrammarSpec.ebnf('root ::= answer "-" digit digit\nanswer ::= "yes" | "no"\n'
                                                'digit ::= [0-9]\n'), "no-07", False),
    Case("ebnf arithmetic", GrammarSpec.ebnf(ARITHMETIC_EBNF), "(12+3)*45-6/7+(8*(9-10))", False),
    Case("gbnf json", GrammarSpec.ebnf(JSON_GBNF),
         '{"name": "Tom", "age": 58, "tags": ["a", "b"], "address": {"city": "Lisbon", "zip": null}}', True),
    Case("lark csv", GrammarSpec.lark(CSV_LARK), "name,age,city\ntom berg,58,lisbon\nana,31,porto", True),
    Case("lark sql", GrammarSpec.lark(SQL_LARK), "SELECT name, age FROM people WHERE age > 30", True),
    # choices
    Case("3 choices", GrammarSpec.choice(["yes", "no", "maybe"]), "maybe", False),
    Case("50 choices", GrammarSpec.choice(STATES), "North Carolina", False),
    Case("500 choices", GrammarSpec.choice([f"{WORDS[i % 19]}-{i:03d}" for i in range(500)]), "amet-441", False),
)
