"""Claude Code (npm `@anthropic-ai/claude-code`) solves one task through the rollout's proxy, over Anthropic Messages.

`claude -p` runs once, non-interactively, with standard input closed and every tool allowed without asking
(`--dangerously-skip-permissions`; IS_SANDBOX=1 lets it do so as root, since the rollout's folder is the sandbox).
ANTHROPIC_BASE_URL is the proxy without /v1 (Claude Code appends /v1/messages) and ANTHROPIC_API_KEY the rollout's
key; every model alias it may pick for side requests or sub-agents (haiku, sonnet, opus, small/fast, sub-agent) is
the rollout's model, so all its calls are the policy's. Its config lives in a private CLAUDE_CONFIG_DIR; telemetry,
error reporting, the auto-updater, the official plugin marketplace and other non-essential traffic are off, and so are
its web tools (measured with strace: only connections to the proxy). `--output-format json` prints one result
object: the final message is its `result`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness_common as hc  # noqa: E402

SWITCHES = {
    "IS_SANDBOX": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
}
"""Environment switches that keep Claude Code off the network and out of permission prompts."""
OFF_TOOLS = ("WebFetch", "WebSearch")
"""Tools that reach the internet (WebFetch from this machine, WebSearch as Anthropic's server tool): off, like Codex's
web search; shell commands are the task's business."""
MODEL_VARIABLES = ("ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                   "ANTHROPIC_DEFAULT_OPUS_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
"""Where Claude Code looks up the model of a side request or sub-agent: all set to the rollout's model."""


def final_message(stdout: str) -> str:
    """The `result` of the JSON object `--output-format json` prints (empty when it printed none)."""
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ""
    return str(result.get("result") or "") if isinstance(result, dict) else ""


def main() -> None:
    args = hc.parse_args()
    repo = hc.prepare_repo(args.workdir, args.task)
    config_dir = args.workdir / "state" / "claude"
    config_dir.mkdir(parents=True, exist_ok=True)
    env = hc.private_env(args.workdir, {
        **SWITCHES, **dict.fromkeys(MODEL_VARIABLES, args.model), "CLAUDE_CONFIG_DIR": str(config_dir),
        "ANTHROPIC_BASE_URL": args.root_url, "ANTHROPIC_API_KEY": args.api_key})
    claude = hc.tool("node", "node_modules", ".bin", "claude")
    argv = [str(claude), "-p", "--output-format", "json", "--model", args.model, "--dangerously-skip-permissions",
            "--disallowed-tools", *OFF_TOOLS, "--", hc.prompt_of(args.task)]
    finished = hc.run_agent(argv, repo, env, args.timeout_s)
    hc.finish(hc.write_outcome(args, repo, finished, final_message(finished.stdout)), finished)


if __name__ == "__main__":
    main()
