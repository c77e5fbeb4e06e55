"""The proxy's Django side: a batching Recorder of ModelCall rows and a RolloutDirectory over Rollout rows."""
from __future__ import annotations

import asyncio
import logging

from proxy.sampling import GREEDY
from proxy.types import CachedDirectory, RecordedCall, RolloutInfo
from runs import rollout_services, services
from runs.models import ModelCall, Rollout
from runs.reconnect import db

logger = logging.getLogger(__name__)


class DjangoRecorder:
    """Writes calls in batches (one transaction each); `record` returns once its call is committed.

    Waiting for the commit lets the proxy's retry queue see a failed write, so no call is dropped silently;
    batching keeps the database load flat when many harnesses call at once.
    """

    def __init__(self, batch_size: int = 64, max_delay_s: float = 0.02) -> None:
        self.batch_size = batch_size
        self.max_delay_s = max_delay_s
        self._pending: list[tuple[RecordedCall, asyncio.Future]] = []
        self._full = asyncio.Event()
        self._writer: asyncio.Task | None = None

    async def record(self, call: RecordedCall) -> None:
        done = asyncio.get_running_loop().create_future()
        self._pending.append((call, done))
        if len(self._pending) >= self.batch_size:
            self._full.set()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_batches())
        await done

    async def report_reward(self, rollout_id: str, reward: float, detail: dict) -> None:
        await db(rollout_services.report_harness_reward)(int(rollout_id), reward, detail)

    async def find_response(self, rollout_id: str, response_id: str) -> tuple[dict, dict] | None:
        """(request, response) of the rollout's answered Responses call `response_id` (a restarted proxy's
        `previous_response_id`), or None."""
        if not rollout_id.isdigit():
            return None
        return await db(_find_response)(int(rollout_id), response_id)

    async def _write_batches(self) -> None:
        while self._pending:
            try:
                await asyncio.wait_for(self._full.wait(), timeout=self.max_delay_s)
            except asyncio.TimeoutError:
                pass
            self._full.clear()
            batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size:]
            try:
                await db(rollout_services.record_calls)([call for call, _ in batch])
            except Exception as exc:
                logger.warning("batch of %d calls not written: %r", len(batch), exc)
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)


class DjangoDirectory:
    """Looks the rollouts of one run up in the database: secret hash, finished state, next call seq, split and own
    sampling. A rollout of any other run is unknown here (404), whatever its key: a run's proxy opens to the
    harnesses of that run only, also where several runs' proxies share a host or a network (docs/deployment.md)."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id

    async def get(self, rollout_id: str) -> RolloutInfo | None:
        if not rollout_id.isdigit():
            return None
        return await db(_rollout_info)(self.run_id, int(rollout_id))


def _rollout_info(run_id: int, rollout_id: int) -> RolloutInfo | None:
    row = (Rollout.objects.filter(pk=rollout_id, run_id=run_id)
           .values("secret_hash", "status", "call_count", "run__status", "split", "greedy").first())
    if row is None:
        return None
    finished = row["status"] in services.ROLLOUT_FINISHED or row["run__status"] in services.FINISHED
    # A greedy evaluation attempt samples at temperature 0; every other rollout at the run's sampling.
    return RolloutInfo(str(rollout_id), row["secret_hash"], finished, next_seq=row["call_count"],
                       sampling=dict(GREEDY) if row["greedy"] else {}, split=row["split"])


def _find_response(rollout_id: int, response_id: str) -> tuple[dict, dict] | None:
    row = (ModelCall.objects.filter(rollout_id=rollout_id, api="responses", status_code=200, error="",
                                    response__id=response_id)
           .order_by("seq").values("request", "response").first())
    return None if row is None else (row["request"], row["response"])


def cached_directory(run_id: int, ttl_s: float = 1.0) -> CachedDirectory:
    """The directory of run `run_id`'s proxy (see DjangoDirectory), each answer kept `ttl_s` seconds."""
    return CachedDirectory(DjangoDirectory(run_id), ttl_s=ttl_s)
