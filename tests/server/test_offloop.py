"""Nothing whose cost grows with a request runs on the event loop: while one request's huge message is being
rendered and tokenized (seconds), a tiny `choice` request on another connection is answered."""

from __future__ import annotations

import random
import threading
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningServer

MODEL = "corral-tiny"
CHOICE: dict[str, Any] = {"structured_outputs": {"choice": ["red", "green", "blue"]}}


def _huge_text(megabytes: float) -> str:
    """Varied words, so tokenizing it costs what a real document does (~4 s for 2 MB on a loaded core)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    pieces: list[str] = []
    size = 0
    while size < megabytes * 1e6:
        pieces.append(f"{rng.choice(words)}{rng.randint(0, 999)}")
        size += len(pieces[-1]) + 1
    return " ".join(pieces)


@pytest.mark.parametrize(
    ("route", "prompt_of", "prompt_param"),
    [
        ("chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}, "messages"),
        ("completions", lambda text: {"prompt": text}, "prompt"),
    ],
)
def test_a_tiny_request_finishes_while_a_huge_one_is_tokenized(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, route: str, prompt_of: Any, prompt_param: str
) -> None:
    frontend: Any = server.frontend
    client: Any = server.client()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 10, "extra_body": CHOICE}
    client.chat.completions.create(**ask)  # compiled and cached: the tiny request costs a few decode steps

    # Learn when the huge request's prompt work has begun (the same method, merely watched).
    started = threading.Event()
    name = "chat_prompt" if route == "chat/completions" else "completion_prompt"
    original = getattr(frontend, name)

    def watched(req: Any) -> Any:
        started.set()
        return original(req)

    monkeypatch.setattr(frontend, name, watched)
    finished: list[str] = []
    huge: dict[str, httpx.Response] = {}

    def send_huge() -> None:
        body = {"model": MODEL, "max_tokens": 5, **prompt_of(_huge_text(2.0))}
        huge["resp"] = httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=300)
        finished.append("huge")

    sender = threading.Thread(target=send_huge)
    sender.start()
    assert started.wait(timeout=120), "the huge request never reached prompt rendering"
    monkeypatch.setattr(frontend, name, original)
    tiny = client.chat.completions.create(**ask)
    finished.append("tiny")
    sender.join(timeout=300)

    assert tiny.choices[0].message.content in ("red", "green", "blue")
    assert finished == ["tiny", "huge"]  # the tiny one did not wait behind the huge one's tokenization
    # The huge one is refused afterwards, naming the field (the model's context is far smaller).
    error = huge["resp"].json()["error"]
    assert huge["resp"].status_code == 400 and error["param"] == prompt_param
    assert error["code"] == "context_length_exceeded"


def test_validation_of_the_answer_runs_off_the_loop(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finished answer is checked against the whole schema on a prepare thread, not the loop's."""
    service: Any = server.service
    threads: list[str] = []
    original = service.check_output

    def watched(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(service, "check_output", watched)
    client: Any = server.client()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=30, response_format=fmt
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=30, response_format=fmt, stream=True
    )
    chunks = list(stream)
    # Both answers finished and were checked. corral-tiny's random weights may run one to max_tokens ("length")
    # when the closing search's deadline passes on a loaded machine; it is checked all the same.
    finishes = (resp.choices[0].finish_reason, chunks[-1].choices[0].finish_reason)
    assert all(reason in ("stop", "length") for reason in finishes), finishes
    assert len(threads) == 2 and all(name.startswith("corral-prepare") for name in threads), threads


def test_openai_client_still_sees_typed_errors_from_the_prepare_threads(server: RunningServer) -> None:
    """A 400 raised while preparing off the loop still reaches the client as OpenAI's error, naming the field."""
    client: Any = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a"}],
            extra_body={"structured_outputs": {"choice": []}},
        )
    assert caught.value.body["param"].startswith("structured_outputs")  # type: ignore[index]
