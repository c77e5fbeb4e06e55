"""Websocket /ws/runs/ (the runs list's feed): auth, a user gets their own runs' status, phase, metrics and resume
events only, staff get every run's, through a real Redis channel layer."""
import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from rest_framework.authtoken.models import Token

from lightning_web.asgi import application
from runs import services

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = [(b"origin", b"http://localhost")]


@database_sync_to_async
def token_of(user):
    return Token.objects.get_or_create(user=user)[0].key


async def join(user):
    ws = WebsocketCommunicator(application, f"/ws/runs/?token={await token_of(user)}", headers=ORIGIN)
    connected, _ = await ws.connect(timeout=5)
    assert connected
    assert await ws.receive_json_from(timeout=5) == {"kind": "feed.joined", "payload": {}}
    return ws


@pytest.fixture
def runs(alice, bob, make_run):
    return make_run(alice, name="alice-run"), make_run(bob, name="bob-run")


async def test_anonymous_clients_and_bad_tokens_are_refused():
    for path in ("/ws/runs/", "/ws/runs/?token=nope"):
        ws = WebsocketCommunicator(application, path, headers=ORIGIN)
        connected, code = await ws.connect(timeout=5)
        assert not connected and code == 4401


async def test_a_metrics_event_of_an_own_run_arrives(alice, runs):
    mine, _ = runs
    ws = await join(alice)
    await database_sync_to_async(services.record_metrics)(mine.pk, 3, {"reward/mean": 0.5, "eval/pass@1": 0.25})
    event = await ws.receive_json_from(timeout=5)
    assert (event["run"], event["kind"]) == (mine.pk, "run.metrics")
    assert event["payload"] == {"step": 3, "values": {"reward/mean": 0.5, "eval/pass@1": 0.25}}
    assert event["seq"] == 2 and "created_at" in event and "type" not in event
    await ws.disconnect()


async def test_an_owner_gets_only_their_own_runs_events(alice, runs):
    mine, theirs = runs
    ws = await join(alice)
    await database_sync_to_async(services.cancel_run)(theirs, theirs.owner)
    await database_sync_to_async(services.set_run_phase)(theirs.pk, "starting the engine")
    await database_sync_to_async(services.set_run_phase)(mine.pk, "starting the engine", 0.5)
    event = await ws.receive_json_from(timeout=5)
    assert (event["run"], event["kind"], event["payload"]) == (mine.pk, "run.phase",
                                                               {"phase": "starting the engine", "progress": 0.5})
    assert await ws.receive_nothing(timeout=0.5)
    await ws.disconnect()


async def test_staff_get_every_runs_events(staff, runs):
    mine, theirs = runs
    ws = await join(staff)
    await database_sync_to_async(services.cancel_run)(mine, mine.owner)
    await database_sync_to_async(services.record_metrics)(theirs.pk, 1, {"reward/mean": 1.0})
    got = [await ws.receive_json_from(timeout=5) for _ in range(2)]
    assert [(e["run"], e["kind"]) for e in got] == [(mine.pk, "run.status"), (theirs.pk, "run.metrics")]
    assert got[0]["payload"] == {"status": "cancelled", "error": "cancelled before it started"}
    await ws.disconnect()


async def test_events_the_list_does_not_show_are_not_sent(alice, runs):
    mine, _ = runs
    ws = await join(alice)
    await database_sync_to_async(services.emit_event)(mine.pk, "run.log", {"line": "hello"})
    assert await ws.receive_nothing(timeout=0.5)
    await ws.send_json_to({"after": 0})
    assert (await ws.receive_json_from(timeout=5))["kind"] == "error"
    await ws.disconnect()
