"""A deterministic stand-in for vLLM's OpenAI server: real chat template and tokenizer, scripted answers.

The harness check and the conformance suite run real harnesses against it: prompts are rendered and tokenized
exactly as vLLM would (`apply_chat_template`, then `encode` without special tokens), and each answer is the
text the chat template renders for the assistant message the policy chose, so a harness that sends its history
back unchanged yields prompts that extend the previous prompt + completion token for token (a 'clean' call).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.scripted_policy import FileEditPolicy, Policy, text_of
from proxy.server import ProxyServer

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class Generated:
    """One choice of an answer: the completion text and ids, and the message vLLM's hermes parser returns."""

    ids: list[int]
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"


class ScriptedEngine:
    """ASGI app answering like vLLM (return_token_ids, logprobs, tools, streaming) with a policy's answers."""

    def __init__(self, tokenizer_dir: str | Path, model_name: str = "scripted", policy: Policy | None = None,
                 max_model_len: int = 131072) -> None:
        from transformers import AutoTokenizer  # heavy: only when an engine is built

        # Agents' prompts run to tens of thousands of tiny-vocabulary tokens: no length warning below the limit.
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), model_max_length=max_model_len)
        self.model_name, self.policy, self.max_model_len = model_name, policy or FileEditPolicy(), max_model_len
        self.produced: list[list[int]] = []
        """Completion ids of every choice answered, in order: every trained token must be among them."""
        self.requests: list[dict] = []
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),  # at the root, like vLLM's
        ])

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)

    # --- the model -----------------------------------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, messages: list[dict], tools: list[dict] | None, prompt_text: str,
                 max_tokens: int | None) -> Generated:
        """The policy's answer as the model would emit it: the chat template's rendering of that assistant turn,
        up to its end-of-turn token, then that token's id (vLLM keeps the EOS id in token_ids)."""
        answer = self.policy(messages, tools)
        turn = {"role": "assistant", "content": answer.text or None, "tool_calls": [
            _call(name, arguments) for name, arguments in answer.tool_calls]}
        rendered = self.render(messages + _normalised([turn]), tools, add_generation_prompt=False)
        if not rendered.startswith(prompt_text):
            raise ValueError("the chat template renders the answer's turn differently from the prompt")
        body = rendered[len(prompt_text):]
        eos = self.tokenizer.eos_token or ""
        body = body[:body.rindex(eos)] if eos and eos in body else body.rstrip()
        ids = self.encode(body)
        if max_tokens is not None and len(ids) >= max_tokens:
            ids = ids[:max_tokens]
            return Generated(ids, self.tokenizer.decode(ids), [], "length")
        content, calls = parse_hermes(body)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return Generated(ids, content, calls, "tool_calls" if calls else "stop")

    @staticmethod
    def logprob(position: int) -> float:
        """A fixed, position-dependent logprob: deterministic and never 0 (a 0 would hide a missing value)."""
        return -0.05 * (position % 7) - 0.01

    def _chat_logprobs(self, ids: list[int], start: int = 0) -> list[dict]:
        return [{"token": self.tokenizer.decode([t]), "logprob": self.logprob(start + i), "bytes": None,
                 "top_logprobs": []} for i, t in enumerate(ids)]

    # --- routes --------------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_name, "object": "model", "owned_by": "scripted", "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: chat messages render with the chat template; a prompt encodes as it is."""
        body = await request.json()
        add_generation_prompt = body.get("add_generation_prompt", True)
        if add_generation_prompt and body.get("continue_final_message"):
            return _error(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if "messages" in body:
            text = self.render(_normalised(body["messages"]), body.get("tools"), add_generation_prompt,
                               bool(body.get("continue_final_message")))
            ids = self.encode(text)
        else:
            ids = list(self.tokenizer.encode(body.get("prompt", ""),
                                             add_special_tokens=body.get("add_special_tokens", True)))
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        messages, tools = _normalised(body.get("messages") or []), body.get("tools") or None
        add_generation_prompt = body.get("add_generation_prompt", True)
        if add_generation_prompt and body.get("continue_final_message"):
            return _error(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and limit < 1:
            return _error(400, f"max_tokens must be at least 1, got {limit}.")
        prompt_text = self.render(messages, tools, add_generation_prompt, bool(body.get("continue_final_message")))
        prompt_ids = self.encode(prompt_text)
        choices = [self.generate(messages, tools, prompt_text, limit) for _ in range(int(body.get("n") or 1))]
        self.produced.extend(list(c.ids) for c in choices)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": body.get("model")}
        usage = _usage(prompt_ids, sum(len(c.ids) for c in choices))
        if body.get("stream"):
            events = self._chat_stream(head, prompt_ids, choices, bool(body.get("logprobs")),
                                       bool((body.get("stream_options") or {}).get("include_usage")), usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse({**head, "object": "chat.completion", "choices": [
            {"index": i, "message": {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls},
             "logprobs": {"content": self._chat_logprobs(c.ids)} if body.get("logprobs") else None,
             "finish_reason": c.finish_reason, "stop_reason": None, "token_ids": c.ids}
            for i, c in enumerate(choices)], "usage": usage, "prompt_logprobs": None, "prompt_token_ids": prompt_ids})

    def _chat_stream(self, head: dict, prompt_ids: list[int], choices: list[Generated], logprobs: bool,
                     include_usage: bool, usage: dict) -> Iterator[bytes]:
        """vLLM's chunks: a first one with the role and prompt ids, deltas each with the token ids they decode
        from, a last one per choice with the end-of-turn id and finish reason, then usage if asked."""
        head = {**head, "object": "chat.completion.chunk"}

        def event(index: int, delta: dict, ids: list[int], start: int, finish: str | None = None, **extra) -> bytes:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "token_ids": ids,
                      "logprobs": {"content": self._chat_logprobs(ids, start)} if logprobs and ids else None, **extra}
            return _sse({**head, "choices": [choice]})

        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                  "token_ids": []} for i in range(len(choices))]
        yield _sse({**head, "choices": first, "prompt_token_ids": prompt_ids})
        for index, choice in enumerate(choices):
            position = 0
            for delta, ids in self._deltas(choice):
                yield event(index, delta, ids, position)
                position += len(ids)
            yield event(index, {}, choice.ids[position:], position, choice.finish_reason, stop_reason=None)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _deltas(self, choice: Generated) -> Iterator[tuple[dict, list[int]]]:
        """(delta, token ids) pieces of a choice, its end-of-turn id left for the last chunk."""
        body = choice.ids[:-1] if choice.finish_reason != "length" else choice.ids
        split = len(body) if not choice.tool_calls else self._text_tokens(body, choice.content or "")
        start = 0
        for end in _text_boundaries(self.tokenizer.decode, body[:split]):
            text = self.tokenizer.decode(body[:end])[len(self.tokenizer.decode(body[:start])):]
            yield {"content": text}, body[start:end]
            start = end
        rest = body[split:]
        pieces = 2 * len(choice.tool_calls)
        bounds = [split + len(rest) * k // pieces for k in range(pieces + 1)] if pieces else []
        for k, call in enumerate(choice.tool_calls):
            name = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield {"tool_calls": [name]}, body[bounds[2 * k]:bounds[2 * k + 1]]
            arguments = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            yield {"tool_calls": [arguments]}, body[bounds[2 * k + 1]:bounds[2 * k + 2]]

    def _text_tokens(self, ids: list[int], content: str) -> int:
        """How many leading ids spell the content before the tool calls."""
        if not content:
            return 0
        return next((k for k in range(1, len(ids) + 1) if len(self.tokenizer.decode(ids[:k])) >= len(content)),
                    len(ids))

    async def completions(self, request: Request) -> Response:
        """Text completions: the policy answers the prompt as one user message with no tools."""
        body = await request.json()
        self.requests.append(body)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            prompt_ids = list(prompt)
        else:
            prompt_ids = list(self.tokenizer.encode(prompt if isinstance(prompt, str) else "".join(prompt)))
        finish, limit = "stop", body.get("max_tokens")
        if limit is not None and limit < 1:
            return _error(400, f"max_tokens must be at least 1, got {limit}.")
        answer = self.policy([{"role": "user", "content": self.tokenizer.decode(prompt_ids)}], None)
        ids = self.encode(answer.text)
        if limit is not None and len(ids) >= limit:
            ids, finish = ids[:limit], "length"
        elif self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        self.produced.append(list(ids))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        lps = [self.logprob(i) for i in range(len(ids))] if body.get("logprobs") is not None else None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model")}
        choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None,
                  "prompt_token_ids": prompt_ids, "token_ids": ids,
                  "logprobs": {"token_logprobs": lps, "tokens": [], "text_offset": [], "top_logprobs": []}
                  if lps is not None else None}
        usage = _usage(prompt_ids, len(ids))
        if not body.get("stream"):
            return JSONResponse({**head, "choices": [choice], "usage": usage})
        events = [_sse({**head, "choices": [{**choice, "finish_reason": None}]}),
                  _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": None,
                                              "token_ids": []}]})]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(_sse({**head, "choices": [], "usage": usage}))
        return StreamingResponse(iter(events + [b"data: [DONE]\n\n"]), media_type="text/event-stream")


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) the way vLLM's hermes parser reads a Qwen2 answer: text before the first
    <tool_call> is the content (None when empty), each block's JSON a call with arguments re-dumped."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        parsed = json.loads(block)
        calls.append(_call(parsed["name"], parsed.get("arguments", {})))
    content = text[:text.index("<tool_call>")]
    return content or None, calls


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _text_boundaries(decode, ids: list[int], per_chunk: int = 4) -> Iterator[int]:
    """Ends of chunks of about `per_chunk` ids, never inside a multi-byte character (vLLM holds those back)."""
    end = 0
    while end < len(ids):
        end = min(end + per_chunk, len(ids))
        while end < len(ids) and decode(ids[:end]).endswith("\ufffd"):
            end += 1
        yield end


