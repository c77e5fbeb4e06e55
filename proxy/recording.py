"""Hands calls to the Recorder without losing any: failures are logged and retried from a bounded queue."""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from proxy.types import RecordedCall, Recorder

logger = logging.getLogger(__name__)


class RecordingQueue:
    """Records calls through a Recorder; a failed record is retried with backoff until it is stored."""

    def __init__(self, recorder: Recorder, max_retry: int = 100_000, backoff_s: float = 0.5) -> None:
        self.recorder = recorder
        self.retry: deque[RecordedCall] = deque()
        self.max_retry = max_retry
        self.backoff_s = backoff_s
        self._tasks: set[asyncio.Task] = set()
        self._retry_task: asyncio.Task | None = None

    async def record(self, call: RecordedCall) -> None:
        """Record now; on failure log it and queue the call for retry (never raises)."""
        try:
            await self.recorder.record(call)
        except Exception:
            logger.exception("rollout %s seq %s: recorder failed; queued for retry", call.rollout_id, call.seq)
            self._queue(call)

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
