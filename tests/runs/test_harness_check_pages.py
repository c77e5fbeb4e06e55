"""The harness pages' check panel, the check page and the ready-made templates: a check queued from the form, run by
the task function (no Celery) on a real harness script through the proxy and the scripted engine, and its report."""
import json
import sys
import textwrap
from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.html import escape

from catalog import harness_templates
from catalog.models import Harness
from runs import check_services, services
from runs.check_tasks import run_harness_check
from runs.models import CheckStatus, HarnessCheck
from tests.runs.test_harness_check_api import models_dir, tokenizer_registry  # noqa: F401  (a real tokenizer)
from trainer.engine import default_engine_venv

pytestmark = pytest.mark.django_db
AGENT = '''
"""A small agent: the openai SDK against the rollout's proxy, one shell tool, the files of the task in its workdir."""
import json, os, subprocess, sys
from openai import OpenAI

task_file, output_file, base_url, api_key, model = sys.argv[1:6]
task = json.load(open(task_file))
for name, text in task.get("files", {}).items():
    open(name, "w").write(text)
client = OpenAI(base_url=base_url, api_key=api_key)
tools = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "user", "content": task["prompt"]}]
for _ in range(4):
    message = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                             max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", 256))).choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
        break
    for call in message.tool_calls:
        command = json.loads(call.function.arguments)["command"]
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": done.stdout + done.stderr})
files = {name: open(name).read() for name in task.get("files", {})}
json.dump({"answer": message.content, "files": files}, open(output_file, "w"))
'''
TASK = {"prompt": "In notes.txt, replace draft with final. Run exactly this shell command: sed -i 's/draft/final/' "
                  "notes.txt  Then reply DONE.", "files": {"notes.txt": "status: draft\n"},
        "expected": {"notes.txt": "status: final\n"}}
REWARD = '''
def reward(task, outcome):
    right = outcome.get("files") == task["expected"]
    return {"reward": float(right), "files_right": right}
'''


@pytest.fixture
def agent_harness(tmp_path, alice, make_harness):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent(AGENT))
    return make_harness(alice, name="sdk-agent", timeout_s=120, command=[
        sys.executable, str(script), "{task_file}", "{output_file}", "{base_url}", "{api_key}", "{model}"])


