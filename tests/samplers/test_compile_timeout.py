"""Compile deadline: hostile grammars of every kind are refused at the deadline, their worker process is
killed (no CPU burnt afterwards), the refusal is cached, and ordinary compiles are unaffected.

The hostile inputs were measured on xgrammar 0.2.8 / llguidance 1.9.1 with the Llama-3 tokenizer
(2 shared cores): each takes far longer than the default 10 s deadline on the engine named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from corral.grammar_engines.compilation import GrammarCache, GrammarRejected
from corral.grammar_engines.protocol import Matcher, SamplerBackend, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammar_engines.sandbox import CompileSandbox
from corral.grammars.spec import GrammarSpec

BACKENDS = ["xgrammar", "llguidance"]
DEADLINE = 0.5
CONCURRENT_DEADLINE = 2.0
SLACK = 1.5  # parent-side work (pickling the spec, scanning a schema's features) and the kill, on a busy host

# 300 counted repetitions in a row; xgrammar: > 30 s (the nested form ((a{1,100}){1,100}){1,100} compiles
# in 0.6 s on xgrammar and 20 ms on llguidance, so it is no test of the deadline).
_COUNTED = "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))
# anyOf of 10 objects x 20 enum-valued properties x 50 values; xgrammar: 22 s.
_ANYOF_ENUMS = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(50)]} for i in range(20)},
            "required": [f"k{i}" for i in range(20)],
        }
        for _ in range(10)
    ]
}
HOSTILE: dict[str, tuple[GrammarSpec, str]] = {
    # (spec, backend requested); `auto` puts xgrammar first for grammars, regexes and choices.
    "regex": (GrammarSpec.regex(_COUNTED), "auto"),
    "json_schema": (GrammarSpec.json_schema(_ANYOF_ENUMS), "xgrammar"),
    "ebnf": (GrammarSpec.ebnf(f"root ::= {' '.join(f'[a-z]{{1,{i + 50}}}' for i in range(300))}"), "xgrammar"),
    "lark": (GrammarSpec.lark(f"start: /{_COUNTED}/"), "auto"),
    # 20,000 options; xgrammar: > 30 s.
    "choice": (GrammarSpec.choice([f"option number {i} " + "x" * (i % 97) for i in range(20000)]), "xgrammar"),
}

SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array",
                                                                                   "items": {"enum": ["a", "b"]}}},
    "required": ["age", "name"],
    "additionalProperties": False,
}
ORDINARY: list[tuple[GrammarSpec, str]] = [
    (GrammarSpec.json_schema(SCHEMA), '{"age": 42, "name": "bob", "tags": ["a"]}'),
    (GrammarSpec.json_object(), '{"x": [1, 2]}'),
    (GrammarSpec.regex(r"[0-9]{3}-[a-z]+"), "123-abc"),
    # 1.4 MB in xgrammar's memory (69 ms): over xgrammar_backend.SHIP_LIMIT_BYTES, so the parent compiles it again.
    (GrammarSpec.regex(r"[a-z]{1,30}[0-9]{1,30}"), "abc123"),
    (GrammarSpec.choice(["yes", "no", "maybe"]), "maybe"),
    (GrammarSpec.ebnf('root ::= "(" [0-9]+ ")"'), "(42)"),
    (GrammarSpec.lark('start: "<" /[a-z]+/ ">"'), "<tag>"),
]


@pytest.fixture(scope="module")
def tokenizer_spec(tokenizer: TokenizerSpec) -> TokenizerSpec:
    return tokenizer  # corral-tiny's, from tests/conftest.py


# Two sandboxes keep the file fast on 2 cores: every kill costs a replacement worker that rebuilds its
# tokenizer tables (~3 CPU-s for xgrammar alone, ~6 s with llguidance), so the hostile-input tests kill
# xgrammar-only workers; the full sandbox (both engines, one worker) checks equivalence and llguidance.
@pytest.fixture(scope="module")
def xgr_sandbox(tokenizer_spec: TokenizerSpec) -> Iterator[CompileSandbox]:
    box = CompileSandbox(tokenizer_spec, ["xgrammar"], workers=2)
    box.start()  # the workers build their tables while the parent builds its own
    yield box
    box.close()


@pytest.fixture(scope="module")
def sandbox(tokenizer_spec: TokenizerSpec) -> Iterator[CompileSandbox]:
    box = CompileSandbox(tokenizer_spec, BACKENDS, workers=1)
    box.start()
    yield box
    box.close()


@pytest.fixture(scope="module")
def backend_set(tokenizer_spec: TokenizerSpec, xgr_sandbox: CompileSandbox, sandbox: CompileSandbox) -> BackendSet:
    backends = BackendSet(tokenizer_spec, list(BACKENDS))
    backends.warm_up()
    return backends


def new_cache(backends: BackendSet, sandbox: CompileSandbox, deadline: float = DEADLINE) -> GrammarCache:
    return GrammarCache(backends, compile_timeout_s=deadline, sandbox=sandbox)


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, not yet reaped by whoever adopted it) is not alive."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def timed_refusal(cache: GrammarCache, spec: GrammarSpec, backend: str) -> tuple[GrammarRejected, float]:
    start = time.perf_counter()
    with pytest.raises(GrammarRejected) as info:
        cache.compile(spec, backend)
    return info.value, time.perf_counter() - start


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_spec_is_refused_at_the_deadline_and_its_worker_killed(
    kind: str, backend_set: BackendSet, xgr_sandbox: CompileSandbox
) -> None:
    spec, backend = HOSTILE[kind]
    sandbox = xgr_sandbox
    concurrent = kind == "json_schema"  # the issue: ordinary requests still finish in time meanwhile
    # The concurrent case times an ordinary compile against the hostile one's deadline: a longer deadline keeps
    # that comparison about queueing, not about how loaded the host is (CI once took 0.255 s for it).
    deadline = CONCURRENT_DEADLINE if concurrent else DEADLINE
    cache = new_cache(backend_set, sandbox, deadline)
    # A worker still booting after an earlier kill is not this test's business.
    sandbox.wait_ready(2 if concurrent else 1)
    before, ready, kills = set(sandbox.pids()), set(sandbox.pids(ready_only=True)), sandbox.stats.killed

    outcome: list[tuple[GrammarRejected, float]] = []
    thread = threading.Thread(target=lambda: outcome.append(timed_refusal(cache, spec, backend)))
    thread.start()
    if concurrent:
        time.sleep(0.05)
        start = time.perf_counter()
        cache.compile(GrammarSpec.json_schema(SCHEMA), "xgrammar")
        ordinary = time.perf_counter() - start
        assert thread.is_alive() and ordinary < deadline / 2, f"waited behind the hostile compile ({ordinary:.2f} s)"
    thread.join(deadline + 10)
    error, elapsed = outcome[0]

    assert error.timed_out and error.deadline_s == deadline and not error.unsupported
    assert error.tried == ["xgrammar"]  # under auto, a timeout spends the budget: no fallback
    assert f"longer than the {deadline:g} s deadline" in str(error)
    assert deadline <= elapsed < deadline + SLACK
    assert sandbox.stats.killed == kills + 1
    gone = before - set(sandbox.pids())
    assert len(gone) == 1 and not alive(gone.pop()), "the worker running the hostile compile still exists"
    survivors = ready & set(sandbox.pids())  # a replacement still booting is busy, and rightly so
    used = {pid: cpu_seconds(pid) for pid in survivors}
    time.sleep(0.3)
    assert all(cpu_seconds(pid) - used[pid] < 0.1 for pid in survivors), "a surviving worker is busy"

    again, elapsed_again = timed_refusal(cache, spec, backend)
    assert elapsed_again < 0.05 and str(again) == str(error) and again.timed_out
    assert cache.hits == 1
    if backend == "auto":  # the backend that timed out refuses an explicit request at once as well
        direct, elapsed_direct = timed_refusal(cache, spec, "xgrammar")
        assert elapsed_direct < 0.05 and direct.timed_out
    assert sandbox.stats.killed == kills + 1


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_workers_killed_by_the_deadline_are_forked_again_from_the_zygote(
    backend_set: BackendSet, xgr_sandbox: CompileSandbox
) -> None:
    """A compile bomb's worker is replaced by a fork of the zygote (tables already built), not by a new
    process that builds them again: a flood of bombs costs their deadlines, not a boot each."""
    spec, backend = HOSTILE["regex"]
    xgr_sandbox.wait_ready()
    zygote = xgr_sandbox.zygote_pid
    assert xgr_sandbox.forking and zygote is not None
    assert all(parent_of(pid) == zygote for pid in xgr_sandbox.pids())
    before = set(xgr_sandbox.pids())
    error, _ = timed_refusal(new_cache(backend_set, xgr_sandbox), spec, backend)
    assert error.timed_out
    xgr_sandbox.wait_ready()
    replacement = set(xgr_sandbox.pids()) - before
    assert len(replacement) == 1 and parent_of(replacement.pop()) == zygote
    assert cpu_seconds(zygote) < 60, "the zygote only builds tables once and forks"


def test_a_dead_zygote_is_booted_again_and_spawned_workers_still_work(
    backend_set: BackendSet, tokenizer_spec: TokenizerSpec
) -> None:
    spawned = CompileSandbox(tokenizer_spec, ["xgrammar"], workers=1, fork_workers=False)
    try:
        cache = new_cache(backend_set, spawned, deadline=10.0)
        assert cache.compile(GrammarSpec.regex("[a-c]{2}-spawned"), "xgrammar").backend == "xgrammar"
        assert not spawned.forking and [parent_of(pid) for pid in spawned.pids()] == [os.getpid()]
    finally:
        spawned.close(final=True)
    box = CompileSandbox(tokenizer_spec, ["xgrammar"], workers=1)
    try:
        box.wait_ready()
        first = box.zygote_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        spec, backend = HOSTILE["regex"]
        error, _ = timed_refusal(new_cache(backend_set, box), spec, backend)  # its worker dies: a new one
        assert error.timed_out
        box.wait_ready()
        second = box.zygote_pid
        assert second not in (None, first) and [parent_of(pid) for pid in box.pids()] == [second]
        cache = new_cache(backend_set, box, deadline=10.0)
        assert cache.compile(GrammarSpec.regex("[a-c]{2}-after"), "xgrammar").backend == "xgrammar"
    finally:
        box.close(final=True)


def test_killed_workers_leave_no_file_descriptors_behind(backend_set: BackendSet, xgr_sandbox: CompileSandbox) -> None:
    """Each cached refusal keeps its traceback, and with it the killed worker: its process pipes must be
    released when it ends, or every compile bomb costs the server file descriptors for as long as it runs."""
    spec, backend = HOSTILE["regex"]
    xgr_sandbox.wait_ready(2)
    before = len(os.listdir("/proc/self/fd"))
    caches = [new_cache(backend_set, xgr_sandbox) for _ in range(3)]  # kept: their refusals stay cached
    for cache in caches:
        error, _ = timed_refusal(cache, spec, backend)
        assert error.timed_out
        xgr_sandbox.wait_ready(2)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_llguidance_refuses_an_exploding_schema_fast_by_its_own_limits(
    backend_set: BackendSet, sandbox: CompileSandbox
) -> None:
    schema = {"type": "object",
              "properties": {f"k{i}": {"enum": [f"value-{i}-{j}" for j in range(3000)]} for i in range(40)}}
    cache = new_cache(backend_set, sandbox, deadline=10.0)
    sandbox.wait_ready(1)
    error, elapsed = timed_refusal(cache, GrammarSpec.json_schema(schema), "llguidance")
    assert not error.timed_out and "too big" in str(error)
    # Refused by llguidance's own size limits, well inside the 10 s deadline (2 s was exceeded on loaded cores).
    assert elapsed < 5.0


def _masks_along(backend: SamplerBackend, matcher: Matcher, tokens: list[int], vocab: int) -> list[torch.Tensor]:
    masks = []
    for token in tokens:
        bitmask = allocate_bitmask(1, vocab)
        backend.fill_bitmasks([matcher], bitmask, [0])
        masks.append(bitmask[0].clone())
        assert matcher.accept_token(token)
    return masks


def assert_matches_in_process(cache: GrammarCache, impl: SamplerBackend, tokenizer: TokenizerSpec) -> None:
    vocab = tokenizer.vocab_size
    bad = tokenizer.hf_tokenizer.encode("}{", add_special_tokens=False)[0]
    for spec, text in ORDINARY:
        result = cache.compile(spec, impl.name)
        assert result.backend == impl.name and not result.cache_hit
        tokens = [int(t) for t in tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)]
        sandboxed, local = impl.new_matcher(result.compiled), impl.new_matcher(impl.compile(spec))
        for got, want in zip(_masks_along(impl, sandboxed, tokens, vocab), _masks_along(impl, local, tokens, vocab),
                             strict=True):
            assert torch.equal(got, want), f"{spec.kind}: masks differ"
        assert sandboxed.can_terminate() and local.can_terminate()
        assert impl.new_matcher(result.compiled).validate_tokens([bad]) == impl.new_matcher(
            impl.compile(spec)).validate_tokens([bad])
    with pytest.raises(GrammarRejected) as info:
        cache.compile(GrammarSpec.regex("a(b"), impl.name)
    assert not info.value.timed_out and not info.value.unsupported


@pytest.mark.parametrize("name", BACKENDS)
def test_sandboxed_compiles_match_in_process_ones(
    name: str, backend_set: BackendSet, sandbox: CompileSandbox, tokenizer_spec: TokenizerSpec
) -> None:
    assert_matches_in_process(new_cache(backend_set, sandbox, deadline=10.0), backend_set.get(name), tokenizer_spec)


def test_replacement_workers_compile_as_before(
    backend_set: BackendSet, xgr_sandbox: CompileSandbox, tokenizer_spec: TokenizerSpec
) -> None:
    xgr_sandbox.wait_ready()
    assert xgr_sandbox.stats.killed >= 2 and len(xgr_sandbox.pids()) == 2  # every original worker was replaced
    impl = backend_set.get("xgrammar")
    assert_matches_in_process(new_cache(backend_set, xgr_sandbox, deadline=10.0), impl, tokenizer_spec)


def test_small_grammars_pay_little_for_the_sandbox(backend_set: BackendSet, sandbox: CompileSandbox) -> None:
    cache = new_cache(backend_set, sandbox)
    impl = backend_set.get("xgrammar")
    for i in range(3):  # warm both paths
        cache.compile(GrammarSpec.choice([f"w{i}", "x"]), "xgrammar")
        impl.compile(GrammarSpec.choice([f"v{i}", "x"]))
    sandboxed, local = [], []
    for i in range(10):
        start = time.perf_counter()
        cache.compile(GrammarSpec.choice([f"yes{i}", "no"]), "xgrammar")
        sandboxed.append(time.perf_counter() - start)
        start = time.perf_counter()
        impl.compile(GrammarSpec.choice([f"si{i}", "no"]))
        local.append(time.perf_counter() - start)
    overhead = sorted(sandboxed)[5] - sorted(local)[5]
    assert overhead < 0.02, f"median sandbox overhead {overhead * 1000:.1f} ms on a two-word choice"


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from corral.grammar_engines.protocol import TokenizerSpec
    from corral.grammar_engines.sandbox import CompileSandbox

    if __name__ == "__main__":
        box = CompileSandbox(TokenizerSpec(None, 8, ()), [], workers=1)  # no backends: a quick boot
        box.wait_ready()
        print(box.pids()[0], flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_no_worker_outlives_its_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    parents = {how: subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env) for how in ("exit", "kill")}
    for how, parent in parents.items():
        out, err = parent.communicate(timeout=60)
        assert parent.returncode == (-signal.SIGKILL if how == "kill" else 0), err
        pid = int(out.split()[0])
        deadline = time.monotonic() + 3
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"worker {pid} outlived its parent ({how})"


def test_llguidance_compile_is_killed_too(backend_set: BackendSet, sandbox: CompileSandbox) -> None:
    # 60,000 options: ~6.5 s on llguidance (it builds lexer tables for every option up front).
    spec = GrammarSpec.choice([f"option number {i} " + "x" * (i % 97) for i in range(60000)])
    cache = new_cache(backend_set, sandbox)
    sandbox.wait_ready(1)
    kills = sandbox.stats.killed
    error, elapsed = timed_refusal(cache, spec, "llguidance")
    assert error.timed_out and error.tried == ["llguidance"]
    assert DEADLINE <= elapsed < DEADLINE + SLACK
    assert sandbox.stats.killed == kills + 1


def test_close_stops_every_worker(sandbox: CompileSandbox, xgr_sandbox: CompileSandbox) -> None:
    pids = xgr_sandbox.pids()
    assert len(pids) == 2
    xgr_sandbox.close()
    assert not any(alive(pid) for pid in pids) and xgr_sandbox.pids() == []
    sandbox.close()  # its replacement for the llguidance kill may still be starting: stopped when it has
    for thread in threading.enumerate():
        if thread.name == "corral-compile-spawn":
            thread.join(30)
    assert sandbox.pids() == []
    # (Other tests' servers in the same process may own compile workers too, so only these are checked.)


def test_final_close_ends_compiles_in_flight_and_refuses_new_ones(
    tokenizer_spec: TokenizerSpec, backend_set: BackendSet
) -> None:
    """A stopping server: the compile running in a worker ends at once, `auto` tries no further backend
    (which would boot workers again and hold the exit up for seconds), and no later compile starts one."""
    box = CompileSandbox(tokenizer_spec, ["xgrammar"], workers=1)
    box.wait_ready()
    cache = GrammarCache(backend_set, compile_timeout_s=60, sandbox=box)
    outcome: list[tuple[GrammarRejected, float]] = []
    thread = threading.Thread(target=lambda: outcome.append(timed_refusal(cache, GrammarSpec.regex(_COUNTED), "auto")))
    thread.start()
    time.sleep(1.0)  # inside the hostile compile
    spawns = sum(t.name == "corral-compile-spawn" for t in threading.enumerate())
    closed_at = time.perf_counter()
    box.close(final=True)
    thread.join(30)
    assert not thread.is_alive()
    error, _ = outcome[0]
    assert "shutting down" in str(error) and error.tried == ["xgrammar"]
    assert time.perf_counter() - closed_at < 10
    assert box.pids() == [] and sum(t.name == "corral-compile-spawn" for t in threading.enumerate()) <= spawns
    later, elapsed = timed_refusal(cache, GrammarSpec.regex("a+b"), "xgrammar")
    assert "shutting down" in str(later) and elapsed < 1.0


def test_a_worker_orphaned_to_a_pid_1_server_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container the server is PID 1: a worker whose zygote died becomes its child, and a zombie
    unless the server reaps it (os.kill finds zombies, so the worker would look alive for ever)."""
    from corral.grammar_engines.worker_handles import Worker

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # exited, not reaped: a zombie
    worker = Worker.__new__(Worker)
    worker._pid = child.pid
    assert worker._forked_alive(), "a zombie answers os.kill(pid, 0)"
    monkeypatch.setattr(os, "getpid", lambda: 1)
    assert not worker._forked_alive()
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # already reaped
    child.returncode = 0  # Popen would otherwise try to reap it again
