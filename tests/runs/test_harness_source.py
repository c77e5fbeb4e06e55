"""The orchestrator's RolloutSource reports every attempt, even one that crashed."""
import asyncio

from runs.harness_source import HarnessSource
from runs.orchestrator import _drift_rows
from trainer.scheduler import StepReport


class Run:
    pk = 1
    harness_snapshot = {"executor": "local"}


async def test_a_crashed_attempt_still_reports_so_its_group_completes(tmp_path):
    source = HarnessSource(Run(), config=None, server=None, workdir=tmp_path, train_ids=[1])

    async def crash():
        raise OSError("disk full")

    await source._report(7, crash())
    result = source.finished.get_nowait()
    assert (result.group_id, result.rollout_id, result.failed, result.reward) == (7, "", True, 0.0)
    assert result.error == "OSError: disk full" and result.calls == ()


async def test_a_cancelled_attempt_does_not_report(tmp_path):
    source = HarnessSource(Run(), config=None, server=None, workdir=tmp_path, train_ids=[1])
    task = asyncio.create_task(source._report(1, asyncio.sleep(60)))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert source.finished.empty()


def test_drift_of_a_rollout_that_never_started_is_not_stored():
    report = StepReport(step=1, policy_version=1, rollouts=(), samples=(), metrics={},
                        drift={"": {}, "12": {0: "clean", 1: "fork"}})
    assert _drift_rows(report) == {12: {0: "clean", 1: "fork"}}
