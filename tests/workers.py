"""Real Celery worker subprocesses on the tests' database and broker, as `manage.py up` starts them."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from common.procs import kill_groups, pids_matching
from lightning_web.celery import app as celery_app
from trainer.engine import default_engine_venv

ROOT = Path(__file__).resolve().parents[1]

REAL_RUN_MARKS = [
    pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]
"""The marks of a test that drives a real run (real workers, vLLM on CPU) against the test database."""


def database_url() -> str:
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    return f"postgres://{s['USER']}:{s['PASSWORD'] or ''}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class Workers:
    """Celery worker subprocesses on the tests' database and broker, as `manage.py up` starts them."""

    def __init__(self, tmp_path: Path):
        self.logs, self.procs = tmp_path / "logs", []
        self.logs.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        # The tests' queues (their own Redis database), and the channel layer the tests and a live server use.
        self.env.update(DATABASE_URL=database_url(), REDIS_URL=settings.REDIS_URL,
                        CELERY_BROKER_URL=celery_app.conf.broker_url,
                        LIGHTNING_DATA_DIR=str(tmp_path / "data"),
                        # The registry the test built its models in: workers refuse models outside it.
                        LIGHTNING_MODELS_DIR=str(settings.LIGHTNING_MODELS_DIR),
                        CHANNELS_PREFIX=settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"],
                        LIGHTNING_HEARTBEAT_EVERY_S="1", LIGHTNING_RUN_LOST_AFTER_S="4",
                        LIGHTNING_SWEEP_EVERY_S="1", LIGHTNING_CHECKPOINTS_KEPT="5", PYTHONUNBUFFERED="1",
                        # The tests read each harness's answers.jsonl (what it was told) after the run.
                        LIGHTNING_KEEP_ROLLOUT_WORKDIRS="1")
        self.data_dir = tmp_path / "data"
        self.runs_dir = self.data_dir / "runs"
        # The engine's compile caches and served folders are shared across tests and sessions (tests.conftest), as
        # on a user's machine across runs: a start with a cold cache compiles for about 20 s more and inspects the
        # model class in a subprocess. Staging a served folder is atomic, so lanes may race on it.
        from tests.conftest import ENGINE_CACHE_DIR

        ENGINE_CACHE_DIR.mkdir(exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not (self.data_dir / "engine-cache").exists():
            (self.data_dir / "engine-cache").symlink_to(ENGINE_CACHE_DIR)

    @classmethod
    def for_real_run(cls, tmp: Path, model: str, harness: str) -> tuple["Workers", Path]:
        """Workers for one real run of a module: a registry with the tiny model `model`, the engine compile cache
        shared across sessions, and `harness` written to tmp/harness.py; returns (workers, registry)."""
        from trainer.models import build_tiny_model

        registry = tmp / "registry"
        build_tiny_model(registry / model, seed=0)
        workers = cls(tmp)
        workers.env.update(LIGHTNING_MODELS_DIR=str(registry))
        (tmp / "harness.py").write_text(harness)
        return workers, registry

    def engines(self) -> list[str]:
        """vLLM processes serving from this test's data dir (the run's folder or the engine cache in it)."""
        return pids_matching(str(self.data_dir), "vllm.entrypoints")

    def start(self, name: str, queues: str, beat: bool = False, loglevel: str = "INFO") -> subprocess.Popen:
        argv = [sys.executable, "-m", "celery", "-A", "lightning_web", "worker", "--pool", "solo", "-Q", queues,
                "-n", f"{name}@test", "--loglevel", loglevel] + (["--beat"] if beat else [])
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the worker process alone, as the kernel's OOM killer does."""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs.iterdir())

    def stop(self) -> None:
        kill_groups([proc.pid for proc in self.procs], grace_s=60)
        for proc in self.procs:
            proc.wait()


def wait_db(condition, what: str, workers: Workers, timeout: float = 300) -> None:
    """Poll `condition` (a database read) until it holds; on timeout fail with the workers' log tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{workers.tails()}")


@pytest.fixture
def workers(tmp_path, test_redis, settings, models_dir):
    """Workers on this test's models registry and channel layer (a live server's pages see their events)."""
    pool = Workers(tmp_path)
    pool.env.update(LIGHTNING_MODELS_DIR=str(models_dir),
                    CHANNELS_PREFIX=settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"])
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    yield pool
    pool.stop()


@contextlib.contextmanager
def real_run(tmp: Path, model: str, harness: str, django_db_blocker):
    """Workers.for_real_run for a module-scoped fixture: the database unblocked, the settings on the workers'
    registry, runs folder and engine cache, and the tests' broker empty; on exit the workers are stopped and the
    broker and database emptied again. Yields the workers."""
    from tests.conftest import ENGINE_CACHE_DIR

    workers, registry = Workers.for_real_run(tmp, model, harness)
    broker = redis.Redis.from_url(celery_app.conf.broker_url)
    broker.flushdb()
    with django_db_blocker.unblock(), override_settings(LIGHTNING_MODELS_DIR=registry,
                                                        LIGHTNING_RUNS_DIR=workers.runs_dir,
                                                        LIGHTNING_ENGINE_CACHE_DIR=ENGINE_CACHE_DIR):
        try:
            yield workers
        finally:
            workers.stop()
            broker.flushdb()
            broker.close()
            call_command("flush", interactive=False, verbosity=0)  # the tests' database as the run found it
