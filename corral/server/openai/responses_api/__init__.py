"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: a request becomes a chat request, its answer
becomes output items (and, streamed, typed events)."""
