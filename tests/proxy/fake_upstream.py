"""A small local fake of vLLM's OpenAI server: byte-level toy tokenizer, token ids, logprobs, tools, streaming."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

IM_START, IM_END, OFFSET = 1, 2, 10  # special ids; a byte b is token b + OFFSET


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    """The text of byte tokens; ids outside them (specials, or a fuzzed prompt's arbitrary integers) spell nothing."""
    return bytes(i - OFFSET for i in ids if OFFSET <= i < OFFSET + 256).decode("utf-8", "replace")


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def render_chat(messages: list[dict], tools: list | None = None) -> list[int]:
    """The fake chat template: <|im_start|>role\\ncontent[tool calls]<|im_end|>\\n ... <|im_start|>assistant\\n."""
    ids: list[int] = []
    if tools:
        ids += [IM_START] + encode("tools\n" + json.dumps(tools, sort_keys=True)) + [IM_END] + encode("\n")
    for m in messages:
        body = _text_of(m.get("content"))
        for call in m.get("tool_calls") or ():
            body += tool_text(call["function"]["name"], call["function"]["arguments"])
        ids += [IM_START] + encode(f"{m['role']}\n{body}") + [IM_END] + encode("\n")
    return ids + [IM_START] + encode("assistant\n")


def usage(prompt_ids: list[int], ids: list[int]) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}


