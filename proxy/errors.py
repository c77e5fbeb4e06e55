"""Proxy errors and their rendering in each caller's API format (OpenAI or Anthropic)."""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

OPENAI, ANTHROPIC = "openai", "anthropic"
CLIENT_CLOSED = 499
"""Status of a call whose harness hung up before it had the whole answer (nginx's code)."""

# status -> (OpenAI error type, Anthropic error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    409: ("conflict_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    499: ("client_closed_request", "api_error"),
    502: ("bad_gateway", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
    504: ("timeout_error", "timeout_error"),
}


class ProxyError(Exception):
    """An error the proxy answers with: HTTP status, message, optional code and headers."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


def error_types(status: int) -> tuple[str, str]:
    if status in _TYPES:
        return _TYPES[status]
    return ("invalid_request_error", "invalid_request_error") if status < 500 else ("api_error", "api_error")


def error_body(fmt: str, status: int, message: str, code: str | None = None) -> dict[str, Any]:
    openai_type, anthropic_type = error_types(status)
    if fmt == ANTHROPIC:
        return {"type": "error", "error": {"type": anthropic_type, "message": message}}
    return {"error": {"message": message, "type": openai_type, "param": None, "code": code}}


def error_response(fmt: str, exc: ProxyError) -> Response:
    body = json.dumps(error_body(fmt, exc.status, exc.message, exc.code))
    return Response(body, status_code=exc.status, media_type="application/json", headers=exc.headers)


def upstream_error_message(body: Any, fallback: str) -> str:
    """The message inside an engine error body (`{"error": {...}}` or vLLM's flat `{"message": ...}`)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
    return fallback


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object"}


def check_field(body: dict, name: str, types: type | tuple[type, ...], required: bool = False) -> Any:
    """Return body[name] after checking its type; a ProxyError(400) names the field and what it must be."""
    if name not in body or body[name] is None:
        if required:
            raise ProxyError(400, f"missing required field '{name}'", "missing_required_parameter")
        return None
    value = body[name]
    wanted = types if isinstance(types, tuple) else (types,)
    bad_bool = isinstance(value, bool) and bool not in wanted  # bool is an int subclass
    if bad_bool or not isinstance(value, wanted):
        names = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in wanted)
        raise ProxyError(400, f"field '{name}' must be {names}, got {type(value).__name__}", "invalid_type")
    return value
