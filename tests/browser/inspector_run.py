"""A real run of the tiny model whose harness calls a tool: the recorded data the inspector's browser test reads.

The harness talks Chat Completions with `tools` through the proxy: a first call on system + user turns, then a
second call carrying the assistant's tool call (the model's own when it wrote a whole one, else one the harness
makes up: the tiny random model hardly ever writes one) and the tool's result. So every rollout records system,
user, assistant and tool turns and a tool definition.
"""
import json

import pytest

from catalog import services as catalog_services
from runs import services
from runs.models import Rollout, Run
from tests.workers import Workers, wait_db

HARNESS = '''
import json, sys, urllib.error, urllib.request
task_file, output_file, base_url, api_key, model = sys.argv[1:6]
task = json.load(open(task_file))
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]

def chat(messages):
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 12}
    request = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + api_key,
                                              "Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]
    except urllib.error.HTTPError as exc:
        sys.exit(f"the proxy answered {exc.code}: {exc.read()[:2000]!r}")

messages = [{"role": "system", "content": "You are a careful calculator user."},
            {"role": "user", "content": "What is " + task["expression"] + "?"}]
first = chat(messages)

def whole(call):
    try:
        return isinstance(json.loads(call["function"]["arguments"]), dict)
    except ValueError:
        return False

calls = [call for call in first.get("tool_calls") or [] if whole(call)] or [{
    "id": "call_0", "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps({"expression": task["expression"]})}}]
messages.append({"role": "assistant", "content": first.get("content") or "", "tool_calls": calls})
for call in calls:
    messages.append({"role": "tool", "tool_call_id": call.get("id") or "call_0", "content": str(task["value"])})
answer = chat(messages).get("content") or ""
print("answer:", ascii(answer))  # the tiny model writes any byte, NUL included
json.dump({"answer": answer, "tool_calls": len(calls)}, open(output_file, "w"))
'''
# Random train rewards give every group a spread, so every step trains; below the pass threshold (1.0), so every
# val attempt fails until the test sets the rewards it wants to see.
REWARD = "import random\n\ndef reward(task, outcome):\n    return {'reward': random.random() * 0.9}\n"
TASKS = [{"id": f"sum-{i}", "expression": f"{i} + {i}", "value": 2 * i, "split": "val" if i < 2 else "train"}
         for i in range(6)]
CONFIG = {"steps": 2, "tasks_per_step": 2, "group_size": 2, "eval_every": 1, "eval_tasks": 2, "eval_samples": 1,
          "eval_greedy": False, "checkpoint_every": 0, "max_model_len": 512, "kv_cache_gb": 0.5,
          "learning_rate": 1e-2}


@pytest.fixture
def models_dir(tmp_path, settings):
    """This test's own registry (the live server, the workers and this process read it), as the new-user test's."""
    settings.LIGHTNING_MODELS_DIR = tmp_path / "registry"
    return settings.LIGHTNING_MODELS_DIR


@pytest.fixture
def tool_run(alice, tmp_path, models_dir, workers: Workers) -> Run:
    """A finished 2-step run of the registered tiny model with evaluations at steps 0, 1 and 2."""
    from trainer.models import build_tiny_model

    build_tiny_model(models_dir / "tiny", seed=0, name="tiny")
    (tmp_path / "harness.py").write_text(HARNESS)
    harness = catalog_services.create_harness(alice, name="calculator-agent", timeout_s=120, command=[
        "python3", str(tmp_path / "harness.py"), "{task_file}", "{output_file}", "{base_url}", "{api_key}",
        "{model}"])
    content = "\n".join(json.dumps(task) for task in TASKS).encode()
    dataset = catalog_services.create_dataset(alice, name="sums", content=content, filename="sums.jsonl")
    reward = catalog_services.create_reward_script(alice, name="random-below-one", source=REWARD)
    run = services.create_run(alice, name="tool run", model="tiny", harness=harness, dataset=dataset,
                              reward_script=reward, config=CONFIG)
    workers.start("runner", "runs")
    wait_db(lambda: Run.objects.get(pk=run.pk).status in ("succeeded", "failed", "cancelled"), "the end of the run",
            workers, timeout=600)
    run.refresh_from_db()
    assert (run.status, run.step, run.error) == ("succeeded", 2, ""), workers.tails()
    unfinished = Rollout.objects.filter(run=run, status__in=("pending", "running"))
    assert not unfinished.exists(), (list(unfinished.values("id", "split", "step", "status")), workers.tails())
    return run
