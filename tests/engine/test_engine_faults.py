"""Faults on the engine thread stay with the request that caused them, and every request gets a final answer:
a bad admission (an out-of-range seed), a grammar engine raising for one row, a hung step failed from the
watchdog thread, and the loop stopping with requests in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import RunningServer
from test_revision_and_watchdog import _DeadEndMatcher, _PlainBackend, make_engine, new_seq

from corral.server.engine import Engine, EngineLoop, SeqOutput
from corral.server.engine.model_runner import DecodedStep
from corral.server.engine.step_watchdog import TOKENS_PER_DEADLINE, StepWatchdog, step_deadline
from corral.server.models import LoadedModel, load_model

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


def _final(outputs: list[SeqOutput], timeout: float = 60.0) -> SeqOutput:
    deadline = time.monotonic() + timeout
    while True:
        done = [o for o in outputs if o.finished]
        if done:
            return done[0]
        if time.monotonic() >= deadline:
            raise AssertionError("the request got no final answer")
        time.sleep(0.01)


def _running_loop(engine: Engine) -> EngineLoop:
    loop = EngineLoop(engine)
    loop.start()
    return loop


def test_a_bad_seed_fails_only_its_own_request(loaded: LoadedModel) -> None:
    loop = _running_loop(make_engine(loaded))
    try:
        bad, bad_out = new_seq(loaded, "bad-seed", max_tokens=4, seed=2**70)  # past what torch can seed
        good, good_out = new_seq(loaded, "good", max_tokens=4)
        loop.submit(good)
        loop.submit(bad)
        assert _final(bad_out).finish_reason == "error" and bad.error and "could not start" in bad.error
        assert _final(good_out).finish_reason in ("stop", "length")
    finally:
        loop.stop()


class _Broken(_DeadEndMatcher):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise RuntimeError("matcher state corrupted")


class _BatchRaises(_PlainBackend):
    """Like an engine whose batched fill raises when any one of its matchers is broken."""

    name = "batch-raises"

    def fill_bitmasks(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if any(isinstance(m, _Broken) for m in matchers):
            raise RuntimeError("one of the batch failed")
        super().fill_bitmasks(matchers, bitmask, rows)


def test_a_fill_failure_fails_only_the_row_that_failed(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    a, b, c = (loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("A", "B", "C"))
    backend = _BatchRaises()
    broken, broken_out = new_seq(loaded, "broken", max_tokens=10)
    healthy, healthy_out = new_seq(loaded, "healthy", max_tokens=10, logit_bias={b: 50.0})
    plain, plain_out = new_seq(loaded, "unconstrained", max_tokens=3)
    broken.matcher, broken.backend = _Broken(a, b, c), backend  # type: ignore[assignment]
    healthy.matcher, healthy.backend = _DeadEndMatcher(a, b, c), backend  # type: ignore[assignment]
    for seq in (broken, healthy, plain):
        engine.add_request(seq)
    for _ in range(20):
        if all(s.is_finished for s in (broken, healthy, plain)):
            break
        engine.step()  # raises nothing: the failure is the broken row's alone
    assert _final(broken_out, 0).finish_reason == "error"
    assert broken.error and "matcher state corrupted" in broken.error
    assert _final(healthy_out, 0).finish_reason == "stop" and healthy.output_ids == [b, b, c]
    assert _final(plain_out, 0).finish_reason in ("stop", "length")


def _blocking_forward(engine: Engine) -> tuple[threading.Event, threading.Event]:
    """Make the next forward hang until released; returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    original: Callable[..., DecodedStep] = engine.runner.decode

    def decode(rows: Any, dense: bool = False) -> DecodedStep:
        entered.set()
        release.wait(60)
        return original(rows, dense)

    engine.runner.decode = decode  # type: ignore[method-assign]
    return entered, release