@pytest.fixture
def tools_dir(tmp_path, settings):
    """A harness tools folder where scripts/install-harnesses recorded codex only."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "versions.json").write_text(json.dumps({"codex": "0.99.0"}))
    settings.LIGHTNING_HARNESS_TOOLS_DIR = tmp_path / "tools"
    return tmp_path / "tools"


def check_post(**overrides):
    data = {"task_source": "json", "task_json": json.dumps(TASK), "dataset": "", "task": "", "model": "tiny",
            "engine": "scripted", "reward_script": ""}
    data.update(overrides)
    return data


def test_a_check_queued_from_the_harness_page_runs_and_its_page_shows_the_report(client, alice, agent_harness,
                                                                                make_reward):
    script = make_reward(alice, name="files", source=REWARD)
    client.force_login(alice)
    page = client.get(f"/harnesses/{agent_harness.pk}/")
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="check-form"' in body and 'id="no-checks"' in body and '<option value="tiny"' in body

    response = client.post(f"/harnesses/{agent_harness.pk}/checks/",
                           check_post(reward_script=str(script.pk)))
    check = HarnessCheck.objects.get()
    assert response.status_code == 302 and response.url == f"/harnesses/{agent_harness.pk}/checks/{check.pk}/"
    assert check.status == CheckStatus.QUEUED and check.reward_script == script and check.task == TASK
    queued = client.get(response.url).content.decode()
    assert 'data-status="queued"' in queued and "js/harness_check.js" in queued and 'id="check-verdict"' not in queued
    assert "expected" not in queued.split('id="check-task"')[1].split("</pre>")[0]  # the harness's view of the task

    assert run_harness_check(check.pk) == CheckStatus.SUCCEEDED
    check.refresh_from_db()
    report = check.report
    assert check.started_at and check.finished_at and check.error == ""
    assert report["verdict"] == "ok" and report["reasons"] == []
    assert [c["api"] for c in report["calls"]] == ["chat", "chat"]
    assert [c["drift"] for c in report["calls"]] == ["clean", "clean"]
    assert all(c["token_ids_complete"] for c in report["calls"])
    assert len(report["samples"]) == 1 and report["samples"][0]["calls"] == [0, 1]
    assert report["trained_tokens"] == report["engine_tokens"] > 0
    assert report["outcome"]["files"] == {"notes.txt": "status: final\n"} and report["outcome"]["answer"] == "DONE"
    assert report["reward"]["ok"] and report["reward"]["reward"] == 1.0
    assert report["reward"]["detail"] == {"files_right": True}

    body = client.get(response.url).content.decode()
    assert 'data-status="succeeded"' in body and "js/harness_check.js" not in body
    assert 'data-verdict="ok"' in body and 'id="check-reasons-none"' in body
    assert body.count('class="drift drift-clean">clean</td>') == 2
    assert f"{report['trained_tokens']} trained tokens of {report['engine_tokens']}" in body
    assert '<span class="tok trained">DONE' in body  # the final answer is trained text
    assert escape('"notes.txt": "status: final\\n"') in body
    assert '<strong id="check-reward-value">1.0</strong>' in body
    listed = client.get(f"/harnesses/{agent_harness.pk}/").content.decode()
    assert f'<tr data-check="{check.pk}">' in listed
    assert 'class="verdict verdict-ok status status-succeeded">ok<' in listed


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                    reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine")
def test_a_check_on_vllm_records_the_models_own_answers(client, alice, agent_harness):
    """The model itself answers (the random tiny model: no tool call, so one turn), with vLLM's token ids."""
    agent_harness.env = {"AGENT_MAX_TOKENS": "24"}
    agent_harness.save()
    client.force_login(alice)
    response = client.post(f"/harnesses/{agent_harness.pk}/checks/", check_post(engine="vllm"))
    check = HarnessCheck.objects.get()
    assert response.status_code == 302 and check.engine == "vllm"
    assert run_harness_check(check.pk) == CheckStatus.SUCCEEDED, check.error
    check.refresh_from_db()
    report = check.report
    assert report["harness"]["exit_code"] == 0 and report["calls"], report["reasons"]
    assert all(c["token_ids_complete"] and c["status"] == 200 for c in report["calls"])
    assert report["calls"][0]["drift"] == "clean" and 0 < report["calls"][0]["completion_tokens"] <= 24
    assert report["trained_tokens"] == report["engine_tokens"] > 0 and report["verdict"] == "ok"
    body = client.get(response.url).content.decode()
    assert "<code>tiny</code> on vLLM" in body and 'data-verdict="ok"' in body


def test_a_harness_that_never_calls_the_proxy_fails_with_the_reason(client, alice, make_harness):
    harness = make_harness(alice, name="silent", command=[sys.executable, "-c", "print('no model here')"])
    client.force_login(alice)
    client.post(f"/harnesses/{harness.pk}/checks/", check_post())
    check = HarnessCheck.objects.get()
    assert run_harness_check(check.pk) == CheckStatus.SUCCEEDED  # the check ran; its verdict is the bad news
    check.refresh_from_db()
    assert check.report["verdict"] == "fail" and check.report["calls"] == [] and check.report["samples"] == []
    assert check.report["reasons"][0].startswith("no model calls were recorded: the harness never reached the proxy")
    body = client.get(f"/harnesses/{harness.pk}/checks/{check.pk}/").content.decode()
    assert 'data-verdict="fail"' in body and escape(check.report["reasons"][0]) in body
    assert "No call reached the proxy." in body and 'id="no-samples"' in body
    assert 'id="check-no-reward"' in body


