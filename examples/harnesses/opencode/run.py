"""OpenCode (npm `opencode-ai`) solves one task through the rollout's proxy, over Chat Completions, Responses or
Anthropic Messages (--mode chat | responses | anthropic).

OpenCode reads a private config file (OPENCODE_CONFIG under the rollout's state folder) that defines one provider,
`lightning`, whose only model is the rollout's model at the proxy's URL with the rollout's key, built on the AI SDK
package of the chosen mode (bundled in the binary: nothing is downloaded). The same model answers the title side
request (small_model). Edits and shell commands are allowed without asking (and --auto approves the rest);
sharing, updates, models.dev fetches, LSP downloads, formatters, plugins, snapshots and reading ~/.claude are off,
npm runs offline (OpenCode installs its plugin package into its config folder in the background: that install now
fails at once, harmlessly), and the tools folder's ripgrep is on PATH, so nothing but the proxy is contacted
(measured with strace in all three modes: only connections to the proxy). `opencode run --format json` prints one
JSON event a line; the final message is the text of the last step's text parts.

The preset's levers (OPTIONS) are OpenCode's own settings, in its config file: --overlay lays a config of its own
format (e.g. small_model.json: a short build-agent prompt, four tools, a step limit) over the generated one, and
--output-tokens / --context-tokens give the rollout's model its `limit` (OpenCode otherwise asks for 32,000 output
tokens a call, more than a small engine's context holds), and --title-tokens gives the title side request a smaller
one (small_model becomes a second entry for the same served model). Nothing in the protocol changes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness_common as hc  # noqa: E402

PROVIDER = "lightning"
TITLE_SUFFIX = "#title"
"""The title model's config key: the rollout's model (its `id`, what the request names) with a limit of its own."""
PACKAGES = {"chat": "@ai-sdk/openai-compatible", "responses": "@ai-sdk/openai", "anthropic": "@ai-sdk/anthropic"}
"""The AI SDK package OpenCode speaks each mode with (the Anthropic one appends /messages to a base ending in /v1)."""
SWITCHES = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1", "OPENCODE_PURE": "1",
    "npm_config_offline": "true",  # it installs @opencode-ai/plugin into its config folder in the background
}
"""Environment switches that keep OpenCode off the network and away from config the rollout does not own."""
RIPGREP = ("node", "node_modules", "@openai", "codex-linux-x64", "vendor", "x86_64-unknown-linux-musl", "codex-path")
"""The tools folder's ripgrep (npm ships it inside Codex): without an `rg` on PATH, OpenCode's grep and glob tools
download one from GitHub."""


OPTIONS = {
    "--overlay": {"type": Path, "default": None,
                  "help": "an OpenCode config file (JSON) deep-merged over the generated one (e.g. small_model.json)"},
    "--output-tokens": {"type": int, "default": 0,
                        "help": "the model's limit.output: max_tokens of each call (0: OpenCode's default, 32000)"},
    "--context-tokens": {"type": int, "default": 0,
                         "help": "the model's limit.context, with --output-tokens (0: unknown, no compaction)"},
    "--title-tokens": {"type": int, "default": 0,
                       "help": "max_tokens of the title side request (0: the model's own limit)"},
}
"""The preset's levers: all are OpenCode's own config settings, nothing in its protocol changes."""


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on it: objects merge key by key, anything else (lists too) is replaced."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict)
                       else value)
    return merged


def config(args: hc.Args) -> dict[str, Any]:
    """OpenCode's config: the proxy as its one provider, everything that would reach out turned off, then the
    options: the model's token limits and the overlay file (which may change anything, the provider too)."""
    generated = base_config(args)
    options = args.options
    if options.get("output_tokens"):
        limit = {"context": options.get("context_tokens") or 0, "output": options["output_tokens"]}
        generated["provider"][PROVIDER]["models"][args.model]["limit"] = limit
    if options.get("title_tokens"):
        # The title comes from small_model: the same served model under a second entry with its own output limit.
        title = f"{args.model}{TITLE_SUFFIX}"
        generated["provider"][PROVIDER]["models"][title] = {
            "id": args.model, "name": args.model, "tool_call": True,
            "limit": {"context": options.get("context_tokens") or 0, "output": options["title_tokens"]}}
        generated["small_model"] = f"{PROVIDER}/{title}"
    if options.get("overlay"):
        overlay = json.loads(Path(options["overlay"]).read_text())
        if not isinstance(overlay, dict):
            raise SystemExit(f"{options['overlay']}: an overlay must be a JSON object")
        generated = deep_merge(generated, overlay)
    return generated


def base_config(args: hc.Args) -> dict[str, Any]:
    """The generated config, before the options."""
    model = f"{PROVIDER}/{args.model}"
    return {
        "provider": {PROVIDER: {
            "npm": PACKAGES[args.mode], "name": "Lightning proxy",
            "options": {"baseURL": args.base_url, "apiKey": args.api_key},
            "models": {args.model: {"name": args.model, "tool_call": True}},
        }},
        "enabled_providers": [PROVIDER],
        "model": model,
        "small_model": model,
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "websearch": "deny"},
        "autoupdate": False,
        "share": "disabled",
        "lsp": False,
        "formatter": False,
        "snapshot": False,  # its undo history: a git copy of the repository at every step, of no use here
    }


def final_message(stdout: str) -> str:
    """The text OpenCode answered last: the text parts after its last tool call, from the JSON event lines."""
    texts: list[str] = []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        part = event.get("part") or {}
        if event.get("type") == "tool_use":
            texts = []
        elif event.get("type") == "text" and part.get("text"):
            texts.append(part["text"])
    return "\n".join(texts).strip()


def search_path() -> str:
    """PATH with the tools folder's ripgrep first, when it is there."""
    ripgrep = hc.tools_dir().joinpath(*RIPGREP)
    path = os.environ.get("PATH", os.defpath)
    return f"{ripgrep}{os.pathsep}{path}" if (ripgrep / "rg").is_file() else path


def main() -> None:
    args = hc.parse_args(tuple(PACKAGES), extra=OPTIONS)
    repo = hc.prepare_repo(args.workdir, args.task)
    config_file = args.workdir / "state" / "opencode.json"
    env = hc.private_env(args.workdir, {**SWITCHES, "OPENCODE_CONFIG": str(config_file), "PATH": search_path()})
    config_file.write_text(json.dumps(config(args), indent=2))
    opencode = hc.tool("node", "node_modules", ".bin", "opencode")
    # The prompt goes in on standard input: `opencode run` wraps a message argument holding spaces in quotes.
    # --auto approves what the config leaves to asking (a file outside the repository, a repeated call).
    argv = [str(opencode), "run", "--format", "json", "--auto", "--model", f"{PROVIDER}/{args.model}"]
    finished = hc.run_agent(argv, repo, env, args.timeout_s, stdin_text=hc.prompt_of(args.task))
    outcome = hc.write_outcome(args, repo, finished, final_message(finished.stdout))
    hc.finish(outcome, finished)


if __name__ == "__main__":
    main()
