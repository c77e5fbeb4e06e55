"""Runs an OpenHands agent (openhands-sdk, local workspace, no Docker) on one task against the rollout's proxy.

The agent lives in agent.py, started with the Python of the openhands venv that scripts/install-harnesses made
(the SDK needs Python 3.12; this runner needs only the standard library). It works in the task repository with the
terminal and file-editor tools; the final message is its finish-tool message or its last text reply.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness_common import (  # noqa: E402
    finish, parse_args, prepare_repo, private_env, prompt_of, run_agent, tool, write_outcome)

MAX_ITERATIONS = 30
"""Agent steps (one model call each) before the conversation stops unfinished."""
OFFLINE_ENV = {
    "OPENHANDS_SUPPRESS_BANNER": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of litellm's price list
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_OFFLINE_MODE": "true",  # every other catalogue litellm would fetch: use the bundled copy
    "HF_HUB_OFFLINE": "1",
    "ANONYMIZED_TELEMETRY": "false",  # browser-use (an openhands-tools dependency) posts usage otherwise
    "LOG_LEVEL": "WARNING",
}
"""No Laminar/OpenTelemetry variables (LMNR_PROJECT_API_KEY, OTEL_*) are passed, so the SDK's tracing stays off."""


def main() -> None:
    args = parse_args()
    repo = prepare_repo(args.workdir, args.task)
    state = args.workdir / "state"
    prompt_file, result_file = state / "prompt.txt", state / "result.json"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(prompt_of(args.task))
    env = private_env(args.workdir, {**OFFLINE_ENV, "LIGHTNING_API_KEY": args.api_key})
    argv = [str(tool("openhands", "bin", "python")), str(Path(__file__).with_name("agent.py")), "--repo", str(repo),
            "--prompt-file", str(prompt_file), "--result", str(result_file), "--base-url", args.base_url,
            "--model", args.model, "--max-iterations", str(MAX_ITERATIONS)]
    finished = run_agent(argv, repo, env, args.timeout_s)
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):
        result = {}
    outcome = write_outcome(args, repo, finished, result.get("final_message", ""),
                            agent_exit_status=result.get("execution_status", ""))
    finish(outcome, finished)


if __name__ == "__main__":
    main()
