"""A recorded model call read back as a conversation in the API it used (chat, completions, responses, messages).

Pure functions over a ModelCall's verbatim `request` and `response` bodies. For a streamed call the proxy records
`response` as the assembled final object (proxy.app: `adapter.response(acc.result())`), the same shape as a
whole answer, so streams need no case of their own. A failed call's `response` is the error body in the
caller's format, or None when the proxy itself failed.

Unlike the proxy's translators (proxy/*_api.py), which turn requests into engine messages and refuse what the
engine cannot take, these never raise: they show what the harness sent, reasoning, hosted tools and all, and
turn anything unknown into a note instead of dropping it.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "note")
_COMMAND_BLOCK = re.compile(r"```(?:mswea_bash_command|bash|sh|shell)[ \t]*\n(.*?)\n?```", re.S)
_COMMAND_RESULT = re.compile(r"\s*(?:<exception>.*?</exception>\s*)?<returncode>(-?\d+)</returncode>\s*"
                             r"<output>\n?(.*?)</output>", re.S)
_TEXT_PARTS = ("text", "input_text", "output_text", "refusal", "summary_text", "reasoning_text")


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made: `arguments` as it wrote them (a JSON string in every API but Anthropic's,
    whose `input` object is written here as JSON)."""

    id: str
    name: str
    arguments: str

    @property
    def pretty_arguments(self) -> str:
        """The arguments indented when they are JSON, as written when they are not."""
        try:
            return json.dumps(json.loads(self.arguments), indent=2, ensure_ascii=False)
        except (TypeError, ValueError):
            return self.arguments

    @cached_property
    def key(self) -> tuple:
        try:  # OpenCode re-serialises arguments compactly: compare them as values, not bytes
            arguments = json.dumps(json.loads(self.arguments), sort_keys=True)
        except (TypeError, ValueError):
            arguments = self.arguments
        return (self.id, self.name, arguments)


@dataclass(frozen=True)
class Turn:
    """One turn: `role` is one of ROLES ('note' for an item no role fits); `completion` marks the model's answer."""

    role: str
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    reasoning: str = ""
    completion: bool = False
    is_error: bool = False

    @cached_property
    def key(self) -> tuple:
        """What makes two turns the same turn (a later call's context repeating an earlier call's turns)."""
        return (self.role, self.text, tuple(c.key for c in self.tool_calls), self.tool_call_id)

    @cached_property
    def commands(self) -> tuple[str, ...]:
        """Shell commands an assistant wrote as fenced blocks (text-based agents: mini-SWE-agent's
        ```mswea_bash_command, or ```bash / ```sh), in order; () for other turns."""
        if self.role != "assistant" or "```" not in self.text:
            return ()
        return tuple(m.group(1).strip("\n") for m in _COMMAND_BLOCK.finditer(self.text))

    @cached_property
    def command_output(self) -> tuple[str, str] | None:
        """(exit status, output) when this turn hands a command's result back to a text-based agent
        (`<returncode>N</returncode>` then `<output>...</output>`, as mini-SWE-agent writes it)."""
        match = _COMMAND_RESULT.match(self.text) if self.role in ("user", "tool") else None
        return (match.group(1), match.group(2).strip("\n")) if match else None


@dataclass(frozen=True)
class ToolDef:
    """A tool offered in the request; `hosted` tools (web search...) run at the provider and never reach our model."""

    name: str
    description: str = ""
    parameters: Any = None
    hosted: bool = False

    @property
    def pretty_parameters(self) -> str:
        return json.dumps(self.parameters, indent=2, ensure_ascii=False) if self.parameters is not None else ""


@dataclass(frozen=True)
class Conversation:
    """A call as a conversation: the request's context turns, then the completion turns of its response."""

    api: str
    turns: tuple[Turn, ...] = ()
    tools: tuple[ToolDef, ...] = ()
    error: str = ""

    @property
    def context(self) -> tuple[Turn, ...]:
        return tuple(t for t in self.turns if not t.completion)

    @property
    def completion(self) -> tuple[Turn, ...]:
        return tuple(t for t in self.turns if t.completion)


