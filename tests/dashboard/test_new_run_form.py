"""The new-run page: TrainerConfig as typed fields in groups, errors beside their field, clone and edit."""
import dataclasses
import inspect
import json
import re

import pytest
from django.utils.html import escape

from dashboard.forms import config_field_docs
from runs import services
from runs.models import Run
from trainer.config import TrainerConfig

pytestmark = pytest.mark.django_db

DEFAULTS = TrainerConfig().to_dict()


def config_post(config: dict) -> dict:
    """A TrainerConfig dict as the browser posts the form: checked boxes only, `extra` as JSON text."""
    data = {}
    for name, value in config.items():
        if isinstance(value, bool):
            if value:
                data[name] = "on"
        elif isinstance(value, dict):
            data[name] = json.dumps(value)
        else:
            data[name] = str(value)
    return data


def field_html(page: str, name: str) -> str:
    """The markup of one field's block: label, input, help and errors."""
    match = re.search(rf'<div class="field[^"]*" id="field-{name}">(.*?)</div>', page, re.S)
    assert match, f"no field block for {name}"
    return match.group(1)


def group_html(page: str, key: str) -> str:
    match = re.search(rf'<fieldset class="config-group" id="group-{key}">(.*?)</fieldset>', page, re.S)
    assert match, f"no fieldset {key}"
    return match.group(1)


@pytest.fixture
def parts(alice, make_harness, make_dataset, make_reward):
    return {"name": "from-form", "model": "tiny", "harness": make_harness(alice).pk,
            "dataset": make_dataset(alice).pk, "reward_script": make_reward(alice).pk}


@pytest.fixture
def alice_client(client, alice):
    client.force_login(alice)
    return client


def test_it_needs_login(client):
    response = client.get("/runs/new/")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_the_docstrings_are_read_from_trainer_config_source():
    docs = config_field_docs()
    source = inspect.getsource(TrainerConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(TrainerConfig)}
    assert docs["group_size"] == "Attempts per task in one group (GRPO group size)."
    # A docstring over several lines is folded into one line of help.
    assert docs["checkpoint_every"].startswith("Save a checkpoint every this many steps (and at the end); 0 saves "
                                               "only at the end. A run whose worker dies resumes from its last")
    for name, doc in docs.items():
        assert doc and doc.split()[0] in source, name


def test_it_shows_every_trainer_config_field_with_its_docstring_and_default(alice_client):
    response = alice_client.get("/runs/new/")
    assert response.status_code == 200
    form, page, docs = response.context["form"], response.content.decode(), config_field_docs()
    for f in dataclasses.fields(TrainerConfig):
        field = form.fields[f.name]
        assert field.help_text == docs[f.name] and field.initial == DEFAULTS[f.name], f.name
        block = field_html(page, f.name)
        assert f'<small class="muted" id="id_{f.name}_helptext">{escape(docs[f.name])}</small>' in block
        assert f'<code class="config-key">{f.name}</code>' in block
    # Each kind of field renders its default as the browser shows it.
    assert '<input type="number" name="steps" value="10"' in field_html(page, "steps")
    assert '<input type="number" name="learning_rate" value="1e-05" step="any"' in field_html(page, "learning_rate")
    assert '<option value="sync" selected>sync</option>' in field_html(page, "mode")
    assert '<option value="async">async</option>' in field_html(page, "mode")
    assert '<input type="checkbox" name="eval_greedy"' in field_html(page, "eval_greedy")
    assert "checked" in field_html(page, "eval_greedy") and "checked" not in field_html(page, "gradient_checkpointing")
    assert re.search(r'<textarea name="extra"[^>]*>\s*\{\}</textarea>', field_html(page, "extra"))
    assert 'name="config"' not in page  # no JSON textarea of the whole config any more


def test_it_groups_the_fields(alice_client):
    page = alice_client.get("/runs/new/").content.decode()
    ids = {key: re.findall(r'id="field-(\w+)"', group_html(page, key))
           for key in ("run", "basic", "evaluation", "advanced")}
    assert ids["run"] == ["name", "model", "harness", "dataset", "reward_script", "pool"]
    assert ids["basic"] == ["steps", "tasks_per_step", "group_size", "learning_rate", "temperature", "mode"]
    assert ids["evaluation"] == ["eval_every", "eval_tasks", "eval_samples", "eval_greedy", "eval_concurrency"]
    every = [f.name for f in dataclasses.fields(TrainerConfig)]
    assert ids["advanced"] == [n for n in every if n not in ids["basic"] + ids["evaluation"]]
    assert ids["advanced"][-1] == "extra" and "kl_coef" in ids["advanced"]
    assert '<details class="config-group" id="group-advanced"><summary>' in page  # closed without errors


