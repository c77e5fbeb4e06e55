"""Engine answers in both shapes: assembling stream chunks into one answer, and one answer into chunks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Choice:
    index: int
    role: str = "assistant"
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # chat: logprobs.content entries
    token_logprobs: list[float] = field(default_factory=list)  # completions: logprobs.token_logprobs
    finish_reason: str | None = None
    stop_reason: Any = None
    has_token_ids: bool = False
    prompt_token_ids: list[int] | None = None


class Accumulator:
    """Folds engine stream chunks (chat or completions) into the equivalent non-streamed answer."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "chat" | "completions"
        self.head: dict[str, Any] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict | None = None
        self.choices: dict[int, _Choice] = {}

    def add(self, chunk: dict) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for raw in chunk.get("choices") or ():
            self._add_choice(raw)

    def _add_choice(self, raw: dict) -> None:
        index = raw.get("index", 0)
        choice = self.choices.get(index)
        if choice is None:  # not setdefault: that would build a _Choice (six lists) for every chunk
            choice = self.choices[index] = _Choice(index)
        if raw.get("token_ids") is not None:
            choice.has_token_ids = True
            choice.token_ids.extend(raw["token_ids"])
        if raw.get("prompt_token_ids") is not None:
            choice.prompt_token_ids = list(raw["prompt_token_ids"])
        if raw.get("finish_reason") is not None:
            choice.finish_reason = raw["finish_reason"]
        if raw.get("stop_reason") is not None:
            choice.stop_reason = raw["stop_reason"]
        logprobs = raw.get("logprobs") or {}
        if self.kind == "completions":
            choice.text.append(raw.get("text") or "")
            choice.token_logprobs.extend(logprobs.get("token_logprobs") or ())
            return
        choice.logprobs.extend(logprobs.get("content") or ())
        delta = raw.get("delta") or {}
        if delta.get("role"):
            choice.role = delta["role"]
        if delta.get("content"):
            choice.text.append(delta["content"])
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            choice.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            slot = choice.tool_calls.get(call.get("index", 0))
            if slot is None:
                slot = choice.tool_calls[call.get("index", 0)] = {
                    "id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    def result(self) -> dict:
        """The assembled answer in the engine's non-streamed shape (token ids included)."""
        body: dict[str, Any] = {
            "id": self.head.get("id"),
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.head.get("created") or int(time.time()),
            "model": self.head.get("model"),
            "choices": [self._choice_result(c) for _, c in sorted(self.choices.items())],
            "usage": self.usage,
        }
        if self.head.get("system_fingerprint") is not None:
            body["system_fingerprint"] = self.head["system_fingerprint"]
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def _choice_result(self, c: _Choice) -> dict:
        out: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if c.has_token_ids:
            out["token_ids"] = c.token_ids
        if c.prompt_token_ids is not None:
            out["prompt_token_ids"] = c.prompt_token_ids
        if self.kind == "completions":
            out["text"] = "".join(c.text)
            out["logprobs"] = {"token_logprobs": c.token_logprobs} if c.token_logprobs else None
            return out
        message: dict[str, Any] = {"role": c.role, "content": "".join(c.text) if c.text or not c.tool_calls else None}
        if c.reasoning:
            message["reasoning_content"] = "".join(c.reasoning)
        if c.tool_calls:
            message["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
        out["message"] = message
        out["logprobs"] = {"content": c.logprobs} if c.logprobs else None
        return out


def chunks_from_answer(answer: dict, kind: str) -> list[dict]:
    """The stream an engine would have sent for this whole answer (for harnesses that stream)."""
    head = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    first: dict[str, Any] = {**head, "choices": []}
    if answer.get("prompt_token_ids") is not None:
        first["prompt_token_ids"] = answer["prompt_token_ids"]
    last: dict[str, Any] = {**head, "choices": []}
    for choice in answer.get("choices") or ():
        body = {k: choice[k] for k in ("index", "logprobs", "token_ids", "prompt_token_ids") if k in choice}
        if kind == "chat":
            message = choice.get("message") or {}
            delta = {k: message[k] for k in ("role", "content", "reasoning_content") if message.get(k) is not None}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
            body["delta"] = delta
        else:
            body["text"] = choice.get("text") or ""
        first["choices"].append({**body, "finish_reason": None})
        end = {"index": choice.get("index", 0), "finish_reason": choice.get("finish_reason")}
        if choice.get("stop_reason") is not None:
            end["stop_reason"] = choice["stop_reason"]
        if kind == "chat":
            end["delta"] = {}
        else:
            end["text"] = ""
        last["choices"].append(end)
    chunks = [first, last]
    if answer.get("usage"):
        chunks.append({**head, "choices": [], "usage": answer["usage"]})
    return chunks


@dataclass(frozen=True)
class Tokens:
    """Token ids and sampled logprobs of one choice of an engine answer."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def extract_tokens(answer: dict | None, index: int = 0) -> Tokens:
    """The tokens of choice `index` (vLLM's `index` field; n > 1 answers hold one choice per sample).

    vLLM returns the prompt's ids once per answer (chat) or once per choice (completions)."""
    if not answer:
        return Tokens([], [], [], None)
    choices = answer.get("choices") or []
    choice = next((c for c in choices if c.get("index", 0) == index), None)
    if choice is None:  # no such choice (an error body, or the engine gave fewer): the prompt is still known
        choice = {}
    first = choices[0] if choices else {}
    prompt_ids = answer.get("prompt_token_ids") or choice.get("prompt_token_ids") or first.get("prompt_token_ids") or []
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        values = [entry.get("logprob") for entry in logprobs.get("content") or ()]
    else:
        values = list(logprobs.get("token_logprobs") or ())
    return Tokens(list(prompt_ids), list(choice.get("token_ids") or ()), values, choice.get("finish_reason"))
