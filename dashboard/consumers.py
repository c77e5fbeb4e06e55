"""Websocket consumer of a run's live events: replay after the client's last seq, then stream."""
from __future__ import annotations

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from runs import events, selectors

REPLAY_BATCH = 500


class RunEventsConsumer(AsyncJsonWebsocketConsumer):
    """Client connects to /ws/runs/<id>/?after=<seq>; may later send {"after": seq} to resume."""

    async def connect(self):
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        self.last_seq = 0
        self.joined = False
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(selectors.user_can_see_run)(user, self.run_id):
            await self.close(code=4404)
            return
        await self.accept()
        # Join before replaying so nothing published during the replay is missed; dedupe by seq.
        await self.channel_layer.group_add(events.run_group(self.run_id), self.channel_name)
        self.joined = True
        await self._replay(_int(parse_qs(self.scope.get("query_string", b"").decode()).get("after", ["0"])[0]))

    async def disconnect(self, code):
        if getattr(self, "joined", False):
            await self.channel_layer.group_discard(events.run_group(self.run_id), self.channel_name)

    async def receive_json(self, content, **kwargs):
        if isinstance(content, dict) and "after" in content:
            await self._replay(_int(content["after"]))
        else:
            await self.send_json({"kind": "error", "payload": {"message": 'send {"after": <seq>} to replay'}})

    async def run_event(self, event):
        if event["seq"] > self.last_seq:
            await self._send(event)

    async def _replay(self, after: int):
        self.last_seq = after
        while True:
            batch = await database_sync_to_async(selectors.run_events_after)(self.run_id, self.last_seq, REPLAY_BATCH)
            for event in batch:
                await self._send(event)
            if len(batch) < REPLAY_BATCH:
                break

    async def _send(self, event):
        self.last_seq = event["seq"]
        await self.send_json({key: value for key, value in event.items() if key != "type"})


def _int(value) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


class RunsFeedConsumer(AsyncJsonWebsocketConsumer):
    """The runs list's live feed at /ws/runs/: status, phase, metrics and resume events of every run the user sees.

    No replay here: the client backfills the rows it shows (GET /runs/rows/) on every (re)connect, after joining,
    then applies events newer than each row's `event_seq`.
    """

    async def connect(self):
        user = self.scope.get("user")
        self.group = None
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        await self.accept()
        self.group = events.STAFF_FEED if user.is_staff else events.owner_feed(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.send_json({"kind": "feed.joined", "payload": {}})

    async def disconnect(self, code):
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        await self.send_json({"kind": "error", "payload": {"message": "the runs feed takes no messages"}})

    async def run_event(self, event):
        await self.send_json({key: value for key, value in event.items() if key != "type"})
