"""Shared fixtures: one real corral server (uvicorn on 127.0.0.1) on the tiny model (corral-tiny), and the
default model's tokenizer with both built-in backends for tests below the server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the engine loads torch; the settings below must come first
    from corral.server.engine import Engine
    from corral.server.engine import Sequence as Seq

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO.parent / "shared" / "jsonschemabench"
SAMPLE_BENCH = REPO / "tests" / "data" / "jsonschemabench_sample"

# Tests build the default model once per machine into a cache the suite owns.
os.environ.setdefault("CORRAL_CACHE_DIR", str(Path.home() / ".cache" / "corral"))
# Tests serve the tiny random model (fast) unless they name another; subprocesses inherit this. The tests that
# need a real model (qwen2.5-coder-1.5b-instruct, the default; gemma-3-270m) ask for it by name.
os.environ.setdefault("CORRAL_MODEL", "corral-tiny")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _default_kernels() -> Iterator[None]:
    """Each test starts and ends with the default CPU kernels (corral/kernels/choice.py): the choice is
    process-wide, and a test that loads a model with another (head_screen=False) must not leave it behind."""
    from corral.kernels.choice import KernelOptions, use_kernels

    use_kernels(KernelOptions())
    yield
    use_kernels(KernelOptions())


def run_until_done(engine: Engine, seqs: Sequence[Seq], max_steps: int = 500) -> None:
    """Step `engine` until every one of `seqs` has finished; fails after `max_steps` steps."""
    for _ in range(max_steps):
        if all(s.is_finished for s in seqs):
            return
        engine.step()
    raise AssertionError("sequences did not finish")


@contextmanager
def stub_peer(answer: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[str]:
    """A local HTTP server standing in for a peer: every POST's JSON body answered with `answer(body)` as JSON.
    Yields its base URL."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    peer = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{peer.server_address[1]}"
    finally:
        peer.shutdown()


def run_bench(command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`corral bench COMMAND ARGS` in a subprocess, as a user runs it; output captured as text."""
    return subprocess.run([sys.executable, "-m", "corral.server.cli", "bench", command, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@dataclass
class RunningServer:
    base_url: str
    service: object  # corral.server.serving.Service; kept loose so collection never imports torch
    frontend: object  # corral.server.openai.frontend.OpenAIFrontend: OpenAI requests into the service's terms

    def client(self, **kwargs: object) -> object:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(**settings: object) -> tuple[RunningServer, object, threading.Thread]:
    import uvicorn

    from corral.benchmarks.serve.server_proc import wait_healthy
    from corral.server.app import create_app
    from corral.server.models import load_model
    from corral.server.serving import Service
    from corral.server.settings import Settings

    port = _free_port()
    config = Settings(port=port, **settings)  # type: ignore[arg-type]
    if config.compile_isolate:  # as `corral serve` starts: the compile zygote imports while the model loads
        from corral.grammar_engines.worker_handles import prespawn_zygote

        prespawn_zygote(config.compile_memory_limit_mb)
    service = Service(config, load_model(config.model, device="cpu", quantization=config.quantization))
    app = create_app(service, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 120)
    return RunningServer(base, service, app.state.frontend), server, thread


@contextmanager
def serving(**settings: object) -> Iterator[RunningServer]:
    """A server started with `settings` (see start_server) for the duration of the block, then stopped."""
    running, uv, thread = start_server(**settings)
    try:
        yield running
    finally:
        uv.should_exit = True  # type: ignore[attr-defined]
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    with serving() as running:
        yield running


@pytest.fixture()
def client(server: RunningServer) -> object:
    return server.client()


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """corral-tiny's TokenizerSpec, as `corral serve` sees it."""
    from corral.benchmarks.jsonschemabench.tokenizer import load_tokenizer_spec

    return load_tokenizer_spec(None)


# The two tokenizer families corral serves: Llama 3's byte-level BPE (corral-tiny) and Gemma's SentencePiece-style
# vocabulary with byte fallback (gemma-3-270m, 262,144 tokens). Modules that prove a behaviour for every family
# parametrize a module-scoped `tokenizer` fixture over these with `family_tokenizer`.
TOKENIZER_FAMILIES = ["corral-tiny", "gemma-3-270m"]


@cache  # one per family for the whole run: loading gemma-3-270m for its tokenizer takes ~17 s
def family_tokenizer(model: str) -> object:
    """`model`'s TokenizerSpec as `corral serve` sees it (vocabulary, logits width, stop tokens)."""
    from corral.grammar_engines.protocol import TokenizerSpec
    from corral.server.models import load_model

    loaded = load_model(model, device="cpu")
    return TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)