def test_it_launches_a_run_with_the_submitted_config(alice_client, alice, parts):
    changes = {"steps": 3, "learning_rate": 2e-5, "mode": "async", "max_staleness": 2, "eval_greedy": False,
               "gradient_checkpointing": True, "extra": {"note": "baseline"}}
    response = alice_client.post("/runs/new/", {**parts, **config_post({**DEFAULTS, **changes})})
    run = Run.objects.get()
    assert response.status_code == 302 and response.url == f"/runs/{run.pk}/"
    assert run.owner == alice and run.name == "from-form" and run.status == "queued" and run.cloned_from is None
    assert run.harness_id == parts["harness"] and run.model == "tiny"
    assert run.config == TrainerConfig(**changes).to_dict()


def test_an_empty_extra_is_an_empty_dict(alice_client, parts):
    response = alice_client.post("/runs/new/", {**parts, **config_post(DEFAULTS), "extra": ""})
    assert response.status_code == 302 and Run.objects.get().config["extra"] == {}


@pytest.mark.parametrize("changes, field, message", [
    ({"steps": 0}, "steps", "steps must be at least 1, got 0; set steps &gt;= 1"),
    ({"temperature": 0}, "temperature", "temperature must be positive"),
    ({"top_p": 0.9}, "top_p", "top_p=0.9 is not supported"),
    ({"updates_per_step": 64}, "updates_per_step", "updates_per_step=64 exceeds the rollouts per step (32)"),
    ({"mode": "async", "max_staleness": 0}, "max_staleness", "mode=&#x27;async&#x27; with max_staleness=0 cannot keep"),
    ({"groups_in_flight": 3}, "groups_in_flight", "mode=&#x27;sync&#x27; launches exactly tasks_per_step=8"),
    ({"group_size": 1}, "group_size", "advantage=&#x27;grpo&#x27; needs a group baseline"),
])
def test_each_config_error_shows_beside_its_field(alice_client, parts, changes, field, message):
    posted = {**DEFAULTS, "learning_rate": 3e-5, **changes}
    response = alice_client.post("/runs/new/", {**parts, **config_post(posted)})
    page = response.content.decode()
    assert response.status_code == 200 and Run.objects.count() == 0
    block = field_html(page, field)
    assert f'<p class="error field-error" id="id_{field}_error"><span>{message}' in block
    assert 'aria-invalid="true"' in block
    assert page.count("field-error") == 1  # beside that field only, not repeated above the form
    assert '<p class="error" id="form-errors">' in page
    # Nothing typed is lost: the form comes back with the user's values.
    assert 'name="name" value="from-form"' in page
    assert 'name="learning_rate" value="3e-05"' in page
    for name, value in changes.items():
        assert f'name="{name}" value="{value}"' in page or f'<option value="{value}" selected>' in field_html(page, name)


def test_an_error_in_an_advanced_field_opens_the_advanced_group(alice_client, parts):
    page = alice_client.post("/runs/new/", {**parts, **config_post({**DEFAULTS, "kl_coef": -1})}).content.decode()
    assert '<details class="config-group" id="group-advanced" open>' in page
    assert "kl_coef must not be negative, got -1.0" in field_html(page, "kl_coef")


@pytest.mark.parametrize("field, value, message", [
    ("steps", "ten", "Enter a whole number."),
    ("learning_rate", "fast", "Enter a number."),
    ("mode", "turbo", "Select a valid choice. turbo is not one of the available choices."),
    ("extra", "{not json", "Enter a valid JSON."),
    ("extra", "[1, 2]", "must be a JSON object"),
])
def test_a_malformed_value_shows_beside_its_field(alice_client, parts, field, value, message):
    response = alice_client.post("/runs/new/", {**parts, **config_post(DEFAULTS), field: value})
    page = response.content.decode()
    assert response.status_code == 200 and Run.objects.count() == 0
    block = field_html(page, field)
    assert message in block and escape(value) in block  # the text the user typed is kept


def test_a_missing_number_is_required(alice_client, parts):
    data = {**parts, **config_post(DEFAULTS)}
    del data["group_size"]
    response = alice_client.post("/runs/new/", data)
    assert response.status_code == 200 and Run.objects.count() == 0
    assert "This field is required." in field_html(response.content.decode(), "group_size")


