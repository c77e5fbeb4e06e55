"""A run page's websocket across a Redis restart (issue 13, point 5), without a real run: the consumer's socket
closes when its Redis goes away (it never lingers deaf to its group), and the reconnect with `?after=` replays
what was published while Redis was down. The real-run version, in Chromium, is in test_faults_infra.py."""
import asyncio
import copy

import pytest
import redis
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from rest_framework.authtoken.models import Token

from lightning_web.asgi import application
from runs import services
from tests.e2e.infra_services import OwnRedis

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
ORIGIN = [(b"origin", b"http://localhost")]


@pytest.fixture
def own_redis(tmp_path, settings):
    """The channel layer on a Redis of this test's own, which it restarts."""
    server = OwnRedis(tmp_path / "redis").start()
    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    layers["default"]["CONFIG"]["hosts"] = [server.url]
    settings.CHANNEL_LAYERS = layers
    yield server
    server.stop()


@database_sync_to_async
def emit(run_id, line):
    return services.emit_event(run_id, "run.log", {"line": line}).seq


async def connect(run_id, token, after):
    ws = WebsocketCommunicator(application, f"/ws/runs/{run_id}/?after={after}&token={token}", headers=ORIGIN)
    connected, _ = await ws.connect(timeout=5)
    assert connected
    return ws


async def reconnect(run_id, token, after, count):
    """Reconnect as the page does (static/js/live.js): `?after=` the last seq seen, and again while the server closes
    the socket (the first consumers after a restart may meet a pooled Redis connection that died with it).

    Returns the socket, the `count` events it replayed and how many connects it took."""
    got = []
    for tries in range(1, 6):
        ws = await connect(run_id, token, after)
        try:
            while len(got) < count:
                got.append(await ws.receive_json_from(timeout=5))
                after = got[-1]["seq"]
            return ws, got, tries
        except redis.ConnectionError:  # the consumer failed on Redis: its socket is closed
            await asyncio.sleep(0.5)
    raise AssertionError(f"no connection held after {tries} tries; got {got}")


async def test_the_socket_closes_with_redis_and_the_reconnect_backfills_then_streams(alice, make_run, own_redis):
    run = await database_sync_to_async(make_run)(alice)
    token = await database_sync_to_async(lambda: Token.objects.get_or_create(user=alice)[0].key)()
    ws = await connect(run.pk, token, 0)
    queued = await ws.receive_json_from(timeout=5)
    assert (queued["seq"], queued["kind"], queued["payload"]["status"]) == (1, "run.status", "queued")
    await emit(run.pk, "before")
    assert (await ws.receive_json_from(timeout=5))["payload"] == {"line": "before"}

    await asyncio.to_thread(own_redis.stop)
    missed = [await emit(run.pk, f"while down {i}") for i in range(3)]  # stored; their publish fails (logged)
    with pytest.raises(Exception, match="(?i)connection"):  # the consumer fails: the server closes its socket
        await ws.receive_output(timeout=5)
    await asyncio.to_thread(own_redis.start)

    ws, replayed, tries = await reconnect(run.pk, token, 2, len(missed))  # from the client's last seq
    print(f"\nreplayed after {tries} reconnects")
    assert [(e["seq"], e["payload"]["line"]) for e in replayed] == [
        (seq, f"while down {i}") for i, seq in enumerate(missed)]
    live = await emit(run.pk, "after")  # the new consumer joined the group on the new Redis
    event = await ws.receive_json_from(timeout=5)
    assert (event["seq"], event["payload"]) == (live, {"line": "after"})
    assert await ws.receive_nothing(timeout=0.5)
    await ws.disconnect()
    assert await database_sync_to_async(lambda: run.events.count())() == 6
