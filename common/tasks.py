"""Enqueueing Celery work by task name: a service never imports the module that defines the task, so the task
modules (which import the services) and the services stay out of one import loop."""
from __future__ import annotations

from typing import Any

from celery import current_app


def send_task(name: str, args: list[Any], queue: str):
    """Publish task `name` with `args` on `queue`; its AsyncResult. Raises what the broker's publish raises."""
    return current_app.send_task(name, args=list(args), queue=queue)
