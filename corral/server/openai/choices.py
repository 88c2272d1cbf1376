"""The choices of one response: `n` independent samples, run or streamed together, each shaped as OpenAI's
choice object in one place (`choice_body` for a whole answer, `chunk_choice` for a streamed piece)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from corral.server.engine import SeqOutput
from corral.server.engine.logprobs import TokenLogprob
from corral.server.openai.finish import FinishReasonMode, finish_fields
from corral.server.openai.logprobs import chat_logprobs, completion_logprobs, token_text
from corral.server.openai.tools import chat_message
from corral.server.prepared import Finished, Prepared
from corral.server.serving import Service


def expand(prepared: Prepared, n: int) -> list[Prepared]:
    """One Prepared per choice. Each becomes its own Sequence with its own grammar matcher and generator; with
    a seed, choice i draws from seed + i (so choice 0 is what the same request with n=1 returns)."""
    if n == 1:
        return [prepared]
    seed = prepared.params.seed
    return [
        replace(
            prepared,
            request_id=f"{prepared.request_id}-{i}",
            params=replace(prepared.params, seed=None if seed is None else seed + i),
        )
        for i in range(n)
    ]


async def run_choices(service: Service, choices: list[Prepared]) -> list[Finished]:
    """Generate every choice to its end, concurrently (`auto`'s regeneration happens per choice). If one
    fails (e.g. 429), the others are cancelled and that error is raised."""
    if len(choices) == 1:
        return [await service.run(choices[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(service.run(p)) for p in choices]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


Streamed = tuple[int, SeqOutput, Finished | None]


async def stream_choices(service: Service, choices: list[Prepared]) -> AsyncGenerator[Streamed]:
    """Every choice's engine outputs, as (choice index, output, the finished answer with the last) in the order
    they come. Closing the iterator (or a failure of one choice) aborts the choices still running; use it under
    `contextlib.aclosing`."""
    queue: asyncio.Queue[Streamed | BaseException | None] = asyncio.Queue()

    async def pump(index: int, prepared: Prepared) -> None:
        try:
            async for out, done in service.stream(prepared):
                queue.put_nowait((index, out, done))
            queue.put_nowait(None)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # a choice still in the engine is aborted by service.stream's cleanup
        await asyncio.gather(*tasks, return_exceptions=True)


def logprobs_body(
    entries: list[TokenLogprob], prepared: Prepared, tokenizer: Any, *, chat: bool, before: list[int] | None = None
) -> dict[str, Any] | None:
    """OpenAI's `logprobs` value for these entries; None when the request did not ask for logprobs.
    `before`: the token ids of entries this choice already streamed (completions' text offsets)."""
    if not prepared.params.logprobs:
        return None
    text = token_text(tokenizer)
    if chat:
        return chat_logprobs(entries, text)
    return completion_logprobs(entries, text, top_n=prepared.params.top_logprobs, before=before or [])


def choice_body(
    index: int,
    done: Finished,
    *,
    chat: bool,
    logprobs: dict[str, Any] | None,
    finish_mode: FinishReasonMode,
    extras: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a whole answer. `extras` (the choice's own `grammar` / `timings`) go in when n > 1."""
    choice: dict[str, Any] = {"index": index, **finish_fields(done.finish_reason, finish_mode), "logprobs": logprobs}
    if chat:
        choice["message"] = chat_message(done.text, done.check)
    else:
        choice["text"] = done.text
    return {**choice, **(extras or {})}


def chunk_choice(
    index: int,
    delta: str | None,
    finish_reason: str | None,
    *,
    chat: bool,
    finish_mode: FinishReasonMode,
    logprobs: dict[str, Any] | None = None,
    first: bool = False,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One choice of a streamed chunk: `delta` is new text (None: none in this chunk); `fields` are other delta
    fields (tool-call deltas)."""
    choice: dict[str, Any] = {"index": index, **finish_fields(finish_reason, finish_mode), "logprobs": logprobs}
    if chat:
        content: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            content["content"] = delta
        choice["delta"] = {**content, **(fields or {})}
    else:
        choice["text"] = delta or ""
    return choice
