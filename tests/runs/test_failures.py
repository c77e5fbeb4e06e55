"""Failures split by cause: policy failures are trained with failure_reward, infrastructure ones are left out.

The attempts run real harness subprocesses through the real proxy (on its own thread, recording into the
database) in front of a small fake vLLM, so the classification sees exactly what a run sees.
"""
import sys

import pytest

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs.harness_source import HarnessSource, failure_of
from runs.models import Rollout, Run
from runs.recorder import DjangoRecorder, cached_directory
from sandbox.executors.base import Outcome
from tests.proxy.fake_upstream import FakeVLLM, Fault
from trainer.config import TrainerConfig
from trainer.samples import CallRecord

HARNESS = '''
import json, os, sys, time, urllib.error, urllib.request
task = json.load(open(sys.argv[1]))
if task.get("exit_before_calling"):
    sys.exit(3)
body = {"model": "m", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
for turn in range(task.get("turns", 1)):  # no retry: any HTTP error ends it
    if turn:
        time.sleep(task.get("pause_s", 0))
    try:
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        print("engine said", exc.code)
        sys.exit(2)
json.dump({"answer": answer}, open(sys.argv[2], "w"))
sys.exit(task.get("exit_code", 0))
'''
pytestmark = pytest.mark.django_db(transaction=True)
CRASHING_REWARD = "def reward(task, outcome):\n    return 1 / 0\n"
CALL = CallRecord(0, (1, 2), (3,), (-0.5,))


def outcome(exit_code=0, error="", timed_out=False):
    return Outcome(exit_code, timed_out, "", "", {}, 1.0, error)


@pytest.mark.parametrize("out, reward_error, calls, trouble, kind", [
    (outcome(), "", (CALL,), "", ""),
    (outcome(), "", (CALL,), "engine or proxy error on call 0: 502", ""),  # the harness recovered: no failure
    (outcome(-9, "harness timed out after 5 s", True), "", (CALL,), "", "policy"),
    (outcome(1, "harness exited with code 1"), "", (CALL,), "", "policy"),
    (outcome(1, "harness exited with code 1"), "", (), "", "infra"),  # nothing answered: nothing to learn
    (outcome(1, "harness exited with code 1"), "", (CALL,), "engine or proxy error on call 1: 502", "infra"),
    (outcome(None, "harness could not start: [Errno 2]"), "", (), "", "infra"),
    (outcome(), "reward: ZeroDivisionError", (CALL,), "", "infra"),
])
def test_failure_of_tells_policy_from_infrastructure(out, reward_error, calls, trouble, kind):
    got, error = failure_of(out, reward_error, calls, trouble)
    assert got == kind
    assert bool(error) == bool(kind)


UNPARSEABLE = "reward: UnparseableOutcome: no answer"


@pytest.mark.parametrize("out, calls, trouble, kind, error", [
    (outcome(), (CALL,), "", "policy", UNPARSEABLE),  # the policy's garbage: its failure
    (outcome(1, "harness exited with code 1"), (CALL,), "", "policy", UNPARSEABLE),
    (outcome(1, "harness exited with code 1"), (CALL,), "engine or proxy error on call 1: 502", "infra",
     "harness exited with code 1 after engine or proxy error on call 1: 502"),  # the engine's doing first
    (outcome(), (), "", "infra", UNPARSEABLE + " before the model answered any call"),  # nothing of the model's
])
def test_an_outcome_the_script_declares_unparseable_is_the_policys_failure(out, calls, trouble, kind, error):
    """Issue 26.4: a declared UnparseableOutcome is no free pass: trained as the policy's failure, unless the
    infrastructure failed first or the model never answered."""
    got, why = failure_of(out, UNPARSEABLE, calls, trouble, reward_kind="unparseable")
    assert (got, why) == (kind, error)
    # The same text from an undeclared exception stays the script's crash: an infrastructure failure.
    assert failure_of(out, UNPARSEABLE, calls, trouble)[0] == "infra"


def test_the_steps_reward_script_counts_and_the_bug_rule():
    from runs.harness_source import reward_script_bug, reward_script_counts
    from trainer.scheduler import RolloutResult

    def result(kind, error):
        return RolloutResult(0, "r", (), 0.0, failure_kind=kind, error=error)

    crash = result("infra", "reward: KeyError: 'answer' (line 3)")
    garbage = result("policy", "reward: UnparseableOutcome: no answer block")
    timeout = result("infra", "reward: the reward script timed out after 10 s")
    fine = result("", "")
    assert reward_script_counts([crash, crash, garbage, timeout, fine]) == {
        "reward/script_errors": 3.0, "reward/unparseable": 1.0}
    assert reward_script_bug([crash, garbage, fine], 2) == ""  # some outcomes only: maybe the outcomes
    assert reward_script_bug([timeout, timeout], 2) == ""  # the machine may cause those
    assert reward_script_bug([], 2) == ""
    message = reward_script_bug([crash, crash, result("infra", "reward: ZeroDivisionError: division by zero")], 4)
    assert message.startswith("the reward script raised on all 3 rollouts of step 4 (2 times: KeyError: 'answer' "
                              "(line 3)): a bug in the script")
    assert "UnparseableOutcome" in message


