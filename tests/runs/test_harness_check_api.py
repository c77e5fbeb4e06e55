"""/api/v1/harnesses/<id>/checks/ and /api/v1/harness-checks/: queue a check on a typed or a dataset's task, read it
back; owners only (others get 404), staff see all; refusals in the API's error shape."""
import json
import sys

import pytest

from runs.models import CheckStatus, HarnessCheck
from tests.workers import wait_db, workers  # noqa: F401  (real Celery workers)
from trainer.models import build_tiny_model

pytestmark = pytest.mark.django_db
TASK = {"prompt": "Run exactly this shell command: echo hi  Then reply DONE.", "expected": "DONE"}


@pytest.fixture(scope="session")
def tokenizer_registry(tmp_path_factory):
    """A registry with a real tiny model (tokenizer and chat template) named `tiny`, and `bare`: config only."""
    root = tmp_path_factory.mktemp("check-registry")
    build_tiny_model(root / "tiny", name="tiny")
    (root / "bare").mkdir()
    (root / "bare" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (root / "bare" / "lightning_model.json").write_text(json.dumps({"name": "bare", "origin": "tiny", "params": 1}))
    return root


@pytest.fixture(autouse=True)
def models_dir(tokenizer_registry, settings):
    """Replaces the shared config-only registry: the scripted engine needs the tokenizer files."""
    settings.LIGHTNING_MODELS_DIR = tokenizer_registry
    return tokenizer_registry


def checks_url(harness) -> str:
    return f"/api/v1/harnesses/{harness.pk}/checks/"


def test_it_queues_a_check_of_a_typed_task(alice_api, alice, make_harness, make_reward,
                                           django_capture_on_commit_callbacks):
    harness, script = make_harness(alice), make_reward(alice)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny", "reward_script": script.pk},
                                  format="json")
    assert response.status_code == 202, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["verdict"] == "" and body["report"] == {}
    assert body["engine"] == "scripted" and body["model"] == "tiny" and body["reward_script"] == script.pk
    assert body["harness"] == harness.pk and body["harness_version"] == 1 and body["task"] == TASK
    check = HarnessCheck.objects.get(pk=body["id"])
    assert check.owner == alice and check.status == CheckStatus.QUEUED
    assert check.task_source["typed"] is True and "expected" in check.task_source["hidden_fields"]
    assert check.harness_task() == {"prompt": TASK["prompt"]}  # the reward-only field is kept from the harness
    assert len(callbacks) == 1  # enqueued after commit


def test_it_queues_a_check_of_a_dataset_task(alice_api, alice, make_harness, make_dataset):
    harness = make_harness(alice)
    dataset = make_dataset(alice, name="arith", hidden_fields=["question"])
    response = alice_api.post(checks_url(harness), {"dataset": dataset.pk, "task_id": "t2", "model": "tiny"},
                              format="json")
    assert response.status_code == 202, response.json()
    check = HarnessCheck.objects.get(pk=response.json()["id"])
    assert check.task == {"id": "t2", "question": "2+1", "answer": 3, "split": "train"}
    assert check.task_source == {"dataset": dataset.pk, "dataset_name": "arith", "task_id": "t2",
                                 "hidden_fields": ["answer", "expected", "question", "solution", "tests"]}
    assert check.harness_task() == {"id": "t2", "split": "train"}
    assert check.reward_script is None


