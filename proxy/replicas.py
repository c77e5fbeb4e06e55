"""Several replicas of one engine behind the proxy: rollouts pinned, new ones to the least busy, cut calls retried.

Each rollout is pinned to one replica (so its prefix cache is reused turn after turn), a new rollout is sent to the
least busy one, and a call cut off by a dying replica is retried once on another.

With one engine (UpstreamConfig.replica_urls empty) every call goes straight to it: no pinning, no retry, and
calls are recorded with replica None, exactly as before replicas existed.

What counts as a dying replica: the connection failed (refused, reset, closed without an answer: UpstreamGone).
The replica is then asked for GET /health; if that fails too it is dropped for the rest of the run, and the call
is retried once on another live replica (least busy), its rollout re-pinned there. Timeouts and error statuses
are never retried (a slow generation is not a dead engine; a 400 would answer the same elsewhere).

A stream is retried only while none of the engine's output has gone to the harness: a failure opening it, or
before its first event. After that the harness holds part of one replica's answer that another replica would
not continue token for token, so the call fails as with one engine (a mid-stream error event, recorded).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace

from proxy.types import UpstreamConfig
from proxy.upstream import Upstream, UpstreamGone

logger = logging.getLogger(__name__)

MAX_PINS = 100_000
"""Rollout pins kept (least recently used dropped first): a finished rollout's pin ages out."""


@dataclass
class Placement:
    """Where one call went: the replica that answered it (None with one engine) and whether it was retried."""

    replica: int | None = None
    retried: bool = False


