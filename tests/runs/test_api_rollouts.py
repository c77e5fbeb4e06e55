"""/api/v1/rollouts/: list and detail with recorded calls and samples, owner-only."""
import pytest

from runs import rollout_services
from runs.models import ModelCall, Sample

pytestmark = pytest.mark.django_db
URL = "/api/v1/rollouts/"


@pytest.fixture
def rollout(alice, make_run):
    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=0, group=0,
                                                 attempt=0)
    ModelCall.objects.create(rollout=rollout, seq=0, api="chat", request={"messages": [{"role": "user", "content": "hi"}]},
                             response={"choices": [{"message": {"content": "<b>hey</b>"}}]}, prompt_ids=[1, 2, 3],
                             completion_ids=[7, 8, 2], logprobs=[-0.1, -0.2, -0.01], finish_reason="stop",
                             status_code=200, latency_ms=12.5, drift="clean")
    ModelCall.objects.create(rollout=rollout, seq=1, api="chat", request={"messages": []}, status_code=504,
                             error="upstream timed out")
    Sample.objects.create(rollout=rollout, token_ids=[1, 2, 3, 7, 8, 2], loss_mask=[0, 0, 0, 1, 1, 1],
                          logprobs=[0, 0, 0, -0.1, -0.2, -0.01], advantage=0.5, call_seqs=[0], build="clean")
    return rollout


def test_detail_holds_calls_and_samples_in_order(alice_api, rollout):
    response = alice_api.get(f"{URL}{rollout.pk}/")
    assert response.status_code == 200
    body = response.json()
    assert body["task_data"] == rollout.task.data and body["status"] == "pending"
    assert [c["seq"] for c in body["calls"]] == [0, 1]
    first = body["calls"][0]
    assert first["prompt_ids"] == [1, 2, 3] and first["completion_ids"] == [7, 8, 2] and first["drift"] == "clean"
    assert first["response"]["choices"][0]["message"]["content"] == "<b>hey</b>"  # verbatim; escaped where rendered
    assert body["calls"][1]["status_code"] == 504 and body["calls"][1]["error"] == "upstream timed out"
    assert body["samples"][0]["loss_mask"] == [0, 0, 0, 1, 1, 1] and body["samples"][0]["advantage"] == 0.5
    assert "secret_hash" not in body


def test_list_filters_by_run_and_status(alice_api, rollout):
    assert alice_api.get(URL, {"run": rollout.run_id}).json()["count"] == 1
    assert alice_api.get(URL, {"status": "succeeded"}).json()["count"] == 0
    assert "calls" not in alice_api.get(URL).json()["results"][0]


def test_others_cannot_see_rollouts(bob_api, staff_api, rollout):
    assert bob_api.get(URL).json()["count"] == 0
    assert bob_api.get(f"{URL}{rollout.pk}/").status_code == 404
    assert staff_api.get(f"{URL}{rollout.pk}/").status_code == 200


def test_rollouts_are_read_only(alice_api, rollout):
    assert alice_api.post(URL, {}, format="json").status_code == 405
    assert alice_api.delete(f"{URL}{rollout.pk}/").status_code == 405


def test_it_says_which_step_a_rollout_was_sampled_for_and_whether_it_trained_on_it(alice_api, rollout):
    dropped, _ = rollout_services.create_rollout(rollout.run, task=None, split="train", step=0, group=1, attempt=0)
    before = alice_api.get(f"{URL}{rollout.pk}/").json()
    assert {k: before[k] for k in ("batch_step", "trained_step", "drop_reason", "fate")} == {
        "batch_step": None, "trained_step": None, "drop_reason": "", "fate": ""}
    rollout_services.record_step(rollout.run_id, 1, 1, [], {}, {},
                                 {rollout.pk: "", dropped.pk: "no_signal: every attempt scored 0"})
    rows = {r["id"]: r for r in alice_api.get(URL, {"run": rollout.run_id}).json()["results"]}
    assert {k: rows[rollout.pk][k] for k in ("batch_step", "trained_step", "drop_reason", "fate")} == {
        "batch_step": 1, "trained_step": 1, "drop_reason": "", "fate": "sampled for step 1: trained"}
    assert {k: rows[dropped.pk][k] for k in ("batch_step", "trained_step", "drop_reason", "fate")} == {
        "batch_step": 1, "trained_step": None, "drop_reason": "no_signal: every attempt scored 0",
        "fate": "sampled for step 1: dropped (no_signal: every attempt scored 0)"}
