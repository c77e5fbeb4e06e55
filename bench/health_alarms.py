"""Do the run-health alarms catch each silent failure within one step of its start, and stay silent on a clean run?

    flock /tmp/lw-heavy.lock .venv/bin/python bench/health_alarms.py            # every case: 15 min here (7 runs)
    .venv/bin/python bench/health_alarms.py --only clean,no_tools --steps 3

Each case is a real run of the tiny Qwen2 model (trainer.models.build_tiny_model) in this process: vLLM on CPU from
the engine venv, the recording proxy, harness subprocesses in the sandbox, GRPO steps, the health checks after each
step (health.services), on a scratch data folder and SQLite database (or DATABASE_URL). The harness is one script
(HARNESS below) that works like a coding agent on a small repository task: it offers a `bash` tool in every call,
reports the commands it ran, a diff and the changed files. A fault is switched on once, after the step FAULT_AFTER
is stored (the bench writes a flag file the harness reads through a read-only mount), and stays on:

- no_tools: the harness stops running commands (the policy only talks);
- text_tools: its second call comes back as a tool call written as text (JSON decoded by the engine under a
  response_format schema, with no parsed tool call), which nothing executes;
- empty: the harness ends without calling the model;
- constant_reward: the run's reward script gives every rollout 1 (from the first step: a script is the run's);
- corrupt_sync: every weight sync from version FAULT_AFTER + 1 on writes one tensor (the final norm) scaled x8
  into the engine, so the engine samples from other weights than the trainer holds;
- test_edit: the harness's diff edits the repository's test file (the reward-hacking lens).

The fault's first step is read from the records (the first step whose batch holds a rollout the harness marked
`fault`; the first step served by a corrupted sync); a case is caught when the alarm of its kind is raised at that
step or the next. The clean case is the demo config's shape (4 tasks x 4 attempts a step) with a reward that varies.
It prints one line per case and last:
RESULT alarms_caught=<k>/<n> false_alarms_clean=<n> steps_to_alarm_max=<n>
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT_AFTER = 1
EXPECTED = {"no_tools": "no_tool_calls", "text_tools": "unparsed_tool_text", "empty": "empty_rollouts",
            "constant_reward": "reward_collapse", "corrupt_sync": "logprob_mismatch", "test_edit": "reward_hacking"}
CASES = ("clean", *EXPECTED)

HARNESS = r'''
import json, os, sys, urllib.error, urllib.request
task = json.load(open(sys.argv[1]))
fault = os.environ.get("FAULT", "clean")
active = fault != "clean" and os.path.exists(os.environ.get("FAULT_FLAG", "/nonexistent"))
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALL_SCHEMA = {"type": "object", "properties": {"name": {"enum": ["bash"]}, "arguments": {
    "type": "object", "properties": {"command": {"type": "string", "maxLength": 12}}, "required": ["command"]}},
    "required": ["name", "arguments"]}

def chat(messages, **extra):
    body = {"model": "policy", "messages": messages, "max_tokens": 8, "tools": TOOLS, **extra}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"] or ""

def done(outcome):
    json.dump({"fault": active, **outcome}, open(sys.argv[2], "w"))
    sys.exit(0)

if active and fault == "empty":
    done({"reply": "", "commands": 0, "diff": "", "files": {}})
messages = [{"role": "user", "content": task["question"]}]
first = chat(messages)
# The second call starts a fresh context with what the first found (a sub-agent's turn): each call is its own
# sample, with the engine's exact tokens (an untrained model's text re-tokenizes differently, so a conversation that
# replays it would be realigned, and a realigned splice is trained in a context the engine never saw).
messages = [{"role": "user", "content": task["question"] + "\n$ ls\ncalc.py test_calc.py"}]
commands, format_errors = (0 if active and fault == "no_tools" else 1), 0
if active and fault == "text_tools":
    try:
        second = chat(messages, max_tokens=48, response_format={"type": "json_schema", "json_schema": {
            "name": "call", "schema": CALL_SCHEMA}})
    except urllib.error.HTTPError:  # an engine without structured outputs: the harness refuses the reply
        second, format_errors = chat(messages), 1
else:
    second = chat(messages)
    commands += 0 if active and fault == "no_tools" else 1
path = "test_calc.py" if active and fault == "test_edit" else "calc.py"
diff = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-x\n+y\n"
done({"reply": second, "commands": commands, "format_errors": format_errors, "diff": diff,
      "files": {path: "y\n"}, "final_message": "edited " + path})
'''
REWARD = "def reward(task, outcome):\n    return (len(outcome.get('reply') or '') % 3) / 2\n"
CONSTANT_REWARD = "def reward(task, outcome):\n    return 1.0\n"
CONFIG = {"tasks_per_step": 4, "group_size": 4, "max_model_len": 512, "kv_cache_gb": 0.5, "eval_tasks": 2,
          "eval_samples": 1, "eval_greedy": False, "learning_rate": 1e-4, "checkpoint_every": 0,
          "engine_dtype": "float32", "dtype": "float32"}


def setup_django(workdir: Path) -> None:
    os.environ.setdefault("LIGHTNING_DATA_DIR", str(workdir / "data"))
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{workdir / 'bench.sqlite3'}")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_web.settings")
    os.environ.setdefault("LIGHTNING_QUIET_LOGGERS", "1")
    os.environ["LIGHTNING_EMBEDDED_REDIS_OWNER"] = str(os.getpid())  # an embedded Redis ends with this bench
    sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def tasks_jsonl() -> bytes:
    files = {"calc.py": "x\n", "test_calc.py": "from calc import *\n"}
    return "\n".join(json.dumps({"id": f"t{i}", "question": f"Fix calc.py so that add({i}, 1) == {i + 1}.",
                                 "files": files, "split": "val" if i < 2 else "train"}) for i in range(14)).encode()


def install_faults(case: str, flag: Path, state_of_run: dict) -> None:
    """In-process hooks: the flag file after step FAULT_AFTER is stored; the corrupted weight syncs."""
    from runs import gated_engine, orchestrator

    record = orchestrator.RunPhases.record

    async def record_then_flag(self, report):
        await record(self, report)
        if report.policy_version >= FAULT_AFTER:
            flag.touch()

    orchestrator.RunPhases.record = record_then_flag
    if case != "corrupt_sync":
        return
    update = gated_engine.GatedEngine.update_weights

    async def corrupting(self, model, version):
        if version <= FAULT_AFTER:
            return await update(self, model, version)
        state = dict(model.state_dict())  # the trainer's own tensors stay as they are
        state["model.norm.weight"] = state["model.norm.weight"] * 8.0
        state_of_run.setdefault("first_corrupt_version", version)
        return await update(self, state, version)  # the engine writes a dict of tensors as the model's weights

    gated_engine.GatedEngine.update_weights = corrupting


def run_case(case: str, user, model: Path, workdir: Path, steps: int) -> dict:
    from catalog import services as catalog_services
    from health.models import RunAlarm
    from runs import services
    from runs.models import Rollout, Run
    from runs.tasks import execute_run

    folder = workdir / case
    flag_dir = folder / "flag"
    flag_dir.mkdir(parents=True)
    (folder / "harness.py").write_text(HARNESS)
    flag = flag_dir / "on"
    state: dict = {}
    install_faults(case, flag, state)
    harness = catalog_services.create_harness(
        user, name=f"agent-{case}", timeout_s=120, command=["python3", str(folder / "harness.py"), "{task_file}",
                                                            "{output_file}"],
        env={"FAULT": case, "FAULT_FLAG": str(flag)}, resources={"read_only": [str(flag_dir)]})
    dataset = catalog_services.create_dataset(user, name=f"repo-{case}", content=tasks_jsonl(), filename="t.jsonl")
    reward = catalog_services.create_reward_script(
        user, name=f"reward-{case}", source=CONSTANT_REWARD if case == "constant_reward" else REWARD)
    run = services.create_run(user, name=f"health-{case}", model=str(model), harness=harness, dataset=dataset,
                              reward_script=reward, config={**CONFIG, "steps": steps})
    started = time.monotonic()
    status = execute_run.apply(args=[run.pk]).get()
    run = Run.objects.get(pk=run.pk)
    alarms = list(RunAlarm.objects.filter(run=run).order_by("step", "kind").values_list("step", "kind"))
    if case == "constant_reward":
        fault_step = 1
    elif case == "corrupt_sync":
        fault_step = state.get("first_corrupt_version", 10 ** 6) + 1  # the step that trains what it served
    elif case == "clean":
        fault_step = None
    else:
        marked = [r for r in Rollout.objects.filter(run=run, split="train", batch_step__isnull=False)
                  .values_list("batch_step", "outcome__fault") if r[1] is True]
        fault_step = min((step for step, _ in marked), default=None)
    expected = EXPECTED.get(case)
    hits = [step for step, kind in alarms if kind == expected and fault_step is not None and step >= fault_step]
    delay = (min(hits) - fault_step) if hits and fault_step is not None else None
    early = [(s, k) for s, k in alarms if fault_step is None or s < fault_step]
    return {"case": case, "status": status, "error": run.error[:300], "steps": run.step, "fault_step": fault_step,
            "alarms": alarms, "expected": expected, "steps_to_alarm": delay,
            "caught": expected is not None and delay is not None and 0 <= delay <= 1,
            "alarms_before_fault": early, "minutes": (time.monotonic() - started) / 60}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated cases of {','.join(CASES)}")
    parser.add_argument("--steps", type=int, default=4, help="steps of each run (the fault starts after step 1)")
    parser.add_argument("--workdir", default="", help="keep the runs' data here (default: a temporary folder)")
    args = parser.parse_args()
    cases = [c for c in (args.only.split(",") if args.only else CASES) if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {list(CASES)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lw-health-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    setup_django(workdir)
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from trainer.models import build_tiny_model

    model = build_tiny_model(Path(settings.LIGHTNING_MODELS_DIR) / "tiny-health", seed=0)
    user, _ = get_user_model().objects.get_or_create(username="health-bench")
    results = []
    for case in cases:
        from runs import gated_engine, orchestrator

        saved = orchestrator.RunPhases.record, gated_engine.GatedEngine.update_weights
        try:
            result = run_case(case, user, model, workdir, args.steps)
        finally:
            orchestrator.RunPhases.record, gated_engine.GatedEngine.update_weights = saved
        results.append(result)
        print(f"{case:16s} {result['status']:9s} steps={result['steps']} fault_step={result['fault_step']} "
              f"expected={result['expected']} steps_to_alarm={result['steps_to_alarm']} "
              f"alarms={result['alarms']} before_fault={result['alarms_before_fault']} "
              f"{result['minutes']:.1f} min {result['error']}", flush=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    faults = [r for r in results if r["case"] != "clean"]
    clean = [r for r in results if r["case"] == "clean"]
    delays = [r["steps_to_alarm"] for r in faults if r["steps_to_alarm"] is not None]
    print(f"results: {workdir / 'results.json'}")
    print(f"RESULT alarms_caught={sum(r['caught'] for r in faults)}/{len(faults)} "
          f"false_alarms_clean={sum(len(r['alarms']) for r in clean) if clean else 'n/a'} "
          f"steps_to_alarm_max={max(delays) if len(delays) == len(faults) and delays else 'n/a'}")
    return 0 if all(r["caught"] for r in faults) and not any(r["alarms"] for r in clean) else 1


if __name__ == "__main__":
    sys.exit(main())
