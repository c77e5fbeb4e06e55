"""OpenAI Responses API: requests translated to chat completions for the engine, answers and events back."""
from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from proxy import sse
from proxy.assemble import Accumulator
from proxy.errors import ProxyError, check_field, error_types
from proxy.openai_api import Adapter

if TYPE_CHECKING:
    from proxy.recording import ResponseLog

logger = logging.getLogger(__name__)

SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "stop")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _content(content: object, where: str) -> str | list[dict]:
    """Responses content (string or parts) as chat content: a string when it is all text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProxyError(400, f"{where}.content must be a string or an array of parts", "invalid_type")
    parts: list[dict] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ProxyError(400, f"{where}.content[{j}] must be an object", "invalid_type")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise ProxyError(400, f"{where}.content[{j}].text must be a string", "invalid_type")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            logger.debug("dropping content part of type %r the engine cannot take", kind)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_output(output: object) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(p.get("text", "") for p in output if isinstance(p, dict))
    return json.dumps(output)


def input_messages(instructions: str | None, items: str | list) -> list[dict]:
    """Responses `instructions` + `input` as chat messages (developer becomes system)."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProxyError(400, f"{where} must be an object", "invalid_type")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ProxyError(400, f"{where}.role must be user, assistant, system or developer", "invalid_value")
            content = _content(item.get("content", ""), where)
            if role == "assistant" and isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str):
                    raise ProxyError(400, f"{where}.{key} must be a string", "invalid_type")
            arguments = item.get("arguments", "")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            function = {"name": item["name"], "arguments": arguments}
            call = {"id": item["call_id"], "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # same assistant turn as its text
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ProxyError(400, f"{where}.call_id must be a string", "invalid_type")
            output = _tool_output(item.get("output", ""))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            logger.debug("dropping input item of type %r (reasoning or hosted tool)", kind)
    return messages


def chat_tools(tools: list) -> list[dict]:
    """Function tools as chat tools; hosted tools (web search...) are dropped, namespaces flattened."""
    out: list[dict] = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise ProxyError(400, "each entry of 'tools' must be an object", "invalid_type")
        if tool.get("type") == "function":
            if not isinstance(tool.get("name"), str):
                raise ProxyError(400, "a function tool needs a string 'name'", "invalid_type")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": function})
        elif isinstance(tool.get("tools"), list):
            out.extend(chat_tools(tool["tools"]))
    return out


def chat_tool_choice(choice: object) -> object:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        return "auto"
    return choice


def _items(items: str | list) -> list:
    """A request's `input` as a list of items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else list(items)


class ResponsesAdapter(Adapter):
    """Responses requests as chat completions. `previous_response_id` continues an earlier answer of the same
    rollout: its input and output items (recursively, back along its own previous_response_id) come before the
    new input; its `instructions` do not carry over (OpenAI's semantics)."""

    api = "responses"

    def validate(self) -> None:
        body = self.request
        check_field(body, "previous_response_id", str)
        items = check_field(body, "input", (str, list), required=True)
        instructions = check_field(body, "instructions", str)
        self.messages = input_messages(instructions, items)
        if not self.messages and body.get("previous_response_id") is None:  # nothing at all for the engine
            raise ProxyError(400, "field 'input' must not be empty", "invalid_value")
        self.tools = chat_tools(check_field(body, "tools", list) or [])
        check_field(body, "tool_choice", (str, dict))
        check_field(body, "max_output_tokens", int)
        check_field(body, "text", dict)
        self.base_id = uuid.uuid4().hex[:24]
        self.created_at = int(time.time())

    async def resolve(self, responses: ResponseLog, rollout_id: str) -> None:
        previous = self.request.get("previous_response_id")
        if previous is None:
            return
        items, seen = _items(self.request["input"]), set()
        while previous is not None and previous not in seen:  # `seen`: a corrupt chain cannot loop
            seen.add(previous)
            found = await responses.find(rollout_id, previous)
            if found is None:
                raise ProxyError(400, f"Previous response with id '{previous}' not found in this rollout.",
                                 "previous_response_not_found")
            request, response = found
            items = _items(request.get("input") or []) + list(response.get("output") or []) + items
            previous = request.get("previous_response_id")
        self.messages = input_messages(self.request.get("instructions"), items)

    @property
    def has_tools(self) -> bool:
        return bool(self.tools)

    def upstream_body(self, served_model: str, upstream_stream: bool) -> dict:
        body = self.request
        out: dict = {"model": served_model, "messages": self.messages, "return_token_ids": True, "logprobs": True}
        for key in ("temperature", "top_p", *SAMPLING_EXTRAS):
            if body.get(key) is not None:
                out[key] = body[key]
        if body.get("max_output_tokens") is not None:
            out["max_tokens"] = body["max_output_tokens"]
        if self.tools:
            out["tools"] = self.tools
            if body.get("tool_choice") is not None:
                out["tool_choice"] = chat_tool_choice(body["tool_choice"])
            if body.get("parallel_tool_calls") is not None:
                out["parallel_tool_calls"] = body["parallel_tool_calls"]
        fmt = (body.get("text") or {}).get("format")
        fmt = fmt if isinstance(fmt, dict) else {}
        if fmt.get("type") == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
            out["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt.get("type") == "json_object":
            out["response_format"] = {"type": "json_object"}
        if upstream_stream:
            out["stream"] = True
            out["stream_options"] = {"include_usage": True}
        return out

    # --- answers -------------------------------------------------------------------------------------

    def _message_item(self, text: str, status: str = "completed") -> dict:
        done = status == "completed"
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": f"msg_{self.base_id}", "status": status, "role": "assistant",
                "content": content}

    def _call_item(self, index: int, call: dict, status: str = "completed") -> dict:
        function = call.get("function") or {}
        arguments = function.get("arguments", "") if status == "completed" else ""
        return {"type": "function_call", "id": f"fc_{self.base_id}_{index}",
                "call_id": call.get("id") or f"call_{self.base_id}_{index}", "name": function.get("name", ""),
                "arguments": arguments, "status": status}

    def _envelope(self, status: str, output: list, usage: dict | None, incomplete: bool = False) -> dict:
        body = self.request
        return {
            "id": f"resp_{self.base_id}", "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}}, "usage": usage,
        }

    @staticmethod
    def _usage(usage: dict | None) -> dict | None:
        if not usage:
            return None
        prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion,
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}

    def response(self, answer: dict) -> dict:
        choices = answer.get("choices") or [{}]
        message = choices[0].get("message") or {}
        output = [self._message_item(message["content"])] if message.get("content") else []
        output += [self._call_item(i, call) for i, call in enumerate(message.get("tool_calls") or ())]
        incomplete = choices[0].get("finish_reason") == "length"
        status = "incomplete" if incomplete else "completed"
        return self._envelope(status, output, self._usage(answer.get("usage")), incomplete)

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        counter = itertools.count()

        def event(kind: str, **data) -> bytes:
            return sse.encode({"type": kind, "sequence_number": next(counter), **data}, event=kind)

        acc = Accumulator("chat")
        opened: dict = {}  # "text" or tool index -> output_index
        text: list[str] = []
        args: dict[int, list[str]] = {}
        calls: dict[int, dict] = {}
        skeleton = self._envelope("in_progress", [], None)
        yield event("response.created", response=skeleton)
        yield event("response.in_progress", response=skeleton)
        msg_id = f"msg_{self.base_id}"
        async for chunk in chunks:
            acc.add(chunk)
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if "text" not in opened:
                        opened["text"] = len(opened)
                        yield event("response.output_item.added", output_index=opened["text"],
                                    item=self._message_item("", "in_progress"))
                        yield event("response.content_part.added", item_id=msg_id, output_index=opened["text"],
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text.append(delta["content"])
                    yield event("response.output_text.delta", item_id=msg_id, output_index=opened["text"],
                                content_index=0, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or ():
                    index = call.get("index", 0)
                    slot = calls.setdefault(index, {"id": None, "function": {"name": "", "arguments": ""}})
                    slot["id"] = slot["id"] or call.get("id")
                    slot["function"]["name"] += (call.get("function") or {}).get("name") or ""
                    if index not in opened:
                        opened[index] = len(opened)
                        yield event("response.output_item.added", output_index=opened[index],
                                    item=self._call_item(index, slot, "in_progress"))
                    piece = (call.get("function") or {}).get("arguments") or ""
                    if piece:
                        args.setdefault(index, []).append(piece)
                        yield event("response.function_call_arguments.delta", item_id=f"fc_{self.base_id}_{index}",
                                    output_index=opened[index], delta=piece)
        if "text" in opened:
            full = "".join(text)
            part = {"type": "output_text", "text": full, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", item_id=msg_id, output_index=opened["text"], content_index=0,
                        text=full, logprobs=[])
            yield event("response.content_part.done", item_id=msg_id, output_index=opened["text"], content_index=0,
                        part=part)
            yield event("response.output_item.done", output_index=opened["text"], item=self._message_item(full))
        for index, slot in calls.items():
            slot["function"]["arguments"] = "".join(args.get(index, ()))
            item = self._call_item(index, slot)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=opened[index],
                        arguments=item["arguments"], name=item["name"])
            yield event("response.output_item.done", output_index=opened[index], item=item)
        final = self.response(acc.result())
        # Always `response.completed`, a length cut showing as status "incomplete": harnesses and the SDK's stream
        # helper wait for that event, and a missing one fails the turn (`response.incomplete` is newer).
        yield event("response.completed", response=final)

    def stream_error(self, status: int, message: str) -> bytes:
        error_type = error_types(status)[0]
        data = {"type": "error", "code": error_type, "message": message, "param": None, "sequence_number": 0,
                "error": {"type": error_type, "message": message}}
        return sse.encode(data, event="error")
