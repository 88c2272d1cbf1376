"""`corral bench agree`: are corral's greedy tokens llama-server's on the same GGUF? The same raw prompts go to a
running corral and a running llama-server (`POST /v1/completions`, temperature 0, the top two logprobs at each
position); the answers are compared token by token. Where they part, both sides' top two logprobs there say why:
two tokens within a few hundredths of a nat of each other are a near-tie, which the two engines' different
rounding (corral computes the best logits of a step exactly in float32, llama-server reads them from its 8-bit
rounded product) may order either way; a wide margin on either side would be a real difference.

Each prompt goes to each server fresh (nothing of it cached), corral with logprobs. corral is then asked it again
without logprobs (drafts on, as a client asks): its prompt now comes from the prefix cache, so its last token is
computed as a decode row, not inside the prompt's chunk. The two kernels sum in different orders, and at a near-tie
the repeat may part from the first answer; llama-server's prompt and decode kernels differ the same way."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from corral.benchmarks.harness import Bench, BenchExit, bench_command, pyplot, save_figure, write_json

# Raw prompts of several kinds (prose, code, arithmetic, a list, JSON, a dialogue), no chat template: both servers
# then tokenize the same text the same way, which the prompt token counts check.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 multiplied by 23?\nA:",
    "Here is a list of five fruits:\n1.",
    '{"name": "Ada Lovelace", "born": 1815, "known_for": "',
    "Once upon a time, in a village by the sea, there lived",
    "The three laws of thermodynamics are",
    "import json\n\nwith open(\"data.json\") as f:\n",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "User: Can you recommend a good book about history?\nAssistant:",
    "SELECT name, COUNT(*) FROM orders",
    "The most important thing to remember when learning to cook is",
)
NEAR_TIE_NATS = 0.1  # top two logprobs closer than this: either order is within the engines' rounding


def add_agree_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "agree", run_agree,
        help="corral's greedy tokens against llama-server's on the same model: where they part and why",
        description="Sends --prompts raw prompts (built in: prose, code, arithmetic, JSON, ...) to a running corral "
        "(--server) and a running llama-server (--peer-url) on the same GGUF, greedy, --tokens tokens each (EOS "
        "ignored), with the top two logprobs at each position; then to corral again without logprobs (its prompt "
        "from the prefix cache, drafts on). Reports per prompt whether the answers are the same text, where they "
        "first part, each side's pick and its margin over its second choice there (a near-tie when under "
        f"{NEAR_TIE_NATS} nats). Prints a table, writes OUT/results.json and OUT/agree.png.",
        server="a running corral, e.g. http://127.0.0.1:8000", out="bench-out/agree",
    ) as p:
        p.add_argument("--peer-url", required=True, metavar="URL", help="a running llama-server on the same GGUF")
        p.add_argument("--prompts", type=int, default=len(PROMPTS), metavar="N",
                       help=f"how many of the built-in prompts (default all {len(PROMPTS)})")
        p.add_argument("--tokens", type=int, default=48, metavar="N", help="max_tokens of each answer (default 48)")


@dataclass(frozen=True)
class Position:
    """One generated token, where it starts in the answer's text (characters), and the top two (token, logprob)
    a side reported there."""

    token: str
    start: int
    top: tuple[tuple[str, float], ...]

    @property
    def margin(self) -> float | None:
        """The pick's lead over the second choice, in nats (None where fewer than two were reported)."""
        return self.top[0][1] - self.top[1][1] if len(self.top) >= 2 else None


@dataclass(frozen=True)
class Answer:
    text: str
    positions: list[Position]

    def token_at(self, char: int) -> int:
        """The index of the token whose text holds character `char` (the last one that starts at or before it)."""
        return max((i for i, p in enumerate(self.positions) if p.start <= char), default=0)


@dataclass(frozen=True)
class Comparison:
    prompt: str
    tokens: int  # corral's answer, in tokens
    same: bool  # the same text
    first_difference: int | None  # corral's token where the texts part
    corral_token: str | None = None
    peer_token: str | None = None
    corral_margin: float | None = None
    peer_margin: float | None = None
    near_tie: bool = False
    prompt_tokens_match: bool = True
    repeat_is_same: bool = True  # corral asked again (prompt from its prefix cache, no logprobs) wrote the same
    corral_text: str = ""
    peer_text: str = ""


def _ranked(pairs: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(pairs, key=lambda pair: -pair[1]))


def answer_of(choice: dict[str, Any]) -> Answer:
    """An answer's text and tokens with their top logprobs, from OpenAI's legacy completions shape (`tokens`,
    `text_offset`, `top_logprobs` as dicts: corral) or the chat shape (`content`, each with its `bytes` and
    `top_logprobs`: llama-server, which joins the tokens of a character split across tokens into one entry)."""
    text, logprobs = str(choice.get("text", "")), choice.get("logprobs") or {}
    if "content" in logprobs:
        positions, consumed, raw = [], 0, text.encode()
        for item in logprobs["content"]:
            start = len(raw[:consumed].decode("utf-8", errors="ignore"))
            ranked = _ranked([(str(t["token"]), float(t["logprob"])) for t in item.get("top_logprobs", [])])
            positions.append(Position(str(item["token"]), start, ranked))
            consumed += len(item.get("bytes") or str(item["token"]).encode())
        return Answer(text, positions)
    tokens = logprobs.get("tokens", [])
    tops = logprobs.get("top_logprobs") or [{} for _ in tokens]
    offsets = logprobs.get("text_offset") or [0] * len(tokens)
    return Answer(text, [Position(str(token), int(offset), _ranked([(str(t), float(v)) for t, v in top.items()]))
                         for token, offset, top in zip(tokens, offsets, tops, strict=True)])


