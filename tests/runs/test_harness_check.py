"""check_harness: small harness scripts (the official openai SDK) against the scripted engine behind the proxy."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from proxy.scripted_engine import ScriptedEngine, ScriptedServer
from runs.harness_check import FAIL, OK, WARNING, check_harness
from tests.conformance.conftest import CONFORMANCE_TASK, REWARD_SOURCE, tiny_tokenizer_dir  # noqa: F401 (fixture)

AGENT = textwrap.dedent('''
    """A minimal tool-calling agent: MODE good (history kept), stream (the same, streaming), rewrite (a new system
    prompt every call), none (no calls), exit3 (fails after its calls), badcall (one refused call first), sleep
    (past any timeout)."""
    import json, subprocess, sys
    from pathlib import Path
    from openai import OpenAI

    mode, task_file, out_file, base_url, api_key, model = sys.argv[1:7]
    task = json.loads(Path(task_file).read_text())
    for name, text in task["files"].items():
        Path(name).write_text(text)
    tools = [{"type": "function", "function": {"name": "shell", "description": "Run a shell command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    messages = [{"role": "system", "content": "You edit files."}, {"role": "user", "content": task["prompt"]}]
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    if mode == "badcall":
        try:
            client.chat.completions.create(model=model, messages=messages, max_tokens=-1)
        except Exception as exc:
            print("refused:", exc)
    if mode == "sleep":
        import time
        time.sleep(120)
    final = None
    for turn in range(0 if mode == "none" else 4):
        if mode == "rewrite":
            messages[0] = {"role": "system", "content": f"Turn {turn}: a fresh system prompt."}
        if mode == "stream":
            with client.chat.completions.stream(model=model, messages=messages, tools=tools) as events:
                reply = events.get_final_completion().choices[0].message
        else:
            reply = client.chat.completions.create(model=model, messages=messages, tools=tools).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            final = reply.content
            break
        for call in reply.tool_calls:
            done = subprocess.run(json.loads(call.function.arguments)["command"], shell=True, capture_output=True,
                                  text=True)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": done.stdout + done.stderr})
    files = {name: Path(name).read_text() for name in task["files"]}
    Path(out_file).write_text(json.dumps({"final_message": final, "files": files}))
    sys.exit(3 if mode == "exit3" else 0)
''')


@pytest.fixture
def check(tmp_path, tiny_tokenizer_dir):  # noqa: F811 (the imported fixture)
    """check(mode, **kw): the agent above through check_harness on the conformance task."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)

    def run(mode: str, **kw):
        command = [sys.executable, str(script), mode, "{task_file}", "{output_file}", "{base_url}", "{api_key}",
                   "{model}"]
        options = {"tokenizer_dir": tiny_tokenizer_dir, "reward_source": REWARD_SOURCE,
                   "workdir": tmp_path / "work", "timeout_s": 60, **kw}
        return check_harness(command, {}, options.pop("timeout_s"), CONFORMANCE_TASK, **options)

    return run


def test_it_passes_a_harness_that_keeps_its_history(check):
    result = check("good")
    report = result.report()
    assert (report["verdict"], report["reasons"]) == (OK, [])
    assert [(c["seq"], c["drift"], c["finish_reason"]) for c in report["calls"]] == [
        (0, "clean", "tool_calls"), (1, "clean", "stop")]
    [sample] = report["samples"]
    assert sample["calls"] == [0, 1] and sample["build"] == "merged"
    assert [s["text"] for s in sample["preview"] if s["trained"]][-1] == "DONE<|im_end|>"
    assert report["trained_tokens"] == report["engine_tokens"] == sum(len(ids) for ids in result.produced)
    assert report["foreign_spans"] == []
    assert report["outcome"]["files"] == {"notes.txt": "status: final\n"}
    assert report["reward"]["reward"] == 1.0
    assert json.loads(json.dumps(report)) == report


def test_it_hides_reward_only_fields_from_the_harness(check, tmp_path):
    check("good")
    assert "expected" not in json.loads((tmp_path / "work" / "rollout" / "task.json").read_text())


