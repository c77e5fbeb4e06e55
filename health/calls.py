"""What a recorded call's request and response say about tools, whatever API the harness used: the tools offered,
the tool calls the model made (parsed by the engine), and the assistant text, where a tool call the harness never
executed shows as text. Pure functions over the stored JSON (runs.models.ModelCall.request / .response)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_TEXT = re.compile(
    r"<tool_call>\s*\{\s*\"(?:name|function)\"\s*:|<function=[\w.-]+>|<\|python_tag\|>\s*\{\s*\"name\"|"
    r"\[TOOL_CALLS\]\s*\[?\s*\{\s*\"name\"|<invoke name=\"[\w.-]+\"|"
    r"\{\s*\"(?:name|function|tool)\"\s*:\s*\"[\w.-]+\"\s*,\s*\"(?:arguments|parameters|args|input)\"\s*:",
    re.IGNORECASE)
"""Assistant text that is a whole tool call, named, in one of the formats models are trained on (Hermes/Qwen
<tool_call>{"name": ...}, Llama <|python_tag|>{"name": ...} and <function=...>, Mistral [TOOL_CALLS][{"name": ...}],
Anthropic-style <invoke name=...>, bare {"name": ..., "arguments": ...} JSON): in a call that offered tools and
whose response carries no parsed tool call, nothing executed it. A marker alone (a stray <tool_call> token, which an
untrained model emits) is not a call."""
CODE_BLOCK = re.compile(r"```[ \t]*([\w.+-]*)[^\n]*\n(.*?)```", re.DOTALL)
SHELL_LANGS = frozenset({"", "bash", "sh", "shell", "console", "zsh", "mswea_bash_command"})


@dataclass
class CallView:
    """One recorded call as the health rules read it."""

    offered_tools: bool = False
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    """[{'name': ..., 'arguments': <str>}] the engine parsed into structured tool calls."""
    texts: list[str] = field(default_factory=list)
    """The assistant text of each choice (tool calls excluded)."""
    finish_reason: str = ""

    @property
    def text_tool_calls(self) -> int:
        """Assistant texts that look like a tool call while no structured one came back (one per text)."""
        if self.tool_calls:
            return 0
        return sum(1 for text in self.texts if TOOL_TEXT.search(text or ""))

    def commands(self) -> list[str]:
        """The shell commands the model wrote: fenced shell blocks of its text and the arguments of its tool calls."""
        found = [call["arguments"] for call in self.tool_calls if call.get("arguments")]
        for text in self.texts:
            found += [body.strip() for lang, body in CODE_BLOCK.findall(text or "")
                      if lang.lower() in SHELL_LANGS and body.strip()]
        return found


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict)
                       and part.get("type") in ("text", "output_text", None) and isinstance(part.get("text"), str))
    return ""


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def view(api: str, request: Any, response: Any, finish_reason: str = "") -> CallView:
    """The CallView of one stored call (api: runs.models.CallApi)."""
    request = request if isinstance(request, dict) else {}
    response = response if isinstance(response, dict) else {}
    out = CallView(offered_tools=bool(request.get("tools") or request.get("functions")), finish_reason=finish_reason)
    if api == "messages":
        for block in response.get("content") or []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                out.tool_calls.append({"name": str(block.get("name", "")), "arguments": _arguments(block.get("input"))})
            elif block.get("type") == "text":
                out.texts.append(str(block.get("text", "")))
    elif api == "responses":
        for item in response.get("output") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") in ("function_call", "custom_tool_call", "local_shell_call"):
                out.tool_calls.append({"name": str(item.get("name", item.get("type"))),
                                       "arguments": _arguments(item.get("arguments", item.get("input",
                                                                                           item.get("action"))))})
            elif item.get("type") == "message":
                out.texts.append(_text(item.get("content")))
    else:  # chat, completions
        for choice in response.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if api == "completions":
                out.texts.append(str(choice.get("text") or ""))
                continue
            message = choice.get("message") or {}
            for call in message.get("tool_calls") or []:
                function = (call or {}).get("function") or {}
                out.tool_calls.append({"name": str(function.get("name", "")),
                                       "arguments": _arguments(function.get("arguments", ""))})
            out.texts.append(_text(message.get("content")))
    return out
