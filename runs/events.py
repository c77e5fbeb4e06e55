"""Names the channel groups and builds the event dicts that go to websocket clients."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)

RUN_STATUS = "run.status"
RUN_LOG = "run.log"
RUN_METRICS = "run.metrics"
RUN_PHASE = "run.phase"
RUN_RESUMED = "run.resumed"  # went back to a checkpoint: later steps' points are dropped and redone
ROLLOUT_STATUS = "rollout.status"
CALL_RECORDED = "call.recorded"
RUN_ALARM = "run.alarm"  # health.services: an alarm raised or acknowledged

MESSAGE_TYPE = "run.event"  # the consumer method `run_event` receives these
FEED_KINDS = frozenset({RUN_STATUS, RUN_METRICS, RUN_PHASE, RUN_RESUMED, RUN_ALARM})
"""Also sent to the runs-list feeds (the run's owner's and the staff's): what a row of the runs list shows."""
STAFF_FEED = "runs.staff"


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


def owner_feed(user_id: int) -> str:
    """The runs-list feed of one user: FEED_KINDS events of every run they own."""
    return f"runs.owner.{user_id}"


def build_event(run_id: int, seq: int, kind: str, payload: dict[str, Any], created_at: str) -> dict[str, Any]:
    return {"type": MESSAGE_TYPE, "run": run_id, "seq": seq, "kind": kind, "payload": payload,
            "created_at": created_at}


def from_row(row) -> dict[str, Any]:
    """The event dict of a RunEvent row (the same shape live and on replay)."""
    return build_event(row.run_id, row.seq, row.kind, row.payload, row.created_at.isoformat())


def publish(event: dict[str, Any], owner_id: int | None = None) -> None:
    """Send to the run's group (and, for FEED_KINDS with `owner_id`, to the runs-list feeds of the owner and staff).

    A lost message is fine (clients replay from RunEvent or backfill), so log and go on.
    """
    publish_many([event], owner_id)


def publish_many(batch: list[dict[str, Any]], owner_id: int | None = None) -> None:
    """publish() each event of `batch`, in order, from one trip into the channel layer's event loop."""
    layer = get_channel_layer()
    if layer is None or not batch:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _send(layer, batch, owner_id)
    else:  # sync code running on an event loop's thread: async_to_sync refuses there, so send from a helper
        sender = threading.Thread(target=_send, args=(layer, batch, owner_id), name="publish-event")
        sender.start()
        sender.join()


def _send(layer, batch: list[dict[str, Any]], owner_id: int | None = None) -> None:
    async def send_all():
        for event in batch:
            groups = [run_group(event["run"])]
            if owner_id is not None and event["kind"] in FEED_KINDS:
                groups += [owner_feed(owner_id), STAFF_FEED]
            try:
                for group in groups:
                    await layer.group_send(group, event)
            except Exception:
                logger.warning("could not publish event seq=%s of run %s", event["seq"], event["run"], exc_info=True)

    try:
        async_to_sync(send_all)()
    except Exception:
        logger.warning("could not publish %d events of run %s", len(batch), batch[0]["run"], exc_info=True)
