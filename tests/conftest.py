"""Shared fixtures: one real corral server (uvicorn on 127.0.0.1) on the embedded default model, and the
default model's tokenizer with both built-in backends for tests below the server."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = REPO.parent / "shared" / "jsonschemabench"
SAMPLE_BENCH = REPO / "tests" / "data" / "jsonschemabench_sample"

# Tests build the default model once per machine into a cache the suite owns.
os.environ.setdefault("CORRAL_CACHE_DIR", str(Path.home() / ".cache" / "corral"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class RunningServer:
    base_url: str
    service: object  # server.serving.Service; kept loose so collection never imports torch

    def client(self, **kwargs: object) -> object:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(**settings: object) -> tuple[RunningServer, object, threading.Thread]:
    import uvicorn

    from server.app import create_app
    from server.models import load_model
    from server.serving import Service
    from server.settings import Settings

    port = _free_port()
    config = Settings(port=port, **settings)  # type: ignore[arg-type]
    service = Service(config, load_model(config.model, device="cpu"))
    app = create_app(service)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise RuntimeError("server did not become healthy within 120 s")
    return RunningServer(base, service), server, thread


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    running, uv, thread = start_server()
    yield running
    uv.should_exit = True  # type: ignore[attr-defined]
    thread.join(timeout=30)


@pytest.fixture()
def client(server: RunningServer) -> object:
    return server.client()


@pytest.fixture(scope="module")
def tokenizer() -> object:
    """The embedded default model's TokenizerSpec, as `corral serve` sees it."""
    from benchmarks.jsonschemabench.tokenizer import load_tokenizer_spec

    return load_tokenizer_spec(None)


@pytest.fixture(scope="module")
def backends(tokenizer: object) -> object:
    """Both built-in backends over `tokenizer`, per module (each BackendSet owns its compile workers)."""
    from samplers.registry import BackendSet

    return BackendSet(tokenizer, ["xgrammar", "llguidance"])  # type: ignore[arg-type]
