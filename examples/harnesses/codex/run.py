"""Codex CLI (npm `@openai/codex`) solves one task through the rollout's proxy, over the Responses API.

Codex reads a private CODEX_HOME under the rollout's state folder whose config.toml defines one model provider,
`lightning`: the proxy's URL with `wire_api = "responses"` and the rollout's key in an environment variable (Codex
takes keys only from there). `codex exec` runs without prompts (approval `never`, no sandbox of its own: the
rollout's folder is the boundary) and with standard input closed; update checks, analytics, feedback, history,
plugins and the hosted web search tool are off, so nothing but the proxy is contacted (measured with strace: only
connections to the proxy). `--strict-config` makes a key this pinned version does not know an error, not a silent
default. The final message is what `--output-last-message` wrote.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness_common as hc  # noqa: E402

PROVIDER = "lightning"
KEY_ENV = "LIGHTNING_PROXY_API_KEY"
"""The variable Codex reads the rollout's key from (the rollout's own key: its commands see it too)."""
CONFIG = """\
model = {model}
model_provider = "{provider}"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[feedback]
enabled = false

[history]
persistence = "none"

[features]
plugins = false

[model_providers.{provider}]
name = "Lightning proxy"
base_url = {base_url}
wire_api = "responses"
env_key = "{key_env}"
"""


def write_config(codex_home: Path, args: hc.Args) -> None:
    """config.toml for this rollout (a JSON string is a valid TOML basic string)."""
    codex_home.mkdir(parents=True, exist_ok=True)
    quoted = {name: json.dumps(value, ensure_ascii=False) for name, value in
              (("model", args.model), ("base_url", args.base_url))}
    (codex_home / "config.toml").write_text(CONFIG.format(**quoted, provider=PROVIDER, key_env=KEY_ENV))


def main() -> None:
    args = hc.parse_args()
    repo = hc.prepare_repo(args.workdir, args.task)
    state = args.workdir / "state"
    codex_home, last_message = state / "codex", state / "last-message.txt"
    write_config(codex_home, args)
    env = hc.private_env(args.workdir, {"CODEX_HOME": str(codex_home), KEY_ENV: args.api_key})
    codex = hc.tool("node", "node_modules", ".bin", "codex")
    argv = [str(codex), "exec", "--strict-config", "--color", "never", "--json", "--cd", str(repo),
            "--output-last-message", str(last_message), "--", hc.prompt_of(args.task)]
    finished = hc.run_agent(argv, repo, env, args.timeout_s)
    final = last_message.read_text().strip() if last_message.exists() else ""
    hc.finish(hc.write_outcome(args, repo, finished, final), finished)


if __name__ == "__main__":
    main()