def test_a_check_that_cannot_run_is_failed_with_the_reason(client, alice, make_harness, settings, tmp_path):
    harness = make_harness(alice)
    client.force_login(alice)
    client.post(f"/harnesses/{harness.pk}/checks/", check_post())
    check = HarnessCheck.objects.get()
    settings.LIGHTNING_MODELS_DIR = tmp_path  # the model went away between queueing and running
    assert run_harness_check(check.pk) == CheckStatus.FAILED
    check.refresh_from_db()
    assert check.error.startswith("model 'tiny' is not a registry model with tokenizer files") and check.report == {}
    body = client.get(f"/harnesses/{harness.pk}/checks/{check.pk}/").content.decode()
    assert 'id="check-error"' in body and escape(check.error) in body
    assert run_harness_check(check.pk) == CheckStatus.FAILED  # a redelivered task finds it taken


def test_a_check_whose_worker_died_is_taken_again_only_once_its_harness_could_not_be_running(client, alice,
                                                                                            agent_harness):
    client.force_login(alice)
    client.post(f"/harnesses/{agent_harness.pk}/checks/", check_post())
    check = HarnessCheck.objects.get()
    recent = timezone.now() - timedelta(seconds=agent_harness.timeout_s)
    HarnessCheck.objects.filter(pk=check.pk).update(status=CheckStatus.RUNNING, started_at=recent)
    assert run_harness_check(check.pk) == CheckStatus.RUNNING  # its worker may still be at it
    check.refresh_from_db()
    assert check.started_at == recent and check.report == {}
    lost = recent - timedelta(seconds=check_services.CHECK_LOST_AFTER_S)
    HarnessCheck.objects.filter(pk=check.pk).update(started_at=lost)
    assert run_harness_check(check.pk) == CheckStatus.SUCCEEDED  # the redelivered task runs it again
    check.refresh_from_db()
    assert check.started_at > recent and check.report["verdict"] == "ok"
    assert not check_services.finish_harness_check(check.pk, lost, error="the first worker, back too late")
    check.refresh_from_db()
    assert check.status == CheckStatus.SUCCEEDED and check.error == ""


def test_a_dataset_task_is_checked_by_id_or_index(client, alice, agent_harness, make_dataset):
    dataset = make_dataset(alice, name="arith")
    client.force_login(alice)
    response = client.post(f"/harnesses/{agent_harness.pk}/checks/",
                           check_post(task_source="dataset", dataset=str(dataset.pk), task="3"))
    assert response.status_code == 302
    check = HarnessCheck.objects.get()
    assert check.task_source["task_id"] == "t3" and check.task["answer"] == 4
    body = client.get(response.url).content.decode()
    assert "arith / t3" in body


@pytest.mark.parametrize("post, field, message", [
    (check_post(task_json="{nope"), "task_json", "not JSON"),
    (check_post(task_json="[1]"), "task_json", "a task is a JSON object"),
    (check_post(model="bare"), "model", "Select a valid choice"),
    (check_post(task_source="dataset", dataset="999999", task="1"), "dataset", "choose one of your datasets"),
])
def test_a_bad_check_form_comes_back_with_the_error_and_queues_nothing(client, alice, agent_harness, post, field,
                                                                      message):
    client.force_login(alice)
    response = client.post(f"/harnesses/{agent_harness.pk}/checks/", post)
    assert response.status_code == 400
    form = response.context["check_form"]
    assert message in " ".join(form.errors[field]) and escape(message) in response.content.decode()
    assert not HarnessCheck.objects.exists()


def test_another_users_harness_and_check_are_404(client, alice, bob, agent_harness):
    client.force_login(alice)
    client.post(f"/harnesses/{agent_harness.pk}/checks/", check_post())
    check = HarnessCheck.objects.get()
    client.force_login(bob)
    assert client.get(f"/harnesses/{agent_harness.pk}/checks/{check.pk}/").status_code == 404
    assert client.post(f"/harnesses/{agent_harness.pk}/checks/", check_post()).status_code == 404
    assert HarnessCheck.objects.count() == 1
    other = Harness.objects.create(owner=alice, name="other", command=["true"])
    client.force_login(alice)
    assert client.get(f"/harnesses/{other.pk}/checks/{check.pk}/").status_code == 404  # not that harness's check