def conversation(api: str, request: Any, response: Any) -> Conversation:
    """The conversation of one call of API `api` ('chat', 'completions', 'responses' or 'messages')."""
    reader = READERS.get(api)
    request = request if isinstance(request, dict) else {}
    if reader is None:
        return Conversation(api, (Turn("note", f"unknown API {api!r}: see the raw request and response"),))
    context, tools = reader.request(request)
    response = response if isinstance(response, dict) else None
    error = _error(response)
    completion = reader.response(response) if response is not None and not error else []
    if response is not None and not error and not completion:
        completion = [Turn("assistant")]  # an empty answer is worth seeing
    return Conversation(api, tuple(context) + tuple(_as_completion(t) for t in completion), tuple(tools), error)


def as_messages(conv: Conversation) -> list[dict[str, Any]]:
    """The conversation's turns as plain dicts in one shape for every API (the export's `messages`): role, text,
    tool calls with their arguments, the tool call a tool result answers, and which turns the model wrote."""
    return [{"role": t.role, "text": t.text,
             "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in t.tool_calls],
             "tool_call_id": t.tool_call_id, "completion": t.completion, "is_error": t.is_error}
            for t in conv.turns]


def tool_call_counts(conversations: Iterable[Conversation]) -> Counter:
    """How many times the model called each tool, by name, over the completions of the calls (the tool calls a
    request repeats from its history are not counted again)."""
    counts: Counter = Counter()
    for conv in conversations:
        for turn in conv.completion:
            counts.update(call.name for call in turn.tool_calls)
    return counts


def tool_definitions(conversations: Iterable[Conversation]) -> list[ToolDef]:
    """Every tool offered over the calls, once by name (its first definition), in the order first offered."""
    seen: dict[str, ToolDef] = {}
    for conv in conversations:
        for tool in conv.tools:
            seen.setdefault(tool.name, tool)
    return list(seen.values())


def shared_prefix(previous: Conversation, current: Conversation) -> int:
    """How many of `current`'s context turns repeat `previous`'s turns (its context and completion) from the start:
    an agent's next call usually resends the whole history, so a page shows only what is new."""
    count = 0
    for before, now in zip(previous.turns, current.context):
        if before is not now and before.key != now.key:
            break
        count += 1
    return count


# --- the four readers --------------------------------------------------------------------------------------------


def _as_completion(turn: Turn) -> Turn:
    return Turn(turn.role, turn.text, turn.tool_calls, turn.tool_call_id, turn.reasoning, True, turn.is_error)


def _error(response: dict | None) -> str:
    """The message of an error body (OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`), or ''."""
    if response is None or not response.get("error"):
        return ""
    error = response["error"]
    if isinstance(error, dict):
        return str(error.get("message") or error.get("type") or json.dumps(error))
    return str(error)


