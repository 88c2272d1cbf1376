"""What a quality task is: its answer's shape, the fields that are scored, and the prompts a user would write for
it (a completion prompt for a base model, chat messages for a chat template). The suites are in suites.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["json", "choice", "tool"]
# How a field's value is compared with the truth (scoring.py): "text" case- and space-insensitive, "label"
# case-insensitive, "number" numerically, "digits" by its digits alone (a phone number however it is spaced),
# "noun" as text without a plural "s", "records" a multiset of records compared key by key (`Field.keys`),
# "items" such a multiset of {name (noun), qty (number)} order lines.
Compare = Literal["text", "label", "number", "digits", "noun", "records", "items"]


@dataclass(frozen=True)
class Field:
    """A scored field. `name` is a key of the answer, or a dotted path to a leaf of nested objects
    ("address.city"), so that a nested answer is scored leaf by leaf; `keys` says how a "records" field compares
    each record's keys (the keys not named are not compared)."""

    name: str
    compare: Compare = "text"
    keys: tuple[Field, ...] = ()


@dataclass(frozen=True)
class Item:
    """One question: `text` is what the prompt embeds (a sentence, a review, a request, a word problem) and
    `truth` the answer a careful person writes (an object, a label, or {"name", "arguments"} of a call)."""

    item_id: str
    text: str
    truth: Any


@dataclass(frozen=True)
class Task:
    """A suite of items with one instruction and one answer shape. `schema` is the answer's JSON Schema (json:
    the object; choice: a string enum of `labels`); a tool task's shape is its `tools`. `example` is the one
    worked example the prompts show when shots=1; it is never one of the items."""

    name: str
    kind: Kind
    description: str
    instruction: str
    input_label: str
    output_label: str
    fields: tuple[Field, ...]
    example: Item
    items: tuple[Item, ...]
    schema: dict[str, Any] = field(default_factory=dict)
    labels: tuple[str, ...] = ()
    tools: tuple[dict[str, Any], ...] = ()

    def scored_fields(self, item: Item) -> tuple[Field, ...]:
        """The fields an item is judged on: all of them, except a call's arguments, which are the truth's own."""
        if self.kind != "tool":
            return self.fields
        keys = {"name", *item.truth["arguments"]}
        return tuple(f for f in self.fields if f.name in keys)

    def answer_text(self, item: Item) -> str:
        """The item's answer as the example shows it: compact JSON in the schema's key order, or the label."""
        return item.truth if self.kind == "choice" else json.dumps(item.truth, ensure_ascii=False)

    def question(self, item: Item) -> str:
        return f"{self.instruction}\n\n{self.input_label}: {item.text}"

    def completion_prompt(self, item: Item, shots: int) -> str:
        """For a base model: the instruction, the worked example when shots=1, then the item, ending at the
        label its answer follows ("JSON:"), as one writes a few-shot prompt."""
        parts = [self.instruction, ""]
        if shots:
            parts += [f"{self.input_label}: {self.example.text}",
                      f"{self.output_label}: {self.answer_text(self.example)}", ""]
        parts += [f"{self.input_label}: {item.text}", f"{self.output_label}:"]
        return "\n".join(parts)

    def chat_messages(self, item: Item, shots: int) -> list[dict[str, Any]]:
        """For a chat template: one user turn, after the worked example as a user/assistant pair when shots=1.
        A tool task is always zero-shot: the server's tool rendering already shows the call format."""
        messages: list[dict[str, Any]] = []
        if shots and self.kind != "tool":
            messages += [{"role": "user", "content": self.question(self.example)},
                         {"role": "assistant", "content": self.answer_text(self.example)}]
        messages.append({"role": "user", "content": self.question(item) if self.kind != "tool" else item.text})
        return messages

    def with_items(self, count: int | None) -> Task:
        """The first `count` items (all when None)."""
        if count is None:
            return self
        return Task(self.name, self.kind, self.description, self.instruction, self.input_label, self.output_label,
                    self.fields, self.example, self.items[:count], self.schema, self.labels, self.tools)


def closed_object(properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required: what a user's pydantic model sends."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
