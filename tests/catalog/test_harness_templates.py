"""Harness templates (catalog/harness_templates.py): read from examples/harnesses/, filled per machine, given to users."""
from __future__ import annotations

import json
import sys
from io import StringIO

import pytest
from django.core.management import call_command

from catalog import harness_templates
from catalog.models import Harness
from common.errors import ServiceError
from sandbox.executors.base import PLACEHOLDERS

pytestmark = pytest.mark.django_db

TEMPLATE = {
    "slug": "toy", "title": "Toy agent", "description": "echoes", "tool": "toy", "api": "chat", "streaming": False,
    "command": ["${python}", "${here}/run.py", "--task", "{task_file}", "--tools", "${tools}"],
    "env": {"TOOLS": "${tools}", "URL": "{base_url}"}, "timeout_s": 120,
    "example_task": {"prompt": "hi", "files": {"a.txt": "a\n"}},
}


@pytest.fixture
def templates_dir(tmp_path, monkeypatch, settings):
    """A templates folder of its own (one `toy` template) and a tools folder with a versions.json."""
    root = tmp_path / "templates"
    (root / "toy").mkdir(parents=True)
    (root / "toy" / "toy.harness.json").write_text(json.dumps(TEMPLATE))
    settings.LIGHTNING_HARNESS_TOOLS_DIR = tmp_path / "tools"
    (tmp_path / "tools").mkdir()
    monkeypatch.setattr(harness_templates, "TEMPLATES_DIR", root)
    harness_templates.templates.cache_clear()
    yield root
    harness_templates.templates.cache_clear()


def test_a_template_fills_python_folder_and_tools_and_keeps_the_rollout_placeholders(templates_dir, settings):
    template = harness_templates.load("toy")
    fields = template.fields()
    here = str((templates_dir / "toy").resolve())
    assert fields["command"] == [sys.executable, f"{here}/run.py", "--task", "{task_file}", "--tools",
                                 str(settings.LIGHTNING_HARNESS_TOOLS_DIR)]
    assert fields["env"] == {"TOOLS": str(settings.LIGHTNING_HARNESS_TOOLS_DIR), "URL": "{base_url}"}
    assert (fields["name"], fields["timeout_s"], fields["executor"]) == ("toy", 120, "local")
    assert fields["description"] == "Toy agent: echoes"
    assert template.example_task == {"prompt": "hi", "files": {"a.txt": "a\n"}}


def test_installed_version_comes_from_the_tools_folder(templates_dir, settings):
    assert harness_templates.load("toy").installed_version() is None
    (settings.LIGHTNING_HARNESS_TOOLS_DIR / "versions.json").write_text(json.dumps({"toy": "1.2.3"}))
    assert harness_templates.load("toy").installed_version() == "1.2.3"
    (settings.LIGHTNING_HARNESS_TOOLS_DIR / "versions.json").write_text("not json")
    assert harness_templates.installed_versions() == {}


@pytest.mark.parametrize("change, message", [
    ({"command": "python run.py"}, "command must be a non-empty list of strings"),
    ({"command": []}, "command must be a non-empty list of strings"),
    ({"env": {"A": 1}}, "env must map names to strings"),
    ({"slug": None, "title": None}, "missing slug, title"),
    ({"preset": {"model": "m", "dataset": "d", "config": {}}}, "preset needs reward_script"),
    ({"preset": {"model": "m", "dataset": "d", "reward_script": "r", "config": {"steps": 0}}}, "preset config: "),
    ({"preset": {"model": "m", "dataset": "d", "reward_script": "r", "config": {"temprature": 1}}}, "temprature"),
])
def test_a_broken_template_is_refused_naming_its_file(templates_dir, change, message):
    broken = {k: v for k, v in {**TEMPLATE, **change}.items() if v is not None}
    (templates_dir / "toy" / "toy.harness.json").write_text(json.dumps(broken))
    with pytest.raises(harness_templates.TemplateError) as caught:
        harness_templates.templates()
    assert "toy.harness.json" in str(caught.value) and message in str(caught.value)


def test_two_templates_with_one_slug_are_refused(templates_dir):
    (templates_dir / "toy" / "again.harness.json").write_text(json.dumps(TEMPLATE))
    with pytest.raises(harness_templates.TemplateError, match="duplicate template slugs"):
        harness_templates.templates()