def _text(content: Any) -> str:
    """Text of a content value in any of the APIs: a string, or a list of parts (non-text parts named)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False)
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            pieces.append(str(part.get("text", part.get("refusal", ""))))
        elif isinstance(part, dict):
            pieces.append(f"[{part.get('type', 'part')}]")
    return "\n".join(pieces)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


class _Chat:
    """OpenAI Chat Completions."""

    @staticmethod
    def message(message: Any) -> Turn:
        if not isinstance(message, dict):
            return Turn("note", _arguments(message))
        role = {"developer": "system", "function": "tool"}.get(message.get("role"), message.get("role"))
        calls = tuple(ToolCall(str(c.get("id") or ""), str((c.get("function") or {}).get("name") or ""),
                               _arguments((c.get("function") or {}).get("arguments", "")))
                      for c in _list(message.get("tool_calls")) if isinstance(c, dict))
        if isinstance(message.get("function_call"), dict):  # the legacy single call
            function = message["function_call"]
            calls += (ToolCall("", str(function.get("name") or ""), _arguments(function.get("arguments", ""))),)
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        call_id = (message.get("tool_call_id") or message.get("name") or "") if role == "tool" else ""
        return Turn(role if role in ROLES else "note", _text(message.get("content")), calls, str(call_id),
                    reasoning if isinstance(reasoning, str) else _text(reasoning))

    @classmethod
    def request(cls, body: dict) -> tuple[list[Turn], list[ToolDef]]:
        tools = [_function_def(t.get("function") or {}) for t in _list(body.get("tools"))
                 if isinstance(t, dict) and t.get("type", "function") == "function"]
        tools += [_function_def(f) for f in _list(body.get("functions")) if isinstance(f, dict)]
        return [cls.message(m) for m in _list(body.get("messages"))], tools

    @classmethod
    def response(cls, body: dict) -> list[Turn]:
        return [cls.message(c.get("message") or {"role": "assistant"}) for c in _list(body.get("choices"))
                if isinstance(c, dict)]


def _function_def(function: dict) -> ToolDef:
    return ToolDef(str(function.get("name") or ""), str(function.get("description") or ""),
                   function.get("parameters"))


class _Completions:
    """OpenAI Completions: a prompt (text, texts or token ids), and the text of each choice."""

    @staticmethod
    def request(body: dict) -> tuple[list[Turn], list[ToolDef]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [Turn("user", prompt)], []
        prompts = _list(prompt)
        if prompts and all(isinstance(p, int) for p in prompts):
            return [Turn("user", f"[{len(prompts)} prompt token ids]")], []
        return [Turn("user", p if isinstance(p, str) else f"[{len(_list(p))} prompt token ids]") for p in prompts], []

    @staticmethod
    def response(body: dict) -> list[Turn]:
        return [Turn("assistant", str(c.get("text") or "")) for c in _list(body.get("choices")) if isinstance(c, dict)]


class _Responses:
    """OpenAI Responses: `instructions` and `input` items; `output` items in the response."""

    @classmethod
    def items(cls, items: list) -> list[Turn]:
        turns: list[Turn] = []
        for item in items:
            if not isinstance(item, dict):
                turns.append(Turn("note", _arguments(item)))
                continue
            kind = item.get("type") or ("message" if "role" in item else "")
            if kind == "message":
                role = {"developer": "system"}.get(item.get("role"), item.get("role"))
                turns.append(Turn(role if role in ROLES else "note", _text(item.get("content"))))
            elif kind in ("function_call", "custom_tool_call"):  # custom: Codex's free-form tools (apply_patch)
                call = ToolCall(str(item.get("call_id") or item.get("id") or ""), str(item.get("name") or ""),
                                _arguments(item.get("arguments", item.get("input", ""))))
                cls._append_call(turns, call)
            elif kind in ("function_call_output", "custom_tool_call_output"):
                turns.append(Turn("tool", _text(item.get("output")), tool_call_id=str(item.get("call_id") or "")))
            elif kind == "reasoning":
                summary = _text(_list(item.get("summary")) + _list(item.get("content")))
                cls._append_reasoning(turns, summary or "[reasoning]")
            else:
                turns.append(Turn("note", f"[{kind or 'item'}] {json.dumps(item, ensure_ascii=False)[:500]}"))
        return turns

    @staticmethod
    def _append_call(turns: list[Turn], call: ToolCall) -> None:
        """A function call joins the assistant turn just before it (its text or its other calls), as one turn."""
        last = turns[-1] if turns else None
        if last is not None and last.role == "assistant":
            turns[-1] = Turn("assistant", last.text, last.tool_calls + (call,), reasoning=last.reasoning)
        else:
            turns.append(Turn("assistant", tool_calls=(call,)))

    @staticmethod
    def _append_reasoning(turns: list[Turn], text: str) -> None:
        """Reasoning opens the assistant turn that follows it."""
        turns.append(Turn("assistant", reasoning=text))

    @classmethod
    def request(cls, body: dict) -> tuple[list[Turn], list[ToolDef]]:
        turns = [Turn("system", body["instructions"])] if isinstance(body.get("instructions"), str) \
            and body["instructions"] else []
        items = body.get("input")
        turns += [Turn("user", items)] if isinstance(items, str) else cls.items(_list(items))
        return _merge_reasoning(turns), cls.tools(_list(body.get("tools")))

    @classmethod
    def tools(cls, tools: list) -> list[ToolDef]:
        out: list[ToolDef] = []
        for tool in tools:
            if not isinstance(tool, dict):
                continue
            if tool.get("type") in ("function", "custom"):
                out.append(ToolDef(str(tool.get("name") or ""), str(tool.get("description") or ""),
                                   tool.get("parameters", tool.get("format"))))
            elif isinstance(tool.get("tools"), list):  # a namespace: Codex groups its tools so
                out.extend(cls.tools(tool["tools"]))
            else:
                out.append(ToolDef(str(tool.get("name") or tool.get("type") or "tool"),
                                   "hosted tool: not offered to the model", hosted=True))
        return out

    @classmethod
    def response(cls, body: dict) -> list[Turn]:
        return _merge_reasoning(cls.items(_list(body.get("output"))))


def _merge_reasoning(turns: list[Turn]) -> list[Turn]:
    """A reasoning-only assistant turn folded into the assistant turn right after it."""
    out: list[Turn] = []
    for turn in turns:
        last = out[-1] if out else None
        if (last is not None and last.role == turn.role == "assistant" and not last.text and not last.tool_calls
                and last.reasoning):
            out[-1] = Turn("assistant", turn.text, turn.tool_calls, reasoning="\n".join(
                r for r in (last.reasoning, turn.reasoning) if r))
        else:
            out.append(turn)
    return out


class _Messages:
    """Anthropic Messages: `system`, messages of content blocks (text, thinking, tool_use, tool_result)."""

    @staticmethod
    def blocks(role: str, content: Any) -> list[Turn]:
        if not isinstance(content, list):
            return [Turn(role if role in ROLES else "note", _text(content))]
        turns: list[Turn] = []
        texts: list[str] = []
        calls: list[ToolCall] = []
        reasoning: list[str] = []

        def flush() -> None:
            if texts or calls or reasoning:
                turns.append(Turn(role, "\n".join(texts), tuple(calls), reasoning="\n".join(reasoning)))
            texts.clear(), calls.clear(), reasoning.clear()

        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                flush()
                turns.append(Turn("tool", _text(block.get("content")), tool_call_id=str(block.get("tool_use_id") or ""),
                                  is_error=bool(block.get("is_error"))))
            elif kind == "tool_use":
                calls.append(ToolCall(str(block.get("id") or ""), str(block.get("name") or ""),
                                      _arguments(block.get("input") or {})))
            elif kind == "thinking":
                reasoning.append(str(block.get("thinking") or ""))
            elif kind == "redacted_thinking":
                reasoning.append("[redacted thinking]")
            elif isinstance(block, dict):
                texts.append(_text([block]))
        flush()
        return turns

    @classmethod
    def request(cls, body: dict) -> tuple[list[Turn], list[ToolDef]]:
        system = body.get("system")
        turns = [Turn("system", _text(system))] if system else []
        for message in _list(body.get("messages")):
            if isinstance(message, dict):
                turns += cls.blocks(str(message.get("role") or ""), message.get("content"))
        tools = [ToolDef(str(t.get("name") or ""), str(t.get("description") or ""), t["input_schema"])
                 if isinstance(t.get("input_schema"), dict) else
                 ToolDef(str(t.get("name") or t.get("type") or "tool"), "server tool: not offered to the model",
                         hosted=True)
                 for t in _list(body.get("tools")) if isinstance(t, dict)]
        return turns, tools

    @classmethod
    def response(cls, body: dict) -> list[Turn]:
        return cls.blocks("assistant", body.get("content") or [])


READERS = {"chat": _Chat, "completions": _Completions, "responses": _Responses, "messages": _Messages}
