"""The reward script's test panel, scored on a worker: the web process never runs user code.

The panel's request is kept in the broker's Redis (`lightning:reward-test:<id>`, for RESULT_TTL_S) and
run_reward_test scores it on the control worker's queue, with the sandbox and isolation a run's scores get (runs.
sandbox); the page asks for the result until it is there. A worker that takes a test already taken (a redelivery)
leaves it alone.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from celery import shared_task

logger = logging.getLogger(__name__)

KEY = "lightning:reward-test:{}"
RESULT_TTL_S = 900
"""How long a test's request and result are kept: the page reads the result within seconds of it."""
QUEUE = "default"
"""The control worker's queue: short jobs, no accelerator needed."""


def _redis():
    from runs.pools import broker_redis

    return broker_redis()


def queue_test(user, request: dict[str, Any]) -> str:
    """Keep the test (`request`: source, timeout_s, task, task_label, outcome) for `user` and queue it; its id."""
    test_id = uuid.uuid4().hex
    entry = {"owner": user.pk, "status": "queued", "queued_at": time.time(), "request": request}
    _redis().set(KEY.format(test_id), json.dumps(entry), ex=RESULT_TTL_S)
    run_reward_test.apply_async(args=[test_id], queue=QUEUE)
    logger.info("reward test %s queued by %s", test_id, user)
    return test_id


def read_test(user, test_id: str) -> dict[str, Any] | None:
    """The test as stored ({"status": "queued" | "running" | "done", ...}), None when unknown or not `user`'s."""
    if not test_id.isalnum():
        return None
    raw = _redis().get(KEY.format(test_id))
    if raw is None:
        return None
    entry = json.loads(raw)
    return entry if entry.get("owner") == user.pk or user.is_staff else None


WAIT_MARGIN_S = 30.0
"""How much longer than the script's timeout the API waits for a worker to score a test."""


class NoWorker(RuntimeError):
    """No worker scored a test in time (the control worker is down or busy)."""


def score_on_worker(user, request: dict[str, Any], poll_s: float = 0.1) -> dict[str, Any]:
    """Queue a test and wait for its result (the API's synchronous `test`); NoWorker past the script's timeout plus
    WAIT_MARGIN_S. The waiting process runs no user code."""
    test_id = queue_test(user, request)
    patience = float(request["timeout_s"]) + WAIT_MARGIN_S
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        entry = read_test(user, test_id)
        if entry is not None and entry["status"] == "done":
            return entry["result"]
        time.sleep(poll_s)
    raise NoWorker(f"no worker scored the test within {patience:.0f} s; reward tests run on the control worker "
                   f"(queue {QUEUE!r}, started by ./lw up): is it running?")


@shared_task(name="catalog.reward_tests.run_reward_test", acks_late=True)
def run_reward_test(test_id: str) -> str:
    """Score a queued test (catalog.services.score_reward) and store its result; the status it left."""
    from catalog import services

    client, key = _redis(), KEY.format(test_id)
    raw = client.get(key)
    if raw is None:
        return "gone"
    entry = json.loads(raw)
    if entry["status"] != "queued":
        return entry["status"]
    client.set(key, json.dumps({**entry, "status": "running", "started_at": time.time()}), ex=RESULT_TTL_S)
    request = entry["request"]
    result = services.score_reward(request["source"], request["task"], request["outcome"],
                                   timeout_s=request["timeout_s"])
    client.set(key, json.dumps({**entry, "status": "done", "finished_at": time.time(), "result": result.as_dict()}),
               ex=RESULT_TTL_S)
    return "done"