def test_an_unknown_slug_names_the_ones_there_are(templates_dir):
    with pytest.raises(KeyError, match="no harness template 'nope' \\(have: toy\\)"):
        harness_templates.load("nope")


def test_add_for_makes_the_users_own_harness_once(templates_dir, alice, bob):
    harness = harness_templates.add_for(alice, "toy")
    assert (harness.owner, harness.name, harness.version) == (alice, "toy", 1)
    assert harness.command[0] == sys.executable and harness.command[3] == "{task_file}"
    with pytest.raises(ServiceError, match="already have a harness named 'toy'"):
        harness_templates.add_for(alice, "toy")
    assert Harness.objects.filter(owner=alice).count() == 1
    assert harness_templates.add_for(bob, "toy").owner == bob


def test_ensure_for_adds_what_is_missing_and_keeps_an_edited_one(templates_dir, alice):
    from catalog import services

    made = harness_templates.ensure_for(alice)
    assert [h.name for h in made] == ["toy"]
    services.update_harness(made[0], timeout_s=30)
    assert harness_templates.ensure_for(alice) == []
    kept = Harness.objects.get(owner=alice, name="toy")
    assert (kept.timeout_s, kept.version) == (30, 2)


def test_the_command_gives_templates_to_a_user_or_everyone(templates_dir, alice, bob):
    out = StringIO()
    call_command("load_harness_templates", username="alice", stdout=out)
    assert "alice: 1 harness templates added (toy)" in out.getvalue()
    assert "Agents not installed yet: toy" in out.getvalue()
    assert list(Harness.objects.values_list("owner__username", flat=True)) == ["alice"]
    out = StringIO()
    call_command("load_harness_templates", all_users=True, stdout=out)
    assert "alice: 0 harness templates added (all present)" in out.getvalue()
    assert "bob: 1 harness templates added (toy)" in out.getvalue()
    assert Harness.objects.filter(name="toy").count() == 2


def test_every_shipped_template_is_valid_and_runs_a_runner_that_exists():
    harness_templates.templates.cache_clear()
    shipped = harness_templates.templates()
    assert {t.tool for t in shipped} >= {"codex", "claude-code", "opencode", "mini-swe-agent", "openhands"}
    for template in shipped:
        fields = template.fields()
        runner = next(arg for arg in fields["command"] if arg.endswith(".py"))
        assert (template.path.parent / runner.rsplit("/", 1)[-1]).exists(), template.slug
        used = {name for arg in fields["command"] + list(fields["env"].values())
                for name in PLACEHOLDERS if "{" + name + "}" in arg}
        assert {"task_file", "output_file", "base_url", "api_key", "model"} <= used, template.slug
        # a rollout key may begin with "-": as an argument of its own, argparse would take it for an option
        assert "{api_key}" not in fields["command"], template.slug
        assert template.api in {"chat", "completions", "responses", "messages"}, template.slug
        assert template.example_task and template.example_task.get("prompt"), template.slug


def test_a_templates_preset_names_what_it_trains_on_and_a_valid_config(templates_dir):
    preset = {"model": "m", "dataset": "d", "reward_script": "r", "notes": "n", "config": {"steps": 3}}
    (templates_dir / "toy" / "toy.harness.json").write_text(json.dumps({**TEMPLATE, "preset": preset}))
    assert harness_templates.load("toy").preset == preset


def test_the_real_agent_presets_train_on_the_repository_suite():
    """mini-SWE-agent's and OpenCode's chat templates carry the run they were measured with; the names are the ones
    `up` loads (runs.management.commands.load_demo.ensure_repo_suite)."""
    from runs.management.commands.load_demo import REPO_DATASET, REPO_REWARD
    from trainer.config import TrainerConfig

    harness_templates.templates.cache_clear()
    for slug in ("mini-swe-agent-text", "opencode-chat"):
        preset = harness_templates.load(slug).preset
        assert (preset["dataset"], preset["reward_script"]) == (REPO_DATASET, REPO_REWARD), slug
        config = TrainerConfig.from_dict(preset["config"])
        assert config.eval_tasks > 0 and config.max_model_len <= 8192, slug
    mini = harness_templates.load("mini-swe-agent-text").fields()["command"]
    assert mini[mini.index("--prompts") + 1].endswith("mini_swe_agent/small_model.yaml")
    assert int(mini[mini.index("--timeout") + 1]) < harness_templates.load("mini-swe-agent-text").fields()["timeout_s"]
