"""`auto`'s second attempt: an answer its first backend failed, generated again with the next backend its spec
routes to."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import replace

from corral.grammar_engines.compilation import CompileResult
from corral.grammars.features import route
from corral.grammars.request import AUTO, ConstraintRequest
from corral.server.answer_metrics import ERROR
from corral.server.engine import SeqOutput, Sequence
from corral.server.errors import ApiError
from corral.server.prepared import Prepared

log = logging.getLogger(__name__)


def engine_failed(prepared: Prepared, out: SeqOutput) -> bool:
    """Whether `auto` may run this answer again on another backend: its grammar engine failed it (`error`)."""
    return (
        out.finish_reason == ERROR
        and out.seq.grammar_failed
        and prepared.constraint.backend == AUTO
        and prepared.compiled is not None
    )


class AutoFallback:
    """`auto`'s second attempt: a request compiled for the next backend its spec routes to (`Service.run` after a
    dead end or a failed check, `Service.stream` after a grammar engine error), and the answers run so (`reruns`:
    each sequence's own Prepared and the backend that failed first, which `Service.finish` reports)."""

    def __init__(self, compile: Callable[[ConstraintRequest], Awaitable[CompileResult]], enabled: list[str]) -> None:
        self._compile = compile
        self._enabled = enabled
        self.reruns: weakref.WeakKeyDictionary[Sequence, tuple[Prepared, str]] = weakref.WeakKeyDictionary()

    async def next_backend(self, prepared: Prepared, why: str) -> Prepared | None:
        """The request compiled for the next backend that takes its spec, or None if there is none."""
        spec, used = prepared.constraint.spec, prepared.compiled
        assert spec is not None and used is not None
        for name in route(spec, self._enabled):
            if name == used.backend:
                continue
            try:
                compiled = await self._compile(ConstraintRequest(spec, name, prepared.constraint.source))
            except ApiError:
                continue
            log.info("request %s: the answer from %s %s; regenerating with %s", prepared.request_id, used.backend,
                     why, name)
            return replace(prepared, compiled=compiled, request_id=f"{prepared.request_id}-{name}")
        return None
