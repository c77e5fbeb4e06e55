"""What a run's model may name: the registry and the user's own checkpoints, nothing else, checked at creation and
again by the worker (symlinks and '..' resolved first)."""
import json

import pytest

from runs import services
from runs.models import Run
from runs.tasks import execute_run

pytestmark = pytest.mark.django_db
URL = "/api/v1/runs/"


@pytest.fixture(autouse=True)
def runs_dir(tmp_path, settings):
    settings.LIGHTNING_RUNS_DIR = tmp_path / "runs"
    return settings.LIGHTNING_RUNS_DIR


def model_folder(path):
    """A folder the registry reads as a transformers model (config.json, one weights file and a tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture
def alice_checkpoint(alice, make_run, runs_dir):
    """A checkpoint of one of alice's runs, where the worker writes them."""
    run = make_run(alice, name="trained")
    folder = model_folder(runs_dir / f"run-{run.pk}" / "checkpoints" / "step-000002")
    Run.objects.filter(pk=run.pk).update(checkpoint_path=str(folder))
    return folder


def parts(owner, make_harness, make_dataset, make_reward, name="next"):
    return {"name": name, "harness": make_harness(owner, name=f"{name}-h").pk,
            "dataset": make_dataset(owner, name=f"{name}-d").pk,
            "reward_script": make_reward(owner, name=f"{name}-r").pk}


@pytest.fixture
def post(make_harness, make_dataset, make_reward):
    sent = []

    def send(api, owner, model):
        sent.append(model)
        kit = parts(owner, make_harness, make_dataset, make_reward, name=f"p{len(sent)}")
        return api.post(URL, {**kit, "name": "next", "model": model}, format="json")

    return send


def assert_refused(response, owner, text="is not allowed"):
    body = response.json()["error"]
    assert response.status_code == 400 and body["code"] == "invalid"
    assert list(body["fields"]) == ["model"] and text in body["fields"]["model"][0]
    assert body["message"].startswith("model: ")
    assert not Run.objects.filter(owner=owner, name="next").exists()


@pytest.mark.parametrize("model", ["tiny", "{registry}/tiny", "{registry}/tiny/../tiny"])
def test_it_accepts_a_registry_name_and_a_registry_folder(alice_api, alice, post, models_dir, model):
    response = post(alice_api, alice, model.format(registry=models_dir))
    assert response.status_code == 201 and response.json()["model_info"]["path"] == str((models_dir / "tiny").resolve())
    assert Run.objects.get(name="next").model_info["origin"] == "tiny"


def test_it_accepts_the_users_own_checkpoint(alice_api, alice, post, alice_checkpoint):
    response = post(alice_api, alice, str(alice_checkpoint))
    assert response.status_code == 201
    run = Run.objects.get(name="next")
    assert run.model == str(alice_checkpoint) and run.model_info["path"] == str(alice_checkpoint.resolve())
    assert run.model_info["weight_sync"] is True and run.owner == alice


def test_another_users_checkpoint_is_refused(bob_api, bob, post, alice_checkpoint):
    assert_refused(post(bob_api, bob, str(alice_checkpoint)), bob)
    assert Run.objects.filter(owner=bob).count() == 0


@pytest.mark.parametrize("model", [
    "/etc", "/etc/passwd", "/", "{registry}/../../../etc", "{runs}/run-{run}/checkpoints/step-000002/../../../../etc",
    "{runs}/run-{run}", "{runs}/run-{run}/../run-{run}/data", "{registry}",
])
def test_escapes_out_of_the_registry_and_own_checkpoints_are_refused(alice_api, alice, post, models_dir, runs_dir,
                                                                       alice_checkpoint, model):
    run_id = alice_checkpoint.parents[1].name.removeprefix("run-")
    model = model.format(registry=models_dir, runs=runs_dir, run=run_id)
    assert_refused(post(alice_api, alice, model), alice)


def test_a_relative_escape_is_not_a_registry_name(alice_api, alice, post):
    assert_refused(post(alice_api, alice, "../../etc"), alice, text="is not in the registry")


def test_a_symlink_in_the_registry_is_followed_before_the_check(alice_api, bob_api, bob, post, models_dir, tmp_path,
                                                               alice_checkpoint):
    outside = model_folder(tmp_path / "outside" / "m")
    (models_dir / "link-out").symlink_to(outside)
    (models_dir / "link-alice").symlink_to(alice_checkpoint)
    try:
        assert_refused(post(bob_api, bob, str(models_dir / "link-out")), bob)
        assert_refused(post(bob_api, bob, str(models_dir / "link-alice")), bob)
        assert_refused(post(bob_api, bob, "link-out"), bob)  # by its registry name too
    finally:
        (models_dir / "link-out").unlink()
        (models_dir / "link-alice").unlink()


