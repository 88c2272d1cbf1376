"""Every request of the hostile corpus (hostile_corpus.py) against a real server over raw HTTP: no 5xx, every
4xx in OpenAI's error shape, no fail-open (an answer that ends `stop`/`tool_calls` keeps its constraint), and
after each one an ordinary request succeeds on the same keep-alive connection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import RunningServer, serving
from hostile_corpus import CORPUS, Hostile

from corral.benchmarks.fuzz.probe import connection_of, exchange

ORDINARY = {"model": "corral-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "structured_outputs": {"choice": ["fine", "good"]}}


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[RunningServer]:
    # A short compile deadline keeps the compile bombs of the corpus cheap; it changes no verdict. A hung
    # step fails the cases after it instead of ending the test process.
    with serving(compile_timeout_s=3.0, exit_on_hung_step=False) as running:
        yield running


def _param(case: Hostile) -> object:
    if case.known_failure is None:
        return pytest.param(case, id=case.name)
    return pytest.param(case, id=case.name, marks=pytest.mark.xfail(reason=case.known_failure, strict=True))


@pytest.mark.parametrize("case", [_param(c) for c in CORPUS])
def test_hostile_request(hostile_server: RunningServer, case: Hostile) -> None:
    with httpx.Client(base_url=hostile_server.base_url, timeout=60,
                      limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
        hostile = exchange(client, case.method, case.path, case.body, case.headers, case.request)
        assert not hostile.problems, hostile.problems
        resp = client.post("/v1/chat/completions", json=ORDINARY)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] in ("fine", "good")
        assert connection_of(resp) == hostile.connection, "the hostile request's connection was not kept alive"


def test_compile_bombs_do_not_hold_up_cached_grammars(hostile_server: RunningServer) -> None:
    """Two compile bombs occupy both compile threads for their whole deadline; a request whose grammar is
    already cached is answered meanwhile instead of queueing behind them."""
    url = f"{hostile_server.base_url}/v1/chat/completions"
    assert httpx.post(url, json=ORDINARY, timeout=60).status_code == 200  # its grammar is now cached
    bomb_codes: list[str] = []

    def bomb(tag: str) -> None:
        regex = tag + "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))
        body = {**ORDINARY, "structured_outputs": {"regex": regex}}
        bomb_codes.append(httpx.post(url, json=body, timeout=60).json()["error"]["code"])

    bombs = [threading.Thread(target=bomb, args=(f"bomb{i}-{time.monotonic()}",)) for i in range(2)]
    for thread in bombs:
        thread.start()
    time.sleep(0.5)  # let both reach the compile threads (ordering only; nothing below is timed)
    resp = httpx.post(url, json=ORDINARY, timeout=60)
    still_compiling = sum(thread.is_alive() for thread in bombs)
    for thread in bombs:
        thread.join(timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] in ("fine", "good")
    assert still_compiling == 2, "the cached request waited for a compile bomb to finish"
    assert bomb_codes == ["grammar_compile_timeout"] * 2