def test_another_users_harness_is_refused_beside_the_field(alice_client, bob, parts, make_harness):
    data = {**parts, **config_post(DEFAULTS), "harness": make_harness(bob, name="theirs").pk}
    response = alice_client.post("/runs/new/", data)
    assert response.status_code == 200 and Run.objects.count() == 0
    assert "Select a valid choice" in field_html(response.content.decode(), "harness")


def test_a_refusal_naming_no_field_shows_above_the_form(alice_client, alice, parts, make_dataset):
    val_only = make_dataset(alice, name="val-only", tasks=[{"id": "v", "answer": 1, "split": "val"}])
    response = alice_client.post("/runs/new/", {**parts, **config_post(DEFAULTS), "dataset": val_only.pk})
    page = response.content.decode()
    assert response.status_code == 200 and Run.objects.count() == 0
    assert "dataset &#x27;val-only&#x27; has no train tasks" in page.split('id="non-field-errors"')[1]
    assert 'name="name" value="from-form"' in page


def test_the_run_page_links_to_clone_and_edit(alice_client, alice, make_run):
    run = make_run(alice)
    page = alice_client.get(f"/runs/{run.pk}/").content.decode()
    assert f'<a href="/runs/new/?clone={run.pk}" id="clone-link" class="button-link">Clone and edit</a>' in page


def test_clone_fills_the_form_from_the_run(alice_client, alice, make_run):
    source = make_run(alice, name="base", config={"steps": 7, "learning_rate": 3e-5, "mode": "async",
                                                  "eval_greedy": False, "extra": {"k": "v"}})
    response = alice_client.get(f"/runs/new/?clone={source.pk}")
    page = response.content.decode()
    assert response.status_code == 200
    assert f'Cloned from <a href="/runs/{source.pk}/">base</a>' in page
    assert 'name="name" value="base (clone)"' in page
    for name, pk in (("harness", source.harness_id), ("dataset", source.dataset_id),
                     ("reward_script", source.reward_script_id)):
        assert f'<option value="{pk}" selected>' in field_html(page, name)
    assert '<option value="tiny" selected>' in field_html(page, "model")
    assert 'name="steps" value="7"' in page and 'name="learning_rate" value="3e-05"' in page
    assert '<option value="async" selected>' in field_html(page, "mode")
    assert "checked" not in field_html(page, "eval_greedy")
    assert "{&quot;k&quot;: &quot;v&quot;}" in field_html(page, "extra")


def test_a_cloned_run_keeps_the_edits_and_records_its_origin(alice_client, alice, make_run):
    source = make_run(alice, name="base", config={"steps": 7, "mode": "async", "extra": {"k": "v"}})
    form = alice_client.get(f"/runs/new/?clone={source.pk}").context["form"]
    data = {name: form[name].value() for name in ("name", "model", "harness", "dataset", "reward_script")}
    response = alice_client.post(f"/runs/new/?clone={source.pk}",
                                 {**data, **config_post({**source.config, "steps": 9})})
    clone = Run.objects.exclude(pk=source.pk).get()
    assert response.status_code == 302 and response.url == f"/runs/{clone.pk}/"
    assert clone.name == "base (clone)" and clone.cloned_from == source and clone.harness == source.harness
    assert clone.config == {**source.config, "steps": 9}


def test_clone_keeps_a_model_outside_the_registry(alice_client, alice, make_harness, make_dataset, make_reward):
    source = services.create_run(alice, name="ext", model="http://127.0.0.1:9/v1", config={},
                                 harness=make_harness(alice), dataset=make_dataset(alice),
                                 reward_script=make_reward(alice))
    page = alice_client.get(f"/runs/new/?clone={source.pk}").content.decode()
    assert '<option value="http://127.0.0.1:9/v1" selected>' in field_html(page, "model")


@pytest.mark.parametrize("query", ["{bob_run}", "999999", "abc"])
def test_cloning_another_users_run_is_not_found(alice_client, bob, make_run, query):
    bob_run = make_run(bob, name="secret")
    response = alice_client.get(f"/runs/new/?clone={query.format(bob_run=bob_run.pk)}")
    assert response.status_code == 404 and b"secret" not in response.content
    response = alice_client.post(f"/runs/new/?clone={query.format(bob_run=bob_run.pk)}", {})
    assert response.status_code == 404 and Run.objects.count() == 1