def compare(prompt: str, ours: Answer, theirs: Answer, *, prompt_tokens_match: bool = True,
            repeat_is_same: bool = True) -> Comparison:
    """Where two greedy answers' texts first part, the token each side wrote there and its margin."""
    same = ours.text == theirs.text
    mine = peer = None
    at: int | None = None
    if not same and ours.positions and theirs.positions:
        char = next((i for i, (a, b) in enumerate(zip(ours.text, theirs.text, strict=False)) if a != b),
                    min(len(ours.text), len(theirs.text)))
        at = ours.token_at(char)
        mine, peer = ours.positions[at], theirs.positions[theirs.token_at(char)]
    margins = (mine.margin if mine else None, peer.margin if peer else None)
    return Comparison(
        prompt=prompt, tokens=len(ours.positions), same=same, first_difference=at,
        corral_token=mine.token if mine else None, peer_token=peer.token if peer else None,
        corral_margin=margins[0], peer_margin=margins[1],
        near_tie=any(m is not None and m < NEAR_TIE_NATS for m in margins),
        prompt_tokens_match=prompt_tokens_match, repeat_is_same=repeat_is_same, corral_text=ours.text,
        peer_text=theirs.text,
    )


def _complete(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise BenchExit(f"{url} answered {response.status_code}: {response.text[:200]}", code=1)
    answer: dict[str, Any] = response.json()
    return answer


def run_agree(args: argparse.Namespace, bench: Bench) -> int:
    import httpx

    if args.server is None:
        raise BenchExit("--server URL: a running corral to compare")
    if not 1 <= args.prompts <= len(PROMPTS) or args.tokens < 1:
        raise BenchExit(f"--prompts must be 1-{len(PROMPTS)}, --tokens >= 1")
    results: list[Comparison] = []
    with httpx.Client(timeout=600) as client, bench.progress() as progress:
        model = str(client.get(f"{args.server}/v1/models").json()["data"][0]["id"])
        progress.phase("prompts", args.prompts)
        for prompt in PROMPTS[: args.prompts]:
            # EOS ignored (both servers then never pick it): every answer is --tokens long on both sides.
            body = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
            ours = _complete(client, args.server, {**body, "model": model, "logprobs": 2})
            theirs = _complete(client, args.peer_url, {**body, "logprobs": 2})
            again = _complete(client, args.server, {**body, "model": model})
            same_prompt = ours["usage"]["prompt_tokens"] == theirs.get("usage", {}).get("prompt_tokens")
            result = compare(prompt, answer_of(ours["choices"][0]), answer_of(theirs["choices"][0]),
                             prompt_tokens_match=same_prompt,
                             repeat_is_same=again["choices"][0]["text"] == ours["choices"][0]["text"])
            results.append(result)
            progress.advance("same" if result.same else f"part at {result.first_difference}")
    same = sum(r.same for r in results)
    ties = sum(r.near_tie for r in results)
    matched = [r.tokens if r.first_difference is None else r.first_difference for r in results]
    summary = {"prompts": len(results), "same": same, "parted_at_near_ties": ties,
               "parted_at_wide_margins": len(results) - same - ties,
               "matched_tokens_median": statistics.median(matched),
               "prompt_tokens_differ": sum(not r.prompt_tokens_match for r in results),
               "repeat_differs": sum(not r.repeat_is_same for r in results)}

    def margin(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    bench.table(f"corral bench agree ({model}, greedy, {args.tokens} tokens): {same} of {len(results)} the same, "
                f"{ties} parted at a near-tie", ["prompt", "tokens", "same", "parts at", "corral / peer pick",
                                                "margins (nats)"],
                [(repr(r.prompt[:28]), str(r.tokens), "yes" if r.same else "no",
                  "-" if r.first_difference is None else str(r.first_difference),
                  "-" if r.same else f"{r.corral_token!r} / {r.peer_token!r}",
                  "-" if r.same else f"{margin(r.corral_margin)} / {margin(r.peer_margin)}") for r in results])
    config = {"server": args.server, "peer_url": args.peer_url, "prompts": args.prompts, "tokens": args.tokens,
              "model": model, "near_tie_nats": NEAR_TIE_NATS}
    path = write_json(args.out, {"config": config, "summary": summary, "results": [asdict(r) for r in results]})
    plt = pyplot()
    fig, axis = plt.subplots(figsize=(8, 3.2))
    axis.bar(range(len(results)), [r.tokens for r in results], color="#dddddd", label="answer")
    axis.bar(range(len(results)), matched, color="#4c72b0", label="the same tokens")
    axis.set_xlabel("prompt")
    axis.set_ylabel("tokens")
    axis.legend()
    bench.wrote(path, save_figure(fig, bench.plot_path))
    return 0
