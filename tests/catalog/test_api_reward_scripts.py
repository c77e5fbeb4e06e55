"""/api/v1/reward-scripts/: CRUD and the `test` action through the reward sandbox."""
import pytest

from catalog.models import RewardScript
from tests.workers import workers  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db
URL = "/api/v1/reward-scripts/"


@pytest.fixture
def control_worker(workers):  # noqa: F811 (tests.workers' fixture, imported below)
    """The control worker `./lw up` starts (queue `default`): it scores the API's reward tests (issue 26.9)."""
    workers.start("control", "default")
    return workers
SOURCE = "def reward(task, outcome):\n    return {'reward': float(outcome['answer'] == task['answer']), 'seen': outcome['answer']}\n"


def test_it_creates_a_script(alice_api, alice):
    response = alice_api.post(URL, {"name": "exact", "source": SOURCE}, format="json")
    assert response.status_code == 201
    assert response.json()["version"] == 1 and response.json()["timeout_s"] == 10
    assert RewardScript.objects.get(owner=alice).source == SOURCE


@pytest.mark.parametrize("source, message", [
    ("def reward(task outcome):\n    pass", "SyntaxError"),
    ("def score(task, outcome):\n    return 1", "must define a top-level function reward(task, outcome)"),
])
def test_it_rejects_scripts_that_cannot_work(alice_api, source, message):
    response = alice_api.post(URL, {"name": "bad", "source": source}, format="json")
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert RewardScript.objects.count() == 0


def test_the_test_action_scores_in_the_sandbox(alice_api, alice, make_reward, control_worker):
    script = make_reward(alice, source=SOURCE)
    response = alice_api.post(f"{URL}{script.pk}/test/", {"task": {"answer": 4}, "outcome": {"answer": 4}}, format="json")
    assert response.status_code == 200
    body = response.json()
    assert body["ok"] is True and body["reward"] == 1.0 and body["detail"] == {"seen": 4} and body["error"] == "", body
    response = alice_api.post(f"{URL}{script.pk}/test/", {"task": {"answer": 4}, "outcome": {"answer": 5}}, format="json")
    assert response.json()["reward"] == 0.0


def test_the_test_action_returns_a_readable_error(alice_api, alice, make_reward, control_worker):
    script = make_reward(alice, source=SOURCE)
    response = alice_api.post(f"{URL}{script.pk}/test/", {"task": {"answer": 4}, "outcome": {}}, format="json")
    assert response.status_code == 200
    body = response.json()
    assert body["ok"] is False and body["reward"] is None and body["kind"] == "exception"
    assert body["error"] == "KeyError: 'answer' (line 2)"


def test_the_test_action_reports_a_timeout(alice_api, alice, make_reward, control_worker):
    script = make_reward(alice, source="def reward(task, outcome):\n    while True:\n        pass\n", timeout_s=1)
    body = alice_api.post(f"{URL}{script.pk}/test/", {"task": {}, "outcome": {}}, format="json").json()
    assert body["ok"] is False and body["kind"] == "timeout" and "timed out after 1 s" in body["error"]


def test_the_test_action_needs_task_and_outcome(alice_api, alice, make_reward):
    script = make_reward(alice)
    response = alice_api.post(f"{URL}{script.pk}/test/", {"task": {}}, format="json")
    assert response.status_code == 400 and "outcome" in response.json()["error"]["fields"]


def test_without_a_worker_the_test_action_says_so_and_runs_nothing_here(alice_api, alice, make_reward, settings,
                                                                        monkeypatch, test_redis):
    from catalog import reward_tests
    from catalog import services

    monkeypatch.setattr(reward_tests, "WAIT_MARGIN_S", 0.5)
    monkeypatch.setattr(services, "score_reward", lambda *a, **k: pytest.fail("the API process scored user code"))
    script = make_reward(alice, source=SOURCE, timeout_s=1)
    response = alice_api.post(f"{URL}{script.pk}/test/", {"task": {"answer": 4}, "outcome": {"answer": 4}},
                              format="json")
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_worker"
    assert "the control worker" in response.json()["error"]["message"]
    assert test_redis.llen("default") == 1  # queued for the worker that is not there


def test_others_cannot_test_or_read_a_script(alice, bob_api, make_reward):
    script = make_reward(alice)
    assert bob_api.post(f"{URL}{script.pk}/test/", {"task": {}, "outcome": {}}, format="json").status_code == 404
    assert bob_api.get(f"{URL}{script.pk}/").status_code == 404


def test_editing_the_source_bumps_the_version(alice_api, alice, make_reward):
    script = make_reward(alice)
    response = alice_api.patch(f"{URL}{script.pk}/", {"source": SOURCE}, format="json")
    assert response.status_code == 200 and response.json()["version"] == 2
    assert RewardScript.objects.get(pk=script.pk).source == SOURCE