@pytest.mark.parametrize("body, field, message", [
    ({"model": "tiny"}, "task", "give either a task object or a dataset with a task_id"),
    ({"model": "tiny", "task": [1, 2]}, "task", "a task is a JSON object"),
    ({"task": TASK}, "model", "This field is required"),
    ({"task": TASK, "model": "tiny", "engine": "tgi"}, "engine", "not a valid choice"),
])
def test_it_refuses_a_bad_request_with_the_field(alice_api, alice, make_harness, body, field, message):
    response = alice_api.post(checks_url(make_harness(alice)), body, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid" and field in error["fields"] and message in error["message"]
    assert not HarnessCheck.objects.exists()


def test_it_refuses_a_task_the_dataset_does_not_have_and_a_dataset_without_task_id(alice_api, alice, make_harness,
                                                                                     make_dataset):
    harness, dataset = make_harness(alice), make_dataset(alice, name="arith")
    response = alice_api.post(checks_url(harness), {"dataset": dataset.pk, "task_id": "t9", "model": "tiny"},
                              format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"task_id": ["dataset 'arith' has no task 't9'"]}
    response = alice_api.post(checks_url(harness), {"dataset": dataset.pk, "model": "tiny"}, format="json")
    assert response.status_code == 400 and "give its id" in response.json()["error"]["message"]
    response = alice_api.post(checks_url(harness), {"dataset": dataset.pk, "task_id": "t1", "task": TASK,
                                                    "model": "tiny"}, format="json")
    assert response.status_code == 400 and "either a task object or a dataset" in response.json()["error"]["message"]
    assert not HarnessCheck.objects.exists()


def test_a_model_without_tokenizer_files_is_refused_naming_the_ones_that_have_them(alice_api, alice, make_harness):
    response = alice_api.post(checks_url(make_harness(alice)), {"task": TASK, "model": "bare"}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert error["message"] == ("model 'bare' is not a registry model with tokenizer files (available: ['tiny']); "
                                "import one with `./lw manage models tiny`")
    assert not HarnessCheck.objects.exists()


def test_a_check_of_a_kubernetes_harness_on_a_worker_with_no_cluster_fails_saying_what_to_set(
        alice_api, alice, make_harness, settings, tmp_path, django_capture_on_commit_callbacks):
    """The check is queued (the web process need not reach the cluster); the worker that takes it says why it cannot."""
    from runs.check_tasks import run_harness_check

    settings.LIGHTNING_PROXY_HOST, settings.LIGHTNING_PROXY_ADVERTISE_URL = "0.0.0.0", "http://10.0.0.5:{port}"
    settings.LIGHTNING_K8S_KUBECONFIG = str(tmp_path / "missing")
    harness = make_harness(alice, executor="kubernetes", image="ghcr.io/me/agent:1")
    with django_capture_on_commit_callbacks(execute=False):
        response = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny"}, format="json")
    assert response.status_code == 202
    assert run_harness_check.apply(args=[response.json()["id"]]).get() == "failed"
    body = alice_api.get(f"/api/v1/harness-checks/{response.json()['id']}/").json()
    assert body["status"] == "failed" and body["report"] == {}
    assert body["error"].startswith("the harness cannot run on this worker: no Kubernetes cluster to run harness jobs")
    assert "LIGHTNING_K8S_KUBECONFIG" in body["error"]


def test_another_users_harness_dataset_and_reward_script_are_not_reachable(alice_api, alice, bob_api, bob,
                                                                           make_harness, make_dataset, make_reward):
    harness = make_harness(alice)
    response = bob_api.post(checks_url(harness), {"task": TASK, "model": "tiny"}, format="json")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    theirs = make_dataset(bob, name="theirs")
    response = alice_api.post(checks_url(harness), {"dataset": theirs.pk, "task_id": "t1", "model": "tiny"},
                              format="json")
    assert response.status_code == 400 and "dataset" in response.json()["error"]["fields"]
    script = make_reward(bob, name="theirs")
    response = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny", "reward_script": script.pk},
                              format="json")
    assert response.status_code == 400 and "reward_script" in response.json()["error"]["fields"]
    assert not HarnessCheck.objects.exists()


def test_checks_are_read_by_their_owner_and_staff_only(alice_api, alice, bob_api, bob, staff_api, make_harness):
    harness = make_harness(alice)
    first = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny"}, format="json").json()
    second = alice_api.post(checks_url(harness), {"task": {"prompt": "again"}, "model": "tiny"}, format="json").json()
    other = make_harness(alice, name="other")
    alice_api.post(checks_url(other), {"task": TASK, "model": "tiny"}, format="json")

    response = alice_api.get(f"/api/v1/harness-checks/{first['id']}/")
    assert response.status_code == 200 and response.json()["task"] == TASK
    listed = alice_api.get(checks_url(harness)).json()
    assert listed["count"] == 2 and [c["id"] for c in listed["results"]] == [second["id"], first["id"]]
    filtered = alice_api.get(f"/api/v1/harness-checks/?harness={harness.pk}").json()
    assert [c["id"] for c in filtered["results"]] == [second["id"], first["id"]]

    assert bob_api.get(f"/api/v1/harness-checks/{first['id']}/").status_code == 404
    assert bob_api.get(checks_url(harness)).status_code == 404
    assert bob_api.get("/api/v1/harness-checks/").json()["count"] == 0
    assert staff_api.get(f"/api/v1/harness-checks/{first['id']}/").status_code == 200
    assert staff_api.get("/api/v1/harness-checks/").json()["count"] == 3


def test_it_requires_authentication(client, alice, make_harness):
    harness = make_harness(alice)
    response = client.post(checks_url(harness), {"task": TASK, "model": "tiny"}, content_type="application/json")
    assert response.status_code in (401, 403) and "error" in response.json()
    assert not HarnessCheck.objects.exists()


@pytest.mark.parametrize("engine, executor, queue", [
    ("scripted", "local", "default"), ("vllm", "local", "runs"), ("scripted", "kubernetes", "runs")])
def test_the_check_goes_to_the_queue_of_its_engine(alice_api, alice, make_harness, test_redis, engine, executor, queue,
                                                   django_capture_on_commit_callbacks):
    """Scripted checks of local harnesses are short (the control worker); one on vLLM needs the runs worker's
    accelerator, one of a kubernetes harness the runs worker's cluster access and advertised proxy."""
    harness = make_harness(alice, executor=executor, image="ghcr.io/me/agent:1" if executor == "kubernetes" else "")
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny", "engine": engine},
                                  format="json")
    assert response.status_code == 202 and response.json()["engine"] == engine
    message = json.loads(test_redis.lrange(queue, 0, -1)[0])
    assert message["headers"]["task"] == "runs.check_tasks.run_harness_check"
    assert message["headers"]["argsrepr"] == f"[{response.json()['id']}]"
    assert test_redis.llen({"default": "runs", "runs": "default"}[queue]) == 0


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_control_worker_runs_a_check_queued_through_the_api(alice_api, alice, make_harness, workers):
    """A real Celery worker on the default queue, as `manage.py up` starts the control worker: it knows the task."""
    workers.start("control", "default")
    harness = make_harness(alice, command=[sys.executable, "-c", "print('no model here')"])
    response = alice_api.post(checks_url(harness), {"task": TASK, "model": "tiny"}, format="json")
    assert response.status_code == 202
    check_id = response.json()["id"]
    wait_db(lambda: HarnessCheck.objects.get(pk=check_id).is_finished, "the check to end", workers, timeout=120)
    body = alice_api.get(f"/api/v1/harness-checks/{check_id}/").json()
    assert body["status"] == "succeeded" and body["verdict"] == "fail" and body["report"]["calls"] == []
    assert body["started_at"] and body["finished_at"]
