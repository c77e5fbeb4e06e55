"""Websocket /ws/runs/<id>/: auth, ownership, replay after a seq, live delivery through a real Redis layer."""
import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from channels_redis.core import RedisChannelLayer
from rest_framework.authtoken.models import Token

from lightning_web.asgi import application
from runs import services

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = [(b"origin", b"http://localhost")]


@database_sync_to_async
def token_of(user):
    return Token.objects.get_or_create(user=user)[0].key


@database_sync_to_async
def emit(run_id, kind, payload):
    return services.emit_event(run_id, kind, payload).seq


async def connect(path):
    communicator = WebsocketCommunicator(application, path, headers=ORIGIN)
    connected, code = await communicator.connect(timeout=5)
    return communicator, connected, code


@pytest.fixture
def run(alice, make_run):
    run = make_run(alice)
    for i in range(3):
        services.emit_event(run.pk, "run.log", {"line": i})
    return run  # events 1 (queued) .. 4


async def test_the_layer_is_redis():
    assert isinstance(get_channel_layer(), RedisChannelLayer)


async def test_it_replays_after_the_last_seq_then_streams_live(alice, run):
    ws, connected, _ = await connect(f"/ws/runs/{run.pk}/?after=2&token={await token_of(alice)}")
    assert connected
    replayed = [await ws.receive_json_from(timeout=5) for _ in range(2)]
    assert [(e["seq"], e["kind"], e["payload"]) for e in replayed] == [(3, "run.log", {"line": 1}),
                                                                       (4, "run.log", {"line": 2})]
    assert replayed[0]["run"] == run.pk and "created_at" in replayed[0] and "type" not in replayed[0]
    seq = await emit(run.pk, "run.log", {"line": "live"})
    live = await ws.receive_json_from(timeout=5)
    assert seq == 5 and (live["seq"], live["payload"]) == (5, {"line": "live"})
    assert await ws.receive_nothing(timeout=0.3)
    await ws.disconnect()


async def test_a_status_change_arrives_live(alice, run):
    ws, connected, _ = await connect(f"/ws/runs/{run.pk}/?after=4&token={await token_of(alice)}")
    assert connected and await ws.receive_nothing(timeout=0.3)
    await database_sync_to_async(services.cancel_run)(run, alice)
    event = await ws.receive_json_from(timeout=5)
    assert event["kind"] == "run.status" and event["payload"] == {"status": "cancelled",
                                                                  "error": "cancelled before it started"}
    await ws.disconnect()


async def test_a_client_can_ask_for_a_replay_again(alice, run):
    ws, connected, _ = await connect(f"/ws/runs/{run.pk}/?after=4&token={await token_of(alice)}")
    assert connected
    await ws.send_json_to({"after": 1})
    assert [(await ws.receive_json_from(timeout=5))["seq"] for _ in range(3)] == [2, 3, 4]
    await ws.send_json_to({"hello": 1})
    assert (await ws.receive_json_from(timeout=5))["kind"] == "error"
    await ws.disconnect()


async def test_nothing_is_lost_across_a_reconnect(alice, run):
    token = await token_of(alice)
    ws, _, _ = await connect(f"/ws/runs/{run.pk}/?after=4&token={token}")
    await emit(run.pk, "run.log", {"line": "a"})
    last = (await ws.receive_json_from(timeout=5))["seq"]
    await ws.disconnect()
    for line in ("b", "c"):  # published while nobody listens
        await emit(run.pk, "run.log", {"line": line})
    ws, _, _ = await connect(f"/ws/runs/{run.pk}/?after={last}&token={token}")
    got = [(await ws.receive_json_from(timeout=5))["payload"]["line"] for _ in range(2)]
    assert got == ["b", "c"]
    await ws.disconnect()


async def test_concurrent_writers_are_delivered_once_each_in_order(alice, run):
    ws, _, _ = await connect(f"/ws/runs/{run.pk}/?after=4&token={await token_of(alice)}")
    await asyncio.gather(*(emit(run.pk, "run.log", {"line": i}) for i in range(10)))
    seqs = [(await ws.receive_json_from(timeout=5))["seq"] for _ in range(10)]
    assert seqs == list(range(5, 15))
    assert await ws.receive_nothing(timeout=0.3)
    await ws.disconnect()


async def test_anonymous_clients_are_refused(run):
    _, connected, code = await connect(f"/ws/runs/{run.pk}/")
    assert not connected and code == 4401


async def test_a_bad_token_is_refused(run):
    _, connected, code = await connect(f"/ws/runs/{run.pk}/?token=nope")
    assert not connected and code == 4401


async def test_other_users_cannot_follow_a_run(bob, run):
    _, connected, code = await connect(f"/ws/runs/{run.pk}/?token={await token_of(bob)}")
    assert not connected and code == 4404


async def test_staff_can_follow_any_run(staff, run):
    ws, connected, _ = await connect(f"/ws/runs/{run.pk}/?after=3&token={await token_of(staff)}")
    assert connected and (await ws.receive_json_from(timeout=5))["seq"] == 4
    await ws.disconnect()


async def test_a_session_cookie_authenticates(alice, run, client):
    await database_sync_to_async(client.force_login)(alice)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?after=3",
                                         headers=ORIGIN + [(b"cookie", cookie)])
    connected, _ = await communicator.connect(timeout=5)
    assert connected and (await communicator.receive_json_from(timeout=5))["seq"] == 4
    await communicator.disconnect()


async def test_a_foreign_origin_is_refused(alice, run):
    communicator = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/?token={await token_of(alice)}",
                                         headers=[(b"origin", b"http://evil.example")])
    connected, _ = await communicator.connect(timeout=5)
    assert not connected
