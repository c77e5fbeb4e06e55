"""The orchestrator's engine watch: a vLLM process that dies mid-run stops the run's work at once with the reason.

No engine here: a stand-in server whose process "exits" on demand. The real kill (SIGKILL of vLLM mid-call during
a real run) is tests/e2e/test_faults_user_code.py.
"""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from runs import orchestrator, rollout_services
from runs.models import Rollout, RolloutStatus
from trainer.engine.server import EngineError

pytestmark = pytest.mark.django_db(transaction=True)


class DyingServer:
    """What the watch reads of a VLLMServer: whether its process runs, and its log."""

    def __init__(self, log_path: Path):
        self.alive = True
        self.log_path = log_path
        log_path.write_text("INFO serving\n[watchdog] vLLM killed by SIGKILL: stopping the engine group\n")

    def running(self) -> bool:
        return self.alive


def run_async(coro):
    """asyncio.run(coro), then close the connection its database calls opened on their thread."""
    async def main():
        try:
            return await coro
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(main())


@pytest.fixture
def running_rollout(alice, make_run, test_redis):
    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=0,
                                                 group=0, attempt=0)
    rollout_services.start_rollout(rollout.pk)
    return run, rollout


def test_an_engine_that_dies_stops_the_work_fails_its_rollouts_and_says_why(running_rollout, tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator, "ENGINE_POLL_S", 0.05)
    run, rollout = running_rollout
    server, source = DyingServer(tmp_path / "engine.log"), SimpleNamespace(run=run, stop_reason="")
    stopped = []

    async def work():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stopped.append(source.stop_reason)  # the attempts it cancels see the reason already
            raise

    async def scenario():
        task = asyncio.ensure_future(orchestrator._unless_engine_dies(server, source, work()))
        await asyncio.sleep(0.2)
        assert not task.done()
        server.alive = False
        return await asyncio.wait_for(task, timeout=5)

    with pytest.raises(orchestrator.EngineDied) as died:
        run_async(scenario())
    message = str(died.value)
    assert message.startswith("the engine (vLLM) died mid-run; the run stopped. Its last log lines (")
    assert "[watchdog] vLLM killed by SIGKILL" in message and str(tmp_path / "engine.log") in message
    assert stopped == [message]
    rollout.refresh_from_db()
    assert (rollout.status, rollout.failure_kind, rollout.error) == (RolloutStatus.FAILED, "infra", message)
    assert rollout.finished_at is not None
    assert run.events.filter(kind="run.log", payload__line=message.splitlines()[0]).exists()


def test_a_live_engine_leaves_the_work_alone(running_rollout, tmp_path):
    run, rollout = running_rollout
    server, source = DyingServer(tmp_path / "engine.log"), SimpleNamespace(run=run, stop_reason="")

    async def work():
        await asyncio.sleep(0.1)
        return "succeeded"

    assert run_async(orchestrator._unless_engine_dies(server, source, work())) == "succeeded"
    assert source.stop_reason == ""
    assert Rollout.objects.get(pk=rollout.pk).status == RolloutStatus.RUNNING


def test_work_failing_because_the_engine_died_reports_the_death_not_the_symptom(running_rollout, tmp_path):
    run, _ = running_rollout
    server, source = DyingServer(tmp_path / "engine.log"), SimpleNamespace(run=run, stop_reason="")

    async def work():  # a weight sync that found the engine gone before the watch did
        server.alive = False
        raise EngineError("engine at http://127.0.0.1:1 unreachable for POST /pause")

    with pytest.raises(orchestrator.EngineDied, match=r"^the engine \(vLLM\) died mid-run") as died:
        run_async(orchestrator._unless_engine_dies(server, source, work()))
    assert isinstance(died.value.__cause__, EngineError)


def test_work_failing_before_the_watchdog_notices_the_death_still_reports_the_death(running_rollout, tmp_path):
    """The real race (CI): vLLM is SIGKILLed, the next weight sync is refused at once, and the watchdog (polling
    vLLM twice a second) exits only afterwards. The run must still say the engine died."""
    run, rollout = running_rollout
    server, source = DyingServer(tmp_path / "engine.log"), SimpleNamespace(run=run, stop_reason="")

    async def work():
        asyncio.get_running_loop().call_later(0.4, setattr, server, "alive", False)  # the watchdog exits later
        raise EngineError("engine at http://127.0.0.1:1 unreachable for POST /pause: [Errno 111] Connection refused")

    with pytest.raises(orchestrator.EngineDied, match=r"^the engine \(vLLM\) died mid-run") as died:
        run_async(orchestrator._unless_engine_dies(server, source, work()))
    assert isinstance(died.value.__cause__, EngineError)
    rollout.refresh_from_db()
    assert (rollout.status, rollout.failure_kind) == (RolloutStatus.FAILED, "infra")


def test_work_failing_on_its_own_keeps_its_error(running_rollout, tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator, "ENGINE_DEATH_NOTICE_S", 0.3)  # a live engine is waited on that long
    run, rollout = running_rollout
    server, source = DyingServer(tmp_path / "engine.log"), SimpleNamespace(run=run, stop_reason="")

    async def work():
        raise ValueError("a bug of the run's own")

    with pytest.raises(ValueError, match="a bug of the run's own"):
        run_async(orchestrator._unless_engine_dies(server, source, work()))
    assert Rollout.objects.get(pk=rollout.pk).status == RolloutStatus.RUNNING  # left to the run's failure path