@pytest.fixture
def engine():
    """The fake vLLM on a real socket (ProxyServer serves any ASGI app on its own thread)."""
    fake = FakeVLLM()
    server = ProxyServer(fake, host="127.0.0.1").start()
    fake.url = f"http://127.0.0.1:{server.port}/v1"
    yield fake
    server.stop()


@pytest.fixture
def source(engine, alice, make_run, tmp_path):
    """(build, run): build(config, reward_source) gives a HarnessSource whose proxy records into the database."""
    (tmp_path / "harness.py").write_text(HARNESS)
    run = make_run(alice)
    run.harness_snapshot = {**run.harness_snapshot, "timeout_s": 30,
                            "command": [sys.executable, str(tmp_path / "harness.py"), "{task_file}", "{output_file}"]}
    run.save(update_fields=["harness_snapshot"])
    proxies = []

    def build(config=TrainerConfig(failure_reward=-0.5), reward_source=None, recorder=None, **app_options):
        if reward_source:
            run.reward_snapshot = {**run.reward_snapshot, "source": reward_source}
        upstream = UpstreamConfig(base_url=engine.url, served_model="policy")
        proxy = ProxyServer(create_app(cached_directory(run.pk, ttl_s=0.1), recorder or DjangoRecorder(), upstream,
                                       **app_options), host="127.0.0.1")
        proxies.append(proxy.start())
        return HarnessSource(run, config, proxy, tmp_path / "work", [])

    yield build, run
    for proxy in proxies:
        proxy.stop()


def task_of(run, **fields):
    task = run.dataset.tasks.filter(split="train").first()
    task.data = {**task.data, **fields}
    task.save()
    return task


async def attempt(build_source, task, **kwargs):
    source = build_source(**kwargs)
    return await source.attempt(task, "train", 0, 0, 0)


async def test_a_harness_that_fails_after_the_model_answered_is_a_policy_failure(source):
    build, run = source
    task = await _task(run, exit_code=4)
    result = await attempt(build, task)
    assert (result.failure_kind, result.reward, len(result.calls)) == ("policy", -0.5, 1)
    row = await _rollout(result.rollout_id)
    assert (row.status, row.failure_kind, row.reward, row.exit_code) == ("failed", "policy", -0.5, 4)
    assert row.error == "harness exited with code 4"
    assert row.reward_detail["script_reward"] in (0.0, 1.0)  # what the reward script said, kept for the inspector


async def test_a_harness_that_fails_before_any_answer_is_an_infrastructure_failure(source):
    build, run = source
    result = await attempt(build, await _task(run, exit_before_calling=True))
    assert (result.failure_kind, result.calls) == ("infra", ())
    row = await _rollout(result.rollout_id)
    assert (row.status, row.failure_kind, row.exit_code) == ("failed", "infra", 3)
    assert row.error == "harness exited with code 3 before the model answered any call"


async def test_an_engine_error_that_ends_the_harness_is_an_infrastructure_failure(source, engine):
    build, run = source
    engine.faults.append(Fault(status=500))
    result = await attempt(build, await _task(run))
    assert result.failure_kind == "infra" and result.calls == ()
    row = await _rollout(result.rollout_id)
    assert row.failure_kind == "infra" and "engine or proxy error on call 0" in row.error


async def test_a_harness_that_gives_up_at_a_weight_update_is_an_infrastructure_failure(source):
    """Issue 26.3: the model answered the first call; the second meets the gate of a weight update that outlasts
    the proxy's wait, is refused (429) and recorded so; the harness does not retry and exits. It failed because of
    the infrastructure, so it is left out of the loss, not trained as the policy's failure."""
    import asyncio

    from asgiref.sync import sync_to_async

    from runs.models import ModelCall

    build, run = source
    task = await _task(run, turns=2, pause_s=1.5)
    harness_source = build(pause_wait_s=0.3)
    attempt_task = asyncio.create_task(harness_source.attempt(task, "train", 0, 0, 0))
    for _ in range(200):  # the first call recorded: the weight update starts
        if await sync_to_async(ModelCall.objects.filter(status_code=200).exists)():
            break
        await asyncio.sleep(0.05)
    await asyncio.to_thread(harness_source.server.pause)
    result = await attempt_task
    await asyncio.to_thread(harness_source.server.resume)

    assert result.failure_kind == "infra" and len(result.calls) == 1
    calls = await sync_to_async(lambda: list(ModelCall.objects.filter(rollout_id=int(result.rollout_id))
                                             .order_by("seq").values_list("seq", "status_code", "error")))()
    assert calls == [(0, 200, ""), (1, 429, "engine_paused: the engine is paused for a weight update; retry shortly")]
    row = await _rollout(result.rollout_id)
    assert (row.status, row.failure_kind, row.exit_code) == ("failed", "infra", 2)
    assert "engine or proxy error on call 1: engine_paused" in row.error


