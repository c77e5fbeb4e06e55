"""The live Celery workers as Celery itself reports them: inspect (ping, stats, active, active_queues) and the workers'
own heartbeat events, read in one short window. The workers page and GET /api/v1/workers/ show this."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import current_app
from django.utils import timezone

from catalog import selectors
from runs import pools
from runs.models import Run

logger = logging.getLogger(__name__)

TIMEOUT_S = 1.0
"""How long the workers have to answer a broadcast (and to send a heartbeat once woken)."""


def heartbeats(seconds: float, into: dict[str, dict]) -> None:
    """Collect `worker-heartbeat` events for `seconds` into `into` (hostname -> event), after asking every worker to
    send one now (Celery's own wake-up broadcast), so a live worker is heard without waiting for its next beat."""
    deadline = time.monotonic() + seconds

    def on_heartbeat(event):
        into[event["hostname"]] = event
        if time.monotonic() >= deadline:
            receiver.should_stop = True

    try:
        with current_app.connection_for_read() as connection:
            receiver = current_app.events.Receiver(connection, handlers={"worker-heartbeat": on_heartbeat})
            receiver.capture(limit=None, timeout=seconds, wakeup=True)
    except TimeoutError:  # nothing more within the window
        pass
    except Exception:
        logger.warning("could not read the workers' heartbeats", exc_info=True)


def inspect_workers(user, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Every worker that answers a ping within `timeout`: its name, pools (queues), heartbeat age, process pool,
    and the runs it holds with their device sets. `user` sees the names of their own runs only (staff: all)."""
    beats: dict[str, dict] = {}
    listener = threading.Thread(target=heartbeats, args=(timeout, beats), name="worker-heartbeats", daemon=True)
    listener.start()
    control = current_app.control
    try:
        names = sorted(control.inspect(timeout=timeout).ping() or {})
        stats = active = queues = hosts = {}
        if names:
            inspect = control.inspect(destination=names, limit=len(names), timeout=timeout)
            stats, active, queues = inspect.stats() or {}, inspect.active() or {}, inspect.active_queues() or {}
            # runs.worker_control's inspect command: a custom command is asked for by name.
            replies = control.broadcast("host_profile", reply=True, destination=names, timeout=timeout) or []
            hosts = {name: answer for reply in replies for name, answer in reply.items()}
    finally:
        listener.join(timeout + 2)
    run_ids = {run_id for tasks in active.values() for task in tasks if (run_id := _run_of(task)) is not None}
    visible = dict(selectors.owned(Run.objects.filter(pk__in=run_ids), user).values_list("pk", "name"))
    statuses = dict(Run.objects.filter(pk__in=run_ids).values_list("pk", "status"))
    now = time.time()
    workers = [_worker(name, stats.get(name, {}), active.get(name, []), queues.get(name, []), beats.get(name),
                       visible, statuses, now, hosts.get(name)) for name in names]
    return {"checked_at": timezone.now(), "timeout_s": timeout, "answered": bool(workers), "workers": workers}


def _run_of(task: dict) -> int | None:
    if task.get("name") != "runs.tasks.execute_run":
        return None
    args = task.get("args") or []
    return args[0] if args and isinstance(args[0], int) else None


def _worker(name: str, stats: dict, active: list[dict], queues: list[dict], beat: dict | None,
            visible: dict[int, str], statuses: dict[int, str], now: float, host: dict | None = None
            ) -> dict[str, Any]:
    queue_names = sorted(q["name"] for q in queues if "name" in q)
    held = _claims(name)
    tasks = []
    for task in active:
        run_id = _run_of(task)
        claim = next((c for c in held.values() if c.get("run") == run_id), None) if run_id is not None else None
        tasks.append({"task": task.get("name", ""), "id": task.get("id", ""), "run": run_id,
                      "run_name": visible.get(run_id), "run_status": statuses.get(run_id),
                      "device_set": claim["index"] if claim else None, "devices": claim["devices"] if claim else None})
    pool = stats.get("pool") or {}
    return {
        "name": name,
        "queues": queue_names,
        "pools": [p for q in queue_names if (p := pools.pool_of_queue(q)) is not None],
        "heartbeat_age_s": round(max(0.0, now - beat["timestamp"]), 2) if beat and "timestamp" in beat else None,
        "pid": stats.get("pid"),
        "uptime_s": stats.get("uptime"),
        "concurrency": pool.get("max-concurrency"),
        "processed": sum((stats.get("total") or {}).values()),
        "active": tasks,
        # The CPU its runs resolve `auto` dtypes on, e.g. 'CPU: AVX2, no native bf16 (...) -> engine float32, ...';
        # '' from a worker that does not answer host_profile (an older version).
        "host": host.get("summary", "") if isinstance(host, dict) and "error" not in host else "",
    }


def _claims(worker: str) -> dict[int, dict]:
    try:
        return {index: {**entry, "index": index} for index, entry in pools.claims(worker).items()}
    except Exception:
        logger.warning("could not read the device sets of %s", worker, exc_info=True)
        return {}
