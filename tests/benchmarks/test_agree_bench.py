"""`corral bench agree` against a live corral (corral-tiny) and a stand-in for llama-server that answers in
llama-server's logprobs shape: the stand-in relays each request to the same corral, so every answer agrees,
except the first prompt's, whose fourth token it changes; the bench must find exactly that."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, run_bench, stub_peer

from corral.benchmarks.serve.greedy_agreement import PROMPTS, Position, answer_of, compare

PARTED_AT = 3


def _llama_shape(answer: dict[str, Any], change: int | None) -> dict[str, Any]:
    """corral's legacy completions logprobs as llama-server writes them (`content`, with each token's bytes), token
    `change` replaced in the text too by one neither side's top two holds, with a wide margin."""
    logprobs = answer["choices"][0]["logprobs"]
    content, text = [], ""
    for i, (token, top) in enumerate(zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)):
        tops = [{"token": t, "logprob": v} for t, v in top.items()]
        if i == change:
            token, tops = "<other>", [{"token": "<other>", "logprob": -0.01}, {"token": token, "logprob": -5.0}]
        content.append({"token": token, "bytes": list(token.encode()), "logprob": tops[0]["logprob"],
                        "top_logprobs": tops})
        text += token
    return {"choices": [{"text": text, "logprobs": {"content": content}}], "usage": answer["usage"]}


@pytest.fixture()
def llama_like(server: RunningServer) -> Iterator[str]:
    def relay(body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "corral-tiny"},
                            timeout=120).json()
        return _llama_shape(answer, PARTED_AT if body["prompt"] == PROMPTS[0] else None)

    with stub_peer(relay) as url:
        yield url


def test_agree_finds_where_greedy_answers_part(server: RunningServer, llama_like: str, tmp_path: Path) -> None:
    done = run_bench("agree", "--server", server.base_url, "--peer-url", llama_like, "--prompts", "3",
                     "--tokens", "8", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    first, *rest = results["results"]
    assert not first["same"] and first["first_difference"] == PARTED_AT and first["peer_token"] == "<other>"
    assert first["peer_margin"] == pytest.approx(4.99) and not first["near_tie"]
    assert all(r["same"] and r["tokens"] == 8 for r in rest)
    # corral asked again (prefix cache, drafts) wrote the same (no near-ties on this model); both saw one prompt.
    assert all(r["repeat_is_same"] and r["prompt_tokens_match"] for r in results["results"])
    assert results["summary"] == {"prompts": 3, "same": 2, "parted_at_near_ties": 0, "parted_at_wide_margins": 1,
                                  "matched_tokens_median": 8, "prompt_tokens_differ": 0,
                                  "repeat_differs": 0}
    assert "2 of 3 the same" in done.stdout
    assert (tmp_path / "agree.png").stat().st_size > 0


def test_a_parting_between_two_near_equal_tokens_is_a_near_tie() -> None:
    ours = answer_of({"text": "ab", "logprobs": {"tokens": ["a", "b"], "text_offset": [0, 1],
                                                 "top_logprobs": [{"a": -0.1, "z": -3.0}, {"b": -0.70, "c": -0.72}]}})
    theirs = answer_of({"text": "ac", "logprobs": {"content": [
        {"token": "a", "bytes": [97],
         "top_logprobs": [{"token": "z", "logprob": -3.0}, {"token": "a", "logprob": -0.1}]},
        {"token": "c", "bytes": [99],
         "top_logprobs": [{"token": "c", "logprob": -0.69}, {"token": "b", "logprob": -0.71}]}]}})
    assert theirs.positions[0] == Position("a", 0, (("a", -0.1), ("z", -3.0)))  # best first, whatever the wire's order
    parted = compare("p", ours, theirs)
    assert parted.first_difference == 1 and (parted.corral_token, parted.peer_token) == ("b", "c")
    assert parted.near_tie and parted.corral_margin == pytest.approx(0.02)
    assert compare("p", ours, ours).same


def test_a_character_split_across_tokens_is_compared_as_text() -> None:
    """llama-server joins the tokens of a character split across tokens ('①' is 3 bytes in 2 of Qwen2.5's tokens)
    into one entry; corral reports each token. The same text is the same answer."""
    circled = "\u2460"
    ours = answer_of({"text": f"x{circled}y", "logprobs": {"tokens": ["x", "\ufffd", "\ufffd", "y"],
                                                          "text_offset": [0, 1, 1, 2], "top_logprobs": [{}] * 4}})
    theirs = answer_of({"text": f"x{circled}z", "logprobs": {"content": [
        {"token": "x", "bytes": [120]}, {"token": circled, "bytes": list(circled.encode())},
        {"token": "z", "bytes": [122]}]}})
    assert [p.start for p in theirs.positions] == [0, 1, 2]
    assert compare("p", ours, ours).same
    parted = compare("p", ours, theirs)
    assert parted.first_difference == 3 and (parted.corral_token, parted.peer_token) == ("y", "z")
