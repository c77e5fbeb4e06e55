"""The proxy's ASGI app: its routes, the body budget over all requests, and what the run drives (pause, version)."""
from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route, Router, request_response

from proxy.admission import HOLD, Admission
from proxy.anthropic_api import MessagesAdapter, tokenize_body
from proxy.budget import BodyBudget
from proxy.call import Call
from proxy.errors import (
    ANTHROPIC,
    OPENAI,
    ProxyError,
    check_field,
    error_body,
    error_response,
    upstream_error_message,
)
from proxy.gate import Gate
from proxy.openai_api import Adapter, ChatAdapter, CompletionsAdapter
from proxy.recording import Outstanding, RecordingQueue
from proxy.replicas import Replicas
from proxy.responses_api import ResponsesAdapter
from proxy.types import Recorder, RolloutDirectory, UpstreamConfig
from proxy.upstream import UpstreamError

logger = logging.getLogger(__name__)

ADAPTERS: dict[str, type[Adapter]] = {
    "chat/completions": ChatAdapter,
    "completions": CompletionsAdapter,
    "responses": ResponsesAdapter,
    "messages": MessagesAdapter,
}


def _guard(fmt: str, handler: Callable[[Request], Awaitable[Response]]):
    """Turn an unexpected exception into a logged 500 in the caller's format; the proxy keeps serving."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception:
            logger.exception("proxy error on %s %s", request.method, request.url.path)
            return error_response(fmt, ProxyError(500, "internal proxy error", "proxy_error"))

    return guarded


class _AnyMethod:
    """An endpoint a Route serves for every HTTP method (Starlette limits function endpoints to a list)."""

    def __init__(self, handler: Callable[[Request], Awaitable[Response]]) -> None:
        self._app = request_response(handler)

    async def __call__(self, scope, receive, send) -> None:
        await self._app(scope, receive, send)


class _ModelCalls:
    """The endpoint of one model API: each request is a Call, speaking ASGI itself (no Response object, no task
    group per stream: proxy.call sends every chunk straight to the server)."""

    def __init__(self, proxy: ProxyApp, adapter_cls: type[Adapter]) -> None:
        self.proxy, self.adapter_cls = proxy, adapter_cls

    async def __call__(self, scope, receive, send) -> None:
        await Call(self.proxy, self.adapter_cls, Request(scope, receive)).serve(send)


class ProxyApp:
    """The recording proxy as an ASGI app, with pause/resume and the policy version for the run to drive."""

    def __init__(
        self,
        directory: RolloutDirectory,
        recorder: Recorder,
        upstream: UpstreamConfig,
        policy_version: Callable[[], int] | int = 0,
        max_body_bytes: int = 32 * 1024 * 1024,
        pause_wait_s: float = 30.0,
        retry_after_s: float = 5.0,
        transport=None,
        bodies_limit_bytes: int = 512 * 1024 * 1024,
        replica_alive: Callable[[int], bool] | None = None,
    ) -> None:
        self.config = upstream
        self.admission = Admission(directory, max_body_bytes)
        # The engine, or its replicas (upstream.replica_urls): `replica_alive(i)` tells whether replica i still runs.
        self.engines = Replicas(upstream, transport, alive=replica_alive)
        self.outstanding = Outstanding()  # seqs handed out and not yet stored (see settled)
        self.records = RecordingQueue(recorder, on_stored=self.outstanding.stored)
        self.recorder = recorder
        self.gate = Gate(pause_wait_s, retry_after_s)
        self.bodies = BodyBudget(bodies_limit_bytes)  # all requests together
        self._policy_version = policy_version
        self.sampling_override_calls = 0  # train calls whose harness asked for sampling other than the run's
        base = "/rollouts/{rollout_id}/v1/"
        routes = [Route(base + path, _ModelCalls(self, adapter), methods=["POST"]) for path, adapter in ADAPTERS.items()]
        routes += [
            Route(base + "messages/count_tokens", _guard(ANTHROPIC, self._count_tokens), methods=["POST"]),
            Route(base + "models", _guard(OPENAI, self._models), methods=["GET"]),
            Route(base + "reward", _guard(OPENAI, self._reward), methods=["POST"]),
            Route(base + "{rest:path}", _guard(OPENAI, self._unknown), methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
            Route("/healthz", self._health, methods=["GET"]),
        ]
        # Last, for every method: whatever no route above takes under a rollout is authenticated before it is
        # told 404 or 405, so a caller without the rollout's key learns nothing about the paths served.
        routes.append(Route("/rollouts/{rollout_id}/{rest:path}", _AnyMethod(_guard(OPENAI, self._unrouted))))
        # A bare Router, not Starlette(): its two middleware layers cost every streamed chunk a detour, and
        # _guard (or Call.serve) already answers unexpected errors with a 500 in the caller's format.
        self.app = Router(routes=routes, lifespan=self._lifespan)

    async def __call__(self, scope, receive, send) -> None:
        """Serve one request, counting its body against the budget for all requests until it is answered."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hold = self.bodies.hold()

        async def counted() -> dict:
            message = await receive()
            if message["type"] == "http.request" and message.get("body"):
                hold.take(len(message["body"]))  # a ProxyError reaches the handler reading the body
            return message

        try:
            await self.app({**scope, HOLD: hold}, counted, send)
        finally:
            hold.release()

    # --- what the run drives -------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        value = self._policy_version
        return int(value() if callable(value) else value)

    def set_policy_version(self, version: int) -> None:
        self._policy_version = int(version)

    @property
    def busy_seconds(self) -> float:
        """Wall seconds with at least one train rollout's call in flight (generation time, for the run's metrics).

        Evaluation calls (RolloutInfo.split 'val') are left out, so an evaluation between two steps does not
        show as the next step's generation."""
        return self.gate.busy_seconds

    async def pause(self, timeout: float | None = None) -> None:
        """Hold new calls and return once calls in flight have drained and been recorded (TimeoutError if not)."""
        await self.gate.pause(timeout)

    async def resume(self) -> None:
        await self.gate.resume()

    def unstored(self, rollout_id: str) -> int:
        """Records of the rollout a trainer must still wait for (Outstanding.unstored)."""
        return self.outstanding.unstored(rollout_id)

    async def settled(self, rollout_id: str, timeout: float) -> int:
        """Wait up to `timeout` s until the rollout's trajectory is whole in the recorder; the records still
        missing then (0: whole)."""
        return await self.outstanding.settled(rollout_id, timeout)

    async def aclose(self) -> None:
        """Flush pending and retried records, then close the engine client."""
        await self.records.aclose()
        await self.engines.aclose()

    @asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.aclose()

    # --- other routes --------------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        fmt = ANTHROPIC if "anthropic-version" in request.headers else OPENAI
        try:
            await self.admission.rollout(request)
        except ProxyError as exc:
            return error_response(fmt, exc)
        model = self.config.served_model
        if fmt == ANTHROPIC:
            entry = {"type": "model", "id": model, "display_name": model, "created_at": "1970-01-01T00:00:00Z"}
            return JSONResponse({"data": [entry], "has_more": False, "first_id": model, "last_id": model})
        entry = {"id": model, "object": "model", "created": 0, "owned_by": "lightning-web"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def _reward(self, request: Request) -> Response:
        try:
            info = await self.admission.rollout(request)
            body = await self.admission.read_json(request, finite=False)  # a NaN reward is told so below
            if not isinstance(body, dict):
                raise ProxyError(400, "request body must be a JSON object", "invalid_body")
            reward = check_field(body, "reward", (int, float), required=True)
            if not math.isfinite(reward):
                raise ProxyError(400, "field 'reward' must be a finite number", "invalid_value")
            detail = check_field(body, "detail", dict) or {}
        except ProxyError as exc:
            return error_response(OPENAI, exc)
        try:
            await self.recorder.report_reward(info.rollout_id, float(reward), detail)
        except Exception:
            logger.exception("rollout %s: recorder failed to store reward %s", info.rollout_id, reward)
            return error_response(OPENAI, ProxyError(503, "could not store the reward; retry", "reward_not_stored"))
        return JSONResponse({"rollout_id": info.rollout_id, "reward": float(reward), "detail": detail})

    async def _count_tokens(self, request: Request) -> Response:
        """Anthropic's count_tokens: the engine's own count of the prompt /v1/messages would render.

        Not a model call: nothing is recorded, and it skips the gate, since the tokenizer is the same before and
        after a weight update and the engine tokenizes while paused.
        """
        try:
            info = await self.admission.rollout(request)
            body = tokenize_body(await self.admission.read_json(request), self.config.served_model)
        except ProxyError as exc:
            return error_response(ANTHROPIC, exc)
        try:
            answer = await self.engines.tokenize(body)
        except UpstreamError as exc:
            message = upstream_error_message(exc.body, exc.message)
            logger.warning("rollout %s: count_tokens failed: %s: %s", info.rollout_id, exc.status, message)
            return JSONResponse(error_body(ANTHROPIC, exc.status, message), status_code=exc.status)
        count = answer.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            message = "engine answered /tokenize without a token count"
            return error_response(ANTHROPIC, ProxyError(502, message, "bad_engine_answer"))
        return JSONResponse({"input_tokens": count})

    async def _unknown(self, request: Request) -> Response:
        """An unknown /v1/ endpoint: 404 for any method, once the caller has shown the rollout's key."""
        return await self._not_served(request, "/v1/" + request.path_params["rest"], [])

    async def _unrouted(self, request: Request) -> Response:
        """Anything else under a rollout: 405 where a route serves the path with other methods, else 404.

        As Starlette's router does, the first route that takes the path names the allowed methods.
        """
        endpoint = "/" + request.path_params["rest"]
        for route in self.app.routes[:-1]:
            if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is Match.PARTIAL:
                return await self._not_served(request, endpoint, sorted(route.methods))
        return await self._not_served(request, endpoint, [])

    async def _not_served(self, request: Request, endpoint: str, allowed: list[str]) -> Response:
        """The 404 or 405 for `endpoint` (the path below /rollouts/<id>), once the caller has shown the key."""
        fmt = ANTHROPIC if "anthropic-version" in request.headers else OPENAI
        try:
            await self.admission.authenticated(request)
        except ProxyError as exc:
            return error_response(fmt, exc)
        if allowed:
            message = f"method {request.method} not allowed on '{endpoint}'"
            return error_response(fmt, ProxyError(405, message, "method_not_allowed", {"allow": ", ".join(allowed)}))
        return error_response(fmt, ProxyError(404, f"unknown endpoint '{endpoint}'", "unknown_endpoint"))

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "paused": self.gate.paused, "in_flight": self.gate.in_flight})


create_app = ProxyApp
"""The proxy for one run: `create_app(directory, recorder, upstream, ...)`; serve it with uvicorn, then
`await app.aclose()`."""
