"""Anthropic Messages API: requests translated to chat completions for the engine, answers and events back."""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator

from proxy import sse
from proxy.assemble import Accumulator
from proxy.errors import ANTHROPIC, ProxyError, check_field, error_body
from proxy.openai_api import Adapter

logger = logging.getLogger(__name__)

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def _text(blocks: object, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ProxyError(400, f"{where} must be a string or an array of content blocks", "invalid_type")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise ProxyError(400, f"{where}[{j}] must be an object", "invalid_type")
        if block.get("type") == "text":
            if not isinstance(block.get("text"), str):
                raise ProxyError(400, f"{where}[{j}].text must be a string", "invalid_type")
            texts.append(block["text"])
    return "\n".join(texts)


def _image(block: dict) -> dict | None:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
        return {"type": "image_url", "image_url": {"url": url}}
    if source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    return None


def _user_turn(blocks: list, where: str) -> list[dict]:
    """A user turn: tool results first (as tool messages), then its text and images as one user message."""
    messages: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise ProxyError(400, f"{where}.content[{j}] must be an object", "invalid_type")
        kind = block.get("type")
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise ProxyError(400, f"{where}.content[{j}].tool_use_id must be a string", "invalid_type")
            content = _text(block.get("content", ""), f"{where}.content[{j}].content")
            messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        elif kind == "text":
            parts.append({"type": "text", "text": _text([block], f"{where}.content")})
        elif kind == "image" and _image(block):
            parts.append(_image(block))
        else:
            logger.debug("dropping user block of type %r", kind)
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        messages.append({"role": "user", "content": "\n".join(p["text"] for p in parts) if only_text else parts})
    return messages


def _assistant_turn(blocks: list, where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            raise ProxyError(400, f"{where}.content[{j}] must be an object", "invalid_type")
        if block.get("type") == "text":
            texts.append(_text([block], f"{where}.content"))
        elif block.get("type") == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ProxyError(400, f"{where}.content[{j}] tool_use needs string 'id' and 'name'", "invalid_type")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
    message: dict = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: object, messages: list) -> list[dict]:
    """Anthropic `system` + `messages` as chat messages."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ProxyError(400, f"{where} must be an object", "invalid_type")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise ProxyError(400, f"{where}.role must be user or assistant", "invalid_value")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise ProxyError(400, f"{where}.content must be a string or an array of content blocks", "invalid_type")
        elif role == "assistant":
            out.append(_assistant_turn(content, where))
        elif role == "system":
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
        else:
            out.extend(_user_turn(content, where))
    return out


def chat_tools(tools: list) -> list[dict]:
    """Custom tools (those with an input_schema) as chat tools; server tools are dropped."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ProxyError(400, f"tools[{i}] must be an object with a string 'name'", "invalid_type")
        if isinstance(tool.get("input_schema"), dict):
            function = {"name": tool["name"], "parameters": tool["input_schema"]}
            if tool.get("description"):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict) -> object:
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return {"any": "required", "none": "none"}.get(kind, "auto")


def _prefilled(messages: list[dict]) -> bool:
    """Whether the request ends in a partial assistant reply for the model to continue (Anthropic prefill)."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and not last.get("tool_calls")


def tokenize_body(body: object, served_model: str) -> dict:
    """vLLM's /tokenize request for a count_tokens body: the same prompt /v1/messages would send the engine."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "invalid_body")
    check_field(body, "model", str, required=True)
    messages = chat_messages(check_field(body, "system", (str, list)), check_field(body, "messages", list, required=True))
    tools = chat_tools(check_field(body, "tools", list) or [])
    check_field(body, "tool_choice", dict)
    prefill = _prefilled(messages)  # vLLM refuses both set, and add_generation_prompt defaults to true
    out: dict = {"model": served_model, "messages": messages, "add_generation_prompt": not prefill}
    if prefill:
        out["continue_final_message"] = True
    if tools:
        out["tools"] = tools
    return out


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {"_raw_arguments": arguments}  # the model wrote invalid JSON: hand it back rather than lose it
    return value if isinstance(value, dict) else {"_value": value}