def _normalised(messages: list[dict]) -> list[dict]:
    """Messages as vLLM hands them to the chat template: list contents joined into strings, and assistant tool-call
    arguments parsed into objects (vLLM's _postprocess_messages), so the template dumps them itself and a history
    renders the same however the harness re-serialised the arguments."""
    out = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = text_of(message["content"])
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            if message["tool_calls"]:
                message["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
            else:
                del message["tool_calls"]  # vLLM drops an empty list, so templates take the plain assistant path
        out.append(message)
    return out


def _parsed_arguments(call: dict) -> dict:
    """The call with its JSON arguments string as an object; like vLLM, invalid or non-object JSON becomes {}."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), dict):
        return call
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _usage(prompt_ids: list[int], completion: int) -> dict:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _sse(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


class ScriptedServer:
    """A ScriptedEngine under uvicorn on a free localhost port, in a thread (proxy.server.ProxyServer serves it)."""

    def __init__(self, engine: ScriptedEngine, host: str = "127.0.0.1") -> None:
        self.engine = engine
        self._server = ProxyServer(engine, host=host)  # serves any ASGI app on its own thread and loop

    @property
    def base_url(self) -> str:
        return f"http://{self._server.host}:{self._server.port}/v1"

    def start(self) -> ScriptedServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
