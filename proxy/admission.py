"""Who may call and what was sent: the rollout's key and state, and the request body read within the proxy's limits."""
from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from proxy.auth import any_key_matches, presented_keys
from proxy.budget import BodyHold, parse_cost
from proxy.errors import CLIENT_CLOSED, ProxyError
from proxy.request_json import parse_json
from proxy.types import RolloutDirectory, RolloutInfo

HOLD = "lightning.body_hold"
"""Scope key of the request's BodyHold (ProxyApp.__call__ puts it there)."""


class Admission:
    """Checks a request against its rollout and reads its body; every refusal is a ProxyError to answer with."""

    def __init__(self, directory: RolloutDirectory, max_body_bytes: int) -> None:
        self.directory = directory
        self.max_body_bytes = max_body_bytes

    async def authenticated(self, request: Request) -> RolloutInfo:
        """The request's rollout once the caller has shown its key: 404 for an unknown rollout, else 401."""
        rollout_id = request.path_params["rollout_id"]
        info = await self.directory.get(rollout_id)
        if info is None:
            raise ProxyError(404, f"unknown rollout '{rollout_id}'", "rollout_not_found")
        if not any_key_matches(presented_keys(request), info.secret_hash):
            raise ProxyError(401, "missing or invalid API key for this rollout", "invalid_api_key")
        return info

    async def rollout(self, request: Request) -> RolloutInfo:
        """The request's rollout, authenticated and still running (409 once it has finished)."""
        info = await self.authenticated(request)
        if info.finished:
            raise ProxyError(409, f"rollout '{info.rollout_id}' is finished", "rollout_finished")
        return info

    async def read_json(self, request: Request, finite: bool = True) -> object:
        """The body as JSON; `finite=False` lets NaN and infinities through for a caller that names its field."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # never inflated here: a gzip bomb costs us nothing
            raise ProxyError(415, f"Content-Encoding '{encoding}' is not supported; send the body uncompressed",
                             "unsupported_content_encoding")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise ProxyError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > self.max_body_bytes:
                    raise ProxyError(413, f"request body over {self.max_body_bytes} bytes", "request_too_large")
                parts.append(part)
        except ClientDisconnect:  # it hung up, or was closed for sending too slowly: nobody reads an answer
            raise ProxyError(CLIENT_CLOSED, "client disconnected while sending the request body",
                             "client_closed_request") from None
        hold: BodyHold = request.scope[HOLD]
        raw = b"".join(parts)
        cost = parse_cost(raw)
        hold.take(cost.peak)  # before parsing: a body that would parse big is refused before it does
        try:
            return parse_json(raw, finite)
        finally:  # the parts, their joined copy and the decoded text are freed on return: hold the parsed body
            hold.give(size + cost.peak - cost.kept)
