"""The demo preset: the dashboard's "Start the demo run" button and `manage.py load_demo --start-run`."""
import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from catalog.models import Dataset, Harness, RewardScript
from runs.management.commands.load_demo import PRESET_FILE, demo_preset
from runs.models import Run, RunEvent
from trainer.config import TrainerConfig

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo_model(models_dir, tmp_path, settings):
    """A registry that also holds a folder named like the preset's model (config and marker: nothing loads it)."""
    name = demo_preset()["model"]
    root = tmp_path / "registry"
    for model in ("tiny", name):
        (root / model).mkdir(parents=True)
        (root / model / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (root / model / "lightning_model.json").write_text(json.dumps({"name": model, "origin": "test"}))
    settings.LIGHTNING_MODELS_DIR = root
    return name


def test_the_preset_is_a_valid_config_of_a_learning_run():
    preset = json.loads(PRESET_FILE.read_text())
    config = TrainerConfig.from_dict(preset["config"])  # raises on an unknown or ill-typed field
    assert config.eval_tasks >= 100 and config.eval_samples == 4 and config.eval_greedy
    assert config.temperature == pytest.approx(0.7) and config.steps >= 1
    assert {"name", "model", "harness", "dataset", "reward_script"} <= set(preset)


def test_it_offers_the_demo_on_an_empty_dashboard_only(client, alice, make_run):
    client.force_login(alice)
    page = client.get("/").content.decode()
    assert 'action="/runs/demo/"' in page and "Start the demo run" in page
    make_run(alice)
    page = client.get("/").content.decode()
    assert "Start the demo run" not in page


def test_the_button_starts_the_preset_run_and_shows_it(client, alice, bob, demo_model):
    client.force_login(alice)
    response = client.post("/runs/demo/")
    run = Run.objects.get()
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    preset = demo_preset()
    assert run.owner == alice and run.name == preset["name"] and run.model == demo_model
    assert run.status == "queued"
    # The preset's config, tagged as the demo preset's run (runs.presets: the new-run form finds it by that).
    assert run.config == TrainerConfig.from_dict({**preset["config"], "extra": {"preset": "arith-demo"}}).to_dict()
    assert run.harness.name == preset["harness"] and run.harness.owner == alice
    assert "examples/arith/agent.py" in " ".join(run.harness.command)
    assert run.dataset.name == preset["dataset"] and run.dataset.owner == alice
    assert run.dataset.val_count >= preset["config"]["eval_tasks"]
    assert run.dataset.train_count + run.dataset.val_count == run.dataset.tasks.count()
    assert run.reward_script.name == preset["reward_script"] and "def reward" in run.reward_script.source
    assert list(RunEvent.objects.filter(run=run).values_list("kind", "payload__status")) == [("run.status", "queued")]
    assert not Run.objects.filter(owner=bob).exists()
    assert client.get(response.url).status_code == 200


def test_a_second_demo_run_reuses_the_demo_rows(client, alice, demo_model):
    client.force_login(alice)
    first = client.post("/runs/demo/")
    second = client.post("/runs/demo/")
    assert first.status_code == second.status_code == 302
    assert Run.objects.filter(owner=alice).count() == 2
    assert Harness.objects.filter(owner=alice).count() == 1
    assert Dataset.objects.filter(owner=alice).count() == 1
    assert RewardScript.objects.filter(owner=alice).count() == 1


def test_without_the_model_it_says_how_to_import_it_and_creates_no_run(client, alice):
    client.force_login(alice)
    response = client.post("/runs/demo/")
    assert response.status_code == 409
    page = response.content.decode()
    assert 'id="demo-error"' in page and "./lw manage models smollm2" in page
    assert not Run.objects.exists()
    assert Harness.objects.filter(owner=alice, name=demo_preset()["harness"]).exists()  # the rows stay for later


def test_the_button_needs_a_post_and_a_login(client, alice, demo_model):
    response = client.post("/runs/demo/")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")
    client.force_login(alice)
    assert client.get("/runs/demo/").status_code == 405
    assert not Run.objects.exists()


def test_load_demo_starts_the_run_for_the_first_superuser_and_prints_its_url(django_user_model, alice, demo_model):
    admin = django_user_model.objects.create_superuser("admin", "admin@localhost", "admin-password-123")
    out = StringIO()
    call_command("load_demo", "--start-run", "--url", "http://127.0.0.1:9000/", stdout=out)
    run = Run.objects.get()
    assert run.owner == admin and run.model == demo_model
    assert f"http://127.0.0.1:9000/runs/{run.pk}/" in out.getvalue()
    assert not Run.objects.filter(owner=alice).exists()


def test_load_demo_without_any_superuser_says_what_to_do(alice, demo_model):
    with pytest.raises(CommandError, match="no superuser yet"):
        call_command("load_demo", "--start-run", stdout=StringIO())
    assert not Run.objects.exists()


def test_load_demo_gives_up_waiting_once_the_app_process_is_gone(alice, demo_model):
    with pytest.raises(CommandError, match="exited before it answered"):
        call_command("load_demo", "--username", "alice", "--start-run", "--url", "http://127.0.0.1:9/",
                     "--wait", "600", "--app-pid", "999999999", stdout=StringIO())
    assert not Run.objects.exists()
