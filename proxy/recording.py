"""Hands calls to the Recorder without losing any, one record per sample, and counts what is not stored yet.

Failed records are retried from a queue; `Outstanding` counts each rollout's records not yet stored (so a trainer
knows when a trajectory is whole), and `ResponseLog` remembers recent Responses API answers for
`previous_response_id`.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from proxy.assemble import extract_tokens
from proxy.types import (
    RecordedCall,
    Recorder,
    ResponseFinder,
    RolloutInfo,
    samples_asked,
)

logger = logging.getLogger(__name__)


def per_choice(call: RecordedCall) -> list[RecordedCall]:
    """The records of one call: itself, or one per choice when it asked for n > 1 (see types.samples_asked).

    Choice k gets seq call.seq + k (reserved at admission) and its own ids, logprobs and finish reason; a choice
    the engine did not return (a failed call) is recorded without tokens, so a rollout's seqs have no holes.
    """
    n = samples_asked(call.api, call.request)
    if n == 1:
        return [call]
    choices = [extract_tokens(call.upstream_response, k) for k in range(n)]
    error = call.error or (_choices_gap(call, choices) if call.status_code == 200 else None)
    if error and not call.error:
        logger.warning("rollout %s seq %s: %s", call.rollout_id, call.seq, error)
    return [replace(call, seq=call.seq + k, choice=k, prompt_ids=t.prompt_ids, completion_ids=t.completion_ids,
                    logprobs=t.logprobs, finish_reason=t.finish_reason, error=error)
            for k, t in enumerate(choices)]


def _choices_gap(call: RecordedCall, choices: list) -> str | None:
    """Why the choices' captured ids cannot be the whole completions (usage disagrees), or None when they can."""
    answer = call.upstream_response or {}
    returned = len(answer.get("choices") or ())
    if returned < len(choices):
        return f"incomplete token capture: the engine returned {returned} of the {len(choices)} choices asked for"
    expected = (answer.get("usage") or {}).get("completion_tokens")
    got = sum(len(t.completion_ids) for t in choices)
    if all(len(t.completion_ids) == len(t.logprobs) for t in choices) and expected in (None, got):
        return None
    return (f"incomplete token capture: the engine reported {expected} completion tokens over {len(choices)} "
            f"choices but returned {got} token ids and {sum(len(t.logprobs) for t in choices)} logprobs")


class ResponseLog:
    """Recent Responses API answers by (rollout, response id), so `previous_response_id` resolves without a query.

    Bounded: at most `max_entries`, least recently used dropped first (a finished rollout's answers age out).
    Answers to `store: false` requests are not held (OpenAI keeps none either; Codex sends those with its whole
    history each turn). Whatever is not held here is asked of the recorder when it has `find_response`, so a
    restarted proxy still resolves a rollout's earlier answers.
    """

    def __init__(self, recorder: Recorder, max_entries: int = 1024) -> None:
        self.recorder = recorder
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], tuple[dict, dict]] = OrderedDict()

    def remember(self, call: RecordedCall) -> None:
        response = call.response
        if (call.api != "responses" or call.status_code != 200 or call.error is not None
                or not isinstance(response, dict) or not isinstance(response.get("id"), str)
                or call.request.get("store") is False):
            return
        # Only what a follow-up needs: not the tools and instructions a request may carry.
        request = {k: call.request[k] for k in ("input", "previous_response_id") if k in call.request}
        self._entries[(call.rollout_id, response["id"])] = (request, {"id": response["id"],
                                                                      "output": response.get("output") or []})
        self._entries.move_to_end((call.rollout_id, response["id"]))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def find(self, rollout_id: str, response_id: str) -> tuple[dict, dict] | None:
        """(request, response) of the rollout's answer `response_id`, or None when the rollout has none."""
        hit = self._entries.get((rollout_id, response_id))
        if hit is not None:
            self._entries.move_to_end((rollout_id, response_id))
            return hit
        if isinstance(self.recorder, ResponseFinder):
            return await self.recorder.find_response(rollout_id, response_id)
        return None


