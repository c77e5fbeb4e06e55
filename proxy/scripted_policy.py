"""The scripted model's choices: a deterministic policy that runs the task's shell command, then finishes.

It runs the command through the harness's shell tool, or as a fenced block for text-mode agents, then the agent's own
finish command when its prompts name one, then says DONE; side requests (titles, summaries) get a short answer.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TASK_MARKER = "Run exactly this shell command:"
SHELL_TOOL_NAMES = ("shell", "exec_command", "local_shell", "bash", "execute_bash", "terminal", "run_shell_command",
                    "run_command", "execute_command", "command")
"""Names of shell-like tools, most specific first (matched case-insensitively)."""
FENCES = ("mswea_bash_command", "bash")
"""Fenced-block languages text-mode agents ask for in their system prompt, most specific first."""
SIDE_ANSWER = "Edit notes.txt"
"""What side requests (titles, summaries, compaction) get: short text that ends them at once."""
_FINISH = re.compile(r"echo\s+([A-Z][A-Z0-9_]{7,})")


@dataclass(frozen=True)
class Answer:
    """What the scripted model says: text, then tool calls as (name, arguments object)."""

    text: str = ""
    tool_calls: tuple[tuple[str, dict], ...] = ()


Policy = Callable[[list[dict], "list[dict] | None"], Answer]
"""(messages as the engine got them, content normalised to strings; tools or None) -> the answer."""


def text_of(content: Any) -> str:
    """Message content as the string a string-content chat template sees (vLLM joins text parts with newlines)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in (
            "text", "input_text", "output_text"))
    return content if isinstance(content, str) else ""


def shell_tool(tools: list[dict] | None) -> dict | None:
    """The offered tool that runs shell commands ({"name", "parameters"}), or None."""
    functions = [t.get("function", t) for t in tools or () if isinstance(t, dict)]
    by_name = {str(f.get("name", "")).lower(): f for f in functions}
    for name in SHELL_TOOL_NAMES:
        if name in by_name:
            return by_name[name]
    return next((f for n, f in by_name.items() if "bash" in n or "shell" in n), None)


def tool_arguments(schema: dict, command: str) -> dict:
    """Arguments for a shell tool from its JSON schema: the command in the form the schema asks for, and a short
    value for every other required field (agents reject calls that lack one)."""
    properties = schema.get("properties") or {}
    key = next((k for k in ("command", "cmd", "commands", "script") if k in properties), "command")
    wanted = properties.get(key) or {}
    arguments: dict[str, Any] = {key: ["bash", "-lc", command] if wanted.get("type") == "array" else command}
    for name in schema.get("required") or ():
        if name not in arguments:
            arguments[name] = _filler(name, properties.get(name) or {})
    return arguments


def _filler(name: str, prop: dict) -> Any:
    if prop.get("enum"):
        return prop["enum"][0]
    kind = prop.get("type")
    if kind in ("integer", "number"):
        return 60
    if kind == "boolean":
        return False
    if kind == "array":
        return []
    return "Run a shell command" if name == "description" else name


def task_command(messages: list[dict]) -> str:
    """The command the newest user turn asks for after TASK_MARKER (up to a double space or line end), or `ls`."""
    for message in reversed(messages):
        text = text_of(message.get("content"))
        if message.get("role") == "user" and TASK_MARKER in text:
            rest = text.split(TASK_MARKER, 1)[1].strip()
            return re.split(r" {2,}|\n", rest, maxsplit=1)[0].strip() or "ls"
    return "ls"


def finish_command(messages: list[dict]) -> str | None:
    """An agent's own 'I am done' command when its prompts name one (mini-SWE-agent: echo COMPLETE_TASK_...)."""
    for message in messages:
        if message.get("role") in ("system", "user", "developer"):
            match = _FINISH.search(text_of(message.get("content")))
            if match:
                return f"echo {match.group(1)}"
    return None


def fence_of(messages: list[dict]) -> str | None:
    """The fenced-block language a text-mode agent's system prompt asks for, or None."""
    prompts = "\n".join(text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    prompts += "\n".join(text_of(m.get("content")) for m in messages[:2] if m.get("role") == "user")
    return next((lang for lang in FENCES if f"```{lang}" in prompts), None)


class FileEditPolicy:
    """The conformance task's model: run the task's shell command (with the offered shell tool, or as a fenced
    block for text-mode agents), then the agent's own finishing command if it has one, then say DONE."""

    final_text = "DONE"

    def __call__(self, messages: list[dict], tools: list[dict] | None) -> Answer:
        tool, fence = shell_tool(tools), None if tools else fence_of(messages)
        if tool is None and fence is None:
            return Answer(SIDE_ANSWER if not tools else self.final_text)
        steps = [task_command(messages)] + [c for c in [finish_command(messages)] if c]
        done = sum(1 for m in messages if m.get("role") == "assistant" and _ran_command(m))
        if done >= len(steps):
            return Answer(self.final_text)
        if tool is not None:
            return Answer("", ((tool["name"], tool_arguments(tool.get("parameters") or {}, steps[done])),))
        thought = "I run the command the task asks for." if done == 0 else "The task is done; I submit."
        return Answer(f"THOUGHT: {thought}\n\n```{fence}\n{steps[done]}\n```")


def _ran_command(message: dict) -> bool:
    return bool(message.get("tool_calls")) or "```" in text_of(message.get("content"))
