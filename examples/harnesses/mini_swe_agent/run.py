"""Runs mini-SWE-agent (its `mini` CLI, via litellm) on one task against the rollout's proxy; modes tools and text.

Mode `tools` is the agent's default: its `mini.yaml` prompts and one `bash` tool the model calls. Mode `text` is
its text-based variant: `mini_textbased.yaml` prompts, no tools, the command in a ```mswea_bash_command fenced block.
Either way the agent ends by running `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; the final message is what it
printed after that line (its submission) or, when that is empty, the text of its last reply that had any, both
read from the trajectory file the agent saves after every step.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness_common import (  # noqa: E402
    finish, parse_args, prepare_repo, private_env, prompt_of, run_agent, tool, write_outcome)

MODES = {"tools": ("mini.yaml", "litellm"), "text": ("mini_textbased.yaml", "litellm_textbased")}
"""Mode -> (the agent's own config file, its model class)."""
_YAML_UNSAFE = re.compile("[^\t\n\r\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters YAML does not read back as themselves inside a double-quoted string."""
STEP_LIMIT = 40
"""Model calls the agent may make before it stops with LimitsExceeded (default of --step-limit)."""
OPTIONS = {
    "--step-limit": {"type": int, "default": STEP_LIMIT, "help": "model calls before the agent stops (LimitsExceeded)"},
    "--max-tokens": {"type": int, "default": 0, "help": "max_tokens of each model call (0: the agent's default)"},
    "--prompts": {"type": Path, "default": None,
                  "help": "a config file of the agent's own format laid over the mode's (e.g. small_model.yaml)"},
}
"""The preset's levers: all are the agent's own settings (its config file), nothing in its protocol changes."""
OFFLINE_ENV = {
    "MSWEA_CONFIGURED": "true",  # skip the first-run setup wizard (it would prompt)
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",  # the proxy's model has no price: not an error
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of litellm's price list
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_OFFLINE_MODE": "true",  # every other catalogue litellm would fetch: use the bundled copy
    "HF_HUB_OFFLINE": "1",
}
"""mini-SWE-agent itself sends no telemetry; litellm would fetch catalogues from GitHub without these."""


def rollout_config(args, repo: Path, path: Path) -> Path:
    """This rollout's settings on top of the mode's config, as a file (JSON is YAML): the task travels there and
    not on the command line (no argv length limit); the API key goes by OPENAI_API_KEY (mini prints its config)."""
    model_kwargs = {"api_base": args.base_url}
    if args.options["max_tokens"]:
        model_kwargs["max_tokens"] = args.options["max_tokens"]
    config = {
        "run": {"task": prompt_of(args.task)},
        "model": {"model_name": f"openai/{args.model}", "model_class": MODES[args.mode][1],
                  "model_kwargs": model_kwargs},
        "agent": {"step_limit": args.options["step_limit"], "cost_limit": 0},
        "environment": {"cwd": str(repo)},
    }
    path.write_text(yaml_safe_json(config))
    return path


def yaml_safe_json(data: Any) -> str:
    """JSON that YAML reads back as the same data: characters YAML would fold or refuse (NEL, line and paragraph
    separators, controls) escaped as \\uXXXX, which both read alike; everything else, astral planes too, as it is
    (YAML reads a JSON \\uD83D\\uDE00 pair as two lone surrogates)."""
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(data, ensure_ascii=False, indent=1))


def command(args, repo: Path, state: Path, trajectory: Path) -> list[str]:
    own = rollout_config(args, repo, state / "rollout.yaml")
    prompts = ["-c", str(args.options["prompts"])] if args.options["prompts"] else []
    return [str(tool("mini-swe-agent", "bin", "mini")), "--yolo", "--exit-immediately", "--output", str(trajectory),
            "-c", MODES[args.mode][0], *prompts, "-c", str(own)]


def final_message(trajectory: dict[str, Any]) -> str:
    """The submission when the agent printed one, else the text of its last reply that had any."""
    submission = (trajectory.get("info") or {}).get("submission") or ""
    if submission.strip():
        return submission
    texts = [m.get("content") for m in trajectory.get("messages", []) if m.get("role") == "assistant"]
    return next((text for text in reversed(texts) if isinstance(text, str) and text.strip()), "")


def reply_counts(trajectory: dict[str, Any]) -> tuple[int, int]:
    """(commands the agent accepted and ran, replies it refused as format errors), from its trajectory: an
    accepted reply is an assistant message carrying actions, a refused one a FormatError interrupt."""
    messages = [m for m in trajectory.get("messages", []) if isinstance(m, dict)]
    commands = sum(len((m.get("extra") or {}).get("actions") or []) for m in messages if m.get("role") == "assistant")
    errors = sum((m.get("extra") or {}).get("interrupt_type") == "FormatError" for m in messages)
    return commands, errors


def read_trajectory(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main() -> None:
    args = parse_args(tuple(MODES), extra=OPTIONS)
    repo = prepare_repo(args.workdir, args.task)
    state = args.workdir / "state"
    trajectory_path = state / "trajectory.json"
    env = private_env(args.workdir, {**OFFLINE_ENV, "MSWEA_GLOBAL_CONFIG_DIR": str(state / "mswea"),
                                      "OPENAI_API_KEY": args.api_key})
    finished = run_agent(command(args, repo, state, trajectory_path), repo, env, args.timeout_s)
    trajectory = read_trajectory(trajectory_path)
    info = trajectory.get("info") or {}
    commands, format_errors = reply_counts(trajectory)
    outcome = write_outcome(args, repo, finished, final_message(trajectory),
                            agent_exit_status=info.get("exit_status", ""),
                            model_calls=(info.get("model_stats") or {}).get("api_calls"),
                            commands=commands, format_errors=format_errors)
    finish(outcome, finished)


if __name__ == "__main__":
    main()