def test_a_folder_in_the_registry_without_a_model_says_so(alice_api, alice, post, models_dir):
    (models_dir / "empty").mkdir(exist_ok=True)
    try:
        assert_refused(post(alice_api, alice, str(models_dir / "empty")), alice,
                       text="is not a folder holding a transformers model")
    finally:
        (models_dir / "empty").rmdir()


def test_cloning_a_run_whose_row_names_a_forbidden_folder_is_refused(alice_api, alice, make_run):
    source = make_run(alice, name="tampered")
    Run.objects.filter(pk=source.pk).update(model="/etc")
    response = alice_api.post(f"{URL}{source.pk}/clone/", {"name": "next"}, format="json")
    assert_refused(response, alice)
    assert Run.objects.filter(owner=alice).count() == 1


def test_the_new_run_form_offers_own_checkpoints_and_shows_refusals_on_the_model_field(
        client, alice, bob, make_run, alice_checkpoint, make_harness, make_dataset, make_reward):
    from tests.dashboard.test_new_run_form import DEFAULTS, config_post

    client.force_login(alice)
    page = client.get("/runs/new/").content.decode()
    assert f'<option value="{alice_checkpoint}">checkpoint of run #' in page
    data = {**parts(alice, make_harness, make_dataset, make_reward), **config_post(DEFAULTS)}
    response = client.post("/runs/new/", {**data, "model": str(alice_checkpoint)})
    run = Run.objects.get(name="next")
    assert response.status_code == 302 and run.model_info["path"] == str(alice_checkpoint)
    client.force_login(bob)  # bob is not offered alice's checkpoint, and cannot post it
    assert str(alice_checkpoint) not in client.get("/runs/new/").content.decode()
    bob_data = {**parts(bob, make_harness, make_dataset, make_reward, name="b"), **config_post(DEFAULTS)}
    response = client.post("/runs/new/", {**bob_data, "model": str(alice_checkpoint)})
    assert response.status_code == 200 and "Select a valid choice" in response.context["form"].errors["model"][0]
    assert not Run.objects.filter(owner=bob).exists()


def test_the_form_shows_a_refused_clone_model_beside_the_model_field(client, alice, make_run):
    from tests.dashboard.test_new_run_form import config_post

    source = make_run(alice, name="tampered")
    Run.objects.filter(pk=source.pk).update(model="/etc")
    client.force_login(alice)
    form = client.get(f"/runs/new/?clone={source.pk}").context["form"]
    data = {name: form[name].value() for name in ("name", "model", "harness", "dataset", "reward_script")}
    response = client.post(f"/runs/new/?clone={source.pk}", {**data, **config_post(source.config)})
    assert response.status_code == 200 and data["model"] == "/etc"
    assert "model folder /etc is not allowed" in response.context["form"].errors["model"][0]
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)  # the orchestrator reads the run from its own thread
@pytest.mark.parametrize("path", ["/etc", "{bob_checkpoint}"])
def test_the_worker_fails_a_run_whose_stored_model_was_changed(alice, bob, make_run, runs_dir, path):
    run = make_run(alice, name="tampered")
    bob_run = make_run(bob, name="bobs")
    bob_checkpoint = model_folder(runs_dir / f"run-{bob_run.pk}" / "checkpoints" / "step-000001")
    path = path.format(bob_checkpoint=bob_checkpoint)
    Run.objects.filter(pk=run.pk).update(model_info={**run.model_info, "path": path})

    assert execute_run.apply(args=[run.pk]).get() == "failed"

    run.refresh_from_db()
    assert run.status == "failed" and run.error.startswith(f"model folder {path} is not allowed")
    assert "a checkpoint of one of your own runs" in run.error
    assert not (runs_dir / f"run-{run.pk}").exists()  # nothing of the run started


def test_the_worker_still_starts_a_run_on_an_own_checkpoint_up_to_the_engine(alice, make_run, runs_dir,
                                                                             alice_checkpoint, settings):
    from runs.orchestrator import model_folder as folder_of

    run = services.create_run(alice, name="from-ckpt", model=str(alice_checkpoint), config={},
                              harness=Run.objects.get(name="trained").harness,
                              dataset=Run.objects.get(name="trained").dataset,
                              reward_script=Run.objects.get(name="trained").reward_script)
    assert folder_of(run) == alice_checkpoint.resolve()