class FlakyRecorder(DjangoRecorder):
    """The database refuses the writes of call `seq` while `down` is set (an outage in the middle of a rollout)."""

    def __init__(self, seq: int):
        super().__init__()
        self.seq, self.down, self.refused = seq, True, 0

    async def record(self, call):
        if self.down and call.seq == self.seq:
            self.refused += 1
            raise RuntimeError("database unavailable (injected)")
        await super().record(call)


async def test_a_rollout_waits_for_its_calls_to_be_stored_before_it_is_trained(source):
    """Issue 26.5: the second call's write fails and is retried by the proxy while the harness already finished.
    The rollout's samples are built only once that retry stored it: the trajectory trained is whole."""
    import asyncio

    build, run = source
    recorder = FlakyRecorder(seq=1)
    harness_source = build(recorder=recorder)
    attempt_task = asyncio.create_task(harness_source.attempt(await _task(run, turns=2), "train", 0, 0, 0))
    for _ in range(400):
        if recorder.refused:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(1.5)  # the harness is done by now; the trainer would read one call of two without the wait
    assert not attempt_task.done()
    recorder.down = False  # the database is back: the proxy's retry stores call 1
    result = await attempt_task
    assert result.failure_kind == "" and [c.seq for c in result.calls] == [0, 1]


async def test_a_rollout_whose_calls_the_database_keeps_refusing_is_an_infrastructure_failure(source, settings):
    build, run = source
    settings.LIGHTNING_RECORD_DEADLINE_S = 1
    recorder = FlakyRecorder(seq=1)
    result = await build(recorder=recorder).attempt(await _task(run, turns=2), "train", 0, 0, 0)
    assert result.failure_kind == "infra" and result.calls == ()
    assert result.error == ("1 of its calls were answered but not stored within 1 s (the database refused them; the "
                            "proxy keeps retrying): a trajectory with holes is never trained")
    row = await _rollout(result.rollout_id)
    assert (row.status, row.failure_kind, row.error) == ("failed", "infra", result.error)
    recorder.down = False


async def test_a_crashing_reward_script_is_an_infrastructure_failure(source):
    build, run = source
    result = await attempt(build, await _task(run), reward_source=CRASHING_REWARD)
    assert result.failure_kind == "infra" and len(result.calls) == 1
    row = await _rollout(result.rollout_id)
    assert row.failure_kind == "infra" and row.error.startswith("reward: ") and "ZeroDivisionError" in row.error


async def test_an_outcome_the_reward_script_cannot_parse_is_trained_as_the_policys_failure(source):
    build, run = source
    declares = "def reward(task, outcome):\n    raise UnparseableOutcome('no number in ' + repr(outcome)[:20])\n"
    result = await attempt(build, await _task(run), reward_source=declares)
    assert (result.failure_kind, result.reward, len(result.calls)) == ("policy", -0.5, 1)  # the run's failure_reward
    row = await _rollout(result.rollout_id)
    assert (row.status, row.failure_kind, row.reward) == ("failed", "policy", -0.5)
    assert row.error.startswith("reward: UnparseableOutcome: no number in")
    assert row.reward_detail["reward_kind"] == "unparseable"


async def test_a_clean_attempt_is_no_failure(source):
    build, run = source
    result = await attempt(build, await _task(run))
    row = await _rollout(result.rollout_id)
    assert (result.failure_kind, row.status, row.failure_kind, row.error) == ("", "succeeded", "", "")
    assert "script_reward" not in row.reward_detail and row.reward in (0.0, 1.0)


async def test_a_worker_runs_at_most_its_cap_of_harnesses_at_once(source, settings):
    """Issue 26.6: LIGHTNING_WORKER_MAX_HARNESSES bounds the harness processes of a worker; the others wait, then
    run, and every attempt ends as it would have."""
    import asyncio

    build, run = source
    settings.LIGHTNING_WORKER_MAX_HARNESSES = 2
    harness_source = build()
    task = await _task(run, turns=2, pause_s=0.3)
    results = await asyncio.gather(*(harness_source.attempt(task, "train", 0, 0, i) for i in range(5)))
    assert [r.failure_kind for r in results] == [""] * 5 and all(len(r.calls) == 2 for r in results)
    assert harness_source.harnesses_peak == 2 and harness_source.harnesses_running == 0


