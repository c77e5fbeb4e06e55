"""A rollout's page (/rollouts/<id>/): facts, output, every call as a conversation, tools, samples, group
neighbours; a call's raw JSON (/rollouts/<id>/calls/<seq>.json); escaped; owner only; constant queries."""
import html as html_lib
import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog.models import Task
from proxy.types import RecordedCall
from runs import rollout_services
from tests.dashboard.test_rollouts_table import call

pytestmark = pytest.mark.django_db

XSS = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
BASH = {"type": "function", "function": {"name": "bash", "description": "run a command",
                                         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}
SUBMIT = {"type": "function", "function": {"name": "submit", "parameters": {"type": "object"}}}


@pytest.fixture
def rollout(alice, make_run, make_dataset, make_harness, make_reward):
    from runs import services

    dataset = make_dataset(alice, name="xss", tasks=[
        {"id": "t-xss", "question": XSS, "answer": "secret-gold-answer", "split": "train"}])
    run = services.create_run(alice, name=f"run {XSS}", model="tiny", config={}, harness=make_harness(alice),
                              dataset=dataset, reward_script=make_reward(alice))
    task = Task.objects.get(dataset=dataset)
    rollout, _ = rollout_services.create_rollout(run, task=task, split="train", step=3, group=2, attempt=1)
    rollout_services.record_calls([call(rollout.pk, 0, prompt=120, completion=7),
                                   call(rollout.pk, 1, prompt=140, completion=9)])
    rollout_services.start_rollout(rollout.pk)
    return rollout_services.finish_rollout(
        rollout.pk, status="failed", reward=0.0, reward_detail={"note": XSS, "checked": True}, exit_code=3,
        stdout_tail=f"out {XSS}", stderr_tail=f"err {XSS}", error=f"harness exited {XSS}", failure_kind="policy")


def agent_calls(rollout_id: int, count: int, argument: str = "ls") -> list[RecordedCall]:
    """An agent's `count` chat calls: each resends the whole history, calls bash, and reads its output back."""
    history = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find the file."}]
    calls = []
    for seq in range(count):
        last = seq == count - 1
        tool = "submit" if last else "bash"
        message = {"role": "assistant", "content": f"step {seq}", "tool_calls": [
            {"id": f"call_{seq}", "type": "function",
             "function": {"name": tool, "arguments": json.dumps({"cmd": f"{argument} {seq}"})}}]}
        response = {"id": f"c{seq}", "object": "chat.completion", "model": "policy",
                    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}
        calls.append(RecordedCall(
            rollout_id=str(rollout_id), seq=seq, api="chat", request={"model": "policy", "messages": list(history),
                                                                      "tools": [BASH, SUBMIT], "stream": True},
            response=response, upstream_request={}, prompt_ids=list(range(100 + 10 * seq)),
            completion_ids=list(range(5 + seq)), logprobs=[0.0] * (5 + seq), finish_reason="tool_calls",
            status_code=200, latency_ms=250.0 + seq, policy_version=seq // 10, error=None, stream=True, started_at=0.0))
        history += [message, {"role": "tool", "tool_call_id": f"call_{seq}", "content": f"output {seq}"}]
    return calls


def agent_rollout(run, calls: int, attempt: int = 0, argument: str = "ls", group: int = 0):
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=1,
                                                 group=group, attempt=attempt)
    rollout_services.record_calls(agent_calls(rollout.pk, calls, argument))
    rollout_services.start_rollout(rollout.pk)
    return rollout_services.finish_rollout(rollout.pk, status="succeeded", reward=1.0, reward_detail={}, exit_code=0)


def section(html: str, seq: int) -> str:
    start = html.index(f'<section class="call" id="call-{seq}"')
    return html[start:html.index("</section>", start)]


def test_it_shows_the_rollout(client, alice, rollout):
    client.force_login(alice)
    response = client.get(f"/rollouts/{rollout.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert f'href="/runs/{rollout.run_id}/"' in html
    for fact in ("<dt>Step</dt><dd>3</dd>", "<dt>Group · attempt</dt><dd>2 · 1</dd>",
                 "<dt>Failure kind</dt><dd>policy</dd>", "<dt>Exit code</dt><dd>3</dd>", "<dt>Task</dt><dd>t-xss</dd>",
                 '<dd id="rollout-reward">0.0</dd>', "<dt>Calls</dt><dd>2</dd>"):
        assert fact in html
    assert 'class="status status-failed">failed</span>' in html
    assert "&quot;checked&quot;: true" in html  # the reward detail as pretty JSON
    assert 'id="rollout-stdout"' in html and 'id="rollout-stderr"' in html


def test_it_lists_the_calls_with_token_counts_counted_in_sql(client, alice, rollout):
    client.force_login(alice)
    with CaptureQueriesContext(connection) as queries:
        html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    table = html[html.index('id="rollout-calls"'):html.index('id="conversation"')]
    rows = table.split('<tr data-seq="')[1:]
    assert len(rows) == 2
    assert '<a href="#call-0">0</a></td><td>chat</td><td>200</td>' in rows[0]
    assert "<td>120</td>" in rows[0] and "<td>7</td>" in rows[0]
    assert "<td>140</td>" in rows[1] and "<td>9</td>" in rows[1] and "<td>stop</td>" in rows[1]
    call_queries = [q["sql"] for q in queries.captured_queries if "modelcall" in q["sql"].lower()]
    assert len(call_queries) == 1
    columns = call_queries[0].split(" FROM ")[0].lower()
    assert 'array_length("runs_modelcall"."prompt_ids")' in columns  # counted by the database
    assert 'array_length("runs_modelcall"."completion_ids")' in columns
    read = re.sub(r'array_length\("runs_modelcall"\."\w+"\)', "", columns)
    for blob in ("logprobs", "prompt_ids", "completion_ids"):
        assert f'"runs_modelcall"."{blob}"' not in read  # the token arrays themselves are never read
    assert '"runs_modelcall"."request"' in read  # the bodies are: they are the conversation


def test_it_escapes_everything_and_hides_reward_only_fields(client, alice, rollout):
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "<script>alert(1)" not in html and "<img src=x" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 6  # task, reward detail, out, err, error, name
    assert "secret-gold-answer" not in html  # the task as the harness saw it


def test_it_renders_each_call_as_a_conversation_with_tool_calls_and_results(client, alice, make_run):
    rollout = agent_rollout(make_run(alice), calls=3)
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()

    assert html.count('<section class="call"') == 3
    first, second = section(html, 0), section(html, 1)
    assert 'data-seq="0" data-api="chat"' in first
    assert 'class="turn turn-system"' in first and "You are an agent." in first and "Find the file." in first
    assert 'class="turn turn-assistant turn-completion"' in first and "step 0" in first
    assert '<div class="tool-call" data-name="bash" data-call-id="call_0">' in first
    assert '<pre class="tool-args">{\n  &quot;cmd&quot;: &quot;ls 0&quot;\n}</pre>' in first
    # the next call resends the history: its 3 repeated turns are named, its new tool result shown
    assert '3 earlier turns as in <a href="#call-0">call 0</a>' in second
    assert "You are an agent." not in second
    assert '<div class="turn turn-tool" data-tool-call-id="call_0">' in second and "output 0" in second
    facts = second[second.index('class="call-facts"'):]
    for fact in ('class="call-latency">251 ms', 'class="call-prompt-tokens">110', 'class="call-completion-tokens">6',
                 'class="call-finish">tool_calls', 'class="call-drift">–', 'class="call-policy">0'):
        assert fact in facts
    assert f'data-url="/rollouts/{rollout.pk}/calls/1.json"' in second
    assert '<pre class="raw-request" hidden></pre>' in second and '<pre class="raw-response" hidden></pre>' in second


def test_tool_definitions_carry_how_often_the_model_called_them(client, alice, make_run):
    rollout = agent_rollout(make_run(alice), calls=4)
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()

    tools = html[html.index('id="tool-defs"'):]
    assert re.search(r'<li class="tool-def" data-name="bash" data-called="3">.*?'
                     r'<span class="called-badge">called 3 times</span>', tools, re.S)
    assert re.search(r'data-name="submit" data-called="1">.*?<span class="called-badge">called 1 time</span>',
                     tools, re.S)
    assert "run a command" in tools


def test_a_tool_argument_with_markup_is_escaped(client, alice, make_run):
    rollout = agent_rollout(make_run(alice), calls=2, argument=XSS)
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()

    assert "<script>alert(1)" not in html and "<img src=x" not in html
    args = re.findall(r'<pre class="tool-args">(.*?)</pre>', html, re.S)
    assert len(args) == 2 and all("&lt;script&gt;alert(1)&lt;/script&gt;" in a for a in args)
    assert json.loads(html_lib.unescape(args[0]))["cmd"] == f"{XSS} 0"


def test_a_50_call_rollout_costs_the_same_queries_as_a_2_call_one(client, alice, make_run,
                                                                  django_assert_max_num_queries):
    run = make_run(alice)
    small, big = agent_rollout(run, calls=2, group=0), agent_rollout(run, calls=50, group=1)
    client.force_login(alice)
    with CaptureQueriesContext(connection) as small_queries:
        assert client.get(f"/rollouts/{small.pk}/").status_code == 200
    with django_assert_max_num_queries(len(small_queries)):
        response = client.get(f"/rollouts/{big.pk}/")
    html = response.content.decode()
    assert response.status_code == 200 and html.count('<section class="call"') == 50
    assert len(small_queries) <= 8  # session, user, rollout, calls, samples, group
    assert "called 49 times" in html  # bash, once a call but the last
    assert html.count("You are an agent.") == 1  # each call shows only what is new


def test_the_raw_json_of_a_call_is_served_to_its_owner_only(client, alice, bob, make_run):
    rollout = agent_rollout(make_run(alice), calls=2)
    client.force_login(alice)
    response = client.get(f"/rollouts/{rollout.pk}/calls/1.json")
    body = response.json()
    assert response.status_code == 200 and (body["rollout"], body["seq"]) == (rollout.pk, 1)
    assert [m["role"] for m in body["request"]["messages"]] == ["system", "user", "assistant", "tool"]
    assert body["response"]["choices"][0]["message"]["content"] == "step 1"
    assert client.get(f"/rollouts/{rollout.pk}/calls/7.json").status_code == 404
    client.force_login(bob)
    assert client.get(f"/rollouts/{rollout.pk}/calls/1.json").status_code == 404


def test_it_links_the_samples_to_their_token_view(client, alice, make_run):
    run = make_run(alice)
    rollout = agent_rollout(run, calls=2)
    rollout_services.record_step(run.pk, 1, 1, [
        {"rollout_id": rollout.pk, "token_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "logprobs": [0.0] * 4,
         "advantage": 0.25, "call_seqs": [0, 1], "build": "merged", "policy_version": 1}], {}, {},
        {rollout.pk: ""})
    sample = rollout.samples.get()
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()

    samples = html[html.index('id="samples"'):]
    assert f'<a class="token-view-link" href="/samples/{sample.pk}/tokens/">sample 0</a>' in samples
    assert "4 tokens · merged · advantage 0.250 · calls 0, 1" in samples
    assert '<dd id="rollout-fate">sampled for step 1: trained</dd>' in html


def test_it_says_a_rollout_its_step_dropped_was_sampled_for_that_step_and_not_trained(client, alice, make_run):
    run = make_run(alice)
    dropped, waiting = agent_rollout(run, calls=1), agent_rollout(run, calls=1, attempt=1)
    rollout_services.record_step(run.pk, 2, 2, [], {}, {}, {dropped.pk: "no_signal: every attempt scored 1"})
    client.force_login(alice)
    html = client.get(f"/rollouts/{dropped.pk}/").content.decode()
    assert '<dd id="rollout-fate">sampled for step 2: dropped (no_signal: every attempt scored 1)</dd>' in html
    assert 'id="samples">No training samples: no_signal: every attempt scored 1.' in html
    assert '<dd id="rollout-fate">–</dd>' in client.get(f"/rollouts/{waiting.pk}/").content.decode()
    dropped.refresh_from_db()
    assert (dropped.batch_step, dropped.trained_step) == (2, None)


def test_it_links_the_previous_and_next_attempts_of_the_group(client, alice, make_run):
    run = make_run(alice)
    first, middle, last = (agent_rollout(run, calls=1, attempt=n) for n in range(3))
    agent_rollout(run, calls=1, attempt=3, group=1)  # another group: not a neighbour
    client.force_login(alice)

    html = client.get(f"/rollouts/{middle.pk}/").content.decode()
    assert f'id="prev-in-group" href="/rollouts/{first.pk}/"' in html
    assert f'id="next-in-group" href="/rollouts/{last.pk}/"' in html
    assert html.count('<a class="group-attempt') == 3
    edge = client.get(f"/rollouts/{first.pk}/").content.decode()
    assert 'id="prev-in-group"' not in edge and f'id="next-in-group" href="/rollouts/{middle.pk}/"' in edge
    assert 'id="next-in-group"' not in client.get(f"/rollouts/{last.pk}/").content.decode()
    assert "rollout_page.js" in html


def test_another_users_rollout_is_not_found(client, bob, rollout):
    client.force_login(bob)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 404


def test_staff_see_any_rollout(client, staff, rollout):
    client.force_login(staff)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 200


def test_login_is_required(client, rollout):
    response = client.get(f"/rollouts/{rollout.pk}/")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_a_rollout_without_calls_or_task(client, alice, make_run):
    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=None, split="val", step=0, group=0, attempt=0)
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert 'id="rollout-no-calls"' in html and "The task was deleted." in html
    assert 'class="status status-pending">pending</span>' in html
    assert 'id="no-tools"' in html and 'id="prev-in-group"' not in html


def text_agent_calls(rollout_id: int) -> list[RecordedCall]:
    """A text-based agent (mini-SWE-agent's protocol): call 0 writes a fenced command, call 1 reads its output back
    and submits, call 2 is a side request with a context of its own (a fork)."""
    def chat(seq, messages, reply):
        return RecordedCall(
            rollout_id=str(rollout_id), seq=seq, api="chat", request={"model": "policy", "messages": messages},
            response={"id": f"c{seq}", "object": "chat.completion", "model": "policy", "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}]},
            upstream_request={}, prompt_ids=list(range(50 + 20 * seq)), completion_ids=[1, 2, 3], logprobs=[0.0] * 3,
            finish_reason="stop", status_code=200, latency_ms=100.0, policy_version=0, error=None, stream=False,
            started_at=0.0)

    first = "THOUGHT: I look.\n```mswea_bash_command\ncat calc.py <x>\n```"
    history = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "Fix calc.py."}]
    result = "<returncode>1</returncode>\n<output>\ndef add(a, b):\n    return a - b\n</output>"
    return [chat(0, history, first),
            chat(1, history + [{"role": "assistant", "content": first}, {"role": "user", "content": result}],
                 "THOUGHT: Done.\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"),
            chat(2, [{"role": "user", "content": "Name this session."}], "Fixing calc")]


def test_a_text_agents_commands_outputs_and_fork_are_marked(client, alice, make_run):
    from runs.models import ModelCall

    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=1, group=0,
                                                 attempt=0)
    rollout_services.record_calls(text_agent_calls(rollout.pk))
    ModelCall.objects.filter(rollout=rollout, seq=1).update(drift="clean")
    ModelCall.objects.filter(rollout=rollout, seq=2).update(drift="fork")
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()

    first, second, side = section(html, 0), section(html, 1), section(html, 2)
    # Each fenced command is shown as a command (escaped), each output turn as the output of one, with its status.
    assert '<pre class="command">$ cat calc.py &lt;x&gt;</pre>' in first
    assert '<pre class="command">$ echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT</pre>' in second
    assert '<span class="turn-badge command-result">command output · exit 1</span>' in second
    assert "command-result" not in first and 'class="command"' not in side
    # The side request is marked a fork in its header and in the call index; the clean call is not.
    assert "fork: its own sample" in side and "fork: its own sample" not in second
    index = html[html.index('id="rollout-calls"'):html.index('id="conversation"')]
    assert index.count('<span class="badge fork"') == 1 and re.search(r'data-seq="1">.*?clean', index, re.S)


def test_turn_command_parsing():
    from dashboard.conversations import Turn

    turn = Turn("assistant", "T\n```bash\nls -la\n```\nthen\n```mswea_bash_command\nsed -i 's/a/b/' f\n```")
    assert turn.commands == ("ls -la", "sed -i 's/a/b/' f")
    assert Turn("user", "```bash\nls\n```").commands == () and Turn("assistant", "no block").commands == ()
    assert Turn("user", "<returncode>0</returncode>\n<output>\nx\n</output>").command_output == ("0", "x")
    assert Turn("tool", "<exception>boom</exception>\n<returncode>-9</returncode>\n<output>\n</output>"
                ).command_output == ("-9", "")
    assert Turn("user", "Fix it").command_output is None
