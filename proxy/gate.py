"""Pause and resume around weight updates: new calls wait (bounded) or get 429; calls in flight drain."""
from __future__ import annotations

import asyncio
import math
import time

from proxy.errors import ProxyError


class Gate:
    """Admission control for engine calls; `pause` returns once every admitted call has finished."""

    def __init__(self, wait_s: float | None = 30.0, retry_after_s: float = 5.0) -> None:
        # How long a new call waits while paused before its 429 (None: until resumed). A run sets it to as long as
        # its weight update may keep the gate closed (runs.gated_engine): a shorter wait refuses more of the calls
        # of long trajectories, which then train less often than short ones.
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.waiting = 0  # calls held at the gate right now
        self.refusals = 0  # timed (train) calls refused with a 429 so far: the run's rollout/gate_refusals
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.timed_in_flight = 0  # the admitted calls that count as busy (see enter)
        self._busy_s = 0.0  # closed busy intervals
        self._busy_since: float | None = None  # start of the open one (perf_counter), None while idle

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def busy_seconds(self) -> float:
        """Wall seconds with at least one timed call in flight, since the gate was made (the open interval included)."""
        since = self._busy_since
        return self._busy_s + (time.perf_counter() - since if since is not None else 0.0)

    async def enter(self, timed: bool = True) -> None:
        """Admit one call, waiting up to wait_s while paused; ProxyError(429) if still paused (counted in `refusals`
        when timed).

        Every call drains before a pause returns; only `timed` ones count in `busy_seconds` (the proxy leaves
        evaluation calls out: they are not a training step's generation).
        """
        if not self._open.is_set():
            self.waiting += 1
            try:
                await asyncio.wait_for(self._open.wait(), self.wait_s)
            except TimeoutError:
                if timed:
                    self.refusals += 1
                raise ProxyError(
                    429,
                    "the engine is paused for a weight update; retry shortly",
                    "engine_paused",
                    {"retry-after": str(max(1, math.ceil(self.retry_after_s)))},
                ) from None
            finally:
                self.waiting -= 1
        if timed:
            if self.timed_in_flight == 0:
                self._busy_since = time.perf_counter()
            self.timed_in_flight += 1
        self.in_flight += 1
        self._drained.clear()

    def exit(self, timed: bool = True) -> None:
        """A call admitted with the same `timed` has finished."""
        if timed:
            self.timed_in_flight -= 1
            if self.timed_in_flight == 0:
                self._busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None
        self.in_flight -= 1
        if self.in_flight == 0:
            self._drained.set()

    async def pause(self, timeout: float | None = None) -> None:
        """Stop admitting calls and wait for those in flight; TimeoutError (still paused) if they don't drain."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{self.in_flight} calls still in flight after {timeout}s; the proxy stays paused"
            ) from None

    async def resume(self) -> None:
        self._open.set()
