"""The proxy's ASGI app: routes, admission (auth, gate), the engine round trip and recording."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match, Route, Router, request_response

from proxy import sse
from proxy.anthropic_api import MessagesAdapter, tokenize_body
from proxy.assemble import Accumulator, Tokens, chunks_from_answer, extract_tokens
from proxy.auth import any_key_matches, presented_keys
from proxy.budget import BodyBudget, BodyHold, parse_cost
from proxy.errors import ANTHROPIC, OPENAI, ProxyError, check_field, error_body, error_response, upstream_error_message
from proxy.gate import Gate
from proxy.openai_api import Adapter, ChatAdapter, CompletionsAdapter
from proxy.recording import RecordingQueue
from proxy.replicas import Placement, Replicas
from proxy.request_json import parse_json
from proxy.responses_api import ResponsesAdapter
from proxy.sampling import constraint_of, enforce_sampling, rollout_sampling
from proxy.types import RecordedCall, Recorder, RolloutDirectory, RolloutInfo, UpstreamConfig
from proxy.upstream import UpstreamError

logger = logging.getLogger(__name__)

ADAPTERS: dict[str, type[Adapter]] = {
    "chat/completions": ChatAdapter,
    "completions": CompletionsAdapter,
    "responses": ResponsesAdapter,
    "messages": MessagesAdapter,
}

_HOLD = "lightning.body_hold"
"""Scope key of the request's BodyHold (ProxyApp.__call__ puts it there)."""
CLIENT_CLOSED = 499
"""Status recorded for a call whose harness hung up before it had the whole answer (nginx's code)."""
NOT_DELIVERED = "client disconnected before the answer was delivered"
STREAM_INCOMPLETE = "stream incomplete: client disconnected before the stream ended"


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


class _Call:
    """One admitted call: everything known at its start, turned into a RecordedCall at its end.

    It holds its place in the gate until its record is stored, so `ProxyApp.pause` returns only once every
    call admitted before it has been recorded. From admission to its record it watches for the harness hanging
    up, so no call is recorded 200 that the harness never received whole, whichever path answered it.
    """

    def __init__(self, proxy: ProxyApp, info: RolloutInfo, adapter: Adapter, upstream_body: dict,
                 sampling_overrides: dict, receive) -> None:
        self.proxy, self.adapter, self.upstream_body = proxy, adapter, upstream_body
        self.sampling_overrides = sampling_overrides
        self.rollout_id = info.rollout_id
        self.timed = _timed(info)  # as admitted: gate.exit must match gate.enter
        self.seq = proxy._take_seq(info, adapter.samples)  # n > 1: one seq per choice (recording.per_choice)
        proxy._live.setdefault(self.rollout_id, set()).add(self)  # until its record is built (see settled)
        self.policy_version = proxy.policy_version  # read after gate.enter(): the weights that will answer
        self.started_at, self._t0 = time.time(), time.perf_counter()
        self.placement = Placement()  # the engine replica that answers, set by proxy.replicas
        self.done = False  # its record is built
        self.hung_up = False  # the harness disconnected before the record was built
        self.delivered = False  # answer bytes went out while the harness was still connected
        self._left = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        await _hung_up(receive)
        self.hung_up = True
        await self.proxy._notify_settled()

    async def answered(self, answer: dict | None, response: dict | None) -> RecordedCall:
        """finish() a call the engine answered in full: 200, or 499 if the harness is gone.

        It first yields to the loop once, so a hang-up the server has already seen reaches the watcher: a
        stream that runs to its end without waiting (its chunks all buffered) would otherwise beat it."""
        await asyncio.sleep(0)
        return self.finish(200, answer, response, None)

    def cut_short(self) -> str:
        """The error of a call whose harness left early: it had none of the answer, or only a part."""
        return STREAM_INCOMPLETE if self.delivered else NOT_DELIVERED

    def finish(self, status: int, answer: dict | None, response: dict | None, error: str | None) -> RecordedCall:
        """Build the record; the call leaves the gate once `store` or `submit` has recorded it."""
        self.done = True
        self._watcher.cancel()
        live = self.proxy._live.get(self.rollout_id)
        if live is not None:
            live.discard(self)
            if not live:
                del self.proxy._live[self.rollout_id]
        if status == 200 and self.hung_up:  # answered, but the harness was gone before it had it all
            status, error = CLIENT_CLOSED, self.cut_short()
        tokens = extract_tokens(answer)
        if status == 200 and error is None and (error := _token_gap(answer, tokens)):
            logger.warning("rollout %s seq %s: %s", self.rollout_id, self.seq, error)
        return RecordedCall(
            rollout_id=self.rollout_id, seq=self.seq, api=self.adapter.api, request=self.adapter.request,
            response=response, upstream_request=self.upstream_body, prompt_ids=tokens.prompt_ids,
            completion_ids=tokens.completion_ids, logprobs=tokens.logprobs, finish_reason=tokens.finish_reason,
            status_code=status, latency_ms=(time.perf_counter() - self._t0) * 1000.0,
            policy_version=self.policy_version, error=error, stream=self.adapter.stream,
            started_at=self.started_at, upstream_response=answer, sampling_overrides=self.sampling_overrides,
            replica=self.placement.replica, retried=self.placement.retried,
            constraint=constraint_of(self.upstream_body),
        )

    def submit(self, record: RecordedCall) -> asyncio.Task:
        """Record in the background, leaving the gate when done (for paths that may be cancelled)."""
        return self.proxy.records.submit(record, then=self._leave)

    async def store(self, record: RecordedCall) -> None:
        """Record, then leave the gate; cancelling the caller does not cancel the record."""
        await asyncio.shield(self.submit(record))

    def _leave(self) -> None:
        self._watcher.cancel()
        if not self._left:
            self._left = True
            self.proxy.gate.exit(self.timed)


