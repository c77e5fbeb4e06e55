"""One call to serve a model for a run: stage a private copy, start vLLM, hand out the scheduler's Engine."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator

from trainer.engine.server import EngineConfig, VLLMServer
from trainer.engine.sync import VLLMEngine, WeightSync, stage_model

logger = logging.getLogger(__name__)


@contextmanager
def managed_engine(config: EngineConfig, work_dir: str | Path, start_timeout: float = 600.0,
                   pause_mode: str = "wait") -> Iterator[VLLMEngine]:
    """Serve config.model_path from `work_dir/served-model` (syncs never touch the source) until the block ends.

    The yielded engine has `.base_url` (OpenAI API under /v1), `.server` (log_path, pgid) and `.sync`.
    """
    server = _staged_server(config, work_dir)
    server.start(timeout=start_timeout)
    engine = None
    try:
        engine = _engine_for(server, pause_mode)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        server.stop()


@asynccontextmanager
async def serving_engine(config: EngineConfig, work_dir: str | Path, start_timeout: float = 600.0,
                         pause_mode: str = "wait") -> AsyncIterator[VLLMEngine]:
    """`managed_engine` for async code: the start runs on a thread, and cancelling the awaiting task at any
    moment, the start included, stops the server and returns only once its process group is gone."""
    server = await asyncio.to_thread(_staged_server, config, work_dir)
    starting = asyncio.get_running_loop().run_in_executor(None, server.start, start_timeout)
    engine = None
    try:
        await asyncio.shield(starting)
        engine = _engine_for(server, pause_mode)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        # A cancelled start is still running on its thread: abort makes it give up within a second.
        await asyncio.to_thread(server.abort)
        await asyncio.wait([starting], timeout=30)
        if starting.done() and not starting.cancelled():
            starting.exception()  # seen: an aborted start's EngineError is expected here


def _staged_server(config: EngineConfig, work_dir: str | Path) -> VLLMServer:
    """A server (not started) for a run-private copy of the model in `work_dir/served-model`."""
    work_dir = Path(work_dir)
    served = stage_model(config.model_path, work_dir / "served-model")
    return VLLMServer(dataclasses.replace(config, model_path=str(served)), log_path=work_dir / "engine.log")


def _engine_for(server: VLLMServer, pause_mode: str) -> VLLMEngine:
    """The scheduler's Engine over a started server, with `.server` for its log and process group."""
    engine = VLLMEngine(WeightSync(server.base_url, server.config.model_path, pause_mode=pause_mode))
    engine.server = server
    return engine