QWEN_INSTRUCT = "qwen2.5-coder-1.5b-instruct"


def _qwen_gguf() -> Path:
    """The Qwen2.5-Coder-1.5B-Instruct GGUF: `CORRAL_TEST_QWEN_GGUF`, else the built-in's file; skips without it."""
    named = os.environ.get("CORRAL_TEST_QWEN_GGUF")
    if named:
        path = Path(named)
    else:
        try:
            from corral.server.models.builtin import builtin_gguf  # type: ignore[attr-defined,unused-ignore]
        except ImportError:
            pytest.skip(f"no {QWEN_INSTRUCT} GGUF: set CORRAL_TEST_QWEN_GGUF to its path "
                        "(corral.server.models.builtin has no builtin_gguf)")
        try:
            path = Path(builtin_gguf(QWEN_INSTRUCT))
        except Exception as exc:  # not installed, or a part missing: the built-in says which
            pytest.skip(f"no {QWEN_INSTRUCT} GGUF (set CORRAL_TEST_QWEN_GGUF to its path): {exc}")
    if not path.is_file():
        pytest.skip(f"the {QWEN_INSTRUCT} GGUF {path} does not exist")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer() -> object:
    """Qwen 2.5 Instruct's TokenizerSpec (its 151,936 logits; `<|im_end|>` and `<|endoftext|>` stop), the tokenizer
    read from the GGUF once (~30 s) and kept under $CORRAL_CACHE_DIR/test-tokenizers (later runs load it in ~2 s,
    on 2 busy cores)."""
    from transformers import AutoTokenizer

    from corral.grammar_engines.protocol import TokenizerSpec

    gguf = _qwen_gguf()
    stat = gguf.stat()
    cache_root = Path(os.environ.get("CORRAL_CACHE_DIR") or Path.home() / ".cache" / "corral")
    saved = cache_root / "test-tokenizers" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (saved / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        staging = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(saved)
        except OSError:  # another worker saved it first
            shutil.rmtree(staging, ignore_errors=True)
    hf = AutoTokenizer.from_pretrained(saved)
    stops = tuple(int(hf.convert_tokens_to_ids(t)) for t in ("<|im_end|>", "<|endoftext|>"))
    return TokenizerSpec(hf, 151_936, stops)


@pytest.fixture(scope="module")
def backends(tokenizer: object) -> object:
    """Both built-in backends over `tokenizer`, per module (each BackendSet owns its compile workers)."""
    from corral.grammar_engines.registry import BackendSet

    return BackendSet(tokenizer, ["xgrammar", "llguidance"])  # type: ignore[arg-type]


# -- ending the test process ---------------------------------------------------------------------------------
# The suite hosts a dozen servers, compile sandboxes and engine threads in one process. Its verdict is known
# once the summary is printed; interpreter teardown after that tests nothing, yet twice (CI and a local run)
# the process lingered there until CI's time ran out. So the process ends with pytest's exit status right
# after the summary, and first names whatever was still running (the clue if that ever matters). How corral
# itself exits on SIGINT/SIGTERM is tested on a real `corral serve` in tests/e2e/test_shutdown.py.
_session_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _session_status.append(int(exitstatus))


def _pytest_owns_the_process() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (spec is not None and spec.name.startswith("pytest")) or Path(sys.argv[0]).name in ("pytest", "py.test")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _session_status or os.environ.get("CORRAL_TEST_NORMAL_EXIT"):
        return
    if not _pytest_owns_the_process():
        return  # pytest.main() inside another program: leave its process alone
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if busy:
        frames = sys._current_frames()
        print(f"\nnote: {len(busy)} non-daemon thread(s) still running at exit:", file=sys.stderr)
        for thread in busy:
            frame = frames.get(thread.ident or -1)
            where = "".join(traceback.format_stack(frame)[-3:]) if frame else "  (no frame)\n"
            print(f"- {thread.name}\n{where}", file=sys.stderr, end="")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_status[-1])