class RecordingQueue:
    """Records calls through a Recorder; a failed record is retried with backoff until it is stored."""

    def __init__(self, recorder: Recorder, max_retry: int = 100_000, backoff_s: float = 0.5,
                 on_stored: Callable[[RecordedCall], None] | None = None) -> None:
        """`on_stored(record)` hears of each record (one per choice) once the recorder has stored it."""
        self.recorder = recorder
        self.on_stored = on_stored
        self.retry: deque[RecordedCall] = deque()
        self.max_retry = max_retry
        self.backoff_s = backoff_s
        self._tasks: set[asyncio.Task] = set()
        self._retry_task: asyncio.Task | None = None
        self.responses = ResponseLog(recorder)

    async def record(self, call: RecordedCall) -> None:
        """Record now, one record per choice; on failure log it and queue the record for retry (never raises)."""
        self.responses.remember(call)
        parts = per_choice(call)
        if len(parts) == 1:
            await self._record_one(call)
        else:  # side by side, so a batching recorder writes them in one transaction
            await asyncio.gather(*(self._record_one(part) for part in parts))

    async def _record_one(self, call: RecordedCall) -> None:
        try:
            await self.recorder.record(call)
        except Exception:
            logger.exception("rollout %s seq %s: recorder failed; queued for retry", call.rollout_id, call.seq)
            self._queue(call)
        else:
            self._stored(call)

    def _stored(self, call: RecordedCall) -> None:
        if self.on_stored is not None:
            self.on_stored(call)

    def submit(self, call: RecordedCall, then: Callable[[], None] | None = None) -> asyncio.Task:
        """Record in the background (for paths that must not wait, such as a disconnected stream), then call
        `then` in the same step, even when the task was cancelled."""
        task = asyncio.get_running_loop().create_task(self._record_then(call, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _record_then(self, call: RecordedCall, then: Callable[[], None] | None) -> None:
        try:
            await self.record(call)
        finally:
            if then is not None:
                then()

    def _queue(self, call: RecordedCall) -> None:
        if len(self.retry) >= self.max_retry:
            logger.critical(
                "rollout %s seq %s: retry queue full (%d calls); the recorder has been failing, holding it anyway",
                call.rollout_id, call.seq, len(self.retry),
            )
        self.retry.append(call)
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.get_running_loop().create_task(self._retry_loop())

    async def _retry_loop(self) -> None:
        delay = self.backoff_s
        while self.retry:
            await asyncio.sleep(delay)
            if await self._retry_once():
                delay = self.backoff_s
            else:
                delay = min(delay * 2, 30.0)

    async def _retry_once(self) -> bool:
        """Retry queued calls in order; stop at the first failure. True if the queue emptied."""
        while self.retry:
            call = self.retry[0]
            try:
                await self.recorder.record(call)
            except Exception as exc:
                logger.error("rollout %s seq %s: recorder retry failed: %r (%d queued)",
                             call.rollout_id, call.seq, exc, len(self.retry))
                return False
            self.retry.popleft()
            self._stored(call)
            logger.info("rollout %s seq %s: recorded on retry", call.rollout_id, call.seq)
        return True

    async def flush(self) -> bool:
        """Wait for background records and retry the queue once; True if nothing is left unrecorded."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        return await self._retry_once()

    async def aclose(self) -> None:
        await self.flush()
        if self._retry_task is not None:
            self._retry_task.cancel()
        for call in self.retry:
            logger.critical("rollout %s seq %s: call NOT recorded at shutdown (recorder failing)",
                            call.rollout_id, call.seq)


class Waiting(Protocol):
    """A call still waiting for its answer, as Outstanding sees it."""

    hung_up: bool  # its harness disconnected: its record (499) is never trained, so nothing waits for it
    samples: int  # records it will make (seqs it holds)


class Outstanding:
    """Each rollout's seqs handed out and its records not yet stored, so a trainer knows when a rollout's trajectory is
    whole in the recorder (`settled`).

    A seq is outstanding from admission (or a refusal at the gate) until the recorder has stored its record: still
    waiting for the engine, being written, or queued for retry while the database refuses it.
    """

    def __init__(self) -> None:
        self._next_seq: dict[str, int] = {}
        self._unstored: dict[str, int] = {}
        self.waiting: dict[str, set[Waiting]] = {}
        """Calls still waiting for their answer, by rollout (see unstored)."""
        self._listeners = 0
        self._changed = asyncio.Condition()  # bound to the serving loop on first use

    def take(self, info: RolloutInfo, count: int = 1) -> int:
        """The first of `count` consecutive seqs for the rollout (after those recorded before a restart)."""
        seq = max(self._next_seq.get(info.rollout_id, 0), info.next_seq)
        self._next_seq[info.rollout_id] = seq + count
        self._unstored[info.rollout_id] = self._unstored.get(info.rollout_id, 0) + count
        return seq

    def wait(self, rollout_id: str, call: Waiting) -> None:
        """`call` waits for its answer (until `answered`)."""
        self.waiting.setdefault(rollout_id, set()).add(call)

    def answered(self, rollout_id: str, call: Waiting) -> None:
        """`call` has its record built: it waits no more."""
        calls = self.waiting.get(rollout_id)
        if calls is not None:
            calls.discard(call)
            if not calls:
                del self.waiting[rollout_id]

    def stored(self, record: RecordedCall) -> None:
        """The recorder has stored `record` (RecordingQueue's on_stored)."""
        left = self._unstored.get(record.rollout_id, 0) - 1
        if left > 0:
            self._unstored[record.rollout_id] = left
        else:
            self._unstored.pop(record.rollout_id, None)
        if self._listeners:
            asyncio.get_running_loop().create_task(self.changed())

    async def changed(self) -> None:
        """Wake `settled` waiters to look again (a record stored, a harness hung up)."""
        if not self._listeners:
            return
        async with self._changed:
            self._changed.notify_all()

    def unstored(self, rollout_id: str) -> int:
        """Records of the rollout's calls that a trainer must still wait for: built (answered or refused) and not
        yet stored (still writing, or queued for retry while the database refuses them), plus calls still waiting
        for the engine whose harness is connected. A call whose harness hung up is recorded later as 499, which is
        never trained: nothing waits for it."""
        gone = sum(call.samples for call in self.waiting.get(rollout_id, ()) if call.hung_up)
        return self._unstored.get(rollout_id, 0) - gone

    async def settled(self, rollout_id: str, timeout: float) -> int:
        """Wait up to `timeout` s until the rollout's trajectory is whole in the recorder (unstored() is 0); the
        records still missing then (0: whole)."""
        self._listeners += 1
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.unstored(rollout_id) == 0), timeout)
        except TimeoutError:
            pass
        finally:
            self._listeners -= 1
        return self.unstored(rollout_id)
