"""A real run of the mini-SWE-agent template on the repository task suite: the real `mini` binary (its text mode under
the template's small-model prompts) in bubblewrap, calling the run's proxy in front of vLLM, scored by the suite's
reward script from the hidden checks, trained by the trainer, the weights synced into the engine.

The tiny test model is first taught (a few hundred supervised steps, in this test) to answer like an agent: list the
files, then submit. So a rollout is two turns the agent accepts, the second prompt extending the first call's
prompt and completion: one merged sample per rollout, as a real agent's multi-turn trajectory is trained.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from catalog import harness_templates
from catalog import services as catalog_services
from runs import services
from runs.management.commands.load_demo import ensure_repo_suite
from runs.models import ModelCall, Rollout, Run, Sample
from tests.workers import REAL_RUN_MARKS, Workers, wait_db

pytestmark = REAL_RUN_MARKS

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "harnesses" / "mini_swe_agent" / "small_model.yaml"
LIST = "THOUGHT: I list the files.\n```mswea_bash_command\nls\n```"
SUBMIT = "THOUGHT: It is done.\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"
CONFIG = {"steps": 2, "tasks_per_step": 2, "group_size": 2, "max_model_len": 2048, "kv_cache_gb": 0.5,
          "eval_tasks": 0, "learning_rate": 1e-5, "temperature": 0.7, "dtype": "float32", "engine_dtype": "float32"}


def prompts() -> tuple[str, str]:
    """The template's system prompt and instance template (the text between the YAML's block scalars)."""
    import yaml

    agent = yaml.safe_load(PROMPTS.read_text())["agent"]
    return agent["system_template"], agent["instance_template"]


def teach_agent_turns(model_dir: Path, tasks: list[dict], steps: int = 400, batch: int = 8) -> None:
    """Supervised steps on the tiny model until it answers the task with LIST and the observation with SUBMIT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    system, instance = prompts()
    examples = []
    for task in tasks:
        first = [{"role": "system", "content": system},
                 {"role": "user", "content": instance.replace("{{task}}", task["prompt"])}]
        listing = "\n".join(sorted(task["files"]))
        second = first + [{"role": "assistant", "content": LIST},
                          {"role": "user", "content": f"<returncode>0</returncode>\n<output>\n{listing}\n</output>"}]
        for messages, reply in ((first, LIST), (second, SUBMIT)):
            context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(context + reply + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
            start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
            examples.append((torch.tensor([ids]), start))
    def loss_of(ids, start):
        return torch.nn.functional.cross_entropy(model(ids).logits[0, start - 1:-1], ids[0, start:])

    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        chosen = torch.randperm(len(examples), generator=generator)[:batch]
        loss = sum(loss_of(*examples[i]) for i in chosen) / len(chosen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        worst = max(loss_of(*example).item() for example in examples)
    assert worst < 0.02, f"the tiny model did not learn the agent's turns (worst loss {worst:.3f} nats per token)"
    model.save_pretrained(model_dir)


@pytest.fixture
def workers(tmp_path, test_redis, settings):
    pool, registry = Workers.for_real_run(tmp_path, "tiny-agent", "")
    settings.LIGHTNING_MODELS_DIR = registry
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    # The agents scripts/install-harnesses put where this test process finds them: the worker's harness goes there.
    pool.env["LIGHTNING_HARNESS_TOOLS_DIR"] = str(settings.LIGHTNING_HARNESS_TOOLS_DIR)
    yield pool
    pool.stop()


def test_mini_swe_agent_template_trains_on_the_repository_suite(alice, tmp_path, workers, settings):
    if "mini-swe-agent" not in harness_templates.installed_versions():
        pytest.skip(f"mini-swe-agent is not installed in {settings.LIGHTNING_HARNESS_TOOLS_DIR}: ./lw harnesses")
    suite, reward = ensure_repo_suite(alice)  # the suite and its reward script, as `up` loads them
    # The run draws from 16 of the suite's train tasks, the ones the tiny model was taught the agent's turns on.
    train = [t.data for t in suite.tasks.filter(split="train").order_by("index")[:16]]
    dataset = catalog_services.create_dataset(alice, name="repo-tasks-16", filename="tasks.jsonl",
                                      content="\n".join(json.dumps(t) for t in train).encode())
    teach_agent_turns(Path(settings.LIGHTNING_MODELS_DIR) / "tiny-agent", train)
    harness = harness_templates.add_for(alice, "mini-swe-agent-text")
    assert str(PROMPTS) in harness.command and harness.command[0] == sys.executable
    run = services.create_run(alice, name="mini on repo tasks", model=str(Path(settings.LIGHTNING_MODELS_DIR) /
                                                                           "tiny-agent"),
                              harness=harness, dataset=dataset, reward_script=reward,
                              config={**CONFIG, "seed": 3})
    workers.start("runs", "runs")
    wait_db(lambda: Run.objects.get(pk=run.pk).status in ("succeeded", "failed"), "the end of the run", workers,
            timeout=900)
    run.refresh_from_db()
    assert (run.status, run.step, run.error) == ("succeeded", 2, ""), workers.tails()

    rollouts = list(Rollout.objects.filter(run=run).select_related("task").order_by("step", "group", "attempt"))
    assert len(rollouts) == 8 and {r.step for r in rollouts} == {0, 1}  # the step each was sampled for
    for rollout in rollouts:
        task = rollout.task.data
        calls = list(ModelCall.objects.filter(rollout=rollout).order_by("seq"))
        assert calls, f"rollout {rollout.pk} made no call: {rollout.error} {rollout.stderr_tail[-500:]}"
        for call in calls:  # the engine's own token ids and sampled-token logprobs, kept per call
            assert call.status_code == 200 and call.prompt_ids and call.completion_ids
            assert len(call.logprobs) == len(call.completion_ids)
            assert call.request["max_tokens"] == 128  # the template's --max-tokens reached the engine
            assert call.request["messages"][0]["content"] == prompts()[0].strip()  # the template's prompts
        # The reward is the suite's: the hidden checks ran on the agent's final files, their fraction passed.
        detail = rollout.reward_detail
        assert detail["checks_total"] == len(task["tests"]) and set(detail) >= {t["name"] for t in task["tests"]}
        assert rollout.reward == pytest.approx(detail["checks_passed"] / detail["checks_total"]
                                               + detail["format_credit"])
        # The agent changed nothing: a code task's import check passes and its behaviour checks fail; a task asking
        # for a file with a value passes none.
        assert detail["checks_passed"] < detail["checks_total"]
        assert (detail["checks_passed"] > 0) == (task["kind"] != "file_value"), detail
        assert "tests" not in run.harness_task(task) and run.harness_task(task)["files"] == task["files"]

    merged = [r for r in rollouts if ModelCall.objects.filter(rollout=r).count() == 2
              and Sample.objects.filter(rollout=r, call_seqs=[0, 1]).exists()]
    assert len(merged) >= 4, [(r.pk, r.call_count, r.error) for r in rollouts]
    for rollout in merged:
        first, second = ModelCall.objects.filter(rollout=rollout).order_by("seq")
        assert second.drift in ("clean", "realign")
        assert "ls" in first.response["choices"][0]["message"]["content"]
        assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in second.response["choices"][0]["message"]["content"]
        assert second.request["messages"][-1]["content"].startswith("<returncode>0</returncode>")
        # Two well-formed replies, the listing ran: the suite's partial credit for a well-formed episode.
        assert rollout.reward_detail["format_credit"] == 0.1
        sample = Sample.objects.get(rollout=rollout, call_seqs=[0, 1])
        assert sample.token_ids[:len(first.prompt_ids)] == first.prompt_ids
        # Loss on exactly the tokens the engine sampled: both completions, nothing of the prompts or the output.
        sampled = [(seq, start, end) for seq, start, end, is_sampled in sample.spans if is_sampled]
        assert sum(sample.loss_mask) == len(first.completion_ids) + len(second.completion_ids)
        assert [(seq, end - start) for seq, start, end in sampled] == [
            (0, len(first.completion_ids)), (1, len(second.completion_ids))]
        for _, start, end, is_sampled in sample.spans:
            assert set(sample.loss_mask[start:end]) == {1 if is_sampled else 0}
        assert sample.token_ids[sampled[1][1]:sampled[1][2]] == second.completion_ids
        assert sample.step == rollout.trained_step == rollout.step + 1  # trained by the step it was sampled for

    # The weights were synced after the first step: the second step's calls were sampled by policy version 1.
    assert {c.policy_version for c in ModelCall.objects.filter(rollout__run=run, rollout__step=0)} == {0}
    assert {c.policy_version for c in ModelCall.objects.filter(rollout__run=run, rollout__step=1)} == {1}
    metrics = {(m.name, m.step): m.value for m in run.metrics.all()}
    assert metrics[("time/sync", 1)] > 0 and metrics[("train/samples", 1)] >= 2
    assert metrics[("length/context_tokens_max", 1)] >= max(
        len(c.prompt_ids) + len(c.completion_ids) for c in ModelCall.objects.filter(rollout__run=run, rollout__step=0))