def tool_text(name: str, arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@dataclass
class Reply:
    """One scripted answer: text and/or tool calls [(name, arguments-json)]."""

    text: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Fault:
    """Make the next call fail: an HTTP status with a vLLM error body, a stall, or a cut stream."""

    status: int = 0
    stall_s: float = 0.0
    cut_stream_after: int = -1  # stream: drop the connection after this many chunks
    drop_tool_ids: bool = False  # stream: tool-call chunks without token ids (a streaming tool parser's bug)


class FakeVLLM:
    """ASGI app answering like vLLM with return_token_ids and logprobs; replies are scripted or echoed."""

    def __init__(self, latency_s: float = 0.0, chunk_delay_s: float = 0.0, chunk_bytes: int = 4) -> None:
        self.latency_s, self.chunk_delay_s, self.chunk_bytes = latency_s, chunk_delay_s, chunk_bytes
        self.replies: deque[Reply] = deque()
        self.faults: deque[Fault] = deque()
        self.requests: list[dict] = []
        self.calls = 0
        self.answered = 0  # calls past their latency (the "engine" has answered)
        self.version = 0  # the "weights" answering now, reported as system_fingerprint "v<version>"
        self.mixed: list[str] = []  # ids of chat answers generated while the version changed
        self.tokenized: list[dict] = []  # /tokenize bodies (kept apart from `requests`: not generation calls)
        self.max_model_len = 4096
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),  # at the root, like vLLM's
        ])

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)

    # --- the toy model -------------------------------------------------------------------------------

    def _reply(self, body: dict, prompt: str) -> Reply:
        if self.replies:
            return self.replies.popleft()
        return Reply(text=f"Hello! You said: {prompt[-40:]}")

    @staticmethod
    def _generate(reply: Reply, body: dict) -> tuple[str, list[int], str, str | None]:
        """Raw generated text, its ids (with <|im_end|> on stop), finish reason, matched stop string."""
        raw = reply.text + "".join(tool_text(n, a) for n, a in reply.tool_calls)
        finish, matched = ("tool_calls" if reply.tool_calls else "stop"), None
        stops = body.get("stop") or []
        for stop in [stops] if isinstance(stops, str) else stops:
            if stop in raw:
                raw, finish, matched = raw[: raw.index(stop)], "stop", stop
        ids = encode(raw)
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        if limit is not None and len(ids) >= limit:
            return decode(ids[:limit]), ids[:limit], "length", None
        return raw, ids + [IM_END], finish, matched

    @staticmethod
    def logprob(position: int) -> float:
        return -0.05 * (position % 7) - 0.01

    async def _fault(self, stream: bool) -> Response | Fault | None:
        if not self.faults:
            return None
        fault = self.faults.popleft()
        if fault.stall_s:
            await asyncio.sleep(fault.stall_s)
        if fault.status:
            kind = "BadRequestError" if fault.status < 500 else "InternalServerError"
            body = {"error": {"message": f"fake engine error {fault.status}", "type": kind, "code": fault.status}}
            return JSONResponse(body, status_code=fault.status)
        return fault if stream else None

    # --- routes --------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.calls += 1
        fault = await self._fault(bool(body.get("stream")))
        if isinstance(fault, Response):
            return fault
        version = self.version  # the weights this answer starts on
        prompt_ids = render_chat(body["messages"], body.get("tools"))
        reply = self._reply(body, _text_of(body["messages"][-1].get("content")))
        if not body.get("tools"):
            reply = Reply(reply.text + "".join(tool_text(n, a) for n, a in reply.tool_calls))
        raw, ids, finish, matched = self._generate(reply, body)
        calls = [] if finish == "length" else reply.tool_calls
        text = decode(encode(raw)) if not calls else (reply.text or None)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        self.answered += 1
        if body.get("stream"):
            return StreamingResponse(self._chat_stream(body, prompt_ids, text, calls, ids, finish, matched, fault,
                                                       version), media_type="text/event-stream")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if self.version != version:
            self.mixed.append(rid)
        message = {"role": "assistant", "content": text, "tool_calls": [
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls]}
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "system_fingerprint": f"v{version}", "choices": [{"index": 0, "message": message, "logprobs": {"content": self._lp_content(ids)},
                         "finish_reason": finish, "stop_reason": matched, "token_ids": ids}],
            "usage": usage(prompt_ids, ids),
            "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
        })

    def _lp_content(self, ids: list[int], start: int = 0) -> list[dict]:
        return [{"token": f"token_id:{t}", "logprob": self.logprob(start + i), "bytes": None, "top_logprobs": []}
                for i, t in enumerate(ids)]

    async def _chat_stream(self, body, prompt_ids, text, calls, ids, finish, matched, fault, version):
        rid, created, n = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.chunk_bytes
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                "system_fingerprint": f"v{version}"}

        def chunk(delta: dict, token_ids: list[int], start: int, finish_reason=None, **extra) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": {"content": self._lp_content(token_ids, start)} if token_ids else None,
                      "finish_reason": finish_reason, "token_ids": token_ids, **extra}
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode()

        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                 "token_ids": []}
        yield f"data: {json.dumps({**head, 'choices': [first], 'prompt_token_ids': prompt_ids})}\n\n".encode()
        pieces: list[tuple[dict, list[int]]] = []
        if text:
            raw = encode(text)
            pieces += [({"content": decode(raw[i:i + n])}, raw[i:i + n]) for i in range(0, len(raw), n)]
        for k, (name, args) in enumerate(calls):
            call_ids = [] if isinstance(fault, Fault) and fault.drop_tool_ids else encode(tool_text(name, args))
            half = len(args) // 2
            pieces.append(({"tool_calls": [{"index": k, "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
                                              "function": {"name": name, "arguments": ""}}]}, call_ids[: len(call_ids) // 2]))
            pieces.append(({"tool_calls": [{"index": k, "function": {"arguments": args[:half]}}]}, call_ids[len(call_ids) // 2:]))
            pieces.append(({"tool_calls": [{"index": k, "function": {"arguments": args[half:]}}]}, []))
        emitted = sum(len(p[1]) for p in pieces)
        position = 0
        for i, (delta, token_ids) in enumerate(pieces):
            if isinstance(fault, Fault) and fault.cut_stream_after == i:
                raise RuntimeError("fake engine dropped the stream")
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            yield chunk(delta, token_ids, position)
            position += len(token_ids)
        if self.version != version:
            self.mixed.append(rid)
        rest = ids[emitted:]
        if isinstance(fault, Fault) and fault.drop_tool_ids:
            rest = [t for t in rest[-1:] if t == IM_END]
        yield chunk({}, rest, position, finish, stop_reason=matched)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(prompt_ids, ids)})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.calls += 1
        fault = await self._fault(bool(body.get("stream")))
        if isinstance(fault, Response):
            return fault
        prompt = body["prompt"]
        prompt_ids = list(prompt) if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt) else encode(
            prompt if isinstance(prompt, str) else "".join(prompt))
        raw, ids, finish, matched = self._generate(self._reply(body, decode(prompt_ids)), body)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        self.answered += 1
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": body["model"]}
        counts = usage(prompt_ids, ids)
        lps = [self.logprob(i) for i in range(len(ids))]
        if not body.get("stream"):
            choice = {"index": 0, "text": raw, "logprobs": {"token_logprobs": lps, "tokens": [], "text_offset": [], "top_logprobs": []},
                      "finish_reason": finish, "stop_reason": matched, "prompt_token_ids": prompt_ids, "token_ids": ids}
            return JSONResponse({**head, "choices": [choice], "usage": counts})

        async def stream():
            n = self.chunk_bytes
            for i in range(0, len(ids), n):
                part = ids[i:i + n]
                choice = {"index": 0, "text": decode(part), "logprobs": {"token_logprobs": lps[i:i + n]}, "finish_reason": None,
                          "token_ids": part, **({"prompt_token_ids": prompt_ids} if i == 0 else {})}
                yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode()
            last = {"index": 0, "text": "", "finish_reason": finish, "stop_reason": matched, "token_ids": []}
            yield f"data: {json.dumps({**head, 'choices': [last]})}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake"}]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a chat body renders with the same template as chat(), a prompt encodes as is."""
        body = await request.json()
        self.tokenized.append(body)
        fault = await self._fault(False)
        if isinstance(fault, Response):
            return fault
        if body.get("add_generation_prompt", True) and body.get("continue_final_message"):
            message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        if "messages" in body:
            ids = render_chat(body["messages"], body.get("tools"))
        else:
            ids = encode(body["prompt"])
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None})