class Replicas:
    """The engine client(s) of one proxy: one Upstream per replica, the rollout pins and the calls in flight."""

    def __init__(self, config: UpstreamConfig, transport=None,
                 alive: Callable[[int], bool] | None = None) -> None:
        """`transport`: one httpx transport for every replica, or a sequence of one per replica (tests).
        `alive(i)`: optional check that replica i's process still runs, asked before each pick."""
        urls = config.replica_urls or (config.base_url,)
        transports = list(transport) if isinstance(transport, Sequence) else [transport] * len(urls)
        if len(transports) != len(urls):
            raise ValueError(f"{len(transports)} transports for {len(urls)} replicas")
        self.upstreams = [Upstream(replace(config, base_url=url, replica_urls=()), t)
                          for url, t in zip(urls, transports)]
        self.in_flight = [0] * len(urls)
        self.dead: dict[int, str] = {}
        """Replicas dropped for the rest of the run -> why."""
        self._assigned = [0] * len(urls)  # rollouts ever pinned to each: spreads new rollouts when loads tie
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._alive = alive

    @property
    def several(self) -> bool:
        return len(self.upstreams) > 1

    def live(self) -> list[int]:
        """Indices of the replicas still served."""
        if self._alive is not None:
            for index in range(len(self.upstreams)):
                if index not in self.dead and not self._alive(index):
                    self.mark_dead(index, "its process is gone")
        return [i for i in range(len(self.upstreams)) if i not in self.dead]

    def mark_dead(self, index: int, reason: str) -> None:
        """Stop sending calls to replica `index`; its rollouts are re-pinned on their next call."""
        if index in self.dead:
            return
        self.dead[index] = reason
        left = len(self.upstreams) - len(self.dead)
        logger.warning("engine replica %d dropped (%s): %d of %d left", index, reason, left, len(self.upstreams))

    def pinned(self, rollout_id: str) -> int | None:
        return self._pins.get(rollout_id)

    def _pick(self, rollout_id: str, avoid: int | None = None) -> int:
        """The rollout's replica: its pin while that one lives, else the live one with the fewest calls in flight
        (then the fewest rollouts pinned so far), pinned from now on. UpstreamGone when none is left."""
        candidates = [i for i in self.live() if i != avoid]
        if not candidates:
            raise UpstreamGone(f"engine unreachable: no live replica left ({self._why_dead()})")
        index = self._pins.get(rollout_id)
        if index in candidates:
            self._pins.move_to_end(rollout_id)
            return index
        index = min(candidates, key=lambda i: (self.in_flight[i], self._assigned[i], i))
        self._assigned[index] += 1
        self._pins[rollout_id] = index
        self._pins.move_to_end(rollout_id)
        while len(self._pins) > MAX_PINS:
            self._pins.popitem(last=False)
        return index

    def leave(self, index: int) -> None:
        """A call on replica `index` has ended (one that started with in_flight[index] += 1)."""
        self.in_flight[index] -= 1

    def _why_dead(self) -> str:
        return "; ".join(f"replica {i}: {why}" for i, why in sorted(self.dead.items())) or "none configured"

    async def _lost(self, index: int, exc: UpstreamGone, placement: Placement) -> None:
        """A call on replica `index` was cut off: drop the replica if it is down, and return if the call may go
        to another one (marking it retried); raise `exc` where it may not (retried already, or none left)."""
        if not await self.upstreams[index].healthy():
            self.mark_dead(index, f"{exc.message}; /health did not answer")
        if placement.retried or not [i for i in self.live() if i != index]:
            raise exc
        placement.retried = True
        logger.warning("call cut off on engine replica %d (%s): retrying it once on another replica", index,
                       exc.message)

    async def post_json(self, rollout_id: str, path: str, body: dict, placement: Placement) -> dict:
        """Upstream.post_json on the rollout's replica, retried once on another if that one dies under it."""
        if not self.several:
            return await self.upstreams[0].post_json(path, body)
        avoid = None
        while True:
            index = placement.replica = self._pick(rollout_id, avoid)
            self.in_flight[index] += 1
            try:
                return await self.upstreams[index].post_json(path, body)
            except UpstreamGone as exc:
                await self._lost(index, exc, placement)
                avoid = index
            finally:
                self.in_flight[index] -= 1

    @asynccontextmanager
    async def stream(self, rollout_id: str, path: str, body: dict,
                     placement: Placement) -> AsyncIterator[AsyncIterator[dict]]:
        """Upstream.stream on the rollout's replica; retried once on another while no event has been passed on."""
        if not self.several:
            async with self.upstreams[0].stream(path, body) as events:
                yield events
            return
        call = _StreamCall(self, rollout_id, path, body, placement)
        try:
            await call.open()
            yield call.events()
        finally:
            await call.close()

    async def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize on a live replica (any: they share the tokenizer)."""
        if not self.several:
            return await self.upstreams[0].tokenize(body)
        live = self.live()
        if not live:
            raise UpstreamGone(f"engine unreachable: no live replica left ({self._why_dead()})")
        return await self.upstreams[min(live, key=self.in_flight.__getitem__)].tokenize(body)

    async def aclose(self) -> None:
        for upstream in self.upstreams:
            await upstream.aclose()


class _StreamCall:
    """One streaming call over replicas: the open stream of its current replica, reopened once elsewhere."""

    def __init__(self, replicas: Replicas, rollout_id: str, path: str, body: dict, placement: Placement) -> None:
        self.replicas, self.rollout_id, self.path, self.body = replicas, rollout_id, path, body
        self.placement = placement
        self._stack: AsyncExitStack | None = None
        self._events: AsyncIterator[dict] | None = None

    async def open(self, avoid: int | None = None) -> None:
        replicas = self.replicas
        while True:
            index = self.placement.replica = replicas._pick(self.rollout_id, avoid)
            replicas.in_flight[index] += 1
            self._stack = AsyncExitStack()
            self._stack.callback(replicas.leave, index)
            try:
                self._events = await self._stack.enter_async_context(replicas.upstreams[index].stream(self.path,
                                                                                                       self.body))
                return
            except UpstreamGone as exc:
                await self.close()
                await replicas._lost(index, exc, self.placement)
                avoid = index
            except BaseException:
                await self.close()
                raise

    async def events(self) -> AsyncIterator[dict]:
        started = False
        while True:
            try:
                async for event in self._events:
                    started = True
                    yield event
                return
            except UpstreamGone as exc:
                if started:  # the harness has part of this replica's answer: no other replica can go on with it
                    raise
                index = self.placement.replica
                await self.close()
                await self.replicas._lost(index, exc, self.placement)
                await self.open(avoid=index)

    async def close(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()
