"""What a worker answers about its host through Celery's inspect (`host_profile`): the CPU its runs resolve their
number formats on (trainer.host), for the workers page and GET /api/v1/workers/."""
from __future__ import annotations

import functools
import logging
import threading

from celery.signals import worker_ready
from celery.worker.control import inspect_command

logger = logging.getLogger(__name__)


@inspect_command()
def host_profile(state) -> dict:
    """This worker's host profile, what `auto` picks there, and the line the run page shows."""
    return profile()


@functools.cache
def profile() -> dict:
    """Detected once per worker process: the CPU and the environment's ISA limits do not change while it runs."""
    from trainer.host import detect, resolve, summary

    host = detect()
    formats = resolve(host)
    return {**host.to_dict(), "auto": formats.to_dict(), "summary": summary(host, formats)}


@worker_ready.connect
def _detect_early(**_) -> None:
    """Detect while the worker is idle (torch's import takes a second or two), so an inspect answers at once."""
    def detect() -> None:
        try:
            logger.info("host: %s", profile()["summary"])
        except Exception:
            logger.warning("could not detect this worker's host", exc_info=True)

    threading.Thread(target=detect, name="host-profile", daemon=True).start()