def test_it_records_streamed_calls_with_their_ids(check):
    report = check("stream").report()
    assert (report["verdict"], report["reasons"]) == (OK, [])
    assert [(c["stream"], c["drift"], c["token_ids_complete"]) for c in report["calls"]] == [
        (True, "clean", True), (True, "clean", True)]


def test_it_fails_a_harness_that_makes_no_calls(check):
    result = check("none")
    assert result.verdict == FAIL
    assert any(reason.startswith("no model calls were recorded") for reason in result.reasons), result.reasons
    assert result.build.samples == () and result.reward["reward"] == 0.0


def test_it_fails_a_harness_whose_calls_only_fork(check):
    result = check("rewrite")
    assert result.verdict == FAIL
    assert [r for r in result.reasons if r.startswith("only forks")], result.reasons
    assert result.build.drift == {0: "clean", 1: "fork"}
    assert len(result.build.samples) == 2


def test_it_fails_a_harness_that_exits_non_zero(check):
    result = check("exit3")
    assert result.verdict == FAIL
    assert result.reasons == ["the harness failed: harness exited with code 3"]
    assert result.harness.exit_code == 3 and result.build.drift == {0: "clean", 1: "clean"}


def test_it_fails_when_the_reward_script_fails(check):
    result = check("good", reward_source="def reward(task, outcome):\n    return 1 / 0\n")
    assert result.verdict == FAIL
    [reason] = result.reasons
    assert reason.startswith("the reward script failed: ZeroDivisionError: division by zero")
    assert result.report()["reward"]["ok"] is False


def test_it_warns_about_calls_the_proxy_could_not_serve(check):
    result = check("badcall")
    report = result.report()
    assert report["verdict"] == WARNING
    assert [c["status"] for c in report["calls"]] == [400, 200, 200]
    assert report["reasons"][0].startswith("1 of 3 calls failed: call 0: ")
    assert result.build.drift == {1: "clean", 2: "clean"} and report["reward"]["reward"] == 1.0


def test_it_fails_a_harness_that_times_out(check):
    result = check("sleep", timeout_s=1)
    assert result.verdict == FAIL
    assert result.harness.timed_out
    assert result.reasons[0] == "the harness failed: harness timed out after 1 s"
    assert "no model calls were recorded" in result.reasons[1]


def test_it_checks_against_a_given_engine(check, tiny_tokenizer_dir):  # noqa: F811
    with ScriptedServer(ScriptedEngine(tiny_tokenizer_dir, model_name="served")) as engine:
        result = check("good", engine_base_url=engine.base_url, model="served", tokenizer_dir=None)
        produced = engine.engine.produced
    report = result.report()
    assert (report["verdict"], result.produced, report["foreign_spans"]) == (OK, None, [])
    assert report["engine_tokens"] == report["trained_tokens"] == sum(len(ids) for ids in produced)
    assert [c["model"] for c in report["calls"]] == ["served", "served"]
    assert all(s["preview"] == [] for s in report["samples"])  # no tokenizer: nothing to decode with


def test_the_harness_sees_the_task_without_its_reward_only_fields_and_the_reward_sees_all(tmp_path,
                                                                                       tiny_tokenizer_dir):  # noqa: F811
    """The defaults (`expected` here) and the dataset's own (`secret`) stay out of the task file; the reward gets
    the whole task."""
    peek = tmp_path / "peek.py"  # a file: braces in an argv are the executor's placeholders
    peek.write_text("import json, sys\njson.dump({'seen': sorted(json.load(open(sys.argv[1])))}, open(sys.argv[2], 'w'))")
    reward = "def reward(task, outcome):\n    return float(sorted(task) == ['expected', 'files', 'prompt', 'secret'])"
    result = check_harness([sys.executable, str(peek), "{task_file}", "{output_file}"], {}, 30,
                           {**CONFORMANCE_TASK, "secret": "only the reward knows"}, hidden=["secret"],
                           workdir=tmp_path, tokenizer_dir=tiny_tokenizer_dir, reward_source=reward)
    assert result.harness.exit_code == 0 and result.outcome["seen"] == ["files", "prompt"]
    assert result.reward["ok"] and result.reward["reward"] == 1.0
    assert result.verdict == FAIL and result.calls == []  # it never called the model: judged so
