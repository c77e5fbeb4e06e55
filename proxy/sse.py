"""Server-sent events: encoding our events, the stream media type and headers."""
from __future__ import annotations

import json
from typing import Any

MEDIA_TYPE = "text/event-stream"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = b"data: [DONE]\n\n"


def encode(data: Any, event: str | None = None) -> bytes:
    """One SSE event; `event:` line only for APIs that name their events (Responses, Anthropic)."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()