class MessagesAdapter(Adapter):
    api = "messages"
    error_format = ANTHROPIC

    def validate(self) -> None:
        body = self.request
        messages = check_field(body, "messages", list, required=True)
        if not messages:  # as Anthropic's API: no turn to answer (the engine would fail on it)
            raise ProxyError(400, "field 'messages' must not be empty", "invalid_value")
        check_field(body, "max_tokens", int, required=True)
        self.messages = chat_messages(check_field(body, "system", (str, list)), messages)
        self.tools = chat_tools(check_field(body, "tools", list) or [])
        self.stop_sequences = check_field(body, "stop_sequences", list) or []
        check_field(body, "tool_choice", dict)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    @property
    def has_tools(self) -> bool:
        return bool(self.tools)

    def upstream_body(self, served_model: str, upstream_stream: bool) -> dict:
        body = self.request
        out: dict = {"model": served_model, "messages": self.messages, "max_tokens": body["max_tokens"],
                     "return_token_ids": True, "logprobs": True}
        for key in ("temperature", "top_p", "top_k"):
            if body.get(key) is not None:
                out[key] = body[key]
        if self.stop_sequences:
            out["stop"] = self.stop_sequences
        if _prefilled(self.messages):
            out["continue_final_message"], out["add_generation_prompt"] = True, False  # a prefilled reply
        if self.tools:
            out["tools"] = self.tools
            choice = body.get("tool_choice") or {}
            if choice:
                out["tool_choice"] = chat_tool_choice(choice)
            if choice.get("disable_parallel_tool_use"):
                out["parallel_tool_calls"] = False
        if upstream_stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out

    def _stop(self, choice: dict) -> tuple[str | None, str | None]:
        finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
        if finish == "stop" and isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return _STOP_REASONS.get(finish, "end_turn" if finish else None), None

    def response(self, answer: dict) -> dict:
        choice = (answer.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content: list[dict] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                            "input": _tool_input(function.get("arguments") or "")})
        stop_reason, stop_sequence = self._stop(choice)
        usage = answer.get("usage") or {}
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                          "output_tokens": usage.get("completion_tokens", 0),
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        acc = Accumulator("chat")
        blocks: dict = {}  # "text" or tool index -> block index
        current = None
        started = False

        def start(prompt_tokens: int) -> bytes:
            message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                       "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
            return sse.encode({"type": "message_start", "message": message}, event="message_start")

        def block_event(kind: str, **data) -> bytes:
            return sse.encode({"type": kind, **data}, event=kind)

        async for chunk in chunks:
            acc.add(chunk)
            if not started:
                started = True
                yield start(len(chunk.get("prompt_token_ids") or ()))
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if "text" not in blocks:
                        if current is not None:
                            yield block_event("content_block_stop", index=current)
                        current = blocks["text"] = len(blocks)
                        yield block_event("content_block_start", index=current,
                                          content_block={"type": "text", "text": ""})
                    yield block_event("content_block_delta", index=blocks["text"],
                                      delta={"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    index = call.get("index", 0)
                    function = call.get("function") or {}
                    if index not in blocks:
                        if current is not None:
                            yield block_event("content_block_stop", index=current)
                        current = blocks[index] = len(blocks)
                        block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}}
                        yield block_event("content_block_start", index=current, content_block=block)
                    if function.get("arguments"):
                        yield block_event("content_block_delta", index=blocks[index],
                                          delta={"type": "input_json_delta", "partial_json": function["arguments"]})
        if not started:
            yield start(0)
        if current is not None:
            yield block_event("content_block_stop", index=current)
        final = self.response(acc.result())
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        yield block_event("message_delta", delta=delta, usage={"output_tokens": final["usage"]["output_tokens"],
                                                              "input_tokens": final["usage"]["input_tokens"]})
        yield block_event("message_stop")

    def stream_error(self, status: int, message: str) -> bytes:
        return sse.encode(error_body(ANTHROPIC, status, message), event="error")
