"""Trust and training signals: one record per round, EWMA reliability per provider × failure class,
and JSONL export of rounds with a verifiable reward (which checks passed) for RLVR-style training."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.mediation.failures import FailureClass


@dataclass(frozen=True)
class RoundRecord:
    provider: str
    model: str
    mode: str
    schema_name: str
    schema_version: str | None  # the version the answer satisfied; None when it satisfied none
    attempt: int  # 1-based round number within the call
    failure_class: str | None  # None: this round produced the validated value
    finish_reason: str | None  # the provider's precise finish reason (corral_finish_reason on corral)
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    # Verifiable reward: each check this round's answer passed (True), failed (False); checks after the
    # first failing tier are absent. Keys: "markers" (when required), "json", "schema", then validator names.
    checks: dict[str, bool] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the request's messages, as sent
    output: str | None = None

    @property
    def reward(self) -> float:
        """Shaped reward: 0 unparseable, 0.3 JSON, 0.6 full schema, 1.0 every semantic validator too."""
        if self.failure_class is None:
            return 1.0
        if self.checks.get("schema"):
            return 0.6
        return 0.3 if self.checks.get("json") else 0.0


class Sink(Protocol):
    def record(self, round_: RoundRecord) -> None: ...


class MemorySink:
    def __init__(self) -> None:
        self.rounds: list[RoundRecord] = []

    def record(self, round_: RoundRecord) -> None:
        self.rounds.append(round_)


class JsonlSink:
    """Appends one JSON line per round, with `reward` and `checks` (the verifiable signal)."""

    def __init__(self, path: Path, *, include_messages: bool = True) -> None:
        self.path = path
        self.include_messages = include_messages
        self._lock = threading.Lock()

    def record(self, round_: RoundRecord) -> None:
        row = asdict(round_)
        row["reward"] = round_.reward
        if not self.include_messages:
            row.pop("messages")
        with self._lock, self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


SUCCESS = "success"


class Reliability:
    """EWMA per provider × outcome (each failure class, and `success`), updated once per round: the rate
    of each outcome in the recent rounds, so a provider losing trust shows *why*."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._rates: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def record(self, round_: RoundRecord) -> None:
        outcome = round_.failure_class or SUCCESS
        with self._lock:
            for name in (SUCCESS, *FailureClass):
                key = (round_.provider, str(name))
                hit = 1.0 if str(name) == outcome else 0.0
                old = self._rates.get(key)
                self._rates[key] = hit if old is None else old + self.alpha * (hit - old)

    def rate(self, provider: str, outcome: FailureClass | str) -> float | None:
        """The EWMA rate of `outcome` (a FailureClass or "success") for `provider`; None before any round."""
        return self._rates.get((provider, str(outcome)))

    def snapshot(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        with self._lock:
            for (provider, outcome), rate in self._rates.items():
                out.setdefault(provider, {})[outcome] = round(rate, 6)
        return out
