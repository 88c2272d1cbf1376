"""Run the extraction requests against each side (corral with drafts, corral without, a peer) at each
concurrency, interleaving the sides repeat by repeat (this machine is shared and noisy: a ratio within one
repeat is what counts)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from corral.benchmarks.drafts.cases import SCHEMA, ExtractionCase


@dataclass(frozen=True)
class Side:
    """A server and how a request is spelled for it: corral's `drafts` field, or a peer's constraint field."""

    name: str
    url: str
    model: str
    drafts: bool | None = None  # corral: True / False; a peer: None
    constraint: str = "response_format"  # response_format (OpenAI's json_schema) or json_schema (llama-server)
    task: str = "extract"  # extract (the JSON record), free (the e-mail answered in words), plain (text that copies
    # nothing, every answer max_tokens long: where drafts find little, they must not cost)


@dataclass
class Run:
    """One side's pass over every case at one concurrency."""

    side: str
    concurrency: int
    repeat: int
    wall_s: float
    answers: int
    tokens: int
    exact: int
    valid: int
    errors: int
    draft_tokens: int = 0
    draft_accepted: int = 0
    drafts: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def answers_per_s(self) -> float:
        return self.answers / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "answers_per_s": self.answers_per_s, "tokens_per_s": self.tokens_per_s}


def body(side: Side, case: ExtractionCase, max_tokens: int, tag: str) -> dict[str, Any]:
    """The request; `tag` opens the prompt, unique per side and pass, so no side reuses another's cached
    prompt (each pays its prefill, as distinct e-mails would)."""
    text = {"extract": case.prompt, "free": case.free_prompt, "plain": case.plain_prompt}[side.task]
    prompt = f"Ticket {tag}.\n\n" + text
    payload: dict[str, Any] = {
        "model": side.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if side.task == "plain":
        payload["ignore_eos"] = True
    elif side.task == "free":
        pass
    elif side.constraint == "json_schema":
        payload["json_schema"] = SCHEMA
    else:
        payload["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    if side.drafts is not None:
        payload["drafts"] = side.drafts
    return payload


async def _one(
    client: httpx.AsyncClient, side: Side, case: ExtractionCase, max_tokens: int, tag: str
) -> dict[str, Any]:
    response = await client.post(f"{side.url}/v1/chat/completions", json=body(side, case, max_tokens, tag))
    if response.status_code != 200:
        return {"error": f"{response.status_code}: {response.text[:200]}"}
    payload: dict[str, Any] = response.json()
    return payload


async def _pass(
    side: Side, cases: list[ExtractionCase], concurrency: int, max_tokens: int, tag: str
) -> tuple[float, list[Any]]:
    limit = asyncio.Semaphore(concurrency)

    async def bounded(client: httpx.AsyncClient, i: int, case: ExtractionCase) -> dict[str, Any]:
        async with limit:
            return await _one(client, side, case, max_tokens, f"{tag}-{i + 1}")

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(bounded(client, i, case) for i, case in enumerate(cases)))
        return time.perf_counter() - start, list(replies)


def run_side(side: Side, cases: list[ExtractionCase], concurrency: int, repeat: int, max_tokens: int) -> Run:
    tag = f"{side.name.replace(' ', '-')}-c{concurrency}-r{repeat}"
    wall_s, replies = asyncio.run(_pass(side, cases, concurrency, max_tokens, tag))
    run = Run(side.name, concurrency, repeat, wall_s, 0, 0, 0, 0, 0)
    for case, reply in zip(cases, replies, strict=True):
        if "error" in reply:
            run.errors += 1
            run.texts.append(str(reply["error"]))
            continue
        run.answers += 1
        run.tokens += int((reply.get("usage") or {}).get("completion_tokens") or 0)
        text = str(reply["choices"][0]["message"].get("content") or "")
        run.texts.append(text[:400])
        timings = reply.get("timings") or {}
        run.draft_tokens += int(timings.get("draft_tokens") or 0)
        run.draft_accepted += int(timings.get("draft_accepted") or 0)
        run.drafts += int(timings.get("drafts") or 0)
        try:
            value = json.loads(text)
        except ValueError:
            continue
        run.valid += 1
        run.exact += value == case.expected
    return run


def run_drafts_bench(
    sides: list[Side], cases: list[ExtractionCase], levels: list[int], repeats: int, max_tokens: int,
    tick: Callable[[str], None],
) -> list[Run]:
    """Every side at every level, `repeats` times, the sides taking turns within each repeat. A warm-up pass
    of one case per side comes first (compiles the schema, fills caches) and is not counted."""
    for side in sides:
        run_side(side, cases[:1], 1, -1, max_tokens)
    runs = []
    for repeat in range(repeats):
        for level in levels:
            for side in sides:
                runs.append(run_side(side, cases, level, repeat, max_tokens))
                tick(f"{side.name} c{level}")
    return runs
