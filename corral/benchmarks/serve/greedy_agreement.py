"""`corral bench agree`: are corral's greedy tokens llama-server's on the same GGUF? The same raw prompts go to a
running corral and a running llama-server (`POST /v1/completions`, temperature 0, the top two logprobs at each
position); the answers are compared token by token. Where they part, both sides' top two logprobs there say why:
two tokens within a few hundredths of a nat of each other are a near-tie, which the two engines' different
rounding (corral computes the best logits of a step exactly in float32, llama-server reads them from its 8-bit
rounded product) may order either way; a wide margin on either side would be a real difference.

corral is also asked each prompt without logprobs: that is the answer a client gets (drafts on, the head's
screens), and it must be the same as the one with logprobs."""

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
        "ignored), with the top two logprobs at each position; and to corral once more without logprobs (the answer "
        "a client gets). Reports per prompt whether the answers are the same token for token, where they first "
        "part, each side's pick and its margin over its second choice there (a near-tie when under "
        f"{NEAR_TIE_NATS} nats). Prints a table, writes OUT/results.json and OUT/agree.png.",
        server="a running corral, e.g. http://127.0.0.1:8000", out="bench-out/agree",
    ) as p:
        p.add_argument("--peer-url", required=True, metavar="URL", help="a running llama-server on the same GGUF")
        p.add_argument("--prompts", type=int, default=len(PROMPTS), metavar="N",
                       help=f"how many of the built-in prompts (default all {len(PROMPTS)})")
        p.add_argument("--tokens", type=int, default=48, metavar="N", help="max_tokens of each answer (default 48)")


@dataclass(frozen=True)
class Position:
    """One generated token and the top two (token, logprob) a side reported there."""

    token: str
    top: tuple[tuple[str, float], ...]

    @property
    def margin(self) -> float | None:
        """The pick's lead over the second choice, in nats (None where fewer than two were reported)."""
        return self.top[0][1] - self.top[1][1] if len(self.top) >= 2 else None


@dataclass(frozen=True)
class Comparison:
    prompt: str
    tokens: int  # the shorter answer's length, in tokens
    same: bool  # token for token, to the shorter answer's end
    first_difference: int | None
    corral_token: str | None = None
    peer_token: str | None = None
    corral_margin: float | None = None
    peer_margin: float | None = None
    near_tie: bool = False
    prompt_tokens_match: bool = True
    served_is_logprobs_answer: bool = True  # corral without logprobs answered as with them


def positions(choice: dict[str, Any]) -> list[Position]:
    """The tokens of an answer with their top logprobs, from OpenAI's legacy completions shape (`tokens`,
    `top_logprobs` as dicts: corral) or the chat shape (`content`, each with `top_logprobs`: llama-server)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [Position(str(item["token"]), tuple(sorted(((str(t["token"]), float(t["logprob"]))
                                                            for t in item.get("top_logprobs", [])),
                                                           key=lambda pair: -pair[1])))
                for item in logprobs["content"]]
    tops = logprobs.get("top_logprobs") or [{} for _ in logprobs.get("tokens", [])]
    return [Position(str(token), tuple(sorted(((str(t), float(v)) for t, v in top.items()), key=lambda p: -p[1])))
            for token, top in zip(logprobs.get("tokens", []), tops, strict=True)]


def compare(prompt: str, ours: list[Position], theirs: list[Position], *, prompt_tokens_match: bool = True,
            served_is_logprobs_answer: bool = True) -> Comparison:
    """Where two greedy answers first part (to the shorter one's end), and both sides' margins there."""
    length = min(len(ours), len(theirs))
    at = next((i for i in range(length) if ours[i].token != theirs[i].token), None)
    mine = theirs_margin = None
    if at is not None:
        mine, theirs_margin = ours[at].margin, theirs[at].margin
    return Comparison(
        prompt=prompt, tokens=length, same=at is None, first_difference=at,
        corral_token=None if at is None else ours[at].token, peer_token=None if at is None else theirs[at].token,
        corral_margin=mine, peer_margin=theirs_margin,
        near_tie=any(m is not None and m < NEAR_TIE_NATS for m in (mine, theirs_margin)),
        prompt_tokens_match=prompt_tokens_match, served_is_logprobs_answer=served_is_logprobs_answer,
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
            served = _complete(client, args.server, {**body, "model": model})
            ours = _complete(client, args.server, {**body, "model": model, "logprobs": 2})
            theirs = _complete(client, args.peer_url, {**body, "logprobs": 2})
            same_prompt = ours["usage"]["prompt_tokens"] == theirs.get("usage", {}).get("prompt_tokens")
            result = compare(prompt, positions(ours["choices"][0]), positions(theirs["choices"][0]),
                             prompt_tokens_match=same_prompt,
                             served_is_logprobs_answer=served["choices"][0]["text"] == ours["choices"][0]["text"])
            results.append(result)
            progress.advance("same" if result.same else f"part at {result.first_difference}")
    same = sum(r.same for r in results)
    ties = sum(r.near_tie for r in results)
    matched = [r.first_difference if r.first_difference is not None else r.tokens for r in results]
    summary = {"prompts": len(results), "same": same, "parted_at_near_ties": ties,
               "parted_at_wide_margins": len(results) - same - ties,
               "matched_tokens_median": statistics.median(matched),
               "prompt_tokens_differ": sum(not r.prompt_tokens_match for r in results),
               "served_differs_from_logprobs_answer": sum(not r.served_is_logprobs_answer for r in results)}

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
