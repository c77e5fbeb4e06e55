"""The models registry: /api/v1/models/, what a run's `model` may name, and the new-run form."""
import pytest

from runs.models import Run
from tests.dashboard.test_new_run_form import DEFAULTS, config_post

pytestmark = pytest.mark.django_db


def test_the_api_lists_registered_models(alice_api, models_dir):
    (models_dir / "not-a-model").mkdir(exist_ok=True)  # no config.json: not listed
    body = alice_api.get("/api/v1/models/").json()
    assert [m["name"] for m in body] == ["tiny"]
    assert body[0]["origin"] == "tiny" and body[0]["path"] == str((models_dir / "tiny").resolve())
    assert body[0]["size_bytes"] > 0 and body[0]["params"] == 1


def test_the_models_api_needs_login(client):
    assert client.get("/api/v1/models/").status_code == 401


@pytest.fixture
def parts(alice, make_harness, make_dataset, make_reward):
    return {"name": "r", "harness": make_harness(alice).pk, "dataset": make_dataset(alice).pk,
            "reward_script": make_reward(alice).pk}


def test_a_run_records_the_resolved_model(alice_api, parts, models_dir):
    body = alice_api.post("/api/v1/runs/", {**parts, "model": "tiny"}, format="json").json()
    assert body["model_info"]["path"] == str((models_dir / "tiny").resolve()) and body["model_info"]["weight_sync"]


def test_a_model_folder_path_is_accepted(alice_api, parts, models_dir):
    response = alice_api.post("/api/v1/runs/", {**parts, "model": str(models_dir / "tiny")}, format="json")
    assert response.status_code == 201 and response.json()["model_info"]["origin"] == "tiny"


def test_an_external_url_runs_without_weight_sync(alice_api, parts):
    response = alice_api.post("/api/v1/runs/", {**parts, "model": "http://10.0.0.5:8000/v1"}, format="json")
    assert response.status_code == 201
    assert response.json()["model_info"] == {"name": "http://10.0.0.5:8000/v1", "path": "", "origin": "external",
                                             "url": "http://10.0.0.5:8000/v1", "weight_sync": False}


@pytest.mark.parametrize("model, message", [
    ("gpt-5", "model 'gpt-5' is not in the registry (available: ['tiny'])"),
    ("/nonexistent/folder", "model folder /nonexistent/folder is not allowed"),
])
def test_an_unknown_model_is_refused(alice_api, parts, model, message):
    response = alice_api.post("/api/v1/runs/", {**parts, "model": model}, format="json")
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert Run.objects.count() == 0


def test_a_model_whose_logits_the_trainer_cannot_reproduce_is_refused(alice_api, parts, tmp_path, settings):
    """Issue 26.7: a registry model (or a folder) whose forward soft-caps or scales its logits after the output
    embedding, which the trainer's logprobs skip, cannot be trained: refused at run creation, saying why."""
    import json

    settings.LIGHTNING_MODELS_DIR = tmp_path  # a registry of this test's own: the session's lists only "tiny"
    for name, config in (("capped", {"model_type": "gemma2", "final_logit_softcapping": 30.0}),
                         ("scaled", {"model_type": "cohere", "logit_scale": 0.0625}),
                         ("plain", {"model_type": "gemma3_text", "final_logit_softcapping": None})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    for model, field in (("capped", "final_logit_softcapping=30.0"), ("scaled", "logit_scale=0.0625"),
                         (str(tmp_path / "capped"), "final_logit_softcapping=30.0")):
        response = alice_api.post("/api/v1/runs/", {**parts, "model": model}, format="json")
        assert response.status_code == 400, response.json()
        message = response.json()["error"]["message"]
        assert f"model capped is refused: its config sets {field}" in message or \
            f"model scaled is refused: its config sets {field}" in message
        assert "the trainer does not apply" in message
    assert Run.objects.count() == 0
    assert alice_api.post("/api/v1/runs/", {**parts, "model": "plain"}, format="json").status_code == 201


def test_the_new_run_form_lists_models_and_own_objects(client, alice, bob, make_harness):
    make_harness(alice, name="mine")
    make_harness(bob, name="theirs")
    client.force_login(alice)
    page = client.get("/runs/new/").content.decode()
    assert '<option value="tiny">tiny (tiny, 0 MB)</option>' in page
    assert "mine" in page and "theirs" not in page
    assert 'name="group_size" value="4"' in page  # the config fields start from TrainerConfig defaults


def test_the_new_run_form_launches_a_run(client, alice, parts):
    client.force_login(alice)
    response = client.post("/runs/new/", {**parts, **config_post({**DEFAULTS, "steps": 2}), "name": "from-form",
                                          "model": "tiny"})
    run = Run.objects.get(name="from-form")
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    assert run.owner == alice and run.config["steps"] == 2 and run.status == "queued"


@pytest.mark.parametrize("config, message", [
    ({"steps": 0}, "steps must be at least 1"),
    ({"steps": "many"}, "Enter a whole number."),
    ({"group_size": 10000}, "group_size must be at most 256, got 10000"),  # issue 26.6: sizes are bounded
    ({"kv_cache_gb": 100000}, "kv_cache_gb must be at most 4096"),
])
def test_the_new_run_form_explains_bad_configs(client, alice, parts, config, message):
    client.force_login(alice)
    response = client.post("/runs/new/", {**parts, **config_post({**DEFAULTS, **config}), "name": "bad",
                                          "model": "tiny"})
    assert response.status_code == 200 and message in response.content.decode()
    assert Run.objects.count() == 0


def test_the_form_refuses_another_users_harness(client, alice, bob, parts, make_harness):
    client.force_login(alice)
    response = client.post("/runs/new/", {**parts, **config_post(DEFAULTS), "harness": make_harness(bob, name="b").pk,
                                          "model": "tiny"})
    assert response.status_code == 200 and "Select a valid choice" in response.content.decode()
    assert Run.objects.count() == 0
