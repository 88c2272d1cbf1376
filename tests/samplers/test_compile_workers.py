"""Compile workers: an out-of-memory compile has its own error, a spare worker stands ready while a killed
one reboots, a worker that cannot be spawned is reported instead of retried forever, and a request never
waits without a deadline for a compile thread."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import RunningServer

from corral.grammar_engines import sandbox as sandbox_module
from corral.grammar_engines import worker_handles
from corral.grammar_engines.compilation import GrammarCache, GrammarRejected
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammar_engines.sandbox import CompileSandbox, SandboxUnavailable
from corral.grammars.spec import GrammarSpec

# 20,000 options: xgrammar needs far more than 64 MB for it (and > 30 s without a cap).
HUNGRY = GrammarSpec.choice([f"option number {i} " + "x" * (i % 97) for i in range(20000)])
ORDINARY = GrammarSpec.regex(r"[0-9]{3}-[a-z]+")


@pytest.fixture(scope="module")
def xgrammar_only(tokenizer: TokenizerSpec) -> BackendSet:
    backends = BackendSet(tokenizer, ["xgrammar"])
    backends.warm_up()
    return backends


@pytest.fixture(scope="module")
def capped(tokenizer: TokenizerSpec) -> Iterator[CompileSandbox]:
    box = CompileSandbox(tokenizer, ["xgrammar"], workers=1, spares=1, memory_limit_mb=64)
    box.wait_ready()
    yield box
    box.close()


def test_an_out_of_memory_compile_has_its_own_error_and_a_spare_stands_ready(
    xgrammar_only: BackendSet, capped: CompileSandbox
) -> None:
    cache = GrammarCache(xgrammar_only, compile_timeout_s=30, sandbox=capped)
    assert len(capped.pids(ready_only=True)) == 2  # the compiling worker and its spare
    with pytest.raises(GrammarRejected) as refused:
        cache.compile(HUNGRY, "xgrammar")
    assert refused.value.out_of_memory and not refused.value.timed_out
    assert "more memory than a compile worker may use" in str(refused.value) and "64 MB" in str(refused.value)
    # The worker that ran out was replaced; its successor is still booting, yet a ready worker is free.
    assert capped.stats.crashed == 1 and len(capped.pids(ready_only=True)) == 1
    assert cache.compile(ORDINARY, "xgrammar").compiled.spec == ORDINARY
    with pytest.raises(GrammarRejected) as again:  # cached, like a timeout, for timeout_retry_s
        cache.compile(HUNGRY, "xgrammar")
    assert again.value.out_of_memory and capped.stats.crashed == 1
    capped.wait_ready()  # the replacement has booted: no spawn of this pool runs on into the next test


def test_a_worker_that_cannot_spawn_is_reported_not_retried_forever(
    tokenizer: TokenizerSpec, xgrammar_only: BackendSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[int] = []

    def no_process(*_: Any, **__: Any) -> Any:
        attempts.append(1)
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(worker_handles, "Worker", no_process)
    box = CompileSandbox(tokenizer, ["xgrammar"], workers=1)
    cache = GrammarCache(xgrammar_only, compile_timeout_s=30, sandbox=box)
    results: list[Any] = []
    compiling = threading.Thread(target=lambda: results.append(cache.compile(ORDINARY, "xgrammar")))
    compiling.start()
    compiling.join(timeout=60)
    assert not compiling.is_alive(), "the compile waited forever for a worker that cannot start"
    assert results and results[0].backend == "xgrammar"  # compiled in-process instead
    tried = len(attempts)
    assert tried == 1
    with pytest.raises(SandboxUnavailable, match=r"worker could be started: .*Resource temporarily unavailable"):
        box.compile(xgrammar_only.get("xgrammar"), GrammarSpec.regex("[a-z]"), sandbox_module.Budget(5))
    assert len(attempts) == tried  # within the back-off: no new spawn, no loop
    box.close(final=True)


def test_a_request_waits_for_a_compile_thread_within_a_deadline(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    service: Any = server.service
    release = threading.Event()
    flooded = ThreadPoolExecutor(1, thread_name_prefix="test-flooded")
    flooded.submit(release.wait, 120)  # every compile thread busy (as under a flood of slow compiles)
    monkeypatch.setattr(service.compiler, "_pool", flooded)
    monkeypatch.setattr(service.compiler, "queue_wait_s", 0.5)
    try:
        body = {
            "model": "corral-tiny",
            "messages": [{"role": "user", "content": "x"}],
            "structured_outputs": {"regex": "[a-f]{2}-queued-[0-9]"},  # not in the cache
        }
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    finally:
        release.set()
        flooded.shutdown(wait=True)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "compile_queue_full"


def test_out_of_memory_reaches_the_client_as_its_own_code(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    service: Any = server.service
    rejection = GrammarRejected("compiling the choice needed more memory than ...", tried=["xgrammar"],
                                unsupported=False, out_of_memory=True)

    def refuse(*_: Any) -> Any:
        raise rejection

    monkeypatch.setattr(service.grammars, "compile", refuse)
    body = {
        "model": "corral-tiny",
        "messages": [{"role": "user", "content": "x"}],
        # A choice no other test sent: a cached grammar is answered before `compile` is called.
        "structured_outputs": {"choice": [f"oom-{uuid.uuid4().hex}", "b"]},
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == "compile_out_of_memory"
    assert error["param"].startswith("structured_outputs")
