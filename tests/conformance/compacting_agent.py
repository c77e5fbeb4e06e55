"""A fork-heavy agent for the conformance suite: a sub-agent with its own system prompt, and a compacted history.

Started by the executor like a template's runner (harness_common's arguments). The main agent talks Chat
Completions through the openai SDK, streaming, with two tools: `shell` and `delegate`. `delegate` starts a
sub-agent with ANOTHER system prompt and a conversation of its own (Chat Completions, or Anthropic Messages through
the anthropic SDK with `--mode messages`, as Claude Code's Task tool does); its final answer comes back to the main
agent as the tool result. Once the main history holds `COMPACT_AFTER` tool results since the last compaction,
the agent compacts it: a side request to a summariser (its own system prompt, the transcript as one user message,
like OpenHands' condenser) or, with `--mode inline`, one more user turn asking the main conversation itself for a
summary (same system prompt and tools, like Claude Code's compaction). Then the main conversation goes on from
[system, summary as a user turn, the latest assistant turn and its tool results]: a truncated history, so the next
prompt extends none of the earlier ones.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from anthropic import Anthropic
from openai import OpenAI

MAIN_SYSTEM = "You are the main agent. Work in the repository with the shell tool; delegate research to a sub-agent."
SUB_AGENT_SYSTEM = "You are a research sub-agent. Answer the one question you are given; you may use the shell tool."
SUMMARISER_SYSTEM = "You summarise agent conversations so that the agent can continue from the summary alone."
SUMMARY_REQUEST = "Summarise the conversation so far so that you can continue from the summary alone."
SUMMARY_PREFIX = "This session continues from an earlier conversation that was compacted. Summary:"
COMPACT_AFTER = 3
"""Tool results in the main history (since the last compaction) that trigger a compaction before the next call."""
MAX_TURNS = 12
SHELL_TIMEOUT_S = 60

SHELL = {"type": "function", "function": {
    "name": "shell", "description": "Run a bash command in the repository and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
DELEGATE = {"type": "function", "function": {
    "name": "delegate", "description": "Ask a sub-agent one question; its answer is returned.",
    "parameters": {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}}}


def shell(repo: Path, command: str) -> str:
    done = subprocess.run(["bash", "-lc", command], cwd=repo, capture_output=True, text=True,
                          timeout=SHELL_TIMEOUT_S)
    return (done.stdout + done.stderr) or f"(exit {done.returncode}, no output)"


def chat(client, model: str, messages: list[dict], tools: list[dict] | None = None) -> dict:
    """One streamed Chat Completions call, assembled into the assistant message the history keeps."""
    extra = {"tools": tools} if tools else {}
    content, calls = [], {}
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, max_tokens=512,
                                                **extra):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            call["id"] += part.id or ""
            call["function"]["name"] += (part.function and part.function.name) or ""
            call["function"]["arguments"] += (part.function and part.function.arguments) or ""
    message: dict = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def sub_agent_chat(client, model: str, repo: Path, question: str) -> str:
    messages = [{"role": "system", "content": SUB_AGENT_SYSTEM}, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = chat(client, model, messages, [SHELL])
        messages.append(reply)
        if not reply.get("tool_calls"):
            return reply["content"] or ""
        for call in reply["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": shell(repo, command)})
    raise SystemExit("the sub-agent did not answer within its turns")


def sub_agent_messages(client, model: str, repo: Path, question: str) -> str:
    """The same sub-agent over Anthropic Messages: system apart, tool_use / tool_result content blocks."""
    tool = {"name": "shell", "description": SHELL["function"]["description"],
            "input_schema": SHELL["function"]["parameters"]}
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.messages.create(model=model, system=SUB_AGENT_SYSTEM, messages=messages, tools=[tool],
                                       max_tokens=512)
        blocks = [{"type": "text", "text": b.text} if b.type == "text" else
                  {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input} for b in reply.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in blocks if b["type"] == "tool_use"]
        if not uses:
            return "".join(b["text"] for b in blocks)
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": shell(repo, b["input"]["command"])}
            for b in uses]})
    raise SystemExit("the sub-agent did not answer within its turns")


def transcript(messages: list[dict]) -> str:
    """The history as plain text for the summariser (what a condenser sends instead of the turns themselves)."""
    lines = []
    for m in messages[1:]:
        for call in m.get("tool_calls") or []:
            lines.append(f"{m['role']} called {call['function']['name']} {call['function']['arguments']}")
        if m.get("content"):
            lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines)


def compact(client, model: str, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """[system, summary as a user turn, the last assistant turn and its tool results].

    With `tools` the summary is asked inside the conversation (inline); without, of a separate summariser."""
    if tools:
        request = [*messages, {"role": "user", "content": SUMMARY_REQUEST}]
    else:
        request = [{"role": "system", "content": SUMMARISER_SYSTEM}, {"role": "user", "content": transcript(messages)}]
    summary = chat(client, model, request, tools)["content"] or ""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return [messages[0], {"role": "user", "content": f"{SUMMARY_PREFIX}\n{summary}"}, *messages[last:]]


def run(args, repo: Path, prompt: str) -> tuple[str, dict]:
    """The main loop; returns the final message and counts of the forks it made."""
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": prompt}]
    counts = {"sub_agents": 0, "compactions": 0}
    since_compaction = 0
    for _ in range(MAX_TURNS):
        if since_compaction >= COMPACT_AFTER:
            inline = [SHELL, DELEGATE] if args.mode == "inline" else None
            messages, since_compaction = compact(client, args.model, messages, inline), 0
            counts["compactions"] += 1
        reply = chat(client, args.model, messages, [SHELL, DELEGATE])
        messages.append(reply)
        if not reply.get("tool_calls"):
            return reply["content"] or "", counts
        for call in reply["tool_calls"]:
            counts["sub_agents"] += call["function"]["name"] == "delegate"
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": tool_result(args, client, repo, call["function"])})
            since_compaction += 1
    raise SystemExit("the main agent did not finish within its turns")


def tool_result(args, client, repo: Path, function: dict) -> str:
    """What a main-agent tool call returns: the command's output, or the sub-agent's final answer."""
    arguments = json.loads(function["arguments"])
    if function["name"] != "delegate":
        return shell(repo, arguments["command"])
    if args.mode == "messages":
        sub = Anthropic(base_url=args.root_url, api_key=args.api_key, max_retries=0, timeout=120)
        return sub_agent_messages(sub, args.model, repo, arguments["question"])
    return sub_agent_chat(client, args.model, repo, arguments["question"])


def main() -> None:
    # Found here, not at import: the test imports this module for its prompts only.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "harnesses"))
    from harness_common import Finished, parse_args, prepare_repo, prompt_of, write_outcome

    args = parse_args(modes=("chat", "messages", "inline"))
    repo = prepare_repo(args.workdir, args.task)
    final, counts = run(args, repo, prompt_of(args.task))
    write_outcome(args, repo, Finished(0, False, "", ""), final, **counts)


if __name__ == "__main__":
    main()
