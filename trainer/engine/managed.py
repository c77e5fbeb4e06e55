"""One call to serve a model for a run: stage a private copy, start vLLM, hand out the scheduler's Engine."""
from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trainer.engine.server import EngineConfig, VLLMServer
from trainer.engine.sync import VLLMEngine, WeightSync, stage_model

logger = logging.getLogger(__name__)


@contextmanager
def managed_engine(config: EngineConfig, work_dir: str | Path, start_timeout: float = 600.0,
                   pause_mode: str = "wait") -> Iterator[VLLMEngine]:
    """Serve config.model_path from `work_dir/served-model` (syncs never touch the source) until the block ends.

    The yielded engine has `.base_url` (OpenAI API under /v1), `.server` (log_path, pgid) and `.sync`.
    """
    work_dir = Path(work_dir)
    served = stage_model(config.model_path, work_dir / "served-model")
    server = VLLMServer(dataclasses.replace(config, model_path=str(served)), log_path=work_dir / "engine.log")
    server.start(timeout=start_timeout)
    engine = None
    try:
        engine = VLLMEngine(WeightSync(server.base_url, served, pause_mode=pause_mode))
        engine.server = server
        yield engine
    finally:
        if engine is not None:
            engine.close()
        server.stop()