def _timed(info: RolloutInfo) -> bool:
    """Whether a rollout's calls count in the proxy's generation time and override count: train ones only."""
    return info.split == "train"


async def _hung_up(receive) -> None:
    """Return once the client disconnects (its body was read already, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _token_gap(answer: dict, tokens: Tokens) -> str | None:
    """Why the captured ids cannot be the whole completion (usage disagrees), or None when they can."""
    expected = (answer.get("usage") or {}).get("completion_tokens")
    if expected is None or len(answer.get("choices") or ()) != 1:
        return None
    if len(tokens.completion_ids) == expected == len(tokens.logprobs):
        return None
    return (f"incomplete token capture: the engine reported {expected} completion tokens but returned "
            f"{len(tokens.completion_ids)} token ids and {len(tokens.logprobs)} logprobs")


class _CallStream(StreamingResponse):
    """A streaming response that finalises its call even if the body iterator never ran to its end, and notes
    whether any of the answer went out before the harness hung up (the server drops what it sends after)."""

    def __init__(self, call: _Call, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self._call, self._on_close = call, on_close

    async def __call__(self, scope, receive, send) -> None:
        call = self._call

        async def noted(message: dict) -> None:
            if not call.delivered and not call.hung_up and message.get("body"):
                call.delivered = True
            await send(message)

        try:
            await super().__call__(scope, receive, noted)
        finally:
            await self._on_close()


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
        self.directory = directory
        self.config = upstream
        # The engine, or its replicas (upstream.replica_urls): `replica_alive(i)` tells whether replica i still runs.
        self.engines = Replicas(upstream, transport, alive=replica_alive)
        self.records = RecordingQueue(recorder, on_stored=self._stored)
        self.recorder = recorder
        # Seqs given out and not yet stored, by rollout, and the calls still waiting for their answer (see settled).
        self._unstored: dict[str, int] = {}
        self._live: dict[str, set[_Call]] = {}
        self._settled_waiters = 0
        self._settled = asyncio.Condition()  # bound to the serving loop on first use
        self.gate = Gate(pause_wait_s, retry_after_s)
        self.max_body_bytes = max_body_bytes
        self.bodies = BodyBudget(bodies_limit_bytes)  # all requests together
        self._policy_version = policy_version
        self._seq: dict[str, int] = {}
        self.sampling_override_calls = 0  # train calls whose harness asked for sampling other than the run's
        base = "/rollouts/{rollout_id}/v1/"
        routes = [Route(base + path, _guard(adapter.error_format, self._endpoint(adapter)), methods=["POST"])
                  for path, adapter in ADAPTERS.items()]
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
        # _guard already answers unexpected errors with a 500 in the caller's format.
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
            await self.app({**scope, _HOLD: hold}, counted, send)
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

    async def aclose(self) -> None:
        """Flush pending and retried records, then close the engine client."""
        await self.records.aclose()
        await self.engines.aclose()

    @asynccontextmanager
    async def _lifespan(self, app):
        yield
        await self.aclose()

    # --- admission -----------------------------------------------------------------------------------

    async def _authenticated(self, request: Request) -> RolloutInfo:
        """The request's rollout once the caller has shown its key: 404 for an unknown rollout, else 401."""
        info = await self.directory.get(request.path_params["rollout_id"])
        if info is None:
            raise ProxyError(404, f"unknown rollout '{request.path_params['rollout_id']}'", "rollout_not_found")
        if not any_key_matches(presented_keys(request), info.secret_hash):
            raise ProxyError(401, "missing or invalid API key for this rollout", "invalid_api_key")
        return info

    async def _rollout(self, request: Request) -> RolloutInfo:
        """The request's rollout, authenticated and still running (409 once it has finished)."""
        info = await self._authenticated(request)
        if info.finished:
            raise ProxyError(409, f"rollout '{info.rollout_id}' is finished", "rollout_finished")
        return info

    async def _read_json(self, request: Request, finite: bool = True) -> object:
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
        hold: BodyHold = request.scope[_HOLD]
        raw = b"".join(parts)
        cost = parse_cost(raw)
        hold.take(cost.peak)  # before parsing: a body that would parse big is refused before it does
        try:
            return parse_json(raw, finite)
        finally:  # the parts, their joined copy and the decoded text are freed on return: hold the parsed body
            hold.give(size + cost.peak - cost.kept)

    def _refusal(self, info: RolloutInfo, adapter: Adapter, upstream_body: dict, overrides: dict, exc: ProxyError,
                 started: float) -> RecordedCall:
        """The record of a call the proxy refused before the engine saw it (the gate's 429): no tokens."""
        return RecordedCall(
            rollout_id=info.rollout_id, seq=self._take_seq(info, adapter.samples), api=adapter.api,
            request=adapter.request, response=None, upstream_request=upstream_body, prompt_ids=[], completion_ids=[],
            logprobs=[], finish_reason=None, status_code=exc.status, latency_ms=(time.time() - started) * 1000.0,
            policy_version=self.policy_version, error=f"{exc.code}: {exc.message}", stream=adapter.stream,
            started_at=started, sampling_overrides=overrides)

    def _take_seq(self, info: RolloutInfo, count: int = 1) -> int:
        seq = max(self._seq.get(info.rollout_id, 0), info.next_seq)
        self._seq[info.rollout_id] = seq + count
        self._unstored[info.rollout_id] = self._unstored.get(info.rollout_id, 0) + count
        return seq

    def _stored(self, record: RecordedCall) -> None:
        left = self._unstored.get(record.rollout_id, 0) - 1
        if left > 0:
            self._unstored[record.rollout_id] = left
        else:
            self._unstored.pop(record.rollout_id, None)
        if self._settled_waiters:
            asyncio.get_running_loop().create_task(self._notify_settled())

    async def _notify_settled(self) -> None:
        if not self._settled_waiters:
            return
        async with self._settled:
            self._settled.notify_all()

    def unstored(self, rollout_id: str) -> int:
        """Records of the rollout's calls that a trainer must still wait for: built (answered or refused) and not
        yet stored (still writing, or queued for retry while the database refuses them), plus calls still waiting
        for the engine whose harness is connected. A call whose harness hung up is recorded later as 499, which is
        never trained: nothing waits for it."""
        live = self._live.get(rollout_id, ())
        waiting = sum(call.adapter.samples for call in live if call.hung_up)
        return self._unstored.get(rollout_id, 0) - waiting

    async def settled(self, rollout_id: str, timeout: float) -> int:
        """Wait up to `timeout` s until the rollout's trajectory is whole in the recorder (unstored() is 0); the
        records still missing then (0: whole)."""
        self._settled_waiters += 1
        try:
            async with self._settled:
                await asyncio.wait_for(self._settled.wait_for(lambda: self.unstored(rollout_id) == 0), timeout)
        except TimeoutError:
            pass
        finally:
            self._settled_waiters -= 1
        return self.unstored(rollout_id)

    # --- model calls ---------------------------------------------------------------------------------

    def _endpoint(self, adapter_cls: type[Adapter]):
        async def endpoint(request: Request) -> Response:
            try:
                info = await self._rollout(request)
                adapter = adapter_cls(await self._read_json(request))
                await adapter.resolve(self.records.responses, info.rollout_id)
                upstream_stream = adapter.stream and self.config.stream and (
                    self.config.stream_with_tools or not adapter.has_tools)
                upstream_body = adapter.upstream_body(self.config.served_model, upstream_stream)
                overrides: dict = {}
                sampling = rollout_sampling(self.config.sampling, info.sampling)  # a greedy eval attempt's own
                if sampling is not None:  # here, so all four APIs get it on their final engine body
                    upstream_body, overrides = enforce_sampling(upstream_body, sampling)
            except ProxyError as exc:
                return error_response(adapter_cls.error_format, exc)
            started = time.time()
            try:
                await self.gate.enter(timed=_timed(info))
            except ProxyError as exc:
                # Refused at the gate of a weight update that outlasted pause_wait_s: recorded like any call the
                # engine could not serve, so a harness that gives up on it is an infrastructure failure.
                await self.records.record(self._refusal(info, adapter, upstream_body, overrides, exc, started))
                return error_response(adapter_cls.error_format, exc)
            call = _Call(self, info, adapter, upstream_body, overrides, request.receive)
            if overrides:
                if call.timed:
                    self.sampling_override_calls += 1
                logger.debug("rollout %s seq %s: harness sampling %s replaced by the run's", info.rollout_id,
                             call.seq, overrides)
            if upstream_stream:
                return await self._stream_from_stream(call)
            return await self._from_answer(call)

        return endpoint

    async def _failed(self, call: _Call, exc: UpstreamError) -> Response:
        message = upstream_error_message(exc.body, exc.message)
        body = error_body(call.adapter.error_format, exc.status, message)
        answer = exc.body if isinstance(exc.body, dict) else None
        await call.store(call.finish(exc.status, answer, body, f"{exc.status}: {message}"))
        return JSONResponse(body, status_code=exc.status)

    async def _from_answer(self, call: _Call) -> Response:
        """A call answered whole by the engine: returned whole, or replayed as a stream when the harness streams.

        A harness that hangs up before the answer is handed over gets a 499 record: only answers the
        harness received are recorded as 200. The engine request is not cancelled when the harness hangs up:
        its answer is recorded (status 499, never trained) with the token ids, so the rollout shows what the
        policy said that the harness never saw. The price is engine time on an answer nobody reads, bounded by
        the request's max_tokens and UpstreamConfig.read_timeout_s; cancelling would free the engine sooner but
        leave the record empty.
        """
        adapter = call.adapter
        try:
            answer = await self.engines.post_json(call.rollout_id, adapter.upstream_path, call.upstream_body,
                                                  call.placement)
            response = adapter.response(answer)
        except UpstreamError as exc:
            return await self._failed(call, exc)
        except BaseException:
            call.submit(call.finish(500, None, None, "proxy error while calling the engine"))
            raise
        if call.hung_up:
            await call.store(call.finish(CLIENT_CLOSED, answer, response, NOT_DELIVERED))
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        if not adapter.stream:
            await call.store(await call.answered(answer, response))
            return JSONResponse(response)

        async def replay() -> AsyncIterator[dict]:
            for chunk in chunks_from_answer(answer, adapter.kind):
                yield chunk
            # Before the stream's last event: recorded when the harness sees it end (499 if it has gone).
            await call.store(await call.answered(answer, response))

        async def close() -> None:
            if not call.done:  # the harness left mid-replay: the engine's answer is still worth keeping
                call.submit(call.finish(CLIENT_CLOSED, answer, response, call.cut_short()))

        return _CallStream(call, adapter.events(replay()), close)

    async def _stream_from_stream(self, call: _Call) -> Response:
        adapter = call.adapter
        stack = AsyncExitStack()
        try:
            chunks = await stack.enter_async_context(self.engines.stream(call.rollout_id, adapter.upstream_path,
                                                                         call.upstream_body, call.placement))
        except UpstreamError as exc:
            await stack.aclose()
            return await self._failed(call, exc)
        except BaseException:
            call.submit(call.finish(500, None, None, "proxy error while calling the engine"))
            raise
        acc = Accumulator(adapter.kind)

        async def tap() -> AsyncIterator[dict]:
            async for chunk in chunks:
                acc.add(chunk)
                yield chunk
            answer = acc.result()
            await call.store(await call.answered(answer, adapter.response(answer)))

        def end(status: int, error: str) -> RecordedCall | None:
            if call.done:
                return None
            answer = acc.result()
            return call.finish(status, answer, adapter.response(answer), error)

        async def close() -> None:
            record = end(CLIENT_CLOSED, call.cut_short())
            if record is not None:
                call.submit(record)  # we may be cancelled here: record in the background
            await stack.aclose()

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in adapter.events(tap()):
                    yield piece
            except UpstreamError as exc:
                message = upstream_error_message(exc.body, exc.message)
                await self._store_if(call, end(exc.status, f"{exc.status}: {message} (mid-stream)"))
                yield adapter.stream_error(exc.status, message)
            except Exception as exc:
                logger.exception("rollout %s seq %s: proxy failed mid-stream", call.rollout_id, call.seq)
                await self._store_if(call, end(500, f"proxy error mid-stream: {exc!r}"))
                yield adapter.stream_error(500, "proxy error mid-stream")
            finally:
                await close()

        return _CallStream(call, body(), close)

    @staticmethod
    async def _store_if(call: _Call, record: RecordedCall | None) -> None:
        if record is not None:
            await call.store(record)

    # --- other routes --------------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        fmt = ANTHROPIC if "anthropic-version" in request.headers else OPENAI
        try:
            await self._rollout(request)
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
            info = await self._rollout(request)
            body = await self._read_json(request, finite=False)  # a NaN reward is told so below
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
            info = await self._rollout(request)
            body = tokenize_body(await self._read_json(request), self.config.served_model)
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
            await self._authenticated(request)
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
