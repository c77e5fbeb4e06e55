"""Server-sent events: encoding our events, the stream media type and headers."""
from __future__ import annotations

import json
from typing import Any

MEDIA_TYPE = "text/event-stream"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
RAW_HEADERS = [(k.encode(), v.encode()) for k, v in HEADERS.items()] + [
    (b"content-type", f"{MEDIA_TYPE}; charset=utf-8".encode())]
"""The ASGI headers of an event stream (as Starlette's StreamingResponse sends them)."""
DONE = b"data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
"""Made once: json.dumps with options builds a new encoder per call, and streams encode one event per chunk."""


def encode(data: Any, event: str | None = None) -> bytes:
    """One SSE event; `event:` line only for APIs that name their events (Responses, Anthropic)."""
    payload = _ENCODER.encode(data)
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()
