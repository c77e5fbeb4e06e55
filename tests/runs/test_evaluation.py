"""The Evaluator: k sampled attempts and a greedy one per val task, stored per attempt, never mixed into training.

The attempts run real harness subprocesses through the real proxy (its own thread, recording into the
database) in front of a small fake vLLM whose answers depend on the temperature it was asked for, so the
greedy attempts are told apart by what reached the engine, not by what the Evaluator says it sent.
"""
import asyncio
import sys
from collections import Counter

import pytest
from asgiref.sync import sync_to_async

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs import selectors, services
from runs.evaluation import Evaluator
from runs.harness_source import HarnessSource
from runs.models import Metric, ModelCall, Rollout, Run
from runs.recorder import DjangoRecorder, cached_directory
from tests.proxy.fake_upstream import FakeVLLM, Reply
from trainer import scheduler
from trainer.config import TrainerConfig
from trainer.step_metrics import rollout_metrics

pytestmark = pytest.mark.django_db(transaction=True)

HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
body = {"model": "m", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 8,
        "temperature": 1.0}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(request, timeout=30).read())["choices"][0]["message"]["content"]
json.dump({"answer": answer}, open(sys.argv[2], "w"))
'''
REWARD = "def reward(task, outcome):\n    return float(outcome['answer'] == 'RIGHT')\n"
RUN_TEMPERATURE = 0.7


class ToyPolicy(FakeVLLM):
    """Answers RIGHT to question q on its first `right[q]` sampled calls, and at temperature 0 iff q is in
    `greedy_right`: per-task pass counts that do not depend on the order attempts reach it."""

    def __init__(self, right: dict[str, int], greedy_right: set[str]):
        super().__init__()
        self.right, self.greedy_right, self.seen = right, greedy_right, Counter()

    def _reply(self, body: dict, prompt: str) -> Reply:
        if body["temperature"] == 0.0:
            return Reply("RIGHT" if prompt in self.greedy_right else "WRONG")
        self.seen[prompt] += 1
        return Reply("RIGHT" if self.seen[prompt] <= self.right.get(prompt, 0) else "WRONG")


VAL = ["q0", "q1", "q2", "q3"]  # q3 lies past eval_tasks=3: never evaluated
RIGHT = {"q0": 4, "q1": 1, "q2": 0, "q3": 4, "train0": 1}
GREEDY_RIGHT = {"q0", "q2"}
CONFIG = TrainerConfig(temperature=RUN_TEMPERATURE, eval_tasks=3, eval_samples=4, eval_greedy=True,
                       eval_concurrency=5, tasks_per_step=1, group_size=2)


@pytest.fixture
def engine():
    fake = ToyPolicy(RIGHT, GREEDY_RIGHT)
    server = ProxyServer(fake, host="127.0.0.1").start()
    fake.url = f"http://127.0.0.1:{server.port}/v1"
    yield fake
    server.stop()


@pytest.fixture
def stand(engine, alice, make_harness, make_dataset, make_reward, tmp_path):
    """(run, source, proxy): a run over 4 val tasks and 1 train task, its HarnessSource and its proxy server."""
    (tmp_path / "harness.py").write_text(HARNESS)
    tasks = [{"id": q, "question": q, "split": "val"} for q in VAL] + [{"id": "t0", "question": "train0",
                                                                       "split": "train"}]
    harness = make_harness(alice, command=[sys.executable, str(tmp_path / "harness.py"), "{task_file}",
                                           "{output_file}"], timeout_s=30)
    run = services.create_run(alice, name="eval", model="tiny", config=CONFIG.to_dict(), harness=harness,
                              dataset=make_dataset(alice, tasks=tasks), reward_script=make_reward(alice, source=REWARD))
    upstream = UpstreamConfig(base_url=engine.url, served_model="policy", sampling=CONFIG.sampling)
    proxy = ProxyServer(create_app(cached_directory(run.pk, ttl_s=0.1), DjangoRecorder(), upstream), host="127.0.0.1").start()
    train_ids = list(run.dataset.tasks.filter(split="train").values_list("pk", flat=True))
    yield run, HarnessSource(run, CONFIG, proxy, tmp_path / "work", train_ids), proxy
    proxy.stop()


async def test_it_scores_k_samples_and_a_greedy_attempt_per_task_and_stores_each(stand, engine):
    run, source, proxy = stand
    metrics = await Evaluator(run, CONFIG, source).maybe(3, force=True)

    expected = {"eval/pass@1": (4 / 4 + 1 / 4 + 0 / 4) / 3, "eval/pass@k": 2 / 3, "eval/pass@1_greedy": 2 / 3,
                "eval/reward_mean": (1 + 0.25 + 0) / 3, "eval/tasks": 3.0, "eval/infra_failures": 0.0}
    assert {k: v for k, v in metrics.items() if k != "eval/seconds"} == pytest.approx(expected)
    stored = await db(lambda: {m.name: m.value for m in Metric.objects.filter(run=run, step=3)})()
    assert stored == pytest.approx(metrics) and stored["eval/seconds"] > 0

    rows = await db(lambda: list(Rollout.objects.filter(run=run)
                                 .values_list("task__external_id", "split", "step", "group", "attempt", "greedy",
                                              "status", "reward")))()
    # One row per task and attempt: group = the task's index, attempt = the sample's, the greedy one last.
    assert sorted(row[:7] for row in rows) == [(q, "val", 3, g, a, a == 4, "succeeded")
                                               for g, q in enumerate(VAL[:3]) for a in range(5)]
    # Sampled attempts of a task reach the engine in any order: which of them passed is not fixed, how many is.
    passes = Counter((q, greedy) for q, *_, greedy, _, reward in rows if reward == 1.0)
    assert passes == {("q0", False): 4, ("q1", False): 1, ("q0", True): 1, ("q2", True): 1}
    # What reached the engine: the run's temperature for the 12 samples, 0 for the 3 greedy attempts.
    assert sorted(Counter(body["temperature"] for body in engine.requests).items()) == [(0.0, 3),
                                                                                        (RUN_TEMPERATURE, 12)]
    greedy_calls = await db(lambda: list(ModelCall.objects.filter(rollout__run=run, rollout__greedy=True)
                                         .values_list("status_code", "sampling_overrides")))()
    assert greedy_calls == [(200, {"temperature": 1.0})] * 3  # the harness asked 1.0; the proxy served 0
    run = await db(Run.objects.get)(pk=run.pk)
    assert run.phase == "evaluating step 3: 15/15"


async def test_the_grid_of_two_evaluations_matches_their_metrics(stand, engine, alice_api):
    run, source, _ = stand
    evaluator = Evaluator(run, CONFIG, source)
    await evaluator.maybe(0, force=True)
    engine.seen.clear()  # the same toy policy again: the same passes at step 2
    await evaluator.maybe(2, force=True)

    grid = await db(selectors.validation_grid)(run)
    assert grid["steps"] == [0, 2] and [t["external_id"] for t in grid["tasks"]] == ["q0", "q1", "q2"]
    cells = {t["external_id"]: t["cells"] for t in grid["tasks"]}
    assert cells["q1"] == [{"attempts": 4, "passed": 1, "pass_fraction": 0.25, "greedy": False, "infra_failures": 0,
                            "unscored": 0}] * 2
    assert [c["pass_fraction"] for c in cells["q0"]] == [1.0, 1.0] and [c["greedy"] for c in cells["q2"]] == [True] * 2
    pass1 = await db(lambda: list(Metric.objects.filter(run=run, name="eval/pass@1").order_by("step")
                                  .values_list("value", flat=True)))()
    for i, value in enumerate(pass1):
        assert value == pytest.approx(sum(c[i]["pass_fraction"] for c in cells.values()) / 3)
    response = await db(alice_api.get)(f"/api/v1/runs/{run.pk}/validation/")
    assert response.status_code == 200 and response.json() == grid


async def test_an_evaluation_around_a_training_group_leaves_the_steps_metrics_alone(stand):
    """The scheduler takes a step's rollouts from next_finished and the proxy's busy time and override count:
    evaluation attempts reach none of them."""
    run, source, proxy = stand
    await source.launch(scheduler.GroupRequest(0, 2, 0))
    metrics = await Evaluator(run, CONFIG, source).maybe(0, force=True)
    results = [await asyncio.wait_for(source.next_finished(), 30) for _ in range(2)]

    assert source.finished.empty() and metrics["eval/tasks"] == 3.0
    ids = [int(r.rollout_id) for r in results]
    splits = await db(lambda: sorted(Rollout.objects.filter(pk__in=ids).values_list("split", flat=True)))()
    assert splits == ["train"] * 2
    step = rollout_metrics(results, [], {}, CONFIG.pass_threshold)
    # The train task's first sampled call is RIGHT, its second WRONG, however many eval calls ran beside them.
    assert (step["reward/mean"], step["reward/pass_rate"], step["rollout/calls_mean"]) == (0.5, 0.5, 1.0)
    # 17 calls asked for temperature 1.0; only the 2 train calls count, as they do in the step's metrics.
    assert await db(lambda: ModelCall.objects.filter(rollout__run=run).exclude(sampling_overrides={}).count())() == 17
    assert proxy.app.sampling_override_calls == 2 and proxy.app.busy_seconds > 0


async def test_an_evaluation_alone_adds_no_generation_time_and_no_override_count(stand):
    run, source, proxy = stand
    await Evaluator(run, CONFIG, source).maybe(0, force=True)
    assert await db(lambda: ModelCall.objects.filter(rollout__run=run, status_code=200).count())() == 15
    assert proxy.app.busy_seconds == 0.0 and proxy.app.sampling_override_calls == 0


class CountingSource:
    """A RolloutSource stand-in that only counts: how many attempts run at once, and which crash."""

    def __init__(self, crash_task: str = ""):
        self.in_flight = self.most = 0
        self.crash_task, self.calls = crash_task, []

    async def attempt(self, task, split, version, group, attempt, greedy=False):
        self.calls.append((task.external_id, split, version, group, attempt, greedy))
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # let every other admitted attempt start
            if task.external_id == self.crash_task and attempt == 0:
                raise RuntimeError("harness executor broke")
            return scheduler.RolloutResult(group, "", (), 1.0)
        finally:
            self.in_flight -= 1


async def test_attempts_run_at_eval_concurrency_not_at_the_training_width(stand):
    run = stand[0]
    config = TrainerConfig(eval_tasks=3, eval_samples=4, eval_concurrency=6, tasks_per_step=1, group_size=2)
    source = CountingSource()
    await Evaluator(run, config, source).maybe(0, force=True)
    assert source.most == 6 and len(source.calls) == 15
    assert source.calls[:5] == [("q0", "val", 0, 0, a, a == 4) for a in range(5)]  # task-major: shared prefixes


async def test_a_crashed_attempt_counts_as_an_infrastructure_failure(stand, caplog):
    run = stand[0]
    metrics = await Evaluator(run, CONFIG, CountingSource(crash_task="q1")).maybe(5, force=True)
    assert metrics["eval/infra_failures"] == 1.0 and metrics["eval/pass@1"] == 1.0
    assert metrics["eval/pass@k"] == 1.0 and metrics["eval/tasks"] == 3.0  # q1 left pass@k: it lost an attempt
    assert "evaluation attempt 0 of val task" in caplog.text and "harness executor broke" in caplog.text


@pytest.mark.parametrize("every, step, force, due", [(0, 3, False, False), (0, 3, True, True), (2, 4, False, True),
                                                     (2, 3, False, False)])
async def test_it_evaluates_only_when_due(stand, every, step, force, due):
    run = stand[0]
    source = CountingSource()
    config = TrainerConfig(eval_every=every, eval_tasks=1, eval_samples=2, eval_greedy=False)
    metrics = await Evaluator(run, config, source).maybe(step, force=force)
    assert (metrics is not None, len(source.calls)) == (due, 2 if due else 0)
    assert await db(Metric.objects.filter(run=run).exists)() is due


def db(fn):
    return sync_to_async(fn)