async def test_a_recorded_rollouts_workdir_goes_but_a_failed_ones_stays(source):
    """Issue 26.2: once recorded, a succeeded rollout leaves no workdir; a failed one is kept for debugging."""
    build, run = source
    harness_source = build()
    ok = await harness_source.attempt(await _task(run), "train", 0, 0, 0)
    failed = await harness_source.attempt(await _task(run, exit_code=4), "train", 0, 0, 1)
    rollouts = harness_source.workdir / "rollouts"
    assert ok.failure_kind == "" and not (rollouts / ok.rollout_id).exists()
    assert failed.failure_kind == "policy" and (rollouts / failed.rollout_id / "task.json").is_file()


async def _task(run, **fields):
    from asgiref.sync import sync_to_async

    return await sync_to_async(task_of)(run, **fields)


async def _rollout(rollout_id):
    from asgiref.sync import sync_to_async

    return await sync_to_async(Rollout.objects.get)(pk=int(rollout_id))


LIVE_HARNESS = '''
import json, os, sys, time, urllib.request
task = json.load(open(sys.argv[1]))
body = {"model": "m", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(request, timeout=30).read())["choices"][0]["message"]["content"]
if task.get("fail"):
    sys.exit(4)  # the policy's failure: its workdir is kept and the run's failed workdirs are pruned
open("started", "w").write("1")
for _ in range(300):  # the test releases it once the failed attempt is recorded
    if os.path.exists("release"):
        break
    time.sleep(0.05)
else:
    sys.exit(5)
json.dump({"answer": answer, "task_file_still_there": os.path.exists(sys.argv[1])}, open(sys.argv[2], "w"))
'''


async def test_a_failed_attempt_prunes_no_workdir_of_the_attempts_still_running(source, settings, tmp_path):
    """Issue 40.1: one failed attempt's clean-up pruned every folder under rollouts/ but the newest
    LIGHTNING_FAILED_WORKDIRS_KEPT, live ones included; their harnesses then failed. Here 24 attempts run beside one
    that fails, with one failed workdir kept: every live one finishes with its files."""
    import asyncio

    from asgiref.sync import sync_to_async

    from runs import disk

    settings.LIGHTNING_FAILED_WORKDIRS_KEPT = 1
    build, run = source
    harness = tmp_path / "live_harness.py"
    harness.write_text(LIVE_HARNESS)
    run.harness_snapshot = {**run.harness_snapshot, "command": [*run.harness_snapshot["command"][:1], str(harness),
                                                                "{task_file}", "{output_file}"]}
    tasks = await sync_to_async(lambda: list(run.dataset.tasks.filter(split="train")[:2]))()
    live_task, failing_task = tasks
    failing_task.data = {**failing_task.data, "fail": True}
    await sync_to_async(failing_task.save)()
    harness_source = build()
    rollouts = tmp_path / "work" / "rollouts"
    live = [asyncio.create_task(harness_source.attempt(live_task, "train", 0, 0, i)) for i in range(24)]
    for _ in range(1200):  # every live harness has called the model and waits
        if rollouts.is_dir() and sum((p / "started").exists() for p in rollouts.iterdir()) == 24:
            break
        await asyncio.sleep(0.05)
    live_dirs = sorted(p for p in rollouts.iterdir() if (p / "started").exists())
    assert len(live_dirs) == 24

    failed = await harness_source.attempt(failing_task, "train", 0, 1, 0)
    assert failed.failure_kind == "policy"
    assert [p.name for p in live_dirs if not (p / "task.json").is_file()] == []  # no live attempt was touched
    assert (rollouts / failed.rollout_id / disk.FAILED_MARK).is_file()  # kept for debugging, marked
    for workdir in live_dirs:
        (workdir / "release").write_text("go")
    results = await asyncio.gather(*live)

    assert [(r.failure_kind, r.error) for r in results] == [("", "")] * 24
    rows = await sync_to_async(lambda: list(Rollout.objects.filter(pk__in=[int(r.rollout_id) for r in results])
                                            .values_list("status", "outcome")))()
    assert [status for status, _ in rows] == ["succeeded"] * 24
    assert all(outcome["task_file_still_there"] is True for _, outcome in rows)
    assert sorted(p.name for p in rollouts.iterdir()) == [failed.rollout_id]  # succeeded ones went once recorded
