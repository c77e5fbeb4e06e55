"""A small fake of vLLM answering `n` choices per call (token ids and logprobs per choice, streams interleaved)."""
from __future__ import annotations

import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.proxy.fake_upstream import IM_END, decode, encode, render_chat, usage


def text(k: int) -> str:
    return f"Choice {k}" + "!" * k  # different lengths, so a mix-up of choices shows


def logprob(k: int, position: int) -> float:
    return -0.1 * (k + 1) - 0.01 * position


class NChoiceVLLM:
    """Answers like vLLM with `n` and return_token_ids: prompt ids once (chat) or per choice (completions), each
    choice with its own token ids and logprobs; streams interleave the choices chunk by chunk by `index`."""

    def __init__(self, fail_with: int = 0) -> None:
        self.fail_with = fail_with
        self.requests: list[dict] = []
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.answer, methods=["POST"]),
                                     Route("/v1/completions", self.answer, methods=["POST"])])

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)

    async def answer(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.fail_with:
            return JSONResponse({"error": {"message": "engine busy", "type": "x", "code": self.fail_with}},
                                status_code=self.fail_with)
        chat = request.url.path.endswith("chat/completions")
        prompt_ids = render_chat(body["messages"]) if chat else encode(body["prompt"])
        ids = [encode(text(k)) + [IM_END] for k in range(body.get("n") or 1)]
        head = {"id": f"x-{uuid.uuid4().hex}", "created": int(time.time()), "model": body["model"],
                "object": "chat.completion" if chat else "text_completion"}
        total = usage(prompt_ids, [t for choice in ids for t in choice])
        if body.get("stream"):
            return StreamingResponse(self._stream(body, chat, head, prompt_ids, ids, total),
                                     media_type="text/event-stream")
        choices = [self._choice(chat, k, choice, prompt_ids) for k, choice in enumerate(ids)]
        extra = {"prompt_token_ids": prompt_ids} if chat else {}
        return JSONResponse({**head, "choices": choices, "usage": total, **extra})

    @staticmethod
    def _logprobs(chat: bool, k: int, ids: list[int], start: int = 0) -> dict:
        values = [logprob(k, start + i) for i in range(len(ids))]
        if chat:
            return {"content": [{"token": f"token_id:{t}", "logprob": v, "top_logprobs": []} for t, v in zip(ids, values)]}
        return {"token_logprobs": values, "tokens": [], "text_offset": [], "top_logprobs": []}

    def _choice(self, chat: bool, k: int, ids: list[int], prompt_ids: list[int]) -> dict:
        out = {"index": k, "logprobs": self._logprobs(chat, k, ids), "finish_reason": "stop", "stop_reason": None,
               "token_ids": ids}
        if chat:
            return {**out, "message": {"role": "assistant", "content": text(k), "tool_calls": []}}
        return {**out, "text": text(k), "prompt_token_ids": prompt_ids}

    async def _stream(self, body, chat, head, prompt_ids, ids, total):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(data: dict) -> bytes:
            return f"data: {json.dumps({**head, **data})}\n\n".encode()

        if chat:  # vLLM: a role chunk per choice first, the prompt's ids on the first
            for k in range(len(ids)):
                first = {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None, "token_ids": []}
                yield event({"choices": [first], **({"prompt_token_ids": prompt_ids} if k == 0 else {})})
        for start in range(0, max(len(c) for c in ids), 3):  # interleaved: 3 tokens of each choice in turn
            for k, choice in enumerate(ids):
                part = choice[start:start + 3]
                if not part:
                    continue
                last = start + 3 >= len(choice)
                out = {"index": k, "logprobs": self._logprobs(chat, k, part, start), "token_ids": part,
                       "finish_reason": "stop" if last else None}
                if chat:
                    out["delta"] = {"content": decode(part)}
                else:
                    out["text"] = decode(part)
                    if start == 0:
                        out["prompt_token_ids"] = prompt_ids
                yield event({"choices": [out]})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event({"choices": [], "usage": total})
        yield b"data: [DONE]\n\n"
