from __future__ import annotations

import json
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_answer_conforms(client: Any) -> None:
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "a person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        max_tokens=200,
        seed=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and value["age"] >= 0
    extra = resp.model_extra or {}
    assert extra["grammar"]["schema_valid"] is True
