"""Several vLLM servers of one model for one run: one weights folder, and pause, weight update and resume sent to
every live replica at once.

Each replica is a VLLMServer of its own (its port, its log, its process group; on a GPU host its own device). The
proxy spreads rollouts over them (proxy.replicas). A replica that dies is dropped: a control call that fails on a
replica whose process is gone within ENGINE_DEATH_NOTICE_S is skipped, and the run goes on with the others; a
control call that fails on a replica still running fails the update (EngineError), as with one engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from trainer.engine.server import EngineError, VLLMServer
from trainer.engine.sync import VLLMEngine, update_weights_in_place, write_weights

logger = logging.getLogger(__name__)

ENGINE_DEATH_NOTICE_S = 3.0
"""How long a failed control call waits to see whether its replica's process died (its watchdog polls at 0.5 s)."""


class ReplicaServers:
    """The replicas' servers seen as one by the run's engine-death watch: running while any replica runs."""

    def __init__(self, servers: list[VLLMServer]):
        self.servers = servers
        self._deaths: list[int] = []  # replicas found dead by newly_dead, in the order found

    def running(self) -> bool:
        return any(server.running() for server in self.servers)

    def alive(self, index: int) -> bool:
        return self.servers[index].running()

    @property
    def log_path(self) -> Path:
        """The log of the replica found dead last (the one whose end stopped the run), else of replica 0."""
        dead = self._deaths or [i for i in range(len(self.servers)) if not self.alive(i)]
        return self.servers[dead[-1] if dead else 0].log_path

    def newly_dead(self) -> list[int]:
        """Replicas found dead since the last call, in index order (for the run's log)."""
        gone = [i for i in range(len(self.servers)) if i not in self._deaths and not self.alive(i)]
        self._deaths += gone
        return gone


class ReplicatedEngine:
    """The scheduler's Engine over several VLLMEngines that serve one weights folder."""

    def __init__(self, engines: list[VLLMEngine]):
        if not engines:
            raise ValueError("ReplicatedEngine needs at least one engine")
        model_dirs = {engine.sync.model_dir for engine in engines}
        if len(model_dirs) != 1:
            raise ValueError(f"replicas must serve one weights folder, got {sorted(map(str, model_dirs))}")
        self.engines = engines
        self.model_dir = model_dirs.pop()
        self.server = ReplicaServers([engine.server for engine in engines])
        self.dropped: dict[int, str] = {}
        """Replicas skipped by control calls since they died -> the error that showed it."""
        self._version = max(engine.version for engine in engines)
        self.last_timings: dict[str, float] = {}

    @property
    def base_url(self) -> str:
        return self.engines[0].base_url

    @property
    def base_urls(self) -> list[str]:
        return [engine.base_url for engine in self.engines]

    @property
    def version(self) -> int:
        return self._version

    def replica_running(self, index: int) -> bool:
        """Whether replica `index` is still served (its process runs and no control call dropped it)."""
        return index not in self.dropped and self.server.alive(index)

    def live(self) -> list[int]:
        return [i for i in range(len(self.engines)) if self.replica_running(i)]

    async def pause(self) -> None:
        await self._on_live("pause", lambda i: self.engines[i].pause())

    async def resume(self) -> None:
        await self._on_live("resume", lambda i: self.engines[i].resume())

    async def update_weights(self, model: "object", version: int) -> None:
        """Write the weights once into the shared folder, then every live replica reloads and tags `version`."""
        state = model.state_dict() if hasattr(model, "state_dict") else model
        started = time.monotonic()
        in_place = await asyncio.to_thread(self._write, state)
        written = time.monotonic()
        reloads: dict[int, float] = {}

        async def reload(index: int) -> None:
            sync = self.engines[index].sync
            reloads[index] = await asyncio.to_thread(sync.reload)
            await asyncio.to_thread(sync.set_version, version)
            self.engines[index]._version = version

        await self._on_live("update_weights", reload)
        self._version = version
        self.last_timings = {"write_s": written - started, "reload_s": max(reloads.values(), default=0.0),
                             "total_s": time.monotonic() - started, "in_place": float(in_place),
                             "replicas": float(len(reloads))}

    def _write(self, state) -> bool:
        in_place = update_weights_in_place(self.model_dir, state)
        if not in_place:
            write_weights(self.model_dir, state)
        return in_place

    async def _on_live(self, what: str, action) -> None:
        """`action(i)` on every live replica at once; a replica that fails and whose process is gone is dropped,
        any other failure raises once all have finished. EngineError when no replica is left."""
        live = self.live()
        if not live:
            raise EngineError(f"cannot {what}: every engine replica has died")
        results = await asyncio.gather(*(action(i) for i in live), return_exceptions=True)
        failures = []
        for index, result in zip(live, results):
            if not isinstance(result, BaseException):
                continue
            if isinstance(result, Exception) and await self._died(index):
                self.dropped[index] = f"{what} failed: {result}"
                logger.warning("engine replica %d died (%s failed: %s); going on with the others", index, what,
                               result)
                continue
            failures.append((index, result))
        if failures:
            index, error = failures[0]
            if isinstance(error, EngineError):
                raise EngineError(f"engine replica {index}: {error}") from error
            raise error
        if not self.live():
            raise EngineError(f"cannot {what}: every engine replica has died")

    async def _died(self, index: int) -> bool:
        deadline = time.monotonic() + ENGINE_DEATH_NOTICE_S
        while self.server.alive(index):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
