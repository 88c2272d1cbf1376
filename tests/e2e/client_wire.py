"""What the client-library tests share: a loopback proxy in front of the shared server that records each JSON
request and its answer (a stream's events as a list of their `data` objects), and a guard that refuses and
records any connection or name lookup beyond loopback (a library that phones home fails its test).

Test modules import the fixtures by name: `from client_wire import Exchange, Recorder, no_outside_network, proxy,
wire  # noqa: F401`."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

# -- recording proxy ------------------------------------------------------------------------------------------


@dataclass
class Exchange:
    path: str
    request: dict[str, Any]
    status: int
    response: Any  # the JSON body, or for a stream the list of its events' `data` objects


@dataclass
class Recorder:
    base_url: str
    exchanges: list[Exchange] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def only(self) -> Exchange:
        """The single exchange of a test: one request means the first answer parsed (no library retry)."""
        assert len(self.exchanges) == 1, [e.request for e in self.exchanges]
        return self.exchanges[0]

    def posts(self, path: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path]


def _decode(answer: httpx.Response) -> Any:
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[len("data: "):]) for line in answer.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    try:
        return answer.json()
    except ValueError:
        return answer.text


def _proxy_handler(upstream: str, recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    forward = httpx.Client(base_url=upstream, timeout=120)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
            answer = forward.request(self.command, self.path, content=body, headers=headers)
            if body:
                recorder.exchanges.append(
                    Exchange(self.path.split("?")[0], json.loads(body), answer.status_code, _decode(answer)))
            self.send_response(answer.status_code)
            self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        do_GET = do_POST = _relay

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture(scope="module")
def proxy(server: Any) -> Iterator[Recorder]:
    """A loopback proxy in front of the shared server that records each JSON request and its answer."""
    recorder = Recorder("")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(server.base_url, recorder))
    httpd.daemon_threads = True
    recorder.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield recorder
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture()
def wire(proxy: Recorder) -> Recorder:
    proxy.exchanges.clear()
    return proxy


# -- no phoning home ------------------------------------------------------------------------------------------


def _is_loopback(host: object) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host)).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def no_outside_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Refuse and record any name lookup or connection beyond loopback made during a test."""
    attempts: list[str] = []
    real_connect = socket.socket.connect
    real_getaddrinfo = socket.getaddrinfo

    def connect(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            attempts.append(f"connect {address}")
            raise OSError(f"no network beyond loopback ({address})")
        real_connect(sock, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_loopback(host.decode() if isinstance(host, bytes) else host):
            attempts.append(f"getaddrinfo {host}")
            raise socket.gaierror(f"no name lookups beyond loopback ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield attempts
    assert attempts == [], f"a client library tried to reach outside this machine: {attempts}"
