"""One model call from request to record: admission, the gate, the engine round trip, the answer and its record."""
from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from starlette.requests import Request

from proxy import sse
from proxy.assemble import Accumulator, Tokens, chunks_from_answer, extract_tokens
from proxy.errors import (
    CLIENT_CLOSED,
    ProxyError,
    error_body,
    error_response,
    upstream_error_message,
)
from proxy.openai_api import Adapter
from proxy.replicas import Placement
from proxy.sampling import constraint_of, enforce_sampling, rollout_sampling
from proxy.types import RecordedCall
from proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from proxy.app import ProxyApp

logger = logging.getLogger(__name__)

NOT_DELIVERED = "client disconnected before the answer was delivered"
STREAM_INCOMPLETE = "stream incomplete: client disconnected before the stream ended"
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
"""Whole answers as Starlette's JSONResponse renders them, with the encoder made once."""


class State(enum.Enum):
    """Where a call is in its lifecycle; NEXT says where it may go from each."""

    RECEIVING = "receiving"  # authenticated, its body read and its engine request built; waiting at the gate
    REFUSED = "refused"  # the gate refused it (a weight update outlasted the wait): recorded, never admitted
    ADMITTED = "admitted"  # through the gate with its seqs: the engine is asked, the harness has none of the answer
    ANSWERING = "answering"  # part of the answer went out while the harness was connected (a stream under way)
    CUT = "cut"  # the harness left mid-stream: the stream is being stopped
    RECORDING = "recording"  # its record is built and being stored; it still holds its place in the gate
    DONE = "done"  # stored: out of the gate


NEXT: dict[State, frozenset[State]] = {
    State.RECEIVING: frozenset({State.ADMITTED, State.REFUSED}),
    State.REFUSED: frozenset(),
    State.ADMITTED: frozenset({State.ANSWERING, State.RECORDING}),
    State.ANSWERING: frozenset({State.CUT, State.RECORDING}),
    State.CUT: frozenset({State.RECORDING}),
    State.RECORDING: frozenset({State.DONE}),
    State.DONE: frozenset(),
}
"""The transition rule: each call is recorded once, and leaves the gate once, after its record is stored."""
_UNRECORDED = (State.ADMITTED, State.ANSWERING, State.CUT)
"""States of an admitted call whose record is not built yet."""


