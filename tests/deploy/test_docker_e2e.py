"""The container deployment, proven by running it: build the CPU image, `docker compose up` (corral behind
the HAProxy balancer), constrained requests with the openai SDK from the host, /metrics, SIGTERM ends the
container within its grace period, then two replicas behind the balancer, one killed, requests keep succeeding.

Slow (an image build on first run; minutes), so it is not part of the main suite: `.ci/run` runs it as its own
step with CORRAL_DOCKER_E2E=1. It installs/starts Docker and Compose where the machine allows (root + apt) and
skips only where Docker cannot run at all. How the base image was obtained is printed and recorded
(tests/deploy/docker_stack.py explains the order: public image, local image, saved image, debootstrap).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from docker_stack import (
    BUILT_TAGS,
    CACHE,
    REPO,
    DockerHost,
    base_image,
    drop_stale_layers,
    ensure_disk_for_build,
    image_id,
    prepare_docker,
    sh,
    stage_build_inputs,
)

pytestmark = [
    pytest.mark.docker,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get("CORRAL_DOCKER_E2E") != "1",
        reason="docker end-to-end test: its own CI step (CORRAL_DOCKER_E2E=1, see .ci/run)",
    ),
]

PROJECT = "corral-e2e"
GRACE_S = 15  # docker-compose.yml's default stop_grace_period
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass
class Stack:
    base_url: str
    env: dict[str, str]
    report: dict[str, Any] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        cmd = ["docker", "compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]
        return sh(*cmd, *args, timeout=timeout, check=check, cwd=REPO, env=self.env).stdout

    def replicas(self) -> list[str]:
        return self.compose("ps", "-q", "corral").split()

    def client(self, retries: int = 0, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=retries, timeout=60, default_headers=headers
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SETUP_FAILED: list[BaseException] = []


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if _SETUP_FAILED:  # pytest retries a failed module fixture for every test: one build is enough
        pytest.fail(f"stack set-up failed earlier: {_SETUP_FAILED[0]!r}"[:2000])
    host, reason = prepare_docker()
    if host is None:
        pytest.skip(f"Docker cannot run here: {reason}")
    port = _free_port()
    env = {**os.environ, "CORRAL_PUBLISH": f"127.0.0.1:{port}", "CORRAL_TORCH_THREADS": "1"}
    running = Stack(f"http://127.0.0.1:{port}", env)
    try:
        start = time.monotonic()
        base, how = base_image()
        running.report["base_image_s"] = round(time.monotonic() - start, 1)
        ensure_disk_for_build()
        build_env, notes = stage_build_inputs()
        env.update(build_env, CORRAL_BASE_IMAGE=base)
        running.report.update(base_image=how, setup=host.notes + notes)
        start = time.monotonic()
        replaced = {tag: image_id(tag) for tag in BUILT_TAGS}
        running.compose("build", timeout=3600)
        running.report["build_s"] = round(time.monotonic() - start, 1)
        running.report["docker_disk_freed_mb"] = drop_stale_layers(replaced)
        size = sh("docker", "image", "inspect", "-f", "{{.Size}}", "corral:cpu").stdout.strip()
        running.report["image_mb"] = round(int(size) / 1e6)
        start = time.monotonic()
        running.compose("up", "-d", "--wait", "--wait-timeout", "300")
        _wait_routable(running)
        running.report["up_healthy_s"] = round(time.monotonic() - start, 1)
    except BaseException as exc:
        _SETUP_FAILED.append(exc)
        _teardown(running, host)
        raise
    yield running
    _teardown(running, host)


def _teardown(running: Stack, host: DockerHost) -> None:
    if running.env.get("CORRAL_BASE_IMAGE"):
        print(running.compose("logs", "--no-color", "--tail", "100", check=False))
        running.compose("down", "-v", "--remove-orphans", "-t", "20", check=False)
    print("docker e2e:", json.dumps(running.report))
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "e2e-report.json").write_text(json.dumps(running.report, indent=2), encoding="utf-8")
    host.stop()


def _wait_routable(stack: Stack) -> None:
    """Until the balancer has resolved and health-checked a replica (it re-resolves each second, checks every 2 s)."""
    deadline = time.monotonic() + 60
    while httpx.get(f"{stack.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the balancer routes to no healthy replica"
        time.sleep(0.5)


def _person(client: openai.OpenAI) -> dict[str, Any]:
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "A person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        max_tokens=64,
    )
    value: dict[str, Any] = json.loads(resp.choices[0].message.content or "")
    jsonschema.validate(value, PERSON)
    return value


def test_constrained_requests_from_the_host(stack: Stack) -> None:
    _person(stack.client())
    choice = stack.client().chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "Pick a colour"}],
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert choice.choices[0].message.content in {"red", "green", "blue"}
    regex = stack.client().completions.create(
        model="corral-tiny",
        prompt="Code:",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}},
    )
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"
    (replica,) = stack.replicas()
    assert sh("docker", "exec", replica, "id", "-u").stdout.strip() == "10001"  # not root


def test_metrics_are_exported(stack: Stack) -> None:
    _person(stack.client())
    text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    assert 'corral_requests_total{finish_reason="stop"}' in text
    assert "corral_grammar_cache_total" in text and "corral_waiting_requests" in text


def test_sigterm_drains_in_flight_requests_and_exits_within_its_grace_period(stack: Stack) -> None:
    (replica,) = stack.replicas()
    stream = stack.client().chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "Talk"}],
        max_tokens=120,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # the request is running in the engine now
    stopped: list[float] = []

    def stop() -> None:
        start = time.monotonic()
        # `docker stop` sends SIGTERM, and SIGKILL only when the grace period runs out (exit code 137 then).
        sh("docker", "stop", "-t", str(GRACE_S), replica, timeout=GRACE_S + 60)
        stopped.append(time.monotonic() - start)

    stopper = threading.Thread(target=stop)
    stopper.start()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    stopper.join()
    state = json.loads(sh("docker", "inspect", "-f", "{{json .State}}", replica).stdout)
    stack.report["sigterm_exit_s"] = round(stopped[0], 1)
    assert finish == ["length"], "the request in flight was not allowed to finish"
    assert state["ExitCode"] == 0, state
    assert stopped[0] < GRACE_S


def _served(replica: str) -> float:
    """Finished requests a replica counted, read from its own /metrics (not through the balancer)."""
    script = (
        "import urllib.request; t = urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode();"
        "print(sum(float(l.split()[-1]) for l in t.splitlines() if l.startswith('corral_requests_total{')))"
    )
    return float(sh("docker", "exec", replica, "python3", "-c", script).stdout)


def test_two_replicas_share_load_keep_schema_affinity_and_survive_one_dying(stack: Stack) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "--scale", "corral=2")
    _wait_routable(stack)
    stack.report["scale_to_2_s"] = round(time.monotonic() - start, 1)
    replicas = stack.replicas()
    assert len(replicas) == 2
    deadline = time.monotonic() + 60  # the balancer re-resolves DNS each second and health-checks every 2 s
    before = {r: _served(r) for r in replicas}
    while time.monotonic() < deadline:
        _person(stack.client())  # no routing header: round-robin
        if all(_served(r) > before[r] for r in replicas):
            break
    assert all(_served(r) > before[r] for r in replicas), "the balancer never used both replicas"

    # One schema hash -> one replica (the per-process compile cache stays warm).
    before = {r: _served(r) for r in replicas}
    pinned = stack.client(**{"X-Corral-Schema-Hash": "person-v1"})
    for _ in range(4):
        _person(pinned)
    grew = [r for r in replicas if _served(r) > before[r]]
    assert len(grew) == 1, "requests with one X-Corral-Schema-Hash were spread over replicas"

    failures: list[str] = []
    after_kill = 0
    killed = threading.Event()
    stop = threading.Event()

    # The SDK's default retry policy (2), as users run it: a request whose replica is SIGKILLed mid-answer
    # cannot be retried by the balancer (part of the answer may have left), so the client retries it.
    retrying = stack.client(retries=2)
    pinned_retrying = stack.client(retries=2, **{"X-Corral-Schema-Hash": "person-v1"})

    def load() -> None:
        nonlocal after_kill
        while not stop.is_set():
            try:
                _person(retrying)
                _person(pinned_retrying)  # its replica may be the one that dies
                after_kill += 2 if killed.is_set() else 0
            except Exception as exc:  # any failure the client sees counts
                failures.append(repr(exc))

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(2)
    sh("docker", "kill", grew[0])  # SIGKILL: a crash, no drain
    killed.set()
    time.sleep(12)
    stop.set()
    worker.join(timeout=120)
    stack.report["requests_after_kill"] = after_kill
    assert not failures, failures
    assert after_kill >= 4


def test_hung_step_exit_70_is_restarted_by_compose(stack: Stack) -> None:
    # A deadline no engine step can meet: the first request's step "hangs", corral fails it, exits with
    # status 70, and the service's `restart: unless-stopped` brings it back.
    stack.env["CORRAL_HUNG_STEP_TIMEOUT_S"] = "0.001"
    stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "--scale", "corral=1")
    _wait_routable(stack)
    (replica,) = stack.replicas()
    with pytest.raises(openai.APIStatusError) as failed:
        _person(stack.client())
    assert failed.value.status_code == 503
    deadline = time.monotonic() + 60
    while json.loads(sh("docker", "inspect", "-f", "{{json .RestartCount}}", replica).stdout) < 1:
        assert time.monotonic() < deadline, "the container was not restarted"
        time.sleep(1)
    assert "exiting with status 70" in sh("docker", "logs", replica).stderr
    start = time.monotonic()
    _wait_routable(stack)
    stack.report["hung_exit_restart_healthy_s"] = round(time.monotonic() - start, 1)
