"""Real Celery workers die by SIGKILL: the sweep reclaims their runs and a second worker resumes or ends them.

vLLM serves a tiny model; the harness talks to it through the proxy. Run under the heavy lock on a shared machine.
"""
from pathlib import Path

import pytest
from django.db.models import Count

from catalog import services as catalog_services
from common.procs import pids_matching
from runs import services
from runs.models import Metric, ModelCall, Rollout, Run, Sample
from tests.workers import REAL_RUN_MARKS, Workers, wait_db

pytestmark = REAL_RUN_MARKS

# Two calls per attempt with a pause between them: a kill after the first call lands mid-rollout.
HARNESS = '''
import json, os, sys, time, urllib.request
task = json.load(open(sys.argv[1]))

def chat(messages):
    body = {"model": "policy", "messages": messages, "max_tokens": 8}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]

messages = [{"role": "user", "content": task["question"]}]
first = chat(messages)
time.sleep(float(os.environ.get("PAUSE_S", "0")))
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "go on"}]
json.dump({"reply": chat(messages)}, open(sys.argv[2], "w"))
'''
CONFIG_TEMPERATURE = 0.7  # TrainerConfig's default, the proxy's for every call
# A continuous random reward: every group has a spread, so every step moves the weights (equal rewards in a group
# give zero advantages and no update, and the checkpoint could not be told from the base model).
REWARD = "import random\n\ndef reward(task, outcome):\n    return random.random()\n"
# float32 on any host: engine_gap below compares the engine with a float32 forward of the checkpoint, and bfloat16's
# own rounding on the random tiny model (about 0.07 nats) would blur what the resume is measured by.
CONFIG = {"steps": 3, "tasks_per_step": 2, "group_size": 2, "checkpoint_every": 1, "max_model_len": 512,
          "kv_cache_gb": 0.5, "eval_tasks": 2, "eval_samples": 1, "eval_greedy": False, "learning_rate": 1e-2,
          "dtype": "float32", "engine_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from trainer.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("durable-models") / "tiny-real", seed=0)


@pytest.fixture
def workers(tmp_path, test_redis, settings, tiny_model):
    settings.LIGHTNING_MODELS_DIR = tiny_model.parent  # this module's registry: workers load models from it only
    pool = Workers(tmp_path)
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    yield pool
    pool.stop()


@pytest.fixture
def make_run(alice, tmp_path, tiny_model):
    (tmp_path / "harness.py").write_text(HARNESS)

    def make(config=None):
        harness = catalog_services.create_harness(alice, name="pausing", timeout_s=120, command=[
            "python3", str(tmp_path / "harness.py"), "{task_file}", "{output_file}"], env={"PAUSE_S": "4"})
        tasks = "\n".join(f'{{"id": "t{i}", "question": "say {i}", "split": "{"val" if i < 2 else "train"}"}}'
                          for i in range(8))
        dataset = catalog_services.create_dataset(alice, name="words", content=tasks.encode(), filename="t.jsonl")
        reward = catalog_services.create_reward_script(alice, name="even", source=REWARD)
        return services.create_run(alice, name="durable", model=str(tiny_model), harness=harness, dataset=dataset,
                                   reward_script=reward, config={**CONFIG, **(config or {})})

    return make


def engine_gap(model_dir: Path, calls: list[ModelCall]) -> float:
    """Mean |engine - model| logprob of the calls' sampled tokens, at the run's temperature (processed logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for call in calls:
        ids = torch.tensor([call.prompt_ids + call.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(call.prompt_ids) - 1:-1] / CONFIG_TEMPERATURE  # (C, V)
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(call.completion_ids)[:, None])[:, 0]
        gaps.append((logprobs - torch.tensor(call.logprobs)).abs().mean().item())
    return sum(gaps) / len(gaps)


def test_a_run_whose_worker_is_killed_mid_step_resumes_on_a_second_worker_and_trains_every_step_once(
        workers, make_run, tiny_model):
    run = make_run()
    first = workers.start("first", "runs")

    def mid_step_2():  # checkpoint 1 is recorded and step 2's attempts are between their two calls
        current = Run.objects.get(pk=run.pk)
        return current.checkpoint_path.endswith("step-000001") and ModelCall.objects.filter(
            rollout__run=run, rollout__split="train", rollout__step=1, rollout__status="running").count() >= 2

    wait_db(mid_step_2, "step 2 mid-rollout", workers)
    workers.kill(first)
    killed_at = Run.objects.get(pk=run.pk)
    assert killed_at.status == "running" and killed_at.step == 1
    workers.start("second", "runs")
    workers.start("control", "default", beat=True)  # beat's sweep re-queues the run for the second worker
    wait_db(lambda: Run.objects.get(pk=run.pk).status in ("succeeded", "failed"), "the end of the run", workers,
             timeout=600)

    run.refresh_from_db()
    assert (run.status, run.step, run.policy_version, run.error) == ("succeeded", 3, 3, ""), workers.tails()
    assert run.worker_starts == 2 and run.checkpoint_path.endswith("step-000003")
    statuses = list(run.events.filter(kind="run.status").values_list("payload__status", flat=True))
    assert statuses == ["queued", "starting", "running", "queued", "starting", "running", "succeeded"]
    resumed = run.events.get(kind="run.resumed").payload
    assert resumed == {"step": 1, "lost_rollouts": 4, "dropped_steps": []}  # step 2's attempts, never recorded

    # No metric step is written twice; every step and both evaluations are there once.
    assert not Metric.objects.filter(run=run).values("step", "name").annotate(n=Count("id")).filter(n__gt=1)
    assert list(run.metrics.filter(name="reward/mean").values_list("step", flat=True)) == [1, 2, 3]
    assert list(run.metrics.filter(name="eval/pass@1").values_list("step", flat=True)) == [0, 3]

    # Every recorded call belongs to a rollout whose status says what happened to it.
    lost = Rollout.objects.filter(run=run, status="lost")
    assert sorted(lost.values_list("split", "step", "group")) == [("train", 1, 2)] * 2 + [("train", 1, 3)] * 2
    assert not Sample.objects.filter(rollout__in=lost).exists()  # never trained
    assert ModelCall.objects.filter(rollout__in=lost).values("rollout").distinct().count() >= 2  # their calls kept
    with_calls = Rollout.objects.filter(run=run, calls__isnull=False).distinct()
    assert set(with_calls.values_list("status", flat=True)) <= {"succeeded", "failed", "lost"}
    trained = Rollout.objects.filter(run=run, split="train").exclude(status="lost")
    assert sorted(trained.values_list("step", "group")) == [(s, g) for s, g in [(0, 0), (0, 1), (1, 2), (1, 3),
                                                                               (2, 4), (2, 5)] for _ in range(2)]
    assert all(r.samples.exists() for r in trained.filter(status="succeeded"))

    # The resumed engine serves the checkpoint's weights as version 1: calls are stamped with it, and the logprobs
    # it reported are those of the checkpoint's weights, not of the model it started from.
    resumed_calls = list(ModelCall.objects.filter(rollout__in=trained.filter(step=1)))
    assert {c.policy_version for c in resumed_calls} == {1}
    checkpoint = workers.runs_dir / f"run-{run.pk}" / "checkpoints" / "step-000001"
    to_checkpoint, to_base = engine_gap(checkpoint, resumed_calls), engine_gap(tiny_model, resumed_calls)
    print(f"\nresumed calls: |engine - trainer| logprob {to_checkpoint:.4f} with the checkpoint's weights, "
          f"{to_base:.4f} with the base model's")
    # The engine and the trainer's float32 forward differ by a few hundredths of a nat on the tiny model's
    # near-uniform distribution whatever the weights; the step-1 update moves it far more than that.
    assert to_checkpoint < 0.15 and to_base > 4 * to_checkpoint
    assert workers.engines() == [] and pids_matching(str(workers.runs_dir)) == []


def test_a_run_left_cancelling_by_a_dead_worker_becomes_cancelled(workers, make_run, alice_api):
    run = make_run()
    first = workers.start("first", "runs")
    wait_db(lambda: Run.objects.get(pk=run.pk).status == "starting" and workers.engines(), "the engine start",
             workers)
    workers.kill(first)
    response = alice_api.post(f"/api/v1/runs/{run.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelling"
    workers.start("control", "default", beat=True)
    wait_db(lambda: Run.objects.get(pk=run.pk).status != "cancelling", "the sweep", workers, timeout=120)
    run.refresh_from_db()
    assert run.status == "cancelled" and run.finished_at is not None
    assert run.error.startswith("cancelled by its owner; worker lost: no heartbeat for ")
    statuses = list(run.events.filter(kind="run.status").values_list("payload__status", flat=True))
    assert statuses == ["queued", "starting", "cancelling", "cancelled"]
    assert not Rollout.objects.filter(run=run).exclude(status="lost").exists()
    wait_db(lambda: workers.engines() == [], "the engine to go with its worker", workers, timeout=60)
