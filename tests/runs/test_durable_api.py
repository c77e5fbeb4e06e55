"""Resume and continue through the API (/api/v1/runs/{id}/resume/, /continue/) and the run page's buttons."""
import pytest

from runs import services
from runs.models import Run

pytestmark = pytest.mark.django_db
URL = "/api/v1/runs/"


def ended(make_run, owner, status, checkpoint="/data/runs/run-1/checkpoints/step-000003", name="run"):
    run = make_run(owner, name=name, config={"steps": 3})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    services.transition_run(run.pk, status, error="" if status == "succeeded" else "engine died")
    Run.objects.filter(pk=run.pk).update(checkpoint_path=checkpoint, step=3)
    return Run.objects.get(pk=run.pk)


def test_it_resumes_a_failed_run(alice_api, alice, make_run, django_capture_on_commit_callbacks, test_redis):
    run = ended(make_run, alice, "failed")
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_api.post(f"{URL}{run.pk}/resume/")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["error"] == "" and body["finished_at"] is None
    assert body["worker_starts"] == 1 and body["checkpoint_path"].endswith("step-000003")
    run.refresh_from_db()
    assert run.status == "queued" and run.celery_task_id and test_redis.llen("runs") == 1


def test_it_refuses_to_resume_a_succeeded_run(alice_api, alice, make_run):
    run = ended(make_run, alice, "succeeded")
    response = alice_api.post(f"{URL}{run.pk}/resume/")
    assert response.status_code == 409
    assert response.json()["error"] == {
        "status": 409, "code": "invalid_transition",
        "message": f"run {run.pk} is succeeded; only failed or cancelled runs can be resumed; "
                   "continue it for more steps instead"}
    assert Run.objects.get(pk=run.pk).status == "succeeded"


def test_it_refuses_to_resume_a_run_that_never_saved_a_checkpoint(alice_api, alice, make_run):
    run = ended(make_run, alice, "failed", checkpoint="")
    response = alice_api.post(f"{URL}{run.pk}/resume/")
    assert response.status_code == 409 and "has no checkpoint to go on from" in response.json()["error"]["message"]
    assert Run.objects.get(pk=run.pk).status == "failed"


def test_it_continues_a_succeeded_run_for_more_steps(alice_api, alice, make_run, django_capture_on_commit_callbacks,
                                                      test_redis):
    run = ended(make_run, alice, "succeeded")
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_api.post(f"{URL}{run.pk}/continue/", {"steps": 4}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "queued" and response.json()["config"]["steps"] == 7
    run.refresh_from_db()
    assert run.status == "queued" and run.config["steps"] == 7 and test_redis.llen("runs") == 1


@pytest.mark.parametrize("body, message", [
    ({}, "steps: This field is required."),
    ({"steps": 0}, "steps: Ensure this value is greater than or equal to 1."),
    ({"steps": "many"}, "steps: A valid integer is required."),
])
def test_continue_names_a_bad_step_count(alice_api, alice, make_run, body, message):
    run = ended(make_run, alice, "succeeded")
    response = alice_api.post(f"{URL}{run.pk}/continue/", body, format="json")
    assert response.status_code == 400 and response.json()["error"]["message"] == message
    assert Run.objects.get(pk=run.pk).config["steps"] == 3


def test_continue_refuses_a_cancelled_run(alice_api, alice, make_run):
    run = make_run(alice)
    services.cancel_run(run, alice)
    response = alice_api.post(f"{URL}{run.pk}/continue/", {"steps": 2}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["message"].endswith("only succeeded runs can be continued; resume it instead")


def test_others_cannot_resume_or_continue(alice, bob_api, make_run):
    failed = ended(make_run, alice, "failed")
    assert bob_api.post(f"{URL}{failed.pk}/resume/").status_code == 404
    assert bob_api.post(f"{URL}{failed.pk}/continue/", {"steps": 1}, format="json").status_code == 404
    assert Run.objects.get(pk=failed.pk).status == "failed"


def test_the_schema_lists_the_actions(alice_api):
    paths = alice_api.get("/api/schema/?format=json").json()["paths"]
    assert "post" in paths["/api/v1/runs/{id}/resume/"] and "post" in paths["/api/v1/runs/{id}/continue/"]


# ---------------------------------------------------------------- the run page


def test_the_page_offers_resume_for_a_failed_run_and_it_queues_the_run(client, alice, make_run):
    run = ended(make_run, alice, "failed")
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="resume-form"' in page and 'id="continue-form"' not in page
    response = client.post(f"/runs/{run.pk}/resume/")
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    assert Run.objects.get(pk=run.pk).status == "queued"
    assert 'id="resume-form"' not in client.get(f"/runs/{run.pk}/").content.decode()


def test_the_page_offers_continue_for_a_succeeded_run(client, alice, make_run):
    run = ended(make_run, alice, "succeeded")
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="continue-form"' in page and 'id="resume-form"' not in page
    assert client.post(f"/runs/{run.pk}/continue/", {"steps": "2"}).status_code == 302
    run.refresh_from_db()
    assert run.status == "queued" and run.config["steps"] == 5


def test_the_page_says_why_an_action_is_refused(client, alice, make_run):
    run = ended(make_run, alice, "succeeded")
    client.force_login(alice)
    response = client.post(f"/runs/{run.pk}/continue/", {"steps": "0"})
    assert response.status_code == 409 and "steps must be at least 1, got 0" in response.content.decode()
    response = client.post(f"/runs/{run.pk}/resume/")
    assert response.status_code == 409 and "only failed or cancelled runs can be resumed" in response.content.decode()
    assert Run.objects.get(pk=run.pk).status == "succeeded"


def test_the_page_offers_nothing_while_running_or_without_a_checkpoint(client, alice, make_run):
    running = make_run(alice, name="a")
    services.claim_run(running.pk, "task")
    no_checkpoint = ended(make_run, alice, "failed", checkpoint="", name="b")
    client.force_login(alice)
    for run in (running, no_checkpoint):
        page = client.get(f"/runs/{run.pk}/").content.decode()
        assert 'id="resume-form"' not in page and 'id="continue-form"' not in page


def test_another_users_run_cannot_be_resumed_from_the_page(client, alice, bob, make_run):
    run = ended(make_run, bob, "failed")
    client.force_login(alice)
    assert client.post(f"/runs/{run.pk}/resume/").status_code == 404
    assert client.get(f"/runs/{run.pk}/resume/").status_code == 405
    assert Run.objects.get(pk=run.pk).status == "failed"