class Call:
    """One model call, driven through its steps by `serve`: receive (auth, body, engine request), admit (the gate,
    its seqs), ask the engine (whole or streamed), answer the harness (whole, replayed as a stream, or relayed chunk by
    chunk while assembling the answer), record it, and leave the gate.

    It holds its place in the gate until its record is stored, so `ProxyApp.pause` returns only once every call
    admitted before it has been recorded. From admission to its record it watches for the harness hanging up, so no
    call is recorded 200 that the harness never received whole, whichever path answered it.

    A harness that hangs up before any of the answer reached it does not stop the engine: the answer is recorded
    (status 499, never trained) with its token ids, so the rollout shows what the policy said that the harness never
    saw; the price is engine time on an answer nobody reads, bounded by max_tokens and the read timeout. One that
    hangs up mid-stream has the engine stream closed at once, and the part streamed so far recorded 499.
    """

    def __init__(self, proxy: ProxyApp, adapter_cls: type[Adapter], request: Request) -> None:
        self.proxy, self.adapter_cls, self.request = proxy, adapter_cls, request
        self.state = State.RECEIVING
        self.hung_up = False  # the harness disconnected before the record was built
        self.status: int | None = None  # the status sent to the harness, once its answer has started
        self.placement = Placement()  # the engine replica that answers, set by proxy.replicas
        self.seq = -1  # taken at admission (or refusal); n > 1: one seq per choice (recording.per_choice)
        self._watcher: asyncio.Task | None = None
        self._task: asyncio.Task | None = None  # the task relaying an engine stream, stopped if the harness leaves

    @property
    def samples(self) -> int:
        return self.adapter.samples

    def _move(self, to: State) -> None:
        if to not in NEXT[self.state]:
            raise RuntimeError(f"rollout {self.info.rollout_id} seq {self.seq}: a call cannot go from "
                               f"{self.state.value} to {to.value}")
        self.state = to

    # --- the steps -----------------------------------------------------------------------------------

    async def serve(self, send) -> None:
        """Answer the harness and record the call; an unexpected error before the answer started is a logged 500."""
        self._send = send
        try:
            try:
                await self._receive()
                await self._admit()
            except ProxyError as exc:
                await self._answer_error(exc)
                return
            await (self._relay_stream() if self.upstream_stream else self._relay_answer())
        except Exception:
            if self.status is not None:
                raise
            logger.exception("proxy error on %s %s", self.request.method, self.request.url.path)
            await self._answer_error(ProxyError(500, "internal proxy error", "proxy_error"))

    async def _receive(self) -> None:
        """Who calls and what: the rollout (authenticated, running), the request as its adapter reads it, and the
        engine request with the rollout's sampling (here, so all four APIs get it on their final engine body)."""
        proxy, config = self.proxy, self.proxy.config
        self.info = await proxy.admission.rollout(self.request)
        self.adapter = adapter = self.adapter_cls(await proxy.admission.read_json(self.request))
        await adapter.resolve(proxy.records.responses, self.info.rollout_id)
        self.upstream_stream = adapter.stream and config.stream and (config.stream_with_tools or not adapter.has_tools)
        self.upstream_body = adapter.upstream_body(config.served_model, self.upstream_stream)
        self.overrides: dict = {}
        sampling = rollout_sampling(config.sampling, self.info.sampling)  # a greedy eval attempt's own
        if sampling is not None:
            self.upstream_body, self.overrides = enforce_sampling(self.upstream_body, sampling)

    async def _admit(self) -> None:
        """Through the gate (ProxyError 429 if a weight update outlasts the wait), with its seqs and policy version."""
        proxy = self.proxy
        self.timed = self.info.split == "train"  # only train calls count in generation time and the override count
        self.started_at, self._t0 = time.time(), time.perf_counter()
        try:
            await proxy.gate.enter(timed=self.timed)
        except ProxyError as exc:
            # Recorded like any call the engine could not serve, so a harness that gives up on it is an
            # infrastructure failure.
            self._move(State.REFUSED)
            self._take_seq()
            await proxy.records.record(self._record(exc.status, None, None, f"{exc.code}: {exc.message}"))
            raise
        self._move(State.ADMITTED)
        self._take_seq()  # the policy version is read after gate.enter(): the weights that will answer
        proxy.outstanding.wait(self.info.rollout_id, self)
        self.started_at, self._t0 = time.time(), time.perf_counter()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        if self.overrides:
            if self.timed:
                proxy.sampling_override_calls += 1
            logger.debug("rollout %s seq %s: harness sampling %s replaced by the run's", self.info.rollout_id,
                         self.seq, self.overrides)

    def _take_seq(self) -> None:
        self.seq = self.proxy.outstanding.take(self.info, self.adapter.samples)
        self.policy_version = self.proxy.policy_version

    async def _watch(self) -> None:
        """Note the harness hanging up; mid-stream, stop the stream (see the class docstring)."""
        receive = self.request.receive
        while (await receive())["type"] != "http.disconnect":  # its body was read: nothing else arrives
            pass
        self.hung_up = True
        if self.state is State.ANSWERING and self._task is not None:
            self._move(State.CUT)
            self._task.cancel()
        await self.proxy.outstanding.changed()

    async def _relay_answer(self) -> None:
        """An answer the engine gives whole: returned whole, or replayed as a stream when the harness streams."""
        adapter = self.adapter
        try:
            answer = await self.proxy.engines.post_json(self.info.rollout_id, adapter.upstream_path,
                                                        self.upstream_body, self.placement)
            response = adapter.response(answer)
        except UpstreamError as exc:
            await self._failed(exc)
            return
        except BaseException:
            self._submit(self._finish(500, None, None, "proxy error while calling the engine"))
            raise
        if self.hung_up:
            await self._store(self._finish(CLIENT_CLOSED, answer, response, NOT_DELIVERED))
            await self._send_whole(CLIENT_CLOSED, b"", [(b"content-length", b"0")])  # nobody reads it
        elif not adapter.stream:
            await self._store(await self._answered(answer, response))
            body = _JSON.encode(response).encode()
            await self._send_whole(200, body, [(b"content-length", str(len(body)).encode()),
                                               (b"content-type", b"application/json")])
        else:
            await self._relay(_replayed(chunks_from_answer(answer, adapter.kind)), lambda: answer)

    async def _relay_stream(self) -> None:
        """An answer the engine streams: relayed chunk by chunk, and assembled into the answer it records."""
        adapter = self.adapter
        async with AsyncExitStack() as stack:
            try:
                chunks = await stack.enter_async_context(self.proxy.engines.stream(
                    self.info.rollout_id, adapter.upstream_path, self.upstream_body, self.placement))
            except UpstreamError as exc:
                await self._failed(exc)
                return
            except BaseException:
                self._submit(self._finish(500, None, None, "proxy error while calling the engine"))
                raise
            acc = Accumulator(adapter.kind)
            await self._relay(chunks, acc.result, acc)

    async def _relay(self, chunks: AsyncIterator[dict], assembled: Callable[[], dict],
                     acc: Accumulator | None = None) -> None:
        """Send the engine's chunks as the harness's event stream, recorded before its last event (499 if the harness
        has gone by then); a failure mid-stream is recorded and ends the stream with an error event. `assembled()` is
        the engine's answer so far (`acc` assembles it from the chunks when the engine streams)."""
        adapter, self._task = self.adapter, asyncio.current_task()
        await self._send({"type": "http.response.start", "status": 200, "headers": sse.RAW_HEADERS})
        self.status = 200
        try:
            async for piece in adapter.events(self._recorded(chunks, assembled, acc)):
                await self._send_body(piece)
            await self._send_body(b"", more=False)
        except asyncio.CancelledError:
            if self.state is not State.CUT or asyncio.current_task().uncancel() > 0:
                raise  # not (only) the harness leaving: the server is stopping
        except UpstreamError as exc:
            message = upstream_error_message(exc.body, exc.message)
            await self._end(assembled, exc.status, f"{exc.status}: {message} (mid-stream)")
            await self._send_body(adapter.stream_error(exc.status, message))
            await self._send_body(b"", more=False)
        except Exception as exc:
            logger.exception("rollout %s seq %s: proxy failed mid-stream", self.info.rollout_id, self.seq)
            await self._end(assembled, 500, f"proxy error mid-stream: {exc!r}")
            await self._send_body(adapter.stream_error(500, "proxy error mid-stream"))
            await self._send_body(b"", more=False)
        finally:
            self._task = None
            if self.state in _UNRECORDED:  # the harness left, or the server stops: keep what the engine said
                answer = assembled()
                self._submit(self._finish(CLIENT_CLOSED, answer, adapter.response(answer), self._cut_short()))

    async def _recorded(self, chunks: AsyncIterator[dict], assembled: Callable[[], dict],
                        acc: Accumulator | None) -> AsyncIterator[dict]:
        """The chunks (each added to `acc`), then the call recorded: before the stream's last event, so it is stored
        when the harness sees the stream end."""
        async for chunk in chunks:
            if acc is not None:
                acc.add(chunk)
            yield chunk
        answer = assembled()
        await self._store(await self._answered(answer, self.adapter.response(answer)))

    async def _end(self, assembled: Callable[[], dict], status: int, error: str) -> None:
        """Record a stream that failed, with what the engine said before it did (unless it was recorded already)."""
        if self.state in _UNRECORDED:
            answer = assembled()
            await self._store(self._finish(status, answer, self.adapter.response(answer), error))

    async def _failed(self, exc: UpstreamError) -> None:
        """The engine gave no answer: recorded with its status, and answered with it in the caller's format."""
        message = upstream_error_message(exc.body, exc.message)
        body = error_body(self.adapter.error_format, exc.status, message)
        answer = exc.body if isinstance(exc.body, dict) else None
        await self._store(self._finish(exc.status, answer, body, f"{exc.status}: {message}"))
        content = _JSON.encode(body).encode()
        await self._send_whole(exc.status, content, [(b"content-length", str(len(content)).encode()),
                                                      (b"content-type", b"application/json")])

    # --- the record ----------------------------------------------------------------------------------

    async def _answered(self, answer: dict, response: dict) -> RecordedCall:
        """finish() a call the engine answered in full: 200, or 499 if the harness is gone.

        It first yields to the loop once, so a hang-up the server has already seen reaches the watcher: a stream
        that runs to its end without waiting (its chunks all buffered) would otherwise beat it."""
        await asyncio.sleep(0)
        return self._finish(200, answer, response, None)

    def _cut_short(self) -> str:
        """The error of a call whose harness left early: it had none of the answer, or only a part."""
        return STREAM_INCOMPLETE if self.state in (State.ANSWERING, State.CUT) else NOT_DELIVERED

    def _finish(self, status: int, answer: dict | None, response: dict | None, error: str | None) -> RecordedCall:
        """Build the record; the call leaves the gate once `_store` or `_submit` has recorded it."""
        if status == 200 and self.hung_up:  # answered, but the harness was gone before it had it all
            status, error = CLIENT_CLOSED, self._cut_short()
        self._move(State.RECORDING)
        self._watcher.cancel()
        self.proxy.outstanding.answered(self.info.rollout_id, self)
        return self._record(status, answer, response, error)

    def _record(self, status: int, answer: dict | None, response: dict | None, error: str | None) -> RecordedCall:
        adapter, tokens = self.adapter, extract_tokens(answer)
        if status == 200 and error is None and (error := _token_gap(answer, tokens)):
            logger.warning("rollout %s seq %s: %s", self.info.rollout_id, self.seq, error)
        return RecordedCall(
            rollout_id=self.info.rollout_id, seq=self.seq, api=adapter.api, request=adapter.request,
            response=response, upstream_request=self.upstream_body, prompt_ids=tokens.prompt_ids,
            completion_ids=tokens.completion_ids, logprobs=tokens.logprobs, finish_reason=tokens.finish_reason,
            status_code=status, latency_ms=(time.perf_counter() - self._t0) * 1000.0,
            policy_version=self.policy_version, error=error, stream=adapter.stream, started_at=self.started_at,
            upstream_response=answer, sampling_overrides=self.overrides, replica=self.placement.replica,
            retried=self.placement.retried,
            # A call the gate refused never reached the engine: nothing constrained its decoding.
            constraint=constraint_of(self.upstream_body) if self.state is not State.REFUSED else "",
        )

    def _submit(self, record: RecordedCall) -> asyncio.Task:
        """Record in the background, leaving the gate when done (for paths that may be cancelled)."""
        return self.proxy.records.submit(record, then=self._leave)

    async def _store(self, record: RecordedCall) -> None:
        """Record, then leave the gate; cancelling the caller does not cancel the record."""
        await asyncio.shield(self._submit(record))

    def _leave(self) -> None:
        self._move(State.DONE)
        self.proxy.gate.exit(self.timed)

    # --- sending -------------------------------------------------------------------------------------

    async def _send_body(self, piece: bytes, more: bool = True) -> None:
        """One piece of a streamed answer; nothing once the harness has gone (the server would drop it)."""
        if self.hung_up:
            return
        if self.state is State.ADMITTED and piece:
            self._move(State.ANSWERING)
        await self._send({"type": "http.response.body", "body": piece, "more_body": more})

    async def _send_whole(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _answer_error(self, exc: ProxyError) -> None:
        self.status = exc.status
        await error_response(self.adapter_cls.error_format, exc)(self.request.scope, self.request.receive,
                                                                  self._send)


async def _replayed(chunks: list[dict]) -> AsyncIterator[dict]:
    for chunk in chunks:
        yield chunk


def _token_gap(answer: dict, tokens: Tokens) -> str | None:
    """Why the captured ids cannot be the whole completion (usage disagrees), or None when they can."""
    expected = (answer.get("usage") or {}).get("completion_tokens")
    if expected is None or len(answer.get("choices") or ()) != 1:
        return None
    if len(tokens.completion_ids) == expected == len(tokens.logprobs):
        return None
    return (f"incomplete token capture: the engine reported {expected} completion tokens but returned "
            f"{len(tokens.completion_ids)} token ids and {len(tokens.logprobs)} logprobs")
