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

MESSAGE_TYPE = "run.event"  # the consumer method `run_event` receives these


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


def build_event(run_id: int, seq: int, kind: str, payload: dict[str, Any], created_at: str) -> dict[str, Any]:
    return {"type": MESSAGE_TYPE, "run": run_id, "seq": seq, "kind": kind, "payload": payload,
            "created_at": created_at}


def from_row(row) -> dict[str, Any]:
    """The event dict of a RunEvent row (the same shape live and on replay)."""
    return build_event(row.run_id, row.seq, row.kind, row.payload, row.created_at.isoformat())


def publish(event: dict[str, Any]) -> None:
    """Send to the run's group; a lost message is fine (clients replay from RunEvent), so log and go on."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _send(layer, event)
    else:  # sync code running on an event loop's thread: async_to_sync refuses there, so send from a helper
        sender = threading.Thread(target=_send, args=(layer, event), name="publish-event")
        sender.start()
        sender.join()


def _send(layer, event: dict[str, Any]) -> None:
    try:
        async_to_sync(layer.group_send)(run_group(event["run"]), event)
    except Exception:
        logger.warning("could not publish event seq=%s of run %s", event["seq"], event["run"], exc_info=True)
