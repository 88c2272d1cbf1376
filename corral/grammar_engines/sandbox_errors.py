"""How a sandboxed compile can end besides a grammar or a refusal (corral/grammar_engines/sandbox.py)."""

from __future__ import annotations

from corral.grammar_engines.protocol import CompileError

STOPPED = "compiling stopped: the server is shutting down"


class CompileTimeout(CompileError):
    """The compile overran its deadline; the worker running it was killed."""

    def __init__(self, message: str, *, backend: str, deadline_s: float) -> None:
        super().__init__(message, backend=backend)
        self.deadline_s = deadline_s


class CompileOutOfMemory(CompileError):
    """The compile needed more memory than a worker may use (`memory_limit_mb`); the worker was replaced."""

    def __init__(self, message: str, *, backend: str, limit_mb: int | None) -> None:
        super().__init__(message, backend=backend)
        self.limit_mb = limit_mb


class CompileStopped(CompileError):
    """The sandbox was shut down (the server is stopping): no compile starts or finishes any more."""


class SandboxUnavailable(RuntimeError):
    """A worker process could not start; callers fall back to compiling in-process."""