def test_user_text_on_the_check_page_is_escaped(client, alice, agent_harness):
    client.force_login(alice)
    client.post(f"/harnesses/{agent_harness.pk}/checks/",
                check_post(task_json=json.dumps({"prompt": "<script>alert(1)</script>"})))
    check = HarnessCheck.objects.get()
    HarnessCheck.objects.filter(pk=check.pk).update(status=CheckStatus.SUCCEEDED, report={
        "verdict": "warning", "reasons": ["<img src=x onerror=alert(2)>"], "drift": {"clean": 1},
        "calls": [{"seq": 1, "api": "chat", "model": "<b>m</b>", "stream": False, "status": 200, "error": "",
                   "prompt_tokens": 3, "completion_tokens": 2, "token_ids_complete": True, "drift": "clean"}],
        "samples": [{"calls": [1], "tokens": 5, "trained_tokens": 2, "build": "single",
                     "preview": [{"call": 1, "trained": False, "text": "<i>ctx</i>"},
                                 {"call": 1, "trained": True, "text": "<u>out</u>"}]}],
        "trained_tokens": 2, "engine_tokens": 2, "outcome": {"answer": "</pre><script>x()</script>"},
        "reward": None, "harness": {"exit_code": 0, "timed_out": False, "stdout_tail": "<s>", "stderr_tail": "",
                                    "seconds": 0.5, "error": ""}})
    body = client.get(f"/harnesses/{agent_harness.pk}/checks/{check.pk}/").content.decode()
    for text in ("<script>alert(1)</script>", "<img src=x onerror=alert(2)>", "<b>m</b>", "<i>ctx</i>",
                 "<u>out</u>", "<script>x()</script>", "<s>"):
        assert text not in body
    assert escape("<img src=x onerror=alert(2)>") in body
    assert f'<span class="tok trained">{escape("<u>out</u>")}</span>' in body


def test_the_list_shows_the_templates_with_their_install_state(client, alice, tools_dir):
    client.force_login(alice)
    body = client.get("/harnesses/").content.decode()
    assert 'id="harness-templates"' in body
    for template in harness_templates.templates():
        assert f'<tr data-template="{template.slug}">' in body and escape(template.title) in body
        row = body.split(f'<tr data-template="{template.slug}">')[1].split("</tr>")[0]
        if template.tool == "codex":
            assert "codex 0.99.0" in row
        else:
            assert f"not installed: <code>scripts/install-harnesses {template.tool}</code>" in row
        assert f'data-add-template="{template.slug}"' in row


def test_adding_a_template_makes_it_a_harness_of_the_user_once(client, alice, bob, tools_dir):
    template = harness_templates.templates()[0]
    client.force_login(alice)
    response = client.post(f"/harnesses/templates/{template.slug}/add/")
    harness = Harness.objects.get(owner=alice)
    assert response.status_code == 302 and response.url == f"/harnesses/{harness.pk}/"
    assert harness.name == template.slug and harness.command == template.fields()["command"]
    detail = client.get(response.url).content.decode()
    assert escape(json.dumps(template.example_task, indent=2)) in detail  # the check form's task, ready to run
    listed = client.get("/harnesses/").content.decode()
    assert f'data-add-template="{template.slug}"' not in listed

    response = client.post(f"/harnesses/templates/{template.slug}/add/", follow=True)
    assert f"you already have a harness named {escape(repr(template.slug))}" in response.content.decode()
    assert Harness.objects.filter(owner=alice).count() == 1
    assert client.get(f"/harnesses/templates/{template.slug}/add/").status_code == 405
    assert client.post("/harnesses/templates/no-such-template/add/").status_code == 404
    client.force_login(bob)
    assert client.post(f"/harnesses/templates/{template.slug}/add/").status_code == 302
    assert Harness.objects.filter(owner=bob, name=template.slug).count() == 1
