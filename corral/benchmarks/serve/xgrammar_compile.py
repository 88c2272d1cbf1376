"""Compile the baseline's xgrammar grammars in a child process that can be killed.

A native xgrammar compile cannot be interrupted; abandoned in a thread it would keep a core busy while the
baseline is being timed (seen: one Kubernetes schema past 30 s). A child process is killed on timeout
instead, and the compiled grammars come back serialized."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


def _worker(conn: Connection, tokenizer_info_json: str, schemas: list[str]) -> None:
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    for i, schema in enumerate(schemas):
        try:
            # The options corral's xgrammar backend uses (no free whitespace), so outputs are comparable.
            grammar = compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=False)
            conn.send((i, grammar.serialize_json(), None))
        except Exception as exc:  # a refusal is a skipped schema, not a failed benchmark
            conn.send((i, None, f"{type(exc).__name__}: {exc}"))
    conn.close()


def compile_schemas(tokenizer_info: Any, schemas: Sequence[Any], timeout_s: float) -> list[Any | str]:
    """Per schema, the xgrammar CompiledGrammar, or a string saying why there is none. Each compile gets
    `timeout_s`; on a timeout the child is killed and a fresh one continues with the next schema."""
    texts = [json.dumps(s) for s in schemas]
    info_json = tokenizer_info.serialize_json()
    out: list[Any | str] = ["not compiled"] * len(texts)
    ctx = mp.get_context("spawn")  # no fork of a process holding torch threads
    start = 0
    while start < len(texts):
        parent, child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_worker, args=(child, info_json, texts[start:]), daemon=True)
        process.start()
        child.close()
        next_start = len(texts)
        try:
            # The first result also waits for the child to start and import xgrammar: give it extra time.
            wait = timeout_s + 30.0
            for k in range(start, len(texts)):
                if not parent.poll(wait):
                    out[k] = f"timeout {timeout_s:g} s"
                    log.warning("baseline: xgrammar compile of schema %d timed out; skipping it", k)
                    next_start = k + 1
                    break
                i, serialized, error = parent.recv()
                out[start + i] = (error if serialized is None else
                                  _deserialize(serialized, tokenizer_info))
                wait = timeout_s
        except EOFError:
            log.warning("baseline: the xgrammar compile process died; %d schemas left", len(texts) - start)
        finally:
            process.kill()
            process.join(5)
            parent.close()
        start = next_start
    return out


def _deserialize(serialized: str, tokenizer_info: Any) -> Any:
    import xgrammar

    return xgrammar.CompiledGrammar.deserialize_json(serialized, tokenizer_info)
