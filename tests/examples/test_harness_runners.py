"""The template runners' shared pieces (examples/harnesses/harness_common.py) and mini-SWE-agent's preset levers:
what a runner reports changed, and the argv and config it gives the agent."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HARNESSES = Path(__file__).resolve().parents[2] / "examples" / "harnesses"
sys.path.insert(0, str(HARNESSES))

import harness_common as hc  # noqa: E402

sys.path.insert(0, str(HARNESSES / "mini_swe_agent"))
import run as mini  # noqa: E402  (examples/harnesses/mini_swe_agent/run.py)

REPO_REWARD = HARNESSES.parent / "repo_tasks" / "reward.py"


def args_for(tmp_path: Path, *extra: str, options=None):
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"prompt": "fix it", "files": {"calc.py": "def add(a, b):\n    return a - b\n"}}))
    return hc.parse_args(tuple(mini.MODES), ["--task", str(task), "--out", str(tmp_path / "out.json"), "--workdir",
                                             str(tmp_path / "w"), "--base-url", "http://127.0.0.1:1/v1",
                                             "--api-key=-k", "--model", "policy", "--mode", "text", *extra],
                         extra=options)


def test_a_moved_file_is_reported_as_deleted_and_added(tmp_path):
    repo = hc.prepare_repo(tmp_path / "w", {"files": {"old.py": "x = 1\n", "keep.py": "y = 2\n"}})
    subprocess.run(["git", "mv", "old.py", "new.py"], cwd=repo, check=True, env={**hc.GIT_ENV, "PATH": "/usr/bin:/bin"})
    diff, files = hc.changes(repo)
    assert files == {"new.py": "x = 1\n"}  # git's rename detection would have hidden the new file's text
    assert "deleted file mode" in diff and "new file mode" in diff
    namespace: dict = {}
    exec(REPO_REWARD.read_text(), namespace)  # the repository suite's reward rebuilds the same tree from it
    assert namespace["final_files"]({"files": {"old.py": "x = 1\n", "keep.py": "y = 2\n"}},
                                    {"diff": diff, "files": files}) == {"keep.py": "y = 2\n", "new.py": "x = 1\n"}


def test_runner_options_are_parsed_beside_the_placeholders(tmp_path):
    args = args_for(tmp_path, "--step-limit", "6", "--max-tokens", "192", "--prompts", "/x/small.yaml",
                    options=mini.OPTIONS)
    assert args.options == {"step_limit": 6, "max_tokens": 192, "prompts": Path("/x/small.yaml")}
    assert args.api_key == "-k" and args.mode == "text"
    assert args_for(tmp_path).options == {}  # a runner without options of its own
    with pytest.raises(SystemExit):  # an option the runner does not declare is refused, as before
        args_for(tmp_path, "--step-limit", "6")


def test_mini_gets_the_prompts_file_step_limit_and_max_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_HARNESS_TOOLS_DIR", str(tmp_path / "tools"))
    (tmp_path / "tools" / "mini-swe-agent" / "bin").mkdir(parents=True)
    (tmp_path / "tools" / "mini-swe-agent" / "bin" / "mini").write_text("")
    prompts = HARNESSES / "mini_swe_agent" / "small_model.yaml"
    args = args_for(tmp_path, "--step-limit", "6", "--max-tokens", "192", "--prompts", str(prompts),
                    options=mini.OPTIONS)
    state = tmp_path / "w" / "state"
    state.mkdir(parents=True)
    argv = mini.command(args, tmp_path / "w" / "repo", state, state / "trajectory.json")
    # The mode's own config first, then the prompts laid over it, then this rollout's settings.
    assert argv[argv.index("-c") + 1:] == ["mini_textbased.yaml", "-c", str(prompts), "-c", str(state / "rollout.yaml")]
    own = json.loads((state / "rollout.yaml").read_text())
    assert own["agent"]["step_limit"] == 6
    assert own["model"]["model_kwargs"] == {"api_base": "http://127.0.0.1:1/v1", "max_tokens": 192}
    default = mini.command(args_for(tmp_path, options=mini.OPTIONS), tmp_path / "w" / "repo", state, state / "t.json")
    assert str(prompts) not in default and json.loads((state / "rollout.yaml").read_text())["agent"]["step_limit"] == 40


def test_the_small_model_prompts_keep_the_agents_protocol():
    """The preset changes the words, not the protocol: the fenced block name and the submit line are the agent's."""
    text = (HARNESSES / "mini_swe_agent" / "small_model.yaml").read_text()
    assert "```mswea_bash_command" in text and "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in text
    assert "{{task}}" in text


def test_mini_outcome_counts_accepted_commands_and_refused_replies():
    """What the repository suite's format credit reads: commands the agent ran, replies it refused."""
    trajectory = {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "task"},
        {"role": "user", "content": "Format error", "extra": {"interrupt_type": "FormatError", "n_actions": 0}},
        {"role": "assistant", "content": "THOUGHT", "extra": {"actions": [{"command": "ls"}]}},
        {"role": "user", "content": "<returncode>0</returncode>"},
        {"role": "assistant", "content": "THOUGHT", "extra": {"actions": [{"command": "echo done"}]}},
        {"role": "exit", "content": "Submitted", "extra": {"exit_status": "Submitted"}}]}
    assert mini.reply_counts(trajectory) == (2, 1)
    assert mini.reply_counts({}) == (0, 0)
