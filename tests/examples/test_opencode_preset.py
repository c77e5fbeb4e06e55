"""The opencode-chat template's small-model preset: the overlay (examples/harnesses/opencode/small_model.json) laid
over the runner's generated config, the runner's token-limit options, and the template that uses them."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

HARNESSES = Path(__file__).resolve().parents[2] / "examples" / "harnesses"
OPENCODE = HARNESSES / "opencode"
sys.path.insert(0, str(HARNESSES))

import harness_common as hc  # noqa: E402

# examples/harnesses/opencode/run.py, under a name of its own (other runners are imported as `run`).
_spec = importlib.util.spec_from_file_location("opencode_run", OPENCODE / "run.py")
opencode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(opencode)

OVERLAY = OPENCODE / "small_model.json"
OFF = ("glob", "grep", "task", "todowrite", "skill")


def args_for(tmp_path: Path, *extra: str):
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"prompt": "fix it", "files": {"calc.py": "def add(a, b):\n    return a - b\n"}}))
    return hc.parse_args(tuple(opencode.PACKAGES), ["--task", str(task), "--out", str(tmp_path / "out.json"),
                                                    "--workdir", str(tmp_path / "w"), "--base-url",
                                                    "http://127.0.0.1:1/v1", "--api-key=-k", "--model", "policy",
                                                    "--mode", "chat", *extra], extra=opencode.OPTIONS)


def test_deep_merge_merges_objects_and_replaces_the_rest():
    base = {"a": {"x": 1, "y": {"p": 1}}, "l": [1, 2], "s": "keep"}
    assert opencode.deep_merge(base, {"a": {"y": {"q": 2}, "z": 3}, "l": [3]}) == {
        "a": {"x": 1, "y": {"p": 1, "q": 2}, "z": 3}, "l": [3], "s": "keep"}
    assert base == {"a": {"x": 1, "y": {"p": 1}}, "l": [1, 2], "s": "keep"}  # not changed in place


def test_the_overlay_is_laid_over_the_generated_config(tmp_path):
    args = args_for(tmp_path, "--overlay", str(OVERLAY), "--output-tokens", "256", "--context-tokens", "3072",
                    "--title-tokens", "24")
    config = opencode.config(args)
    # The runner's provider, model and switches stay.
    provider = config["provider"][opencode.PROVIDER]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:1/v1", "apiKey": "-k"}
    assert config["model"] == "lightning/policy" and config["enabled_providers"] == ["lightning"]
    assert config["share"] == "disabled" and config["snapshot"] is False and config["lsp"] is False
    # The model's limits; the title's own entry names the same served model.
    assert provider["models"]["policy"]["limit"] == {"context": 3072, "output": 256}
    title = provider["models"]["policy" + opencode.TITLE_SUFFIX]
    assert title["id"] == "policy" and title["limit"] == {"context": 3072, "output": 24}
    assert config["small_model"] == "lightning/policy" + opencode.TITLE_SUFFIX
    # The overlay's agent prompt, step limit and tools.
    build = config["agent"]["build"]
    assert build["prompt"].startswith("You are a coding agent") and "<tool_call>" in build["prompt"]
    assert build["steps"] == 6
    assert config["agent"]["title"]["prompt"].startswith("You are a title generator.")
    permission = config["permission"]
    assert {k: permission[k] for k in ("edit", "bash", "read")} == {"edit": "allow", "bash": "allow", "read": "allow"}
    assert all(permission[name] == "deny" for name in (*OFF, "webfetch", "websearch"))
    assert "*" not in permission  # OpenCode takes the last matching rule: a wildcard after bash would turn it off
    assert config["compaction"]["auto"] is False and config["tool_output"]["max_bytes"] == 4096


def test_without_options_the_config_is_opencodes_stock_one(tmp_path):
    config = opencode.config(args_for(tmp_path))
    assert config == opencode.base_config(args_for(tmp_path))
    assert "agent" not in config and "limit" not in config["provider"]["lightning"]["models"]["policy"]
    assert config["small_model"] == config["model"]


def test_an_overlay_that_is_not_an_object_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(SystemExit):
        opencode.config(args_for(tmp_path, "--overlay", str(bad)))


def test_the_template_runs_the_runner_with_the_overlay_and_limits():
    template = json.loads((OPENCODE / "opencode-chat.harness.json").read_text())
    command = template["command"]
    assert command[command.index("--overlay") + 1] == "${here}/small_model.json"
    assert int(command[command.index("--output-tokens") + 1]) < template["preset"]["config"]["max_model_len"]
    assert float(command[command.index("--timeout") + 1]) < template["timeout_s"]
    assert "--overlay" in template["description"]


def test_the_template_preset_validates():
    from catalog import harness_templates

    harness_templates.templates.cache_clear()
    harness_templates.templates()  # no TemplateError
    preset = harness_templates.load("opencode-chat").preset
    assert set(preset) == {"notes", "model", "dataset", "reward_script", "config"}
    assert preset["model"] == "gemma3-270m" and preset["reward_script"] == "repo-checks"
    assert set(preset["config"]) >= {"steps", "tasks_per_step", "group_size", "max_model_len", "temperature"}