def test_a_hung_step_is_answered_from_outside_without_touching_the_scheduler(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    entered, release = _blocking_forward(engine)
    loop = _running_loop(engine)
    try:
        stuck, stuck_out = new_seq(loaded, "stuck", max_tokens=4)
        loop.submit(stuck)
        assert entered.wait(60)
        queued, queued_out = new_seq(loaded, "queued", max_tokens=4)
        loop.submit(queued)  # in the inbox: the stuck engine never admits it
        engine.abandon_all("an engine step ran longer than 1 s", "hung_step")  # the watchdog thread's call
        assert _final(stuck_out, 0).finish_reason == "hung_step" and stuck.error
        assert _final(queued_out, 0).finish_reason == "hung_step"
        assert engine.scheduler.running == [stuck]  # still the stuck step's; this thread left it alone
        release.set()  # the step returns after all: the engine drops what was answered, answers nothing twice
        deadline = time.monotonic() + 60
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.scheduler.has_work()
        assert [o.finished for o in stuck_out].count(True) == 1 and len(queued_out) == 1
    finally:
        release.set()
        loop.stop()


def test_stopping_the_loop_answers_every_request_in_flight(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    loop = _running_loop(engine)
    running, running_out = new_seq(loaded, "running", max_tokens=400, ignore_eos=True)
    loop.submit(running)
    deadline = time.monotonic() + 60
    while not running.output_ids and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    final = _final(running_out, 0)
    assert final.finish_reason == "error" and running.error == "the server stopped before this request finished"
    late, late_out = new_seq(loaded, "late", max_tokens=4)
    engine.add_request(late)  # submitted as the loop stopped: never admitted
    engine.fail_all("the server stopped before this request finished")
    assert _final(late_out, 0).finish_reason == "error"


def test_a_stuck_loop_still_answers_when_stopped(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(loaded)
    entered, release = _blocking_forward(engine)
    loop = _running_loop(engine)
    seq, outputs = new_seq(loaded, "stuck-at-stop", max_tokens=4)
    loop.submit(seq)
    assert entered.wait(60)
    monkeypatch.setattr(loop._thread, "join", lambda timeout=None: None)  # as if the 10 s join ran out
    loop.stop()
    assert _final(outputs, 0).finish_reason == "error"
    release.set()


# -- over HTTP ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**80])
def test_a_seed_outside_int64_is_a_400_naming_seed(server: RunningServer, seed: int) -> None:
    body = {"model": "corral-tiny", "messages": CHAT, "max_tokens": 2, "seed": seed}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "seed"


def test_the_int64_extremes_are_served(server: RunningServer, client: Any) -> None:
    for seed in (2**63 - 1, -(2**63)):
        resp = client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=2, seed=seed, n=2)
        assert [c.finish_reason for c in resp.choices] != [] and all(
            c.finish_reason in ("stop", "length") for c in resp.choices
        )


def test_a_streamed_request_over_the_limit_is_a_real_429(
    server: RunningServer, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service: Any = server.service
    monkeypatch.setattr(service.settings, "max_queue", 1)
    blocker = threading.Thread(
        target=lambda: client.chat.completions.create(
            model="corral-tiny", messages=CHAT, max_tokens=300, extra_body={"ignore_eos": True}
        )
    )
    blocker.start()
    deadline = time.monotonic() + 60
    while service.in_flight < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    body = {"model": "corral-tiny", "messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as resp:
        status, payload = resp.status_code, resp.read()
    assert status == 429, payload  # before the fix: 200, then the error inside the event stream
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=4, stream=True)
    blocker.join(timeout=120)
    with client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=4, stream=True) as stream:
        assert [c for c in stream][-1].choices[0].finish_reason in ("stop", "length")


def test_a_long_prompt_step_gets_a_longer_deadline_than_a_decode_step() -> None:
    # A prompt is computed in one step: 1,555 tokens of Qwen2.5 1.5B took over 60 s on 2 busy cores, and the
    # watchdog ended a server that was only slow. The deadline grows with the tokens, never below the base.
    assert step_deadline(60.0, 1) == 60.0 and step_deadline(60.0, TOKENS_PER_DEADLINE) == 60.0
    assert 180 < step_deadline(60.0, 1555) < 185  # ~8.5 tokens/s at the least
    assert step_deadline(60.0, 4 * TOKENS_PER_DEADLINE) == 240.0


class _StepOf:
    """What the watchdog reads of the engine and its loop: the step's start and its tokens."""

    def __init__(self, tokens: int) -> None:
        self.step_tokens = tokens
        self.step_started: float | None = time.monotonic()
        self.abandoned: list[str] = []
        self.scheduler = self

    def abandon_all(self, message: str, reason: str) -> None:
        self.abandoned.append(message)


@pytest.mark.parametrize(("tokens", "trips"), [(1, True), (8 * TOKENS_PER_DEADLINE, False)])
def test_the_watchdog_waits_longer_for_a_step_that_computes_a_long_prompt(tokens: int, trips: bool) -> None:
    step = _StepOf(tokens)
    dog = StepWatchdog(step, step, 0.2, exit_on_hang=False)  # type: ignore[arg-type]
    dog.start()
    try:
        time.sleep(0.8)  # past the base deadline, within 8 deadlines
    finally:
        dog.stop()
    assert bool(step.abandoned) is trips and dog.healthy is not trips
