"""`corral bench paired`: one request at a time, corral and llama-server taking turns request by request on the
same prompts: per-token time (TPOT) of free text and prompt processing (prefill) speed, each from the server's own
timings. On a shared machine whose speed drifts within minutes, alternating single requests compares the two
engines where a long run of one side and then the other compares two moments.

corral's figures come from its `timings` extra (`tpot_ms`; prefill: prompt tokens ÷ `ttft_ms`), llama-server's
from its own `timings` (`predicted_per_token_ms`, `prompt_per_second`). Prefill prompts are fresh random words
each round, so neither server reuses a cached prefix."""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from corral.benchmarks.harness import Bench, BenchExit, bench_command, pyplot, save_figure, write_json

_WORDS = ("cat", "river", "blue", "seven", "quickly", "under", "house", "north", "paper", "green", "stone", "wind")


def add_paired_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "paired", run_paired,
        help="corral against llama-server, single requests taking turns: TPOT and prefill speed",
        description="Sends one request at a time to a running corral (--server) and a running llama-server "
        "(--peer-url), taking turns request by request: --rounds greedy free-text answers of --tokens tokens "
        "(EOS ignored) and --rounds prompts of --prompt-words fresh random words answered with one token. "
        "Reports each side's median TPOT and prefill tokens/s from the servers' own timings and their ratio. "
        "Prints a table, writes OUT/results.json and OUT/paired.png.",
        server="a running corral, e.g. http://127.0.0.1:8000", out="bench-out/paired",
    ) as p:
        p.add_argument("--peer-url", required=True, metavar="URL", help="a running llama-server")
        p.add_argument("--rounds", type=int, default=6, metavar="N", help="requests per side and kind (default 6)")
        p.add_argument("--tokens", type=int, default=64, metavar="N", help="free-text tokens (default 64)")
        p.add_argument("--prompt-words", type=int, default=150, metavar="N",
                       help="words in each prefill prompt (default 150, ~450 tokens)")


def _post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"{url}/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise BenchExit(f"{url} answered {response.status_code}: {response.text[:200]}")
    answer: dict[str, Any] = response.json()
    return answer


def _corral_model(client: Any, url: str) -> str:
    listed = client.get(f"{url}/v1/models").json()
    return str(listed["data"][0]["id"])


def run_paired(args: argparse.Namespace, bench: Bench) -> int:
    import httpx

    if args.server is None:
        raise BenchExit("--server URL: a running corral to compare")
    if args.rounds < 1 or args.tokens < 2 or args.prompt_words < 1:
        raise BenchExit("--rounds must be >= 1, --tokens >= 2, --prompt-words >= 1")
    samples: dict[str, list[float]] = {"corral_tpot_ms": [], "peer_tpot_ms": [], "corral_prefill_tok_s": [],
                                       "peer_prefill_tok_s": []}
    words = random.Random()
    story = [{"role": "user", "content": "Write a long story about a cat."}]
    with httpx.Client(timeout=600) as client:
        model = _corral_model(client, args.server)
        for _ in range(args.rounds):
            free = {"messages": story, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
            samples["corral_tpot_ms"].append(_post(client, args.server, {**free, "model": model})["timings"]["tpot_ms"])
            peer = _post(client, args.peer_url, free)["timings"]
            samples["peer_tpot_ms"].append(float(peer["predicted_per_token_ms"]))
            text = " ".join(f"{words.choice(_WORDS)}{words.randint(0, 99)}" for _ in range(args.prompt_words))
            prompt = {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
            ours = _post(client, args.server, {**prompt, "model": model})
            samples["corral_prefill_tok_s"].append(ours["usage"]["prompt_tokens"] / ours["timings"]["ttft_ms"] * 1000)
            text += " ."  # a prompt of its own for the peer too, never a prefix corral's request left in its cache
            theirs = _post(client, args.peer_url, {**prompt, "messages": [{"role": "user", "content": text}]})
            samples["peer_prefill_tok_s"].append(float(theirs["timings"]["prompt_per_second"]))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    rows = [
        ("TPOT ms (lower is better)", medians["corral_tpot_ms"], medians["peer_tpot_ms"],
         medians["peer_tpot_ms"] / medians["corral_tpot_ms"]),
        ("prefill tok/s", medians["corral_prefill_tok_s"], medians["peer_prefill_tok_s"],
         medians["corral_prefill_tok_s"] / medians["peer_prefill_tok_s"]),
    ]
    bench.table(f"corral bench paired ({model}, {args.rounds} rounds)", ["metric", "corral", "llama-server",
                "corral's speed ÷ peer's"], [(name, f"{a:.1f}", f"{b:.1f}", f"{r:.2f}x") for name, a, b, r in rows])
    config = {key: getattr(args, key) for key in ("server", "peer_url", "rounds", "tokens", "prompt_words")}
    path = write_json(args.out, {"config": {**config, "model": model}, "medians": medians, "samples": samples,
                                 "ratios": {"tpot": rows[0][3], "prefill": rows[1][3]}})
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for axis, (key, label) in zip(axes, (("tpot_ms", "TPOT ms"), ("prefill_tok_s", "prefill tok/s")), strict=True):
        axis.boxplot([samples[f"corral_{key}"], samples[f"peer_{key}"]], tick_labels=["corral", "llama-server"])
        axis.set_title(label)
    bench.wrote(path, save_figure(fig, bench.plot_path))
    return 0
