"""The new-run form's presets: the demo's and each harness template's fill the form, tag the run, and show attempts
per task and temperature beside the signal share of the user's last run of that preset."""
import pytest

from dashboard.forms import CONFIG_FIELDS
from runs import presets, services
from runs.management.commands.load_demo import ensure_demo, start_demo_run
from runs.models import Run
from tests.runs.test_demo import demo_model  # noqa: F401 (a registry of its own holding the demo's model)
from tests.dashboard.test_new_run_form import config_post, field_html

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_client(client, alice):
    client.force_login(alice)
    return client


def test_the_presets_are_the_demos_and_the_templates_with_one():
    slugs = [p.slug for p in presets.all_presets()]
    assert slugs[0] == "arith-demo" and {"mini-swe-agent-text", "opencode-chat"} <= set(slugs)
    mini = presets.find("mini-swe-agent-text")
    assert (mini.harness, mini.dataset, mini.reward_script) == ("mini-swe-agent-text", "repo-tasks", "repo-checks")
    assert mini.tagged_config["extra"] == {"preset": "mini-swe-agent-text"}
    assert presets.find("nope") is None
    assert presets.tag({"steps": 3, "extra": {"note": "x"}}, "s") == {"steps": 3, "extra": {"note": "x", "preset": "s"}}


def test_the_form_lists_the_presets_and_fills_itself_from_one(alice_client, alice):
    harness, dataset, reward = ensure_demo(alice)
    page = alice_client.get("/runs/new/").content.decode()
    assert '<option value="arith-demo">' in page and '<option value="mini-swe-agent-text">' in page
    assert 'id="preset-facts"' not in page
    response = alice_client.get("/runs/new/?preset=arith-demo")
    page = response.content.decode()
    assert response.status_code == 200
    assert '<option value="arith-demo" selected>' in page
    for name, pk in (("harness", harness.pk), ("dataset", dataset.pk), ("reward_script", reward.pk)):
        assert f'<option value="{pk}" selected>' in field_html(page, name)
    assert 'name="steps" value="15"' in page and 'name="name" value="arith-demo"' in page
    assert "{&quot;preset&quot;: &quot;arith-demo&quot;}" in field_html(page, "extra")
    assert '<dd id="preset-group-size">4 (group_size), 8 tasks a step</dd>' in page
    assert '<dd id="preset-temperature">0.7</dd>' in page and '<dd id="preset-dynamic">off</dd>' in page
    assert "no run with this preset yet" in page and 'id="preset-missing"' not in page
    assert alice_client.get("/runs/new/?preset=nope").status_code == 404


def test_a_run_launched_from_a_preset_is_tagged_and_its_signal_shown_next_time(alice_client, alice):
    ensure_demo(alice)
    form = alice_client.get("/runs/new/?preset=arith-demo").context["form"]
    data = {name: form[name].value() for name in ("name", "harness", "dataset", "reward_script")}
    config = {name: form[name].value() for name in CONFIG_FIELDS}  # every field as the page shows it
    response = alice_client.post("/runs/new/?preset=arith-demo", {**data, "model": "tiny", **config_post(config)})
    assert response.status_code == 302, response.context["form"].errors
    run = Run.objects.get()
    assert response.status_code == 302 and run.config["extra"] == {"preset": "arith-demo"}
    # Two steps trained: 3 of 8 then 1 of 8 sampled groups had signal.
    services.record_metrics(run.pk, 1, {"groups/total": 8.0, "groups/with_signal": 3.0})
    services.record_metrics(run.pk, 2, {"groups/total": 8.0, "groups/with_signal": 1.0})
    Run.objects.filter(pk=run.pk).update(step=2)
    page = alice_client.get("/runs/new/?preset=arith-demo").content.decode()
    signal = page.split('<dd id="preset-signal">')[1].split("</dd>")[0]
    assert signal.startswith("0.25 of the groups sampled had attempts that scored differently")
    assert f'<a href="/runs/{run.pk}/">run #{run.pk}</a> (arith-demo, 2 steps)' in signal
    # Another preset's page does not count it, nor does another user's.
    assert "no run with this preset yet" in alice_client.get("/runs/new/?preset=mini-swe-agent-text").content.decode()
    assert presets.last_run_signal(alice, "mini-swe-agent-text") is None


def test_the_last_run_with_dynamic_sampling_shows_both_shares(alice, make_run):
    run = make_run(alice, config={"dynamic_sampling": True, "extra": {"preset": "arith-demo"}})
    services.record_metrics(run.pk, 1, {"groups/sampled": 8.0, "groups/trained": 4.0, "groups/with_signal": 3.0,
                                        "groups/trained_with_signal": 3.0, "groups/sampled_signal_share": 0.375,
                                        "groups/signal_share": 0.75})
    Run.objects.filter(pk=run.pk).update(step=1)
    last = presets.last_run_signal(alice, "arith-demo")
    assert last == {"run": run.pk, "name": "run", "steps": 1, "dynamic_sampling": True,
                    "sampled_signal_share": 0.375, "signal_share": 0.75}


def test_a_preset_says_which_of_its_parts_the_user_lacks(alice_client):
    page = alice_client.get("/runs/new/?preset=mini-swe-agent-text").content.decode()
    missing = page.split('id="preset-missing">')[1].split("</p>")[0]
    assert "harness &#x27;mini-swe-agent-text&#x27;, dataset &#x27;repo-tasks&#x27;, reward script" in missing


def test_the_demo_button_tags_its_run(alice, demo_model):
    run = start_demo_run(alice)
    assert run.model == demo_model
    assert run.config["extra"] == {"preset": "arith-demo"} and run.config["steps"] == 15
