"""`corral serve` starts the compile zygote's process before it loads the model
(corral/grammar_engines/worker_handles.py
`prespawn_zygote`): the first sandbox adopts that process, hands it the tokenizer, and its forked workers
compile; a started process that does not fit is stopped, not left behind."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.context import SpawnProcess

import pytest

from corral.grammar_engines import worker_handles
from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammar_engines.sandbox import DEFAULT_MEMORY_LIMIT_MB, CompileSandbox
from corral.grammars.spec import GrammarSpec


def _started_ahead(memory_limit_mb: int | None) -> SpawnProcess:
    assert worker_handles._spare is None
    worker_handles.prespawn_zygote(memory_limit_mb)
    worker_handles.prespawn_zygote(memory_limit_mb)  # a second call starts no second process
    assert worker_handles._spare is not None and worker_handles._spare[1].pid is not None
    return worker_handles._spare[1]


def test_the_first_sandbox_adopts_the_zygote_started_ahead(tokenizer: TokenizerSpec) -> None:
    ahead = _started_ahead(DEFAULT_MEMORY_LIMIT_MB).pid
    box = CompileSandbox(tokenizer, ["xgrammar"], workers=1)
    try:
        box.wait_ready()
        assert box.forking and box.zygote_pid == ahead and worker_handles._spare is None
        backends = BackendSet(tokenizer, ["xgrammar"])
        backends.warm_up()
        cache = GrammarCache(backends, compile_timeout_s=30.0, sandbox=box)
        assert cache.compile(GrammarSpec.regex("[a-c]{2}-ahead"), "xgrammar").backend == "xgrammar"
    finally:
        box.close(final=True)


def test_a_zygote_started_ahead_with_another_memory_limit_is_stopped(tokenizer: TokenizerSpec) -> None:
    process = _started_ahead(DEFAULT_MEMORY_LIMIT_MB + 1)
    box = CompileSandbox(tokenizer, ["xgrammar"], workers=1)
    try:
        box.wait_ready()
        assert box.zygote_pid not in (None, process.pid) and worker_handles._spare is None
        assert not process.is_alive()
    finally:
        box.close(final=True)


@pytest.fixture(autouse=True)
def _no_spare_left() -> Iterator[None]:
    yield
    spare, worker_handles._spare = worker_handles._spare, None
    if spare is not None:
        spare[1].kill()
        spare[1].join(5)
